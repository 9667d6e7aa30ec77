"""Issue 45, item 2 (draining), live: a rolling restart of every worker under load fails no request.

Three simulated workers, each its own process (``kvrouter worker sim``: HTTP, KV events on ZeroMQ with a replay
socket), take ~20 requests/s (completions and chat, streamed and not) for the whole test, while each in turn is
taken out of the fleet, left to finish what it has, killed (SIGKILL: a request still on it would be lost, so only
the drain can keep it whole, not the worker's own graceful shutdown), started again on the same ports (a new
process with an empty cache), brought back, and routed to again before the next one goes. The processes are
restarted for real, on fixed ports, so the router and Envoy see the same address come back, as after a pod's
restart.

- Through the proxy: w0 and w1 are drained with ``/admin/drain`` (idle: the router's in-flight count for it in
  ``/admin/workers`` and the engine's own ``/metrics`` both at 0) and brought back with ``/admin/undrain``; w2
  through the watched workers file: its entry removed, the router drains it and lets it go, index and all, once
  the requests it has are done (``Fleet.leave``; idle: gone from the router, and its ``/metrics`` at 0), its entry
  put back.
- Through Envoy + ``kvrouter epp``: the picker has no admin API; its own mechanism is its discovery (the workers
  file here; a terminating pod leaves a Kubernetes pool the same way, through ``Fleet.set_workers``). Envoy names
  the upstream that served each answer in a response header. (The engine's ``/metrics`` alone does not say a
  worker is done: it counts neither a request still on its way through Envoy nor an answer still being sent.)

Checked: every answer is a 200 with all its tokens (a stream ends with its usage and ``[DONE]``); no request sent
after a worker left went to it until it was being brought back; some requests finished on a worker after it left
(the drain had something to wait for); every worker served requests after its restart; nothing was retried (the
proxy's retry counter, Envoy's retry and connect-failure counters); and once the new process is back the router's
index holds none of the blocks the old one had.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from bench.load import free_port
from router.discovery import WorkerSpec
from router.frontends.envoy_config import bootstrap
from router.frontends.epp import EndpointPicker, serve_epp
from router.frontends.fleet import Fleet
from router.frontends.metrics import RouterMetrics
from router.index import Medium
from router.scheduling import RouteRequest, RoutingConfig, RoutingCore
from router.tokenizer import load_tokenizer
from tests.envoy_helpers import envoy
from tests.test_proxy import proxy
from tests.zmq_helpers import wait_until

TIME_SCALE = "2.0"  # the engine model's step times doubled: a request takes a few tenths of a second
RATE = 20.0  # requests per second, open loop
KINDS = ("completions", "completions-stream", "chat", "chat-stream")
FILLER = "the system document says that the answer to every question is somewhere in the question " * 3
SERVED_BY = "x-served-by"  # Envoy's response header naming the upstream that answered (added by this test)


# ---- the workers ---------------------------------------------------------------------------------------------
@dataclass
class SimProcess:
    """One ``kvrouter worker sim`` process on fixed ports, restartable on them."""

    wid: str
    port: int = field(default_factory=free_port)
    events: int = field(default_factory=free_port)
    replay: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def entry(self) -> dict[str, str]:
        """Its workers-file entry."""
        return {"id": self.wid, "url": self.url, "events": f"tcp://127.0.0.1:{self.events}",
                "replay": f"tcp://127.0.0.1:{self.replay}"}

    def spawn(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "router.cli", "worker", "sim", "--port", str(self.port),
             "--events-endpoint", f"tcp://[::ffff:127.0.0.1]:{self.events}",  # '::': binds, loopback only
             "--replay-endpoint", f"tcp://[::ffff:127.0.0.1]:{self.replay}", "--time-scale", TIME_SCALE],
            stdout=subprocess.DEVNULL)

    async def ready(self, session: aiohttp.ClientSession, timeout: float = 30.0) -> None:
        """Until its /health answers 200 (or it exits, or ``timeout``)."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(self.url + "/health") as r:
                    if r.status == 200:
                        return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.wid} did not start (exit {self.proc.poll()})")
            await asyncio.sleep(0.05)

    async def kill(self) -> None:
        """SIGKILL: a request still on it is lost (its own graceful shutdown, on SIGTERM, would finish it)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            await asyncio.to_thread(self.proc.wait, 10)

    async def busy(self, session: aiohttp.ClientSession) -> int:
        """Requests its engine has running or waiting, by its own /metrics."""
        async with session.get(self.url + "/metrics") as r:
            assert r.status == 200
            text = await r.text()
        return sum(round(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
                   if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{")))


def write_workers(path: Path, ws: list[SimProcess]) -> None:
    """Replace the workers file at once (a watcher never reads half a file)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps([w.entry() for w in ws]))
    os.replace(tmp, path)


