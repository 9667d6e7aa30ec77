"""Issue 50, finding 5: a graceful stop on SIGTERM (and SIGINT) for ``kvrouter serve`` and ``kvrouter epp``, one
process and several (``--processes 2``), with real signals to real processes, the picker behind the real Envoy.

Each case has a stream in flight (20 of its 300 tokens read), a request the worker holds before its first token
(the router counts its prefill as pending, so flow control finds the fleet saturated) and requests flow control
then queues. After the signal: the queued requests are answered 429 with Retry-After (through Envoy too: not an
empty 500, not a reset), the router reports itself not ready (the proxy's ``/health`` 503 on a connection opened
before; the picker's gRPC health NOT_SERVING), new connections are refused, and the requests in flight finish
whole (the stream's 300 tokens and ``[DONE]``) once the worker lets them go; then the process exits 0. A second
signal cuts the drain short. Before this, SIGTERM killed a lone router at once (no handler): the stream was cut,
the queued clients got resets (an empty 500 through Envoy).

Nothing here waits on time: the worker holds its answers until the test releases them, and every wait is on
something the test sees (tokens read, requests the worker received, decisions in ``/metrics``, answers).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import yaml
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.load import free_port, server_process
from router.frontends.envoy_config import bootstrap
from tests.envoy_helpers import envoy
from tests.zmq_helpers import wait_until

pytestmark = pytest.mark.sockets

TOKENS = 300  # the stream in flight: this many tokens, then its usage and [DONE]
EARLY = 20  # of them sent before the signal
QUEUED = 3  # requests flow control holds when the signal comes
GRACE_S = 120.0  # never reached: every case ends by the worker's release, well inside it
EARLY_HEADER = "x-test-early"  # tokens the worker sends at once; then it holds until released
PROMPT = "the document the whole fleet is asked about, once and again " * 4


class ScriptedWorker:
    """An OpenAI-shaped worker whose streams the test scripts: a request sends ``x-test-early`` tokens at once (0 by
    default: nothing, its prefill still pending for the router), then holds until ``release`` is set, then sends the
    rest of its ``max_tokens``, the usage and ``[DONE]``."""

    def __init__(self) -> None:
        self.received = 0
        self.release = asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        app.add_routes([web.get("/health", self.ok), web.get("/metrics", self.ok), web.get("/v1/models", self.models),
                        web.post("/v1/completions", self.complete)])
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        self.release.set()
        if self.runner is not None:
            await self.runner.cleanup()

    async def ok(self, _: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "sim-model", "max_model_len": 4096}]})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received += 1
        early = int(request.headers.get(EARLY_HEADER, "0"))
        total = int(body.get("max_tokens", 16))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(total):
            if i == early:
                await self.release.wait()
            chunk = {"object": "text_completion", "choices": [{"index": 0, "text": f"t{i} ", "finish_reason": None}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        usage = {"prompt_tokens": 40, "completion_tokens": total, "total_tokens": 40 + total}
        await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@contextlib.asynccontextmanager
async def scripted_worker() -> AsyncIterator[ScriptedWorker]:
    worker = ScriptedWorker()
    await worker.start()
    try:
        yield worker
    finally:
        await worker.stop()


async def stream(s: aiohttp.ClientSession, url: str, early: int, seen: asyncio.Event | None = None
                 ) -> tuple[int, list[str], bool]:
    """A streamed completion of ``TOKENS`` tokens: its status, the token texts read and whether ``[DONE]`` came;
    ``seen`` is set once ``early`` tokens were read."""
    body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": TOKENS, "stream": True}
    tokens: list[str] = []
    done = False
    async with s.post(url + "/v1/completions", json=body, headers={EARLY_HEADER: str(early)}) as r:
        async for line in r.content:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                done = True
                continue
            tokens += [c["text"] for c in json.loads(data).get("choices", [])]  # (an error event has none)
            if seen is not None and len(tokens) >= early:
                seen.set()
        return r.status, tokens, done


async def completion(s: aiohttp.ClientSession, url: str) -> tuple[int, str | None, int]:
    """A short completion (held by flow control, or by the worker): status, Retry-After, tokens answered."""
    body = {"model": "sim-model", "prompt": PROMPT + "and a question", "max_tokens": 4, "stream": True}
    async with s.post(url + "/v1/completions", json=body) as r:
        text = await r.text()
        return r.status, r.headers.get("retry-after"), text.count('"text"')


async def until(check: Callable[[], Awaitable[bool]], timeout_s: float = 30.0) -> None:
    """Until ``check()`` holds (a condition the test can see, looked at again and again), else fail."""
    async with asyncio.timeout(timeout_s):
        while not await check():
            await asyncio.sleep(0.02)


async def decisions(metrics_url: str) -> float:
    """Requests decided so far (``kvrouter_decision_seconds_count``: observed before flow control holds one)."""
    async with aiohttp.ClientSession() as s, s.get(metrics_url) as r:
        text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvrouter_decision_seconds_count"))


async def at_least(metrics_url: str, n: float) -> bool:
    return await decisions(metrics_url) >= n


async def refused(port: int) -> bool:
    """A new connection to ``port`` is refused (nothing listens there any more)."""
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except ConnectionRefusedError:
        return True
    writer.close()
    return False


async def both_processes_up(admin_url: str) -> bool:
    """Process 0's admin hears process 1 (each listens once its fleet and load exchange are up)."""
    try:
        async with aiohttp.ClientSession() as s, s.get(admin_url + "/admin/workers") as r:
            return len((await r.json())["shared_load"]["peers"]) == 1
    except (aiohttp.ClientError, KeyError, TypeError):
        return False


