"""``kvrouter serve --processes 2``: two processes answer on one port; a request dispatched by either counts in
the other's load (process 0's ``/admin/workers``); ``/metrics`` sums both from whichever answers; a killed
child is restarted; SIGTERM to the parent stops them all cleanly."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from bench.load import free_port, server_process

pytestmark = pytest.mark.sockets
REQUESTS = 16


class HeldWorker:
    """An OpenAI-shaped worker that sends a streamed answer's first chunk, then holds it until released: the
    requests stay in flight exactly as long as the test needs, no timing involved."""

    def __init__(self) -> None:
        self.started = 0
        self.release = asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.add_routes([web.get("/health", self.ok), web.get("/metrics", self.ok), web.get("/v1/models", self.models),
                        web.post("/v1/completions", self.complete)])
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    async def ok(self, _: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "sim-model", "max_model_len": 4096}]})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        self.started += 1
        await resp.write(b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n')
        await self.release.wait()
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def until(check: Callable[[], Awaitable[bool]], deadline_s: float = 30.0) -> None:
    t0 = time.monotonic()
    while not await check():
        if time.monotonic() - t0 > deadline_s:
            raise AssertionError(f"not within {deadline_s} s")
        await asyncio.sleep(0.05)


async def get_json(url: str) -> Any:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return await r.json()


def router_children(parent: int) -> list[int]:
    """The parent's router processes (not multiprocessing's resource tracker)."""
    with open(f"/proc/{parent}/task/{parent}/children") as fh:
        pids = [int(p) for p in fh.read().split()]
    out = []
    for pid in pids:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            if b"resource_tracker" not in fh.read():
                out.append(pid)
    return out


def listeners(port: int) -> int:
    """Sockets listening on ``port`` (SO_REUSEPORT: one per process)."""
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as fh:
            for line in fh.readlines()[1:]:
                f = line.split()
                n += f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port
    return n


async def test_serve_processes_2_one_port_shared_load_metrics_and_restart():
    workers = [HeldWorker(), HeldWorker()]
    for w in workers:
        await w.start()
    port, admin = free_port(), free_port()
    args = ["-m", "router.cli", "serve", "--processes", "2", "--host", "127.0.0.1", "--port", str(port),
            "--admin-port", str(admin), "--policy", "least_loaded",
            *[a for i, w in enumerate(workers) for a in ("--worker", f"{w.url},id=w{i}")]]
    admin_url = f"http://127.0.0.1:{admin}/admin/workers"
    body = {"model": "sim-model", "prompt": "a prompt for two processes", "max_tokens": 8, "stream": True}
    with server_process(args, port) as parent:

        async def peers() -> dict[str, Any]:
            try:
                return (await get_json(admin_url))["shared_load"]["peers"]
            except (aiohttp.ClientError, KeyError):
                return {}

        async def sibling_heard() -> bool:  # process 0 serves admin and hears process 1's heartbeats
            return len(await peers()) == 1

        await until(sibling_heard)

        async def both_listening() -> bool:  # else every connection opened now lands on the first one
            return listeners(port) == 2

        await until(both_listening)
        sessions = [aiohttp.ClientSession() for _ in range(REQUESTS)]  # one connection each: the kernel spreads them
        try:
            answers = [await s.post(f"http://127.0.0.1:{port}/v1/completions", json=body) for s in sessions]
            assert all(r.status == 200 for r in answers)
            for r in answers:
                await r.content.readline()  # the first chunk: in flight on its worker now

            async def counted() -> bool:
                state = await get_json(admin_url)
                return sum(w["inflight"] for w in state["workers"].values()) == REQUESTS

            await until(counted, 5.0)
            state = await get_json(admin_url)
            shared = state["shared_load"]
            (sibling,) = shared["peers"].values()
            # both processes took some of them, and process 0 counts the other's as well as its own
            assert shared["local_requests"] >= 1 and sibling["requests"] >= 1
            assert shared["local_requests"] + sibling["requests"] == REQUESTS
            for w in workers:
                w.release.set()
            for r in answers:
                await r.read()
        finally:
            for s in sessions:
                await s.close()

        async def drained() -> bool:
            state = await get_json(admin_url)
            return sum(w["inflight"] for w in state["workers"].values()) == 0

        await until(drained, 5.0)
        for _ in range(6):  # fresh connections: either process may answer, each with the pod's totals
            async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/metrics") as r:
                text = await r.text()
            assert f'kvrouter_requests_total{{status="200"}} {float(REQUESTS)}' in text

        children = router_children(parent.pid)
        assert len(children) == 2
        os.kill(children[1], signal.SIGKILL)

        async def replaced() -> bool:
            now = router_children(parent.pid)
            return len(now) == 2 and children[1] not in now

        await until(replaced)

        async def restarted_heard() -> bool:
            state = await get_json(admin_url)
            return state["shared_load"]["stats"]["restarts"] + state["shared_load"]["stats"]["replicas_expired"] >= 1

        await until(restarted_heard)
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/health") as r:
            assert r.status == 200
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(timeout=20) == 0  # the children stopped on the forwarded signal, the parent after them
    for w in workers:
        await w.runner.cleanup()  # type: ignore[union-attr]


@pytest.mark.parametrize(("overrides", "message"), [
    ({"processes": 0}, "processes must be at least 1"),
    ({"processes": 2, "events_bind": "tcp://*:5557"}, "cannot share one events_bind"),
    ({"load_bus": "redis://x"}, "expected a nats://"),
    ({"replica_id": "a.b"}, "one NATS subject token"),
])
def test_processes_and_load_bus_settings_are_checked(overrides, message):
    from router.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides, environ={})


def test_processes_options_reach_the_config():
    from router.cli import _load_router_config, build_parser

    args = build_parser().parse_args(["serve", "--worker", "http://127.0.0.1:1", "--processes", "3", "--load-bus",
                                      "nats://127.0.0.1:4222", "--replica-id", "r1"])
    config = _load_router_config(args, {})
    assert (config.processes, config.load_bus, config.replica_id) == (3, "nats://127.0.0.1:4222", "r1")
