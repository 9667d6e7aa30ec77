"""Say what is wrong with a worker, in words: a problem code and its likely cause. Pure: every function takes
``now`` and reads the routing core and the fleet's specs and subscriber without changing anything.

The fleet runs ``diagnose_fleet`` every probe interval and logs each worker's problem once when it starts,
changes or ends (``ProblemLog``, at most one line per worker per ``min_interval_s``); ``/admin/workers`` and
the ``kvrouter_worker_problem`` gauge show the same diagnosis. ``kvrouter doctor`` (router/doctor.py) checks a
worker from outside, before or without a router.

Problems, most severe first (a worker shows one):
- ``unhealthy``: its ``/health`` probes failed; it takes no requests.
- ``block-size-mismatch``: its events carry another block size than ``routing.block_size``; they are ignored.
- ``malformed``: frames or events it published could not be decoded.
- ``unsynced``: a sequence gap could not be filled from its replay socket; no prefix credit until it resyncs.
- ``never-published``: it has taken requests for longer than ``stale_after_s`` and no batch ever arrived.
- ``stale``: it published before, then went silent while taking requests.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from router.discovery import WorkerSpec
    from router.frontends.fleet import Fleet
    from router.scheduling import RoutingCore

PROBLEMS = ("unhealthy", "block-size-mismatch", "malformed", "unsynced", "never-published", "stale")
MIN_REQUESTS = 3  # requests a silent worker must have taken before its silence is called a problem
LOG_INTERVAL_S = 30.0

_CACHE_INFO = re.compile(r'^vllm:cache_config_info\{([^}]*)\}', re.MULTILINE)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


@dataclass(frozen=True, slots=True)
class Diagnosis:
    worker_id: str
    problem: str | None  # one of PROBLEMS, None when nothing is wrong
    cause: str | None  # what was seen and its likely cause, in words

    def as_json(self) -> dict[str, str | None]:
        return {"problem": self.problem, "cause": self.cause}


def vllm_binds(endpoint: str) -> bool:
    """vLLM's publisher binds its PUB socket only for these endpoints; any other it connects to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def engine_block_size(metrics_text: str) -> int | None:
    """The ``block_size`` label of vLLM's ``vllm:cache_config_info`` in a ``/metrics`` page, if it has one."""
    m = _CACHE_INFO.search(metrics_text)
    if m is None:
        return None
    labels = dict(_LABEL.findall(m.group(1)))
    try:
        n = int(labels.get("block_size", ""))
    except ValueError:
        return None
    return n if n > 0 else None


def diagnose_worker(
    core: RoutingCore, worker_id: str, now: float, *, spec: WorkerSpec | None = None, bind: str | None = None,
    bound_endpoint: str | None = None, ready: Iterable[str] | None = None, replay: str | None = None,
    engine_block_size: int | None = None, failures: int = 0, min_requests: int = MIN_REQUESTS,
    events_bus: str | None = None,
) -> Diagnosis:
    """What is wrong with one worker at ``now``, if anything.

    ``spec``: its discovery entry (events/replay endpoints, topic); ``bind``/``bound_endpoint``: the router's
    bound SUB socket in bind mode; ``ready``: the dialled workers past their connect-time replay; ``replay``: the
    replay endpoint the router asks (defaults to the spec's); ``engine_block_size``: as its ``/metrics`` said;
    ``failures``: its failed probes in a row; ``events_bus``: the bus the router follows instead of dialling
    the engines (its relay, not the router, asks the engine's replay socket then).
    """
    ep = core.endpoints.get(worker_id)
    if ep is None:
        return Diagnosis(worker_id, None, None)
    if not ep.healthy:
        url = spec.url if spec is not None else ep.url
        return Diagnosis(worker_id, "unhealthy", f"{failures or 'several'} failed probes in a row of "
                         f"{url}/health (or /metrics): the engine is down, restarting or unreachable")
    if not ep.events:
        return Diagnosis(worker_id, None, None)  # no event endpoint configured: load only, by design
    state = core.state
    feed = core.feeder.feeds.get(worker_id)
    routing_bs = core.config.block_size
    if feed is not None and feed.block_size_mismatch > 0:
        engine = f"{engine_block_size}" if engine_block_size else "another size"
        return Diagnosis(worker_id, "block-size-mismatch", (
            f"its KV events carry block_size {engine}, routing.block_size is {routing_bs}: "
            f"{feed.block_size_mismatch} stored blocks were ignored (no prefix credit); set routing.block_size "
            f"(--block-size) to the engine's --block-size"))
    if feed is not None and feed.malformed > 0 and feed.malformed >= feed.batches:
        return Diagnosis(worker_id, "malformed", (
            f"{feed.malformed} malformed frames or events against {feed.batches} good batches: what it publishes "
            f"is not vLLM's KV-event wire format as the router decodes it (another engine or version on that "
            f"port?)"))
    if feed is not None and not feed.synced and feed.unsynced_since is not None:
        replay_ep = replay or (spec.replay if spec is not None else None)
        if events_bus is not None:
            where = (f"the router follows it on the event bus {events_bus}: records for it were missing on the bus "
                     f"(purged by the stream's retention, or dropped from the relay's outbox while the bus was down: "
                     f"kvrouter_bus_missed_total) or its relay could not fill the gap from the engine's replay socket "
                     f"(the relay's log says which)")
        elif replay_ep:
            where = (f"its replay endpoint {replay_ep} did not supply the missing range (wrong endpoint, not "
                     f"bound by the engine, or the gap is older than its replay buffer)")
        else:
            where = "no replay endpoint is configured for it (give replay=tcp://HOST:PORT, vLLM's replay_endpoint)"
        return Diagnosis(worker_id, "unsynced", (
            f"a sequence gap (seen {feed.gaps}, filled {feed.gaps_filled}) could not be filled: {where}; "
            f"no prefix credit until fresh events have flowed for {core.feeder.resync_after_s:g} s"))
    if core.index_state(worker_id, now) != "stale":
        return Diagnosis(worker_id, None, None)
    load = core.load.workers.get(worker_id)
    taken = load.dispatched_total if load is not None else 0
    if taken < min_requests:
        return Diagnosis(worker_id, None, None)
    since = state.awaiting_events_since.get(worker_id)
    silent = f"{now - since:.1f} s" if since is not None else f"over {state.stale_after_s:g} s"
    if feed is None or feed.last_event_at is None:
        return Diagnosis(worker_id, "never-published", (
            f"it has taken {taken} requests over {silent} and no KV-event batch ever arrived: "
            + _silence_cause(worker_id, spec, bind, bound_endpoint, ready, core)))
    return Diagnosis(worker_id, "stale", (
        f"it published {feed.batches} batches (last seq {feed.last_seq}, {now - feed.last_event_at:.1f} s ago), "
        f"then nothing while it took requests for {silent}: its publisher stopped (events disabled or the engine "
        f"restarted on another endpoint?) or the connection to it dropped"))


