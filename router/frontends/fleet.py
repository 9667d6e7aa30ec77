"""The live fleet around one routing core: event subscriptions, health probes, metric scrapes, discovery.

The adapters here keep ``RoutingCore`` fed (endpoints, engine metrics, KV events) and share one clock
(``time.monotonic``) with it. Used by both the proxy and the endpoint picker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp

from router.aio import cancel_and_wait
from router.config import RouterConfig
from router.discovery import DiscoveryError, WorkerSpec, load_workers_file
from router.events.bus_nats import BusSubscriber
from router.events.subscriber import EventSource, KvEventSubscriber
from router.frontends.diagnosis import Diagnosis, ProblemLog, diagnose_fleet, engine_block_size
from router.load import parse_engine_metrics
from router.nats_connection import NatsAuth
from router.scheduling import Endpoint, RoutingCore

log = logging.getLogger(__name__)

# the prompt budget until some worker reports its max_model_len (vLLM's /v1/models does): refuses only what
# no model served today could take
DEFAULT_MAX_MODEL_LEN = 1 << 20


def fleet_from_config(core: RoutingCore, config: RouterConfig) -> Fleet:
    k8s = config.kubernetes
    fleet = Fleet(core, probe_interval_s=config.probe_interval_s, events_bind=config.events_bind,
                  events_bus=config.events_bus, events_bus_auth=config.events_bus_auth,
                  workers_file=config.workers_file, max_model_len=config.max_model_len,
                  kubernetes=(k8s.namespace, k8s.pool, k8s.events_by_default, k8s.kubeconfig) if k8s.pool else None)
    fleet.set_workers(config.workers)
    return fleet


class Fleet:
    def __init__(
        self,
        core: RoutingCore,
        *,
        probe_interval_s: float = 1.0,
        probe_timeout_s: float = 1.0,
        unhealthy_after: int = 2,
        events_bind: str | None = None,
        events_bus: str | None = None,
        events_bus_auth: NatsAuth | None = None,
        workers_file: str | None = None,
        file_poll_s: float = 1.0,
        kubernetes: tuple[str, str, bool, str | None] | None = None,
        max_model_len: int | None = None,
    ) -> None:
        """``kubernetes``: (namespace, InferencePool, events on :5557 by default, kubeconfig or None) to watch.
        ``max_model_len``: the prompt budget, overriding what the workers report. ``events_bus``: a nats://
        URL: every worker's KV events come from its relay on the bus (router/events/bus.py), none dialled;
        ``events_bus_auth``: the credentials and TLS presented to it."""
        self.core = core
        self.clock = time.monotonic
        self.probe_interval_s = probe_interval_s
        self.probe_timeout_s = probe_timeout_s
        self.unhealthy_after = unhealthy_after
        self.workers_file = workers_file
        self.file_poll_s = file_poll_s
        self.specs: dict[str, WorkerSpec] = {}
        self.failures: dict[str, int] = {}
        # workers discovery no longer lists, draining until their requests end: worker -> draining before it left
        self.leaving: dict[str, bool] = {}
        self.max_model_len_override = max_model_len
        self.context_lens: dict[str, int] = {}  # worker -> the largest max_model_len its /v1/models reports
        self.events_bus = events_bus
        self.subscriber: KvEventSubscriber | BusSubscriber
        if events_bus is not None:
            self.subscriber = BusSubscriber(core.feeder, events_bus, clock=self.clock, auth=events_bus_auth)
        else:
            self.subscriber = KvEventSubscriber(core.feeder, bind=events_bind, clock=self.clock)
        self.engine_block_sizes: dict[str, int] = {}  # worker -> block_size of its vllm:cache_config_info
        # worker -> the LoRA adapter names it lists that another worker serves as a base model: refused there
        # (``resolve_names``)
        self.name_conflicts: dict[str, frozenset[str]] = {}
        self.problem_log = ProblemLog()  # each worker's problem, logged once per change (rate-limited)
        self._tasks: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None
        self._file_mtime: float | None = None
        self._kubernetes = None
        if kubernetes is not None:
            from router.discovery.kubernetes import KubernetesDiscovery

            ns, pool, events_default, kubeconfig = kubernetes
            self._kubernetes = KubernetesDiscovery(ns, pool, self.set_workers, events_default, kubeconfig)

    # ---- membership --------------------------------------------------------------------------
    def set_workers(self, specs: Sequence[WorkerSpec]) -> None:
        """Make the fleet ``specs``: add new workers, update changed ones, let the rest leave (``leave``)."""
        wanted = {s.worker_id: s for s in specs}
        for wid in list(self.specs):
            if wid not in wanted:
                self.leave(wid)
        for spec in specs:
            if spec.worker_id in self.leaving:  # listed again before it had left: drained as it was before
                self.core.set_draining(spec.worker_id, self.leaving.pop(spec.worker_id))
            if self.specs.get(spec.worker_id) != spec:
                self._add(spec)
        self.resolve_names()  # once for the whole change (it looks at every worker)

    def add(self, spec: WorkerSpec) -> None:
        self._add(spec)
        self.resolve_names()

    def _add(self, spec: WorkerSpec) -> None:
        prev = self.core.endpoints.get(spec.worker_id)
        self.specs[spec.worker_id] = spec
        self.core.upsert_endpoint(Endpoint(
            spec.worker_id, spec.address, spec.models, spec.loras,  # (its adapters as resolve_names leaves them)
            healthy=prev.healthy if prev else True, draining=prev.draining if prev else False,
            url=spec.url, events=bool(spec.events) or self.subscriber.bind is not None or self.events_bus is not None,
            role=spec.role,
        ))
        if self.events_bus is not None:  # its relay reads the engine; we follow the worker's subject
            self.subscriber.add_source(EventSource(spec.worker_id, spec.events or "", spec.replay, spec.topic))
        elif spec.events:
            self.subscriber.add_source(EventSource(spec.worker_id, spec.events, spec.replay, spec.topic))
        elif spec.replay:
            self.subscriber.replay_endpoints[spec.worker_id] = spec.replay

    def leave(self, worker_id: str) -> None:
        """Discovery no longer lists the worker (a terminating pod, an entry gone from the workers file): it drains,
        taking no new request while the requests it has finish, and is removed (its index, its subscription) once
        none is left or it stops answering its probes; at once if it has none."""
        if worker_id in self.leaving:
            return
        ep = self.core.endpoints.get(worker_id)
        if ep is None or not self._busy(worker_id):
            self.remove(worker_id)
            return
        self.leaving[worker_id] = ep.draining
        self.core.set_draining(worker_id, True)

    def _busy(self, worker_id: str) -> bool:
        load = self.core.load.workers.get(worker_id)
        return load is not None and load.requests > 0

    def reap(self) -> None:
        """Remove the leaving workers that have finished their requests or stopped answering."""
        for wid in list(self.leaving):
            ep = self.core.endpoints.get(wid)
            if ep is None or not ep.healthy or not self._busy(wid):
                self.remove(wid)

    def remove(self, worker_id: str) -> None:
        self.leaving.pop(worker_id, None)
        self.specs.pop(worker_id, None)
        self.context_lens.pop(worker_id, None)
        self.engine_block_sizes.pop(worker_id, None)
        self.subscriber.remove_source(worker_id)
        self.core.remove_endpoint(worker_id)
        self.resolve_names()  # a base model gone: an adapter of its name may be served again

    def resolve_names(self) -> None:
        """A model name means one model fleet-wide: where one worker serves a name as its base model and another
        lists it as a LoRA adapter, the adapter is refused (that worker is not routed requests for the name; its
        other models and adapters stay), and the conflict is logged once per change, exported
        (``kvrouter_model_name_conflicts``) and shown in ``/admin/workers``. Why the base model: it is the name
        the engine was started with, the one meaning it has there; an adapter is loaded under a name its
        loader picks, and one named like a base model shadows it. Why not both: the router keys a request's
        cache blocks by what the name means (an adapter's blocks carry its name in their hashes, the base
        model's do not) and prices adapter loads by it, and a client asking for one name would get two
        different models' answers by where it landed (docs/fleet.md, section 4)."""
        with_loras = [s for s in self.specs.values() if s.loras]
        base = frozenset().union(*(s.models for s in self.specs.values())) if with_loras else frozenset()
        conflicts: dict[str, frozenset[str]] = {}
        for spec in with_loras:
            refused = spec.loras & base
            if refused:
                conflicts[spec.worker_id] = refused
            ep = self.core.endpoints.get(spec.worker_id)
            if ep is not None and ep.loras != spec.loras - refused:
                ep.loras = spec.loras - refused
        if conflicts != self.name_conflicts:
            for name in sorted(frozenset().union(*conflicts.values()) if conflicts else ()):
                bases = sorted(w for w, s in self.specs.items() if name in s.models)
                adapters = sorted(w for w, r in conflicts.items() if name in r)
                log.warning("model name %r is a base model on %s and a LoRA adapter on %s: served as the base "
                            "model only (a name means one model fleet-wide); rename the adapter",
                            name, ", ".join(bases), ", ".join(adapters))
            if self.name_conflicts and not conflicts:
                log.info("no model name conflicts left")
            self.name_conflicts = conflicts

    def drain(self, worker_id: str, draining: bool = True) -> bool:
        return self.core.set_draining(worker_id, draining)

    def max_model_len(self) -> int:
        """The most tokens a request may need: the configured limit, else the largest context any worker
        reports (the default while some worker has not said)."""
        if self.max_model_len_override:
            return self.max_model_len_override
        known = [self.context_lens.get(wid) for wid in self.specs]
        if not known or None in known:
            return max([DEFAULT_MAX_MODEL_LEN, *(n for n in known if n)])
        return max(n for n in known if n)

    # ---- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.probe_timeout_s))
        await self.subscriber.start()
        if self.workers_file:
            self._reload_file(initial=True)
            self._tasks.append(asyncio.create_task(self._watch_file()))
        if self._kubernetes is not None:
            await self._kubernetes.start()
        self._tasks.append(asyncio.create_task(self._probe_loop()))

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks)
        self._tasks.clear()
        if self._kubernetes is not None:
            await self._kubernetes.stop()
        await self.subscriber.stop()
        if self._session is not None:
            await self._session.close()

    # ---- discovery file ----------------------------------------------------------------------
    def _reload_file(self, initial: bool = False) -> None:
        assert self.workers_file is not None
        path = Path(self.workers_file)
        try:
            mtime = path.stat().st_mtime
        except FileNotFoundError:
            if initial:
                raise
            log.warning("workers file %s is gone; keeping the last known workers", path)
            return
        if mtime == self._file_mtime:
            return
        try:
            specs = load_workers_file(path)
        except DiscoveryError:
            if initial:
                raise
            log.exception("workers file %s is invalid; keeping the last known workers", path)
            return
        self._file_mtime = mtime
        self.set_workers(specs)
        log.info("workers file %s: %d workers", path, len(specs))

    async def _watch_file(self) -> None:
        while True:
            await asyncio.sleep(self.file_poll_s)
            self._reload_file()

    # ---- health and metrics ------------------------------------------------------------------
    async def _probe_loop(self) -> None:
        while True:
            await asyncio.gather(*(self.probe(wid) for wid in list(self.specs)), return_exceptions=True)
            self.reap()
            self.report_problems()
            await asyncio.sleep(self.probe_interval_s)

    def diagnose(self) -> dict[str, Diagnosis]:
        """Each worker's problem and its likely cause, now (router/frontends/diagnosis.py)."""
        return diagnose_fleet(self, self.clock())

    def report_problems(self) -> None:
        """Log a worker's problem when it starts, changes or ends: at most one line per worker per 30 s."""
        try:
            for level, line in self.problem_log.update(self.diagnose(), self.clock()):
                log.log(level, line)
        except Exception:  # a diagnosis must never stop the probes
            log.exception("diagnosis pass failed")

    async def probe(self, worker_id: str) -> None:
        """GET /health and /metrics: a failure of either counts; ``unhealthy_after`` in a row removes the worker
        from the candidates until one probe succeeds."""
        spec = self.specs.get(worker_id)
        ep = self.core.endpoints.get(worker_id)
        if spec is None or ep is None or self._session is None:
            return
        ok = False
        try:
            async with self._session.get(spec.url + "/health") as r:
                ok = r.status == 200
            if ok:
                self.core.scrape_sent(worker_id)
                async with self._session.get(spec.url + "/metrics") as r:
                    if r.status == 200:
                        text = await r.text()
                        self.core.update_metrics(worker_id, parse_engine_metrics(text, self.clock()))
                        if (bs := engine_block_size(text)) is not None:
                            self.engine_block_sizes[worker_id] = bs
            if ok and (worker_id not in self.context_lens or self.failures.get(worker_id)):
                # learned once, and again after failures (a restarted engine may serve another context length;
                # meanwhile the one it had still bounds prompts)
                await self._learn_context(worker_id, spec.url)
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            log.debug("probe of %s failed: %r", worker_id, e)
            ok = False
        if ok:
            self.failures[worker_id] = 0
            if self.core.set_healthy(worker_id, True):
                log.info("worker %s is healthy again", worker_id)
        else:
            self.mark_failure(worker_id)

    async def _learn_context(self, worker_id: str, url: str) -> None:
        """The largest ``max_model_len`` in the worker's ``/v1/models`` (vLLM and SGLang report it per model)."""
        assert self._session is not None
        async with self._session.get(url + "/v1/models") as r:
            if r.status != 200:
                return
            data = await r.json(content_type=None)
        models = data.get("data") if isinstance(data, dict) else None
        lens = [m.get("max_model_len") for m in models or [] if isinstance(m, dict)]
        lens = [n for n in lens if type(n) is int and n > 0]
        if lens:
            self.context_lens[worker_id] = max(lens)

    def mark_failure(self, worker_id: str) -> None:
        """A probe or a request failed: the worker loses prefix credit at once (it may be restarting), and after
        ``unhealthy_after`` failures in a row it stops being a candidate."""
        n = self.failures.get(worker_id, 0) + 1
        self.failures[worker_id] = n
        self.core.worker_failed(worker_id, self.clock())
        if n >= self.unhealthy_after and self.core.set_healthy(worker_id, False):
            log.warning("worker %s marked unhealthy after %d failures", worker_id, n)
