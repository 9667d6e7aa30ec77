"""``kvrouter doctor``: check each worker from outside, before (or beside) a router, and say what is wrong.

Per worker, one row per check with a verdict (ok / warn / FAIL) and a detail:
- ``health``: ``GET /health`` answers 200.
- ``models``: ``GET /v1/models``: the models served (and the configured ones among them), ``max_model_len``.
- ``metrics``: ``GET /metrics`` parsed as the router does; vLLM's ``vllm:cache_config_info``: block size (must
  equal ``routing.block_size``) and capacity.
- ``events-socket``: a ZeroMQ SUB connects to the events endpoint and waits for the ZMTP handshake. A SUB
  ``connect`` to a port nothing listens on succeeds silently and then receives nothing forever, which is
  what a router meets when the engine's publisher connects instead of binding.
- ``events``: one live batch within ``--wait`` seconds, after a 1-token test request with a fresh prompt (so
  the engine stores new blocks and publishes them; ``--no-provoke`` only listens).
- ``replay``: the replay socket's buffer (what the engine has published; answers at all = ok).
- ``events-block-size``: the ``block_size`` of the ``BlockStored`` events seen, against ``routing.block_size``.

Exit status 0 when no check failed (warnings allowed), 1 otherwise, 2 for a bad command line or config.
Bounded: the HTTP checks and the handshake take at most ``--timeout`` each (concurrently), the live wait
``--wait``, the replay read ``--timeout`` per reply; all workers are checked concurrently.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field

import aiohttp
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from router.discovery import DiscoveryError, WorkerSpec, load_workers_file, parse_worker_arg
from router.events.codec import (
    SEQ_BYTES,
    BlockStored,
    EventMessage,
    MalformedFrame,
    decode_message,
    decode_replay_frames,
)
from router.frontends.diagnosis import vllm_binds
from router.load import parse_engine_metrics

OK, WARN, FAIL = "ok", "warn", "FAIL"
REPLAY_MAX_BATCHES = 20_000  # vLLM buffers 10,000


@dataclass(frozen=True)
class Check:
    worker: str
    check: str
    verdict: str  # ok | warn | FAIL
    detail: str


@dataclass
class _Seen:
    """What the event checks found, for the verdicts that depend on more than one of them."""

    handshake: bool = False
    tcp_accepted: bool = False
    refused: bool = False
    live: list[EventMessage] = field(default_factory=list)
    live_after_s: float | None = None
    live_malformed: int = 0
    replay: list[EventMessage] = field(default_factory=list)
    replay_answered: bool = False
    replay_malformed: int = 0


def _why(e: BaseException) -> str:
    if isinstance(e, TimeoutError | asyncio.TimeoutError):
        return "no answer in time"
    return str(e) or type(e).__name__


# ---- HTTP ------------------------------------------------------------------------------------------------
async def _http_checks(session: aiohttp.ClientSession, spec: WorkerSpec, block_size: int,
                       timeout_s: float) -> tuple[list[Check], list[str], bool]:
    """health, models, metrics (concurrently); also the served models and whether /health said 200."""
    wid, url = spec.worker_id, spec.url

    async def health() -> Check:
        try:
            async with session.get(url + "/health") as r:
                if r.status == 200:
                    return Check(wid, "health", OK, f"GET {url}/health: 200")
                return Check(wid, "health", FAIL, f"GET {url}/health: HTTP {r.status}: the engine is not ready")
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            return Check(wid, "health", FAIL, f"GET {url}/health: {_why(e)}: the engine is down, still starting, "
                         f"or the URL is wrong")

    async def models() -> tuple[Check, list[str]]:
        try:
            async with session.get(url + "/v1/models") as r:
                if r.status != 200:
                    return Check(wid, "models", FAIL, f"GET {url}/v1/models: HTTP {r.status}"), []
                data = await r.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as e:
            return Check(wid, "models", FAIL, f"GET {url}/v1/models: {_why(e)}"), []
        entries = [m for m in (data.get("data") or [] if isinstance(data, dict) else []) if isinstance(m, dict)]
        ids = [str(m.get("id")) for m in entries if m.get("id") is not None]
        lens = sorted({m["max_model_len"] for m in entries if type(m.get("max_model_len")) is int})
        if not ids:
            return Check(wid, "models", FAIL, f"GET {url}/v1/models: no models listed"), []
        detail = ", ".join(ids) + (f"; max_model_len {'/'.join(map(str, lens))}" if lens else
                                   "; no max_model_len reported (the router's prompt budget stays its default)")
        missing = sorted(set(spec.models) - set(ids))
        if missing:
            return Check(wid, "models", FAIL, f"configured models {', '.join(missing)} are not served; it serves "
                         + detail), ids
        return Check(wid, "models", OK if lens else WARN, detail), ids

    async def metrics() -> Check:
        try:
            async with session.get(url + "/metrics") as r:
                if r.status != 200:
                    return Check(wid, "metrics", FAIL, f"GET {url}/metrics: HTTP {r.status}: no load-aware routing")
                text = await r.text()
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            return Check(wid, "metrics", FAIL, f"GET {url}/metrics: {_why(e)}")
        try:
            m = parse_engine_metrics(text, 0.0)
            info = _cache_config(text)
        except ValueError as e:
            return Check(wid, "metrics", FAIL, f"GET {url}/metrics: not Prometheus text: {e}")
        load = f"waiting {_num(m.waiting)}, running {_num(m.running)}, kv_usage {_num(m.kv_usage)}"
        if m.waiting is None and m.running is None:
            return Check(wid, "metrics", WARN, "no vllm:num_requests_waiting/running: the router sees only the "
                         "load it sent")
        if info is None:
            return Check(wid, "metrics", WARN, f"{load}; no vllm:cache_config_info: block size and KV capacity "
                         f"unknown")
        bs, blocks = info
        cap = f", {blocks} GPU blocks = {m.cache_tokens} tokens" if blocks is not None and m.cache_tokens else ""
        if bs is None:
            return Check(wid, "metrics", WARN, f"{load}; vllm:cache_config_info has no block_size")
        if bs != block_size and _rechunked(bs, block_size):
            return Check(wid, "metrics", OK, f"block_size {bs}: its pages are re-chunked into routing blocks of "
                         f"{block_size}{cap}; {load}")
        if bs != block_size:
            return Check(wid, "metrics", FAIL, f"engine block_size {bs} != routing.block_size {block_size}: the "
                         f"router ignores every block it stores; set routing.block_size (--block-size) to {bs}")
        return Check(wid, "metrics", OK, f"block_size {bs} = routing.block_size{cap}; {load}")

    (h, (mo, ids), me) = await asyncio.gather(health(), models(), metrics())
    return [h, mo, me], ids, h.verdict == OK


def _rechunked(page_size: int, block_size: int) -> bool:
    """Whether the router's feed re-chunks engine pages of ``page_size`` into its blocks (SGLang's page 1)."""
    try:
        from router.events.rechunk import can_rechunk
    except ImportError:  # a router without re-chunking drops every block of another size
        return False
    return can_rechunk(page_size, block_size)


def _num(v: float | None) -> str:
    return "?" if v is None else f"{v:g}"


def _cache_config(text: str) -> tuple[int | None, int | None] | None:
    """(block_size, num_gpu_blocks summed over ranks) from ``vllm:cache_config_info``; None if absent."""
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(text):
        if fam.name != "vllm:cache_config_info":
            continue
        sizes, blocks = set(), 0
        for s in fam.samples:
            with contextlib.suppress(KeyError, ValueError):
                sizes.add(int(s.labels["block_size"]))
            with contextlib.suppress(KeyError, ValueError):
                blocks += int(s.labels["num_gpu_blocks"])
        return (min(sizes) if len(sizes) == 1 else (max(sizes) if sizes else None)), (blocks or None)
    return None


async def _provoke(session: aiohttp.ClientSession, url: str, model: str | None) -> str:
    """A 1-token completion of a prompt no cache holds: the engine stores new blocks and publishes them."""
    prompt = f"kvrouter doctor {uuid.uuid4().hex} " + "the quick brown fox jumps over the lazy dog " * 24
    body: dict[str, object] = {"prompt": prompt, "max_tokens": 1}
    if model:
        body["model"] = model
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            await r.read()
            return f"test request (HTTP {r.status})"
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        return f"test request (failed: {_why(e)})"


# ---- ZeroMQ ----------------------------------------------------------------------------------------------
async def _handshake(mon: zmq.asyncio.Socket, seen: _Seen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            ev = parse_monitor_message(await asyncio.wait_for(mon.recv_multipart(), left))
        except TimeoutError:
            return
        kind = ev["event"]
        if kind == zmq.EVENT_CONNECTED:
            seen.tcp_accepted = True
        elif kind == zmq.EVENT_CONNECT_RETRIED:
            seen.refused = True
        elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            seen.handshake = True
            return


async def _listen(sub: zmq.asyncio.Socket, seen: _Seen, started: float, deadline: float) -> None:
    """Live batches until one carries a BlockStored, or the deadline."""
    while (left := deadline - time.monotonic()) > 0:
        try:
            frames = await asyncio.wait_for(sub.recv_multipart(), left)
        except TimeoutError:
            return
        try:
            msg = decode_message(frames)
        except MalformedFrame:
            seen.live_malformed += 1
            continue
        if not seen.live:
            seen.live_after_s = time.monotonic() - started
        seen.live.append(msg)
        if any(isinstance(e, BlockStored) for e in msg.batch.events):
            return


async def ask_replay(ctx: zmq.asyncio.Context, endpoint: str, timeout_s: float,
                     seen: _Seen) -> None:
    """The replay socket's whole buffer (``[b"", seq 0]``), as the router's connect-time replay asks it; unlike
    ``fetch_replay`` it tells an empty buffer from no answer."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if "[" in endpoint:
        sock.setsockopt(zmq.IPV6, 1)
    try:
        sock.connect(endpoint)
        await sock.send_multipart([b"", (0).to_bytes(SEQ_BYTES, "big")])
        while len(seen.replay) < REPLAY_MAX_BATCHES:
            frames = await asyncio.wait_for(sock.recv_multipart(), timeout_s)
            seen.replay_answered = True
            try:
                msg = decode_replay_frames(frames)
            except MalformedFrame:
                seen.replay_malformed += 1
                continue
            if msg is None:
                return
            seen.replay.append(msg)
    except (TimeoutError, zmq.ZMQError):
        return
    finally:
        sock.close()


def _block_sizes(msgs: list[EventMessage]) -> set[int]:
    return {e.block_size for m in msgs for e in m.batch.events if isinstance(e, BlockStored)}


async def _event_checks(ctx: zmq.asyncio.Context, session: aiohttp.ClientSession, spec: WorkerSpec,
                        http: asyncio.Task[tuple[list[Check], list[str], bool]], *, block_size: int,
                        events_bind: str | None, wait_s: float, timeout_s: float, provoke: bool) -> list[Check]:
    wid, ep = spec.worker_id, spec.events
    seen = _Seen()
    out: list[Check] = []
    note = ""
    if ep:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        if "[" in ep:
            sub.setsockopt(zmq.IPV6, 1)
        sub.setsockopt(zmq.SUBSCRIBE, spec.topic.encode())
        mon = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        try:
            sub.connect(ep)
            await _handshake(mon, seen, timeout_s)
            if seen.handshake:
                await asyncio.sleep(0.2)  # our subscription reaches the publisher before the test request
            _, ids, healthy = await http
            started = time.monotonic()
            pending = None
            if provoke and healthy:
                pending = asyncio.create_task(_provoke(session, spec.url, ids[0] if ids else None))
            await _listen(sub, seen, started, started + wait_s)
            if pending is not None:
                if pending.done():
                    note = pending.result()
                else:
                    pending.cancel()
                    note = "test request (still running)"
        except zmq.ZMQError as e:
            hint = (f": {ep} is a bind address (the engine's); the router dials the engine's host, "
                    f"tcp://HOST:{ep.rsplit(':', 1)[-1]}" if vllm_binds(ep) and ep.startswith("tcp://") else "")
            out.append(Check(wid, "events-socket", FAIL, f"cannot connect to {ep}: {e}{hint}"))
        finally:
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            mon.close()
            sub.close()
    else:
        await http
    if spec.replay:
        await ask_replay(ctx, spec.replay, timeout_s, seen)

    # ---- verdicts
    topic = f"topic {spec.topic!r}" if spec.topic else "every topic"
    buffered = ""
    if seen.replay:
        buffered = (f"its replay buffer holds {len(seen.replay)} batches (seq {seen.replay[0].seq}.."
                    f"{seen.replay[-1].seq}): it does publish, but ")
    if ep:
        connect_cause = (f"the engine's publisher connects instead of binding (vLLM binds only when its endpoint has "
                         f"'*' or '::', e.g. tcp://*:{ep.rsplit(':', 1)[-1]}), so nothing ever listens on {ep}; or "
                         f"the host or port is wrong; or KV events are disabled on the engine "
                         f"(enable_kv_cache_events)")
        if not out:
            if seen.handshake:
                out.append(Check(wid, "events-socket", OK, f"a ZeroMQ peer answers at {ep} (handshake done)"))
            elif seen.tcp_accepted:
                out.append(Check(wid, "events-socket", FAIL, f"{ep} accepts TCP connections but no ZeroMQ handshake "
                                 f"followed in {timeout_s:g} s: not the engine's KV-event socket (wrong port?)"))
            else:
                how = "connection refused" if seen.refused else f"no answer in {timeout_s:g} s"
                out.append(Check(wid, "events-socket", FAIL, f"nothing listens on {ep} ({how}): a SUB connect "
                                 f"there succeeds silently and receives nothing, ever"))
        provoked = f" after a {note}" if note else ""
        if seen.live:
            first = seen.live[0]
            out.append(Check(wid, "events", OK, f"live batch seq {first.seq} (topic {first.topic!r}) in "
                             f"{seen.live_after_s or 0:.2f} s{provoked}"))
        elif seen.live_malformed:
            out.append(Check(wid, "events", FAIL, f"{seen.live_malformed} frames arrived on {ep} but none decodes as "
                             f"vLLM's KV-event wire format (another engine or version on that port?)"))
        elif not seen.handshake:
            out.append(Check(wid, "events", FAIL, f"no batch in {wait_s:g} s{provoked}: {buffered}nothing reaches a "
                             f"subscriber of {ep}. Likely cause: " + connect_cause))
        else:
            topics = sorted({m.topic for m in seen.replay if not m.topic.startswith(spec.topic)})
            if topics:
                why = (f"a topic mismatch: the engine publishes topic {topics[0]!r}, the router subscribes to "
                       f"{topic} (set topic= to it)")
            else:
                why = (f"a topic mismatch (subscribed to {topic}; vLLM's is kv_events_config.topic, default ''), or "
                       f"KV events or prefix caching disabled on the engine")
            if note.startswith("test request (HTTP 2"):  # it served a fresh prompt and published nothing here
                out.append(Check(wid, "events", FAIL, f"a publisher is there but sent no batch in {wait_s:g} s"
                                 f"{provoked}: {buffered}none reached this subscriber. Likely cause: {why}"))
            else:
                held = f"; its replay buffer holds {len(seen.replay)} batches" if seen.replay else ""
                hint = ("idle? without --no-provoke a test request makes it publish" if not note
                        else "the test request did not succeed")
                out.append(Check(wid, "events", WARN, f"no batch in {wait_s:g} s{provoked} ({hint}){held}"))
    elif events_bind:
        out.append(Check(wid, "events", WARN, f"the engine connects to the router's bound socket ({events_bind}); "
                         f"the doctor does not listen there: see the router's /admin/workers (problem, cause)"))
    else:
        out.append(Check(wid, "events", WARN, "no events endpoint: the router routes it on load alone (no prefix "
                         "credit); give events=tcp://HOST:PORT (vLLM's kv_events_config endpoint)"))

    if spec.replay:
        if not seen.replay_answered:
            out.append(Check(wid, "replay", FAIL, f"no answer from {spec.replay} in {timeout_s:g} s: a sequence gap "
                             f"would leave the worker unsynced (wrong endpoint, or the engine's replay_endpoint is "
                             f"not bound, e.g. tcp://*:{spec.replay.rsplit(':', 1)[-1]})"))
        elif seen.replay:
            out.append(Check(wid, "replay", OK, f"{len(seen.replay)} batches buffered (seq {seen.replay[0].seq}.."
                             f"{seen.replay[-1].seq})"))
        elif seen.replay_malformed:
            out.append(Check(wid, "replay", FAIL, f"{seen.replay_malformed} replay replies do not decode"))
        else:
            out.append(Check(wid, "replay", OK, "answers; its buffer is empty (nothing published since it started)"))
    elif ep:
        out.append(Check(wid, "replay", WARN, "no replay endpoint: a sequence gap leaves the worker unsynced until "
                         "fresh events have flowed; give replay=tcp://HOST:PORT (vLLM's replay_endpoint)"))

    sizes = _block_sizes(seen.live) | _block_sizes(seen.replay)
    if ep or spec.replay:
        if not sizes:
            out.append(Check(wid, "events-block-size", WARN, "no BlockStored event seen: nothing to compare"))
        elif sizes == {block_size}:
            out.append(Check(wid, "events-block-size", OK, f"BlockStored events carry block_size {block_size} = "
                             f"routing.block_size"))
        elif all(_rechunked(n, block_size) for n in sizes):
            got = ", ".join(map(str, sorted(sizes)))
            out.append(Check(wid, "events-block-size", OK, f"BlockStored events carry block_size {got}: re-chunked "
                             f"into routing blocks of {block_size}"))
        else:
            got = ", ".join(map(str, sorted(sizes)))
            out.append(Check(wid, "events-block-size", FAIL, f"BlockStored events carry block_size {got}, "
                             f"routing.block_size is {block_size}: the router ignores those blocks; set "
                             f"routing.block_size (--block-size) to the engine's --block-size"))
    return out


async def check_worker(ctx: zmq.asyncio.Context, spec: WorkerSpec, *, block_size: int, events_bind: str | None = None,
                       wait_s: float = 3.0, timeout_s: float = 2.0, provoke: bool = True) -> list[Check]:
    """Every check of one worker, in a stable order."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        http = asyncio.create_task(_http_checks(session, spec, block_size, timeout_s))
        try:
            events = await _event_checks(ctx, session, spec, http, block_size=block_size, events_bind=events_bind,
                                         wait_s=wait_s, timeout_s=timeout_s, provoke=provoke)
        finally:
            if not http.done():
                http.cancel()
        checks, _, _ = await http
        return checks + events


async def run_doctor(specs: list[WorkerSpec], *, block_size: int, events_bind: str | None = None,
                     wait_s: float = 3.0, timeout_s: float = 2.0, provoke: bool = True) -> list[Check]:
    ctx = zmq.asyncio.Context()
    try:
        per_worker = await asyncio.gather(*(
            check_worker(ctx, s, block_size=block_size, events_bind=events_bind, wait_s=wait_s, timeout_s=timeout_s,
                         provoke=provoke) for s in specs))
    finally:
        ctx.destroy(linger=0)
    return [c for checks in per_worker for c in checks]


def format_table(checks: list[Check]) -> str:
    rows = [("WORKER", "CHECK", "VERDICT", "DETAIL")] + [(c.worker, c.check, c.verdict, c.detail) for c in checks]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    return "\n".join(f"{a:<{w0}}  {b:<{w1}}  {v:<7}  {d}" for a, b, v, d in rows)


def _specs(args: argparse.Namespace) -> tuple[list[WorkerSpec], int, str | None]:
    from router.config import load_config

    config = load_config(args.config, {"routing.block_size": args.block_size, "workers_file": args.workers_file,
                                       "events_bind": args.events_bind})
    specs = [parse_worker_arg(w) for w in args.worker] if args.worker else list(config.workers)
    if not args.worker and config.workers_file:
        specs += load_workers_file(config.workers_file)
    return specs, config.routing.block_size, config.events_bind


def main(args: argparse.Namespace) -> int:
    from router.config import ConfigError

    try:
        specs, block_size, events_bind = _specs(args)
    except (ConfigError, DiscoveryError) as e:
        print(f"kvrouter doctor: {e}", file=sys.stderr)
        return 2
    if not specs:
        print("kvrouter doctor: no workers: give --worker URL[,events=E][,replay=R] (repeatable), --workers-file "
              "or --config with workers", file=sys.stderr)
        return 2
    checks = asyncio.run(run_doctor(specs, block_size=block_size, events_bind=events_bind, wait_s=args.wait,
                                    timeout_s=args.timeout, provoke=not args.no_provoke))
    failed = [c for c in checks if c.verdict == FAIL]
    if args.json:
        print(json.dumps({"ok": not failed, "block_size": block_size, "checks": [asdict(c) for c in checks]},
                         indent=2))
    else:
        print(f"kvrouter doctor: {len(specs)} workers, routing.block_size {block_size}")
        print(format_table(checks))
        if failed:
            names = sorted({c.worker for c in failed})
            print(f"FAIL: {len(failed)} checks failed on {', '.join(names)}")
        else:
            print("ok: every check passed" + (" (with warnings)" if any(c.verdict == WARN for c in checks) else ""))
    return 1 if failed else 0