def _silence_cause(worker_id: str, spec: WorkerSpec | None, bind: str | None, bound_endpoint: str | None,
                   ready: Iterable[str] | None, core: RoutingCore) -> str:
    events = spec.events if spec is not None else None
    if events:
        topic = f"topic {spec.topic!r}" if spec is not None and spec.topic else "every topic"
        pending = ready is not None and worker_id not in set(ready)
        head = (f"the router dials {events} (subscribed to {topic})"
                + (", its connect-time replay still pending" if pending else ""))
        return (f"{head}. Likely cause: the engine's publisher connects instead of binding (vLLM binds only "
                f"when its endpoint has '*' or '::', e.g. tcp://*:{_port(events)}), so nothing listens on "
                f"{events}; or the wrong host or port; or a topic mismatch; or KV events disabled on the engine "
                f"(enable_kv_cache_events). Run kvrouter doctor --worker ... to check each")
    where = bound_endpoint or bind or "its bound events socket"
    strays = sorted(w for w in core.feeder.feeds if w not in core.endpoints)
    stray = (f"; events do arrive under names no worker has: {', '.join(strays[:5])} (a topic mismatch)"
             if strays else "")
    return (f"the router binds {where} and no batch named {worker_id!r} arrived{stray}. Likely cause: the "
            f"engine binds too instead of connecting (its endpoint must have no '*' or '::', e.g. "
            f"tcp://ROUTER-HOST:{_port(where)}); or it connects to the wrong host or port; or its topic does not "
            f"name this worker (topic {worker_id!r}); or KV events are disabled on the engine "
            f"(enable_kv_cache_events)")


def _port(endpoint: str) -> str:
    tail = endpoint.rsplit(":", 1)[-1]
    return tail if tail.isdigit() else "PORT"


def diagnose_fleet(fleet: Fleet, now: float, min_requests: int = MIN_REQUESTS) -> dict[str, Diagnosis]:
    """``diagnose_worker`` for every worker the fleet's core knows."""
    sub = fleet.subscriber
    sizes: Mapping[str, int] = getattr(fleet, "engine_block_sizes", {})
    return {
        wid: diagnose_worker(
            fleet.core, wid, now, spec=fleet.specs.get(wid), bind=sub.bind, bound_endpoint=sub.bound_endpoint,
            ready=sub.ready, replay=sub.replay_endpoints.get(wid), engine_block_size=sizes.get(wid),
            failures=fleet.failures.get(wid, 0), min_requests=min_requests,
            events_bus=getattr(fleet, "events_bus", None))
        for wid in list(fleet.core.endpoints)
    }


@dataclass
class ProblemLog:
    """Turns successive diagnoses into log lines: a warning when a worker enters or changes problem, an info
    line when it recovers; at most one line per worker per ``min_interval_s`` (a flapping worker's changes in
    between are folded into the next line, or into none if it is back where it was last reported). Pure:
    ``update`` returns the lines, the caller logs them."""

    min_interval_s: float = LOG_INTERVAL_S
    reported: dict[str, str | None] = field(default_factory=dict)  # the problem the last line said
    last_line_at: dict[str, float] = field(default_factory=dict)
    updates: int = 0

    def update(self, diagnoses: Mapping[str, Diagnosis], now: float) -> list[tuple[int, str]]:
        self.updates += 1
        for wid in [w for w in self.reported if w not in diagnoses]:
            self.reported.pop(wid, None)
            self.last_line_at.pop(wid, None)
        lines: list[tuple[int, str]] = []
        for wid, d in diagnoses.items():
            was = self.reported.get(wid)
            if d.problem == was:
                continue
            last = self.last_line_at.get(wid)
            if last is not None and now - last < self.min_interval_s:
                continue
            self.reported[wid] = d.problem
            self.last_line_at[wid] = now
            if d.problem is None:
                lines.append((logging.INFO, f"worker {wid}: recovered from {was}"))
            elif was is None:
                lines.append((logging.WARNING, f"worker {wid}: {d.problem}: {d.cause}"))
            else:
                lines.append((logging.WARNING, f"worker {wid}: {d.problem} (was {was}): {d.cause}"))
        return lines
