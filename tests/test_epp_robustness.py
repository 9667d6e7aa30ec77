"""Issue 13's endpoint-picker defects, each through a real Envoy -> in-process kvrouter epp -> simulated workers.

One test per defect: the body limit (413), the tenant header as the only source of ``cache_salt``, accounting
keyed by the picker's own request ids (not the client's ``x-request-id``), malformed input answered 400 (never
5xx), a big prompt parsed off the event loop, and worker control paths refused by the picker itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from bench.load import free_port
from router.discovery import WorkerSpec
from router.frontends.envoy_config import bootstrap
from router.frontends.epp import EndpointPicker, serve_epp
from router.frontends.fleet import Fleet
from router.frontends.metrics import RouterMetrics
from router.scheduling import RoutingConfig, RoutingCore
from router.tokenizer import PromptTokenizer, load_tokenizer
from tests.envoy_helpers import Picker, envoy
from tests.zmq_helpers import wait_until
from workers.engine import EngineConfig, EngineModel
from workers.sim.publisher import KvEventPublisher
from workers.sim.server import SimWorker

pytestmark = pytest.mark.sockets
SYSTEM = "you are a helpful assistant and the system document says the answer is in the question " * 12
LONG = SYSTEM * 2  # ~1000 tokens: 60+ blocks of 16


# ---- helpers -------------------------------------------------------------------------------------
@dataclass
class Seen:
    """What reached a simulated worker over HTTP: (method, path, headers) per request."""

    requests: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)

    def paths(self) -> list[str]:
        return [p for _, p, _ in self.requests]

    def generate(self) -> list[dict[str, str]]:
        return [h for m, p, h in self.requests if m == "POST" and p.startswith("/v1/")]


@dataclass
class Worker:
    worker: SimWorker
    runner: web.AppRunner
    port: int
    seen: Seen
    role: str = "both"  # prefill | decode | both
    models: frozenset[str] = frozenset()  # what discovery says it serves (empty: whatever is asked)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def spec(self, wid: str) -> WorkerSpec:
        pub = self.worker.publisher
        assert pub is not None
        return WorkerSpec(wid, self.url, pub.endpoint, pub.replay_endpoint, models=self.models, role=self.role)

    async def stop(self) -> None:
        await self.runner.cleanup()


async def start_recording_worker(*, time_scale: float = 0.0, max_model_len: int = 32768,
                                 topic: str = "w0", model: str = "sim-model") -> Worker:
    """tests.sim_helpers.start_worker with a middleware recording every request the worker receives
    (the simulator keeps no headers of its own)."""
    tok = load_tokenizer()
    engine = EngineModel(EngineConfig(num_gpu_blocks=2048, block_size=16, cpu_blocks=0,
                                      max_model_len=max_model_len, vocab_size=tok.vocab_size))
    pub = KvEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic)
    worker = SimWorker(engine, tok, model, pub, time_scale)
    seen = Seen()

    @web.middleware
    async def record(request: web.Request, handler):  # type: ignore[no-untyped-def]
        if "x-forwarded-proto" in request.headers:  # came through Envoy (not the picker's own probes)
            headers = {k.lower(): v for k, v in request.headers.items()}
            seen.requests.append((request.method, request.path, headers))
        return await handler(request)

    app = worker.app()
    app.middlewares.append(record)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return Worker(worker, runner, port, seen)


@contextlib.asynccontextmanager
async def recording_workers(n: int = 1, **kw: Any) -> AsyncIterator[list[Worker]]:
    ws = [await start_recording_worker(topic=f"w{i}", **kw) for i in range(n)]
    try:
        yield ws
    finally:
        for w in ws:
            await w.stop()


async def start_picker_with(specs: list[WorkerSpec], port: int, picker_kw: dict[str, Any],
                            tokenizer_for: Callable[[str | None], PromptTokenizer] | None = None,
                            **routing: Any) -> Picker:
    """tests.envoy_helpers.start_picker, also passing EndpointPicker's keyword arguments."""
    core = RoutingCore(RoutingConfig(policy="precise", block_size=16, seed=0, **routing))
    fleet = Fleet(core, probe_interval_s=0.2)
    for s in specs:
        fleet.add(s)
    await fleet.start()
    picker = EndpointPicker(core, fleet, tokenizer_for or (lambda m: load_tokenizer()), 16, RouterMetrics(fleet),
                            **picker_kw)
    started = asyncio.Event()
    task = asyncio.create_task(serve_epp(core, fleet, picker, port, None, "127.0.0.1", started=started, grace_s=1))
    await asyncio.wait_for(started.wait(), 10)
    return Picker(core, fleet, picker, port, task)