def write_config(tmp: Path, grace: dict[str, Any]) -> str:
    path = tmp / "kvrouter.yaml"
    path.write_text(yaml.safe_dump({
        # saturated as soon as a prefill is pending on the worker; a queued request waits as long as the test
        "flow_control": {"enabled": True, "saturation_queue_s": 0.0, "queue_timeout_s": 600.0},
        "probe_interval_s": 0.2, **grace}))
    return str(path)


async def exit_code(proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> int | None:
    return await asyncio.to_thread(proc.wait, timeout_s)


async def scenario(url: str, worker: ScriptedWorker, metrics_url: str, proc: subprocess.Popen[bytes],
                   sig: signal.Signals, processes: int, after_signal: Callable[[], Awaitable[None]]) -> None:
    """The stream, the held request and the queued ones; the signal; then what every case checks. ``after_signal``
    checks the front end's own readiness and listener once the queued requests have their answers."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        seen = asyncio.Event()
        long_stream = asyncio.create_task(stream(s, url, EARLY, seen))
        await asyncio.wait_for(seen.wait(), 30)
        held = asyncio.create_task(stream(s, url, 0))  # its prefill pending: the fleet is saturated from now on
        await wait_until(lambda: worker.received == 2, 30)
        base = await decisions(metrics_url)
        queued = [asyncio.create_task(completion(s, url)) for _ in range(QUEUED)]
        await until(lambda: at_least(metrics_url, base + QUEUED))  # decided, so held: the fleet is saturated
        proc.send_signal(sig)
        answers = await asyncio.wait_for(asyncio.gather(*queued), 30)
        shed = [a for a in answers if a[0] == 429]
        assert all(retry is not None and int(retry) >= 1 for _, retry, _ in shed), answers
        if processes == 1:
            assert len(shed) == QUEUED, answers
        else:
            # a sibling that had not yet heard of the held request sent one of them to the worker (then it had its
            # own pending prefill): that one is in flight, and finishes whole below
            assert len(shed) >= QUEUED - (processes - 1), answers
        in_flight = [a for a in answers if a[0] != 429]
        await after_signal()
        assert not long_stream.done() and not held.done()  # the drain waits for them
        worker.release.set()
        status, tokens, done = await asyncio.wait_for(long_stream, 30)
        assert status == 200 and done and tokens == [f"t{i} " for i in range(TOKENS)]
        status, tokens, done = await asyncio.wait_for(held, 30)
        assert status == 200 and done and len(tokens) == TOKENS
        assert all(a == (200, None, 4) for a in in_flight), in_flight
    assert await exit_code(proc) == 0


# ---- kvrouter serve ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("processes", "sig"), [(1, signal.SIGTERM), (1, signal.SIGINT), (2, signal.SIGTERM)],
                         ids=["1-SIGTERM", "1-SIGINT", "2-SIGTERM"])
async def test_a_signal_drains_serve(tmp_path: Path, processes: int, sig: signal.Signals) -> None:
    async with scripted_worker() as worker:
        port, admin = free_port(), free_port()
        args = ["-m", "router.cli", "serve", "--config", write_config(tmp_path, {"http": {"grace_s": GRACE_S}}),
                "--host", "127.0.0.1", "--port", str(port), "--admin-port", str(admin),
                "--processes", str(processes), "--worker", f"{worker.url},id=w0"]
        url = f"http://127.0.0.1:{port}"
        with server_process(args, port) as proc:
            if processes > 1:
                await until(lambda: both_processes_up(f"http://127.0.0.1:{admin}"))
            # a client's kept-alive connection, opened before the signal
            reader, writer = await asyncio.open_connection("127.0.0.1", port)

            async def after_signal() -> None:
                # not ready: /health on the open connection is 503, and that answer closes it. With several
                # processes the connection's own may take the signal a moment later (asked until it has), or have
                # finished its drain already, nothing in flight there: then it closed the idle connection
                while True:
                    writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
                    try:
                        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
                    except asyncio.IncompleteReadError as e:
                        assert processes > 1 and e.partial == b""
                        break
                    length = int(next(h.split(b":")[1] for h in head.split(b"\r\n")
                                      if h.lower().startswith(b"content-length")))
                    await reader.readexactly(length)
                    if head.startswith(b"HTTP/1.1 503"):
                        assert b"connection: close" in head.lower()
                        assert await asyncio.wait_for(reader.read(), 30) == b""
                        break
                    assert processes > 1 and head.startswith(b"HTTP/1.1 200"), head
                # no new connections (every process's listener closed)
                if processes == 1:
                    assert await refused(port)
                else:
                    await until(lambda: refused(port))

            await scenario(url, worker, url + "/metrics", proc, sig, processes, after_signal)
            writer.close()


async def test_a_second_sigterm_cuts_the_drain_short(tmp_path: Path) -> None:
    async with scripted_worker() as worker:
        port, admin = free_port(), free_port()
        args = ["-m", "router.cli", "serve", "--config", write_config(tmp_path, {"http": {"grace_s": GRACE_S}}),
                "--host", "127.0.0.1", "--port", str(port), "--admin-port", str(admin),
                "--worker", f"{worker.url},id=w0"]
        with server_process(args, port) as proc:
            async with aiohttp.ClientSession() as s:
                seen = asyncio.Event()
                long_stream = asyncio.create_task(stream(s, f"http://127.0.0.1:{port}", EARLY, seen))
                await asyncio.wait_for(seen.wait(), 30)
                proc.send_signal(signal.SIGTERM)
                await until(lambda: refused(port))  # draining: the stream is held, the grace far off
                assert not long_stream.done()
                proc.send_signal(signal.SIGTERM)
                assert await exit_code(proc) == 0  # without the worker's release: the drain was cut short
                with pytest.raises(aiohttp.ClientPayloadError):
                    await asyncio.wait_for(long_stream, 30)


# ---- kvrouter epp behind Envoy -------------------------------------------------------------------------------
async def health_status(port: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        res = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="readiness"),
                                                         timeout=5)
        return int(res.status)


@pytest.mark.parametrize("processes", [1, 2])
async def test_sigterm_drains_the_picker_behind_envoy(tmp_path: Path, processes: int) -> None:
    async with scripted_worker() as worker:
        picker, health, metrics, admin = free_port(), free_port(), free_port(), free_port()
        listen, envoy_admin = free_port(), free_port()
        args = ["-m", "router.cli", "epp", "--config", write_config(tmp_path, {"epp": {"grace_s": GRACE_S}}),
                "--port", str(picker), "--health-port", str(health), "--metrics-port", str(metrics),
                "--admin-port", str(admin), "--processes", str(processes), "--worker", f"{worker.url},id=w0"]
        cfg = bootstrap(listen_port=listen, admin_port=envoy_admin, picker_port=picker,
                        workers=[f"127.0.0.1:{worker.port}"], queue_timeout_s=600.0)
        with server_process(args, picker) as proc, envoy(cfg, tmp_path):
            if processes > 1:
                await until(lambda: both_processes_up(f"http://127.0.0.1:{admin}"))
            await until(lambda: _serving(health))

            async def after_signal() -> None:
                await until(lambda: _not_serving(health))  # not ready (each process answers for itself)
                await until(lambda: refused(picker))  # and no new connections: Envoy opens its next ones elsewhere

            await scenario(f"http://127.0.0.1:{listen}", worker, f"http://127.0.0.1:{metrics}/metrics", proc,
                           signal.SIGTERM, processes, after_signal)


async def _serving(port: int) -> bool:
    return await health_status(port) == health_pb2.HealthCheckResponse.SERVING


async def _not_serving(port: int) -> bool:
    try:
        return await health_status(port) == health_pb2.HealthCheckResponse.NOT_SERVING
    except grpc.aio.AioRpcError:
        return False