async def wait_for(predicate: Callable[[], Awaitable[bool]], what: str, timeout: float = 10.0) -> None:
    """``wait_until`` for a predicate that has to ask over the network."""
    deadline = time.monotonic() + timeout
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached in {timeout} s: {what}")
        await asyncio.sleep(0.02)


async def expect(what: str, waiting: Awaitable[None]) -> None:
    """``waiting`` (a ``wait_until``), failing with what it waited for."""
    try:
        await waiting
    except AssertionError:
        raise AssertionError(f"not reached in time: {what}") from None


# ---- the client ----------------------------------------------------------------------------------------------
@dataclass
class Result:
    kind: str
    sent: float
    done: float = 0.0  # 0 while it is in flight
    worker: str | None = None
    error: str | None = None  # None: a 200 with all its tokens


def incomplete(status: int, data: bytes, chat: bool, stream: bool, max_tokens: int) -> str | None:
    """Why an answer is not a whole one; None for a 200 carrying all ``max_tokens`` tokens."""
    if status != 200:
        return f"status {status}: {data[:300]!r}"
    try:
        if not stream:
            answer = json.loads(data)
            choice = answer["choices"][0]
            text = choice["message"]["content"] if chat else choice["text"]
            if (not isinstance(text, str) or choice["finish_reason"] != "length"
                    or answer["usage"]["completion_tokens"] != max_tokens):
                return f"incomplete answer: {data[:300]!r}"
            return None
        events = [line[6:] for line in data.decode().split("\n") if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            return f"stream cut before [DONE]: {data[-300:]!r}"
        chunks = [json.loads(e) for e in events[:-1]]
        if any("error" in c for c in chunks):
            return f"error event in the stream: {data[-300:]!r}"
        # a token chunk: completions' text, chat's content (not the opening role chunk)
        tokens = [c["choices"][0] for c in chunks if c["choices"] and "role" not in c["choices"][0].get("delta", {})]
        finishes = [t["finish_reason"] for t in tokens if t["finish_reason"]]
        usage = chunks[-1].get("usage") or {}
        if len(tokens) != max_tokens or finishes != ["length"] or usage.get("completion_tokens") != max_tokens:
            return f"truncated stream: {len(tokens)} of {max_tokens} tokens, finish {finishes}, usage {usage}"
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
        return f"malformed answer ({e!r}): {data[:300]!r}"
    return None


class Load:
    """``RATE`` requests a second, open loop, for as long as it runs: the four kinds in turn, 16 to 48 tokens each.
    Every prompt opens with the current ``phase``, so no prompt of a later phase shares a block (not even the
    first) with one of an earlier phase."""

    def __init__(self, session: aiohttp.ClientSession, url: str, worker_of: Callable[[Any], str | None]) -> None:
        self.session, self.url, self.worker_of = session, url, worker_of
        self.phase = 0
        self.results: list[Result] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        start = time.monotonic()
        n = 0
        while True:
            task = asyncio.create_task(self.one(n))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            n += 1
            await asyncio.sleep(max(0.0, start + n / RATE - time.monotonic()))  # the pace, not a wait for state

    async def finish(self) -> None:
        """Every request sent has its answer."""
        await asyncio.gather(*list(self._tasks))

    async def one(self, n: int) -> None:
        kind = KINDS[n % len(KINDS)]
        chat, stream = kind.startswith("chat"), kind.endswith("stream")
        max_tokens = 16 + (7 * n) % 33
        system = f"phase {self.phase} family {n % 5}. {FILLER}"
        body: dict[str, Any] = ({"messages": [{"role": "system", "content": system},
                                              {"role": "user", "content": f"question {n}"}]} if chat
                                else {"prompt": f"{system} question {n}"})
        body |= {"max_tokens": max_tokens, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        r = Result(kind, time.monotonic())
        self.results.append(r)
        try:
            async with self.session.post(self.url + ("/v1/chat/completions" if chat else "/v1/completions"),
                                         json=body) as resp:
                r.worker = self.worker_of(resp.headers)
                status, data = resp.status, await resp.read()
            r.error = incomplete(status, data, chat, stream, max_tokens)
        except (aiohttp.ClientError, TimeoutError) as e:  # a cut stream is a ClientPayloadError here
            r.error = repr(e)
        r.done = time.monotonic()


# ---- the rolling restart -------------------------------------------------------------------------------------
@dataclass
class Cycle:
    wid: str
    left: float  # the router had it out: nothing sent from here on may reach it ...
    back: float  # ... until here, when it was being brought back
    finished_after_leaving: int  # its requests that ended after it left (the drain waited for them)


async def rolling_restart(load: Load, ws: list[SimProcess], session: aiohttp.ClientSession, core: RoutingCore,
                          leave: Callable[[SimProcess], Awaitable[None]],
                          idle: Callable[[SimProcess], Awaitable[None]],
                          rejoin: Callable[[SimProcess], Awaitable[None]]) -> list[Cycle]:
    """Each worker in turn: ``leave`` (the router has it out), ``idle`` (it has finished its requests), kill it,
    start it again on its ports, ``rejoin``, and wait until the router routes to it again and its index has
    none of the old process's blocks."""
    cycles = []
    for w in ws:
        load.phase += 1  # what is sent from here on shares no block with what the old process had
        old = set().union(*core.index.resident_keys(w.wid).values())
        assert old, f"{w.wid} held no blocks in the index before it left"
        await leave(w)
        left = time.monotonic()
        await idle(w)
        await w.kill()
        w.spawn()
        await w.ready(session)
        back = time.monotonic()
        await rejoin(w)
        await expect(f"{w.wid} serves again after its restart", wait_until(
            lambda w=w, back=back: any(r.worker == w.wid and r.sent > back and r.done for r in load.results),
            timeout=20))
        # the new process's events replaced the old one's state: none of its blocks is credited to the worker
        await expect(f"the old {w.wid}'s blocks leave the index", wait_until(
            lambda w=w, old=old: not old & set().union(*core.index.resident_keys(w.wid).values()), timeout=10))
        finished = sum(1 for r in load.results if r.worker == w.wid and r.sent < left < r.done)
        cycles.append(Cycle(w.wid, left, back, finished))
    return cycles


def check_run(load: Load, ws: list[SimProcess], cycles: list[Cycle]) -> None:
    results = load.results
    failed = [r for r in results if r.error is not None]
    assert not failed, f"{len(failed)} of {len(results)} failed: {[(r.kind, r.worker, r.error) for r in failed[:5]]}"
    assert {r.kind for r in results} == set(KINDS)
    for c in cycles:
        wrong = [r for r in results if r.worker == c.wid and c.left < r.sent < c.back]
        assert not wrong, f"{len(wrong)} requests reached {c.wid} while it was out"
        assert any(r.worker == c.wid and r.sent > c.back for r in results), f"{c.wid} served nothing after restart"
    assert [c.wid for c in cycles] == [w.wid for w in ws]
    # the drains had requests to wait for, and those finished whole (every answer is checked above)
    assert sum(c.finished_after_leaving for c in cycles) > 0


async def run_rolling_restart(session: aiohttp.ClientSession, url: str, worker_of: Callable[[Any], str | None],
                              ws: list[SimProcess], core: RoutingCore,
                              leave: Callable[[SimProcess], Awaitable[None]],
                              idle: Callable[[SimProcess], Awaitable[None]],
                              rejoin: Callable[[SimProcess], Awaitable[None]]) -> tuple[Load, list[Cycle]]:
    load = Load(session, url, worker_of)
    runner = asyncio.create_task(load.run())
    try:
        # every worker is serving and in the index before the first one goes
        await expect("every worker has blocks in the index", wait_until(
            lambda: all(any(core.index.resident_keys(w.wid).values()) for w in ws), timeout=20))
        cycles = await rolling_restart(load, ws, session, core, leave, idle, rejoin)
    finally:
        runner.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await runner
        await load.finish()
    return load, cycles


@contextlib.asynccontextmanager
async def sim_fleet(n: int) -> AsyncIterator[tuple[list[SimProcess], aiohttp.ClientSession]]:
    ws = [SimProcess(f"w{i}") for i in range(n)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        try:
            for w in ws:
                w.spawn()
            for w in ws:
                await w.ready(session)
            yield ws, session
        finally:
            for w in ws:
                await w.kill()


async def engine_idle(w: SimProcess, session: aiohttp.ClientSession) -> None:
    async def idle() -> bool:
        return await w.busy(session) == 0

    await wait_for(idle, f"{w.wid}'s engine has no request")


async def leave_by_file(path: Path, ws: list[SimProcess], w: SimProcess, core: RoutingCore) -> None:
    """Its entry out of the workers file: the router drains it (or, with nothing in flight there, drops it)."""
    write_workers(path, [x for x in ws if x is not w])
    await expect(f"{w.wid} drains once out of the workers file", wait_until(
        lambda: w.wid not in core.endpoints or core.endpoints[w.wid].draining))


async def gone_by_file(w: SimProcess, core: RoutingCore, session: aiohttp.ClientSession) -> None:
    """A worker out of the workers file has finished once the router has let it go: its requests have ended (the
    router's count: what it sent there and has not seen end), and it left the index with the fleet."""
    await expect(f"{w.wid} leaves the router once its requests end", wait_until(
        lambda: w.wid not in core.endpoints, timeout=10))
    assert w.wid not in core.index.workers() and w.wid not in core.load.workers
    await engine_idle(w, session)


# ---- through the proxy ---------------------------------------------------------------------------------------
@pytest.mark.sockets
async def test_a_rolling_restart_through_the_proxy_fails_no_request(tmp_path):
    path = tmp_path / "workers.json"
    async with sim_fleet(3) as (ws, session):
        write_workers(path, ws)
        async with proxy([], workers_file=str(path)) as (server, url, admin):
            server.fleet.file_poll_s = 0.05
            by_file = ws[2]  # the other two through the admin API

            async def workers_state() -> dict[str, Any]:
                async with session.get(admin + "/admin/workers") as r:
                    assert r.status == 200
                    return (await r.json())["workers"]

            async def leave(w: SimProcess) -> None:
                if w is by_file:
                    await leave_by_file(path, ws, w, server.core)
                    return
                async with session.post(admin + "/admin/drain", params={"worker": w.wid}, json={}) as r:
                    assert r.status == 200 and (await r.json()) == {"worker": w.wid, "draining": True}

            async def idle(w: SimProcess) -> None:
                if w is by_file:
                    await gone_by_file(w, server.core, session)
                    return

                async def router_idle() -> bool:  # the router's own count: what it sent there and has not seen end
                    state = (await workers_state())[w.wid]
                    assert state["draining"]
                    return state["inflight"] == 0

                await wait_for(router_idle, f"the router has nothing in flight on {w.wid}")
                await engine_idle(w, session)

            async def rejoin(w: SimProcess) -> None:
                if w is by_file:
                    write_workers(path, ws)
                    await wait_until(lambda: w.wid in server.core.endpoints)
                    return
                async with session.post(admin + "/admin/undrain", params={"worker": w.wid}, json={}) as r:
                    assert r.status == 200 and (await r.json()) == {"worker": w.wid, "draining": False}

            load, cycles = await run_rolling_restart(session, url, lambda h: h.get("x-kvrouter-worker"), ws,
                                                     server.core, leave, idle, rejoin)
            check_run(load, ws, cycles)
            assert server.metrics.retries._value.get() == 0  # the drains, not retries, kept every request whole
            state = await workers_state()
            assert sorted(state) == ["w0", "w1", "w2"] and not any(s["draining"] for s in state.values())


# ---- through Envoy + the picker ------------------------------------------------------------------------------
@contextlib.asynccontextmanager
async def picker_behind_envoy(ws: list[SimProcess], workers_file: Path, tmp: Path
                              ) -> AsyncIterator[tuple[str, RoutingCore, Callable[[], Awaitable[dict[str, int]]]]]:
    """``kvrouter epp`` (in-process, its workers from the watched file) behind a real Envoy whose answers name the
    upstream that served them; yields Envoy's URL, the picker's core, and a reader of Envoy's pool counters."""
    core = RoutingCore(RoutingConfig(block_size=16, seed=0))
    fleet = Fleet(core, probe_interval_s=0.2, workers_file=str(workers_file), file_poll_s=0.05)
    await fleet.start()
    picker = EndpointPicker(core, fleet, lambda _model: load_tokenizer(), 16, RouterMetrics(fleet))
    picker_port, listen, admin = free_port(), free_port(), free_port()
    started = asyncio.Event()
    task = asyncio.create_task(serve_epp(core, fleet, picker, picker_port, None, "127.0.0.1", started=started,
                                         grace_s=1))
    try:
        await asyncio.wait_for(started.wait(), 10)
        cfg = bootstrap(listen_port=listen, admin_port=admin, picker_port=picker_port,
                        workers=[w.address for w in ws])
        hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        for route in hcm["route_config"]["virtual_hosts"][0]["routes"]:
            if "route" in route:
                route["response_headers_to_add"] = [{"header": {"key": SERVED_BY,
                                                                "value": "%UPSTREAM_REMOTE_ADDRESS%"}}]

        async def pool_counters() -> dict[str, int]:
            async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{admin}/stats",
                                                           params={"filter": r"^cluster\.inference_pool\."}) as r:
                lines = (await r.text()).splitlines()
            return {k.removeprefix("cluster.inference_pool."): int(v) for k, _, v in
                    (line.partition(": ") for line in lines) if v.isdigit()}

        with envoy(cfg, tmp):
            yield f"http://127.0.0.1:{listen}", core, pool_counters
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await fleet.stop()


@pytest.mark.sockets
async def test_a_rolling_restart_through_envoy_and_the_picker_fails_no_request(tmp_path):
    path = tmp_path / "workers.json"
    async with sim_fleet(3) as (ws, session):
        write_workers(path, ws)
        by_address = {w.address: w.wid for w in ws}
        async with picker_behind_envoy(ws, path, tmp_path) as (url, core, pool_counters):

            async def leave(w: SimProcess) -> None:  # as a terminating pod leaves the pool
                await leave_by_file(path, ws, w, core)

            async def idle(w: SimProcess) -> None:
                await gone_by_file(w, core, session)

            async def rejoin(w: SimProcess) -> None:
                write_workers(path, ws)
                await wait_until(lambda: w.wid in core.endpoints)

            load, cycles = await run_rolling_restart(session, url, lambda h: by_address.get(h.get(SERVED_BY, "")),
                                                     ws, core, leave, idle, rejoin)
            check_run(load, ws, cycles)
            assert all(r.worker is not None for r in load.results)  # Envoy named the upstream of every answer
            counters = await pool_counters()
            assert counters["upstream_rq_200"] == len(load.results)
            assert counters["upstream_rq_retry"] == 0 and counters["upstream_cx_connect_fail"] == 0


# ---- the fleet's part, without sockets -----------------------------------------------------------------------
def test_a_worker_out_of_discovery_drains_until_its_requests_end_then_leaves_the_index():
    """Regression: a worker the workers file (or Kubernetes: a terminating pod) no longer listed was dropped at
    once, with the requests it had: the router forgot them, so nothing it showed could tell when the worker was
    done (the picker behind Envoy then lost streams to a worker stopped once its engine looked idle). It drains
    now: no new request, its requests counted to their end, then it leaves, index and all."""
    core = RoutingCore(RoutingConfig(block_size=16, seed=0))
    fleet = Fleet(core)
    specs = [WorkerSpec(f"w{i}", f"http://127.0.0.1:{9000 + i}") for i in range(3)]
    fleet.set_workers(specs)
    core.index.store("w0", [1, 2], [11, 12], Medium.GPU)
    now = time.monotonic()

    def dispatch(wid: str, rid: str):  # type: ignore[no-untyped-def]
        req = RouteRequest(rid, [], 0, 16, 1, subset=frozenset({wid}))
        decision = core.decide(req, now)
        assert decision.outcome == "routed" and decision.ranked[0] == wid
        return core.dispatch(req, decision, wid, now)

    running = dispatch("w0", "r0")
    fleet.set_workers(specs[1:])  # w0 is out of discovery while r0 runs there
    assert core.endpoints["w0"].draining and core.load.workers["w0"].requests == 1
    for i in range(6):  # nothing new goes there
        assert "w0" not in core.decide(RouteRequest(f"n{i}", [], 0, 16, 1), now).ranked
    fleet.reap()
    assert "w0" in core.endpoints and "w0" in core.index.workers()  # still busy: still there
    running.complete(now)
    fleet.reap()
    assert "w0" not in core.endpoints and "w0" not in core.index.workers() and "w0" not in fleet.specs

    fleet.set_workers([specs[0], specs[2]])  # w1, idle, leaves at once; w0 is back, taking requests
    assert "w1" not in core.endpoints and not core.endpoints["w0"].draining

    core.set_draining("w2", True)  # drained by the admin API, then out of discovery and back before it left
    running = dispatch("w0", "r1")
    core.set_draining("w2", False)
    running_w2 = dispatch("w2", "r2")
    core.set_draining("w2", True)
    fleet.set_workers([specs[0]])
    assert core.endpoints["w2"].draining and "w2" in fleet.leaving
    fleet.set_workers([specs[0], specs[2]])
    assert core.endpoints["w2"].draining and not fleet.leaving  # the admin's drain stands
    core.set_draining("w2", False)
    fleet.set_workers([specs[0]])  # out again, busy: draining, not removed ...
    assert core.endpoints["w2"].draining
    core.set_healthy("w2", False)  # ... until it stops answering, with its request still counted
    fleet.reap()
    assert "w2" not in core.endpoints and "w0" in core.endpoints
    running.complete(now)
    running_w2.complete(now)