@contextlib.asynccontextmanager
async def gateway_with(ws: list[Worker], tmp: Path, picker_kw: dict[str, Any] | None = None,
                       tokenizer_for: Callable[[str | None], PromptTokenizer] | None = None,
                       route_everything: bool = False, **routing: Any) -> AsyncIterator[tuple[str, Picker]]:
    """tests.envoy_helpers.gateway with EndpointPicker kwargs; ``route_everything``: one prefix "/" route to
    the pool (as a hand-written Envoy config might have), so only the picker can refuse a control path."""
    listen, admin, picker_port = free_port(), free_port(), free_port()
    specs = [w.spec(f"w{i}") for i, w in enumerate(ws)]
    picker = await start_picker_with(specs, picker_port, picker_kw or {}, tokenizer_for, **routing)
    cfg = bootstrap(listen_port=listen, admin_port=admin, picker_port=picker_port,
                    workers=[s.address for s in specs])
    if route_everything:
        vhost = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"][
            "route_config"]["virtual_hosts"][0]
        first = vhost["routes"][0]
        vhost["routes"] = [{"match": {"prefix": "/"}, "route": first["route"],
                            "per_request_buffer_limit_bytes": first["per_request_buffer_limit_bytes"]}]
    try:
        await wait_until(lambda: all(picker.core.endpoints[s.worker_id].healthy for s in specs), 10)
        with envoy(cfg, tmp):
            yield f"http://127.0.0.1:{listen}", picker
    finally:
        await picker.stop()


async def post(s: aiohttp.ClientSession, url: str, body: Any = None, headers: dict[str, str] | None = None,
               data: bytes | None = None) -> tuple[int, Any]:
    hdrs = {"content-type": "application/json", **(headers or {})}
    payload = data if data is not None else json.dumps(body).encode()
    async with s.post(url, data=payload, headers=hdrs) as r:
        raw = await r.read()
        try:
            return r.status, json.loads(raw)
        except ValueError:
            return r.status, raw


def cached_tokens(out: dict[str, Any]) -> int:
    return out["usage"]["prompt_tokens_details"]["cached_tokens"]


# ---- 1. body limit ------------------------------------------------------------------------------
async def test_body_over_max_body_bytes_is_413_and_never_reaches_a_worker(tmp_path):
    async with recording_workers(1) as ws, \
            gateway_with(ws, tmp_path, {"max_body_bytes": 64 * 1024}) as (url, picker), \
            aiohttp.ClientSession() as s:
        engine = ws[0].worker.engine
        big = {"prompt": "hello", "max_tokens": 1, "user": "x" * 200_000}  # 200 KB, under Envoy's 8 MiB
        st, out = await post(s, url + "/v1/completions", big)
        assert st == 413, out
        assert "limit" in out["message"] and str(64 * 1024) in out["message"]
        assert ws[0].seen.generate() == [] and engine.stats.finished == 0  # the worker got nothing
        assert not picker.core.load.inflight
        st, out = await post(s, url + "/v1/completions", {"prompt": "hello", "max_tokens": 1})
        assert st == 200, out  # the next request on the gateway is served as usual
        assert engine.stats.finished == 1


# ---- 2. tenant isolation ------------------------------------------------------------------------
@pytest.mark.parametrize("missing", ["reject", "no_salt"])
async def test_tenant_header_is_the_only_source_of_cache_salt(tmp_path, missing):
    kw = {"tenant_header": "x-tenant", "tenant_missing": missing}
    async with recording_workers(1) as ws, gateway_with(ws, tmp_path, kw) as (url, picker), \
            aiohttp.ClientSession() as s:
        cmpl = url + "/v1/completions"
        st, out = await post(s, cmpl, {"prompt": LONG + " a", "max_tokens": 1}, {"x-tenant": "tenantA"})
        assert st == 200, out
        await wait_until(lambda: sum(picker.core.index.blocks_held("w0").values()) >= 50)
        st, out = await post(s, cmpl, {"prompt": LONG + " b", "max_tokens": 1}, {"x-tenant": "tenantA"})
        assert st == 200 and cached_tokens(out) > 900  # control: tenant A itself does share its prefix

        forged = {"prompt": LONG + " c", "max_tokens": 1, "cache_salt": "tenantA"}
        n = len(ws[0].seen.generate())
        st, out = await post(s, cmpl, forged)  # no tenant header, tenant A's salt in the body
        if missing == "reject":
            assert st == 400, out
            assert "x-tenant" in out["message"]
            assert len(ws[0].seen.generate()) == n  # refused by the picker
        else:
            assert st == 200, out
            assert cached_tokens(out) < 16  # the worker did not share tenant A's cache
        # a header always wins over the body's salt
        st, out = await post(s, cmpl, forged | {"prompt": LONG + " d"}, {"x-tenant": "tenantB"})
        assert st == 200, out
        assert cached_tokens(out) < 16


# ---- 3. client x-request-id does not key the accounting ------------------------------------------
async def test_a_shared_client_request_id_neither_merges_accounting_nor_escapes_the_limit(tmp_path):
    limit = 3
    async with recording_workers(1, time_scale=1.0) as ws, \
            gateway_with(ws, tmp_path, max_inflight_requests=limit) as (url, picker), \
            aiohttp.ClientSession() as s:
        cmpl = url + "/v1/completions"
        rid = {"x-request-id": "same-id-from-the-client"}
        body = {"prompt": "keep me busy", "max_tokens": 3000, "stream": True}
        held: list[aiohttp.ClientResponse] = []
        try:
            for _ in range(limit):
                r = await s.post(cmpl, json=body, headers=rid)
                held.append(r)
                assert r.status == 200, await r.read()
            # every one counted, though all carry the same client id
            await wait_until(lambda: len(picker.core.load.inflight) == limit)
            for _ in range(2):
                st, out = await post(s, cmpl, body | {"stream": False}, rid)
                assert st == 429, out  # the excess is shed, not folded into one in-flight entry
            assert len(picker.core.load.inflight) == limit
            # the client's id still reached the worker untouched
            got = [h.get("x-request-id") for h in ws[0].seen.generate()]
            assert got == ["same-id-from-the-client"] * limit
        finally:
            for r in held:
                r.close()
        await wait_until(lambda: not picker.core.load.inflight, 10)  # client gone: every entry released


# ---- 4. malformed input -> 400 -------------------------------------------------------------------
MALFORMED: list[tuple[str, str, bytes]] = [
    ("text part not a string", "/v1/chat/completions",
     json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}).encode()),
    ("token id >= 2**32", "/v1/completions", json.dumps({"prompt": [1, 2**32], "max_tokens": 1}).encode()),
    ("token id >= 2**64", "/v1/completions", json.dumps({"prompt": [2**64 + 1], "max_tokens": 1}).encode()),
    ("lone surrogate", "/v1/completions", b'{"prompt": "abc \\ud800 def", "max_tokens": 1}'),
    ("100k-deep JSON", "/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b', "max_tokens": 1}'),
    ("boolean token ids", "/v1/completions", b'{"prompt": [true, false], "max_tokens": 1}'),
    ("stream as a string", "/v1/completions", b'{"prompt": "hi", "max_tokens": 1, "stream": "false"}'),
    ("token id == vocab size", "/v1/completions",
     json.dumps({"prompt": [1, load_tokenizer().vocab_size], "max_tokens": 1}).encode()),
    ("over max_model_len", "/v1/completions", json.dumps({"prompt": SYSTEM, "max_tokens": 1}).encode()),
    ("ids over max_model_len", "/v1/completions", json.dumps({"prompt": [1] * 300}).encode()),
]


async def test_malformed_input_is_400_with_a_message_from_the_picker(tmp_path):
    async with recording_workers(1, max_model_len=256) as ws, gateway_with(ws, tmp_path) as (url, picker), \
            aiohttp.ClientSession() as s:
        await wait_until(lambda: picker.fleet.context_lens.get("w0") == 256)  # learned from /v1/models
        failures = []
        for name, path, data in MALFORMED:
            st, out = await post(s, url + path, data=data)
            if st != 400 or not isinstance(out, dict) or not out.get("message"):
                failures.append((name, st, out if isinstance(out, dict) else bytes(out)[:200]))
            elif name.endswith("max_model_len") and "256" not in out["message"]:
                failures.append((name, st, out["message"]))  # the limit learned from the worker is named
        assert not failures
        st, out = await post(s, url + "/v1/completions", {"prompt": SYSTEM, "max_tokens": 1})
        assert st == 400 and "maximum context length is 256" in out["message"]  # vLLM's own wording
        assert ws[0].seen.generate() == []  # every one answered by the picker, none by the worker
        st, out = await post(s, url + "/v1/completions", {"prompt": "fine", "max_tokens": 1})
        assert st == 200, out


# ---- 5. a big prompt does not freeze the picker --------------------------------------------------
class GatedTokenizer:
    """The real tokenizer, but a big prompt's tokenizing waits for the test (as a slow GIL-releasing tokenize
    would): the picker stays responsive only if it parses off its event loop."""

    def __init__(self) -> None:
        self.real = load_tokenizer()
        self.entered = threading.Event()
        self.release = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def request_prompts(self, body: dict[str, Any], kind: str, token_budget: int | None = None) -> list[list[int]]:
        prompt = body.get("prompt")
        if isinstance(prompt, str) and len(prompt) > 1_000_000:
            self.entered.set()
            self.release.wait(8)  # bounded: an event-loop-blocking picker must not hang the test forever
        return self.real.request_prompts(body, kind, token_budget)


async def test_a_big_prompt_is_parsed_off_the_event_loop(tmp_path):
    """While the picker parses an 8 MB body (held at its tokenizer by the gate), a small request through
    Envoy is served and the gRPC health check answers: ordering, not timing. A picker parsing on its event
    loop answers neither until the gate's timeout (Envoy's 5 s message timeout fails the small one first)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    gate = GatedTokenizer()
    async with recording_workers(1) as ws, \
            gateway_with(ws, tmp_path, tokenizer_for=lambda m: gate) as (url, picker), \
            aiohttp.ClientSession() as s, grpc.aio.insecure_channel(f"127.0.0.1:{picker.port}") as ch:
        await wait_until(lambda: "w0" in picker.fleet.context_lens)
        # 8.4 MB: past the route's 8 MiB buffer limit, yet FULL_DUPLEX_STREAMED streams it all to the picker
        big = {"prompt": "hello world " * 700_000, "max_tokens": 1}
        big_task = asyncio.create_task(post(s, url + "/v1/completions", big))
        try:
            await wait_until(gate.entered.is_set, 20)  # the picker has the whole body and is parsing it
            st, out = await post(s, url + "/v1/completions", {"prompt": "small", "max_tokens": 1})
            assert st == 200, out
            live = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="liveness"))
            assert live.status == health_pb2.HealthCheckResponse.SERVING
            assert not big_task.done()  # both answered while the big one was still being parsed
        finally:
            gate.release.set()
        st, out = await big_task
        assert st == 400 and "32768" in out["message"], out  # longer than any served context
        assert len(ws[0].seen.generate()) == 1  # only the small one reached the worker


# ---- 6. worker control paths ----------------------------------------------------------------------
async def test_the_picker_itself_refuses_worker_control_paths(tmp_path):
    async with recording_workers(1) as ws, \
            gateway_with(ws, tmp_path, route_everything=True) as (url, _), aiohttp.ClientSession() as s:
        st, out = await post(s, url + "/v1/completions", {"prompt": LONG, "max_tokens": 1})
        assert st == 200, out
        cached = len(ws[0].worker.engine.pool.cached)
        assert cached > 0
        for path, body in [("/reset_prefix_cache", {}), ("/fault", {"health": 503}),
                           ("/collective_rpc", {"method": "x"})]:
            st, out = await post(s, url + path, body)
            assert st == 404, (path, out)
            assert path in out["message"]
        async with s.get(url + "/metrics") as r:  # bodyless, too
            assert r.status == 404
        assert ws[0].seen.paths() == ["/v1/completions"]  # no control path reached the worker
        assert len(ws[0].worker.engine.pool.cached) == cached  # its prefix cache was not reset
        assert ws[0].worker.faults.health_status == 200
        async with s.get(url + "/v1/models") as r:  # the API itself still passes
            assert r.status == 200
