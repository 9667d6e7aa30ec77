"""Service objectives and flow control through the live front ends, with real sockets: the endpoint picker
behind the real Envoy (and the proxy, tests below). The headers are llm-d's (``x-slo-ttft-ms``,
``x-slo-tpot-ms``) and GIE's (``x-gateway-inference-objective``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import aiohttp
import pytest

from router.scheduling.flow import FlowParams
from router.scheduling.slo import parse_slo_config
from tests.sim_helpers import workers
from tests.test_epp_robustness import gateway_with, post, recording_workers
from tests.test_flow_gate import free, occupy
from tests.test_proxy import proxy, spec_of
from tests.zmq_helpers import wait_until

pytestmark = pytest.mark.sockets

SLO = parse_slo_config({"objectives": {"batch": {"priority": -1}, "chat": {"priority": 1, "ttft_ms": 60000}}})
BODY = {"model": "sim-model", "prompt": "the quick brown fox " * 20, "max_tokens": 4}


async def test_the_picker_behind_envoy_honours_the_objective_headers(tmp_path):
    async with recording_workers(1) as ws, gateway_with(ws, tmp_path, {"slo": SLO}) as (url, _), \
            aiohttp.ClientSession() as s:
        status, _ = await post(s, f"{url}/v1/completions", BODY)
        assert status == 200
        # sheddable, with a target no worker can meet: refused, with Retry-After, and never sent to a worker
        sent = len(ws[0].seen.requests)
        async with s.post(f"{url}/v1/completions", json=BODY, headers={
                "x-gateway-inference-objective": "batch", "x-slo-ttft-ms": "0.001"}) as r:
            assert r.status == 429 and int(r.headers["retry-after"]) >= 1
            assert "no worker meets its objective" in await r.text()
        assert len(ws[0].seen.requests) == sent
        # the same target at the default priority: served, on the least violation
        status, _ = await post(s, f"{url}/v1/completions", BODY, {"x-slo-ttft-ms": "0.001"})
        assert status == 200
        # a malformed header or an objective nobody configured: a 400 naming the header
        for headers in ({"x-slo-tpot-ms": "soon"}, {"x-gateway-inference-objective": "platinum"}):
            status, out = await post(s, f"{url}/v1/completions", BODY, headers)
            assert status == 400 and next(iter(headers)) in str(out), headers


async def test_a_request_held_by_flow_control_past_its_deadline_gets_429_with_retry_after(tmp_path):
    flow = FlowParams(enabled=True, queue_timeout_s=0.5)
    async with recording_workers(1) as ws, gateway_with(ws, tmp_path, {"slo": SLO, "flow": flow}) as (url, picker), \
            aiohttp.ClientSession() as s:
        core = picker.picker.core
        load = occupy(core, next(iter(core.endpoints)), time.monotonic())  # the fleet busy (issue 50: not a target)
        # a target no worker can meet, not sheddable: held while the fleet is busy, as without a target, then refused
        async with s.post(f"{url}/v1/completions", json=BODY, headers={"x-slo-ttft-ms": "0.001"}) as r:
            assert r.status == 429 and int(r.headers["retry-after"]) >= 1
            assert "waited" in await r.text()
        assert picker.picker.gate.waiting == 0
        free(load, time.monotonic())
        status, _ = await post(s, f"{url}/v1/completions", BODY)  # no target: served at once
        assert status == 200


async def test_a_client_that_leaves_while_held_frees_its_place_through_envoy(tmp_path):
    flow = FlowParams(enabled=True, queue_timeout_s=3600.0)
    async with recording_workers(1) as ws, gateway_with(ws, tmp_path, {"slo": SLO, "flow": flow}) as (url, picker):
        gate, core = picker.picker.gate, picker.picker.core
        load = occupy(core, next(iter(core.endpoints)), time.monotonic())  # the fleet busy: a request waits
        for _ in range(3):
            async with aiohttp.ClientSession() as s:
                call = asyncio.create_task(s.post(f"{url}/v1/completions", json=BODY,
                                                  headers={"x-slo-ttft-ms": "0.001"}))
                await wait_until(lambda: gate.waiting == 1, 10)
                call.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await call
            await wait_until(lambda: gate.waiting == 0 and len(gate.queue) == 0, 10)  # Envoy reset the stream
        free(load, time.monotonic())
        async with aiohttp.ClientSession() as s:  # and the gateway serves on
            status, _ = await post(s, f"{url}/v1/completions", BODY)
            assert status == 200


# ---- the proxy ----------------------------------------------------------------------------------------------
SLO_RAW = {"objectives": {"batch": {"priority": -1}, "chat": {"priority": 1, "ttft_ms": 60000}}}


async def test_the_proxy_honours_the_objective_headers_and_counts_the_outcomes():
    async with workers(1) as ws, proxy([spec_of(ws[0], "w0")], slo=SLO_RAW) as (server, url, _), \
            aiohttp.ClientSession() as s:
        await wait_until(lambda: server.core.endpoints["w0"].healthy, 10)
        stream = {**BODY, "stream": True, "stream_options": {"include_usage": True}}
        async with s.post(f"{url}/v1/completions", json=stream, headers={
                "x-gateway-inference-objective": "chat"}) as r:
            assert r.status == 200
            await r.read()
        async with s.post(f"{url}/v1/completions", json=BODY, headers={
                "x-gateway-inference-objective": "batch", "x-slo-ttft-ms": "0.001"}) as r:
            assert r.status == 429 and int(r.headers["retry-after"]) >= 1
            assert "no worker meets its objective" in (await r.json())["message"]
        for headers in ({"x-slo-ttft-ms": "-3"}, {"x-gateway-inference-objective": "nope"}):
            async with s.post(f"{url}/v1/completions", json=BODY, headers=headers) as r:
                assert r.status == 400 and next(iter(headers)) in (await r.json())["message"]
        async with s.get(url + "/metrics") as r:
            text = await r.text()
        assert 'kvrouter_slo_requests_total{objective="chat",outcome="met",priority="1"} 1.0' in text
        assert 'kvrouter_slo_requests_total{objective="batch",outcome="shed",priority="-1"} 1.0' in text
        assert "kvrouter_ttft_observed_over_predicted_count 1.0" in text
        assert "kvrouter_tpot_observed_over_predicted_count 1.0" in text


async def test_a_request_held_by_the_proxy_past_its_deadline_gets_429_with_retry_after():
    flow = {"enabled": True, "queue_timeout_s": 0.3}
    async with workers(1) as ws, proxy([spec_of(ws[0], "w0")], slo=SLO_RAW, flow_control=flow) as (server, url, _), \
            aiohttp.ClientSession() as s:
        await wait_until(lambda: server.core.endpoints["w0"].healthy, 10)
        load = occupy(server.core, "w0", time.monotonic())  # the fleet busy (issue 50: not the target) holds it
        async with s.post(f"{url}/v1/completions", json=BODY, headers={"x-slo-ttft-ms": "0.001"}) as r:
            assert r.status == 429 and int(r.headers["retry-after"]) >= 1
            assert "waited" in (await r.json())["message"]
        free(load, time.monotonic())
        async with s.post(f"{url}/v1/completions", json=BODY) as r:  # the fleet idle again: served at once
            assert r.status == 200
        assert server.gate.waiting == 0


async def test_ten_thousand_clients_that_leave_the_proxy_while_held_leave_nothing_behind():
    flow = {"enabled": True, "queue_timeout_s": 3600.0, "max_queued": 1000}
    body = json.dumps(BODY).encode()
    raw = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nx-slo-ttft-ms: 0.001\r\n"
           b"content-length: %d\r\n\r\n%b" % (len(body), body))
    async with workers(1) as ws, proxy([spec_of(ws[0], "w0")], flow_control=flow) as (server, url, _):
        await wait_until(lambda: server.core.endpoints["w0"].healthy, 10)
        host, port = url.removeprefix("http://").split(":")
        gate = server.gate
        load = occupy(server.core, "w0", time.monotonic())  # the fleet busy: every request waits
        for _ in range(20):
            conns = [await asyncio.open_connection(host, int(port)) for _ in range(500)]
            for _, writer in conns:
                writer.write(raw)
            await wait_until(lambda: gate.waiting == 500, 30)
            for _, writer in conns:
                writer.close()
            await wait_until(lambda: gate.waiting == 0 and len(gate.queue) == 0, 30)
        free(load, time.monotonic())
        load = server.core.load.workers.get("w0")
        assert load is None or load.requests == 0  # none was dispatched, none is counted in flight
        async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/completions", json=BODY) as r:
            assert r.status == 200


async def test_a_completions_batch_is_routed_to_its_objective_and_shed_whole():
    async with workers(1) as ws, proxy([spec_of(ws[0], "w0")], slo=SLO_RAW) as (server, url, _), \
            aiohttp.ClientSession() as s:
        await wait_until(lambda: server.core.endpoints["w0"].healthy, 10)
        batch = {**BODY, "prompt": ["first " * 30, "second " * 30]}
        async with s.post(f"{url}/v1/completions", json=batch, headers={
                "x-gateway-inference-objective": "batch", "x-slo-ttft-ms": "0.001"}) as r:
            assert r.status == 429 and "prompt[0]: no worker meets its objective" in (await r.json())["message"]
        async with s.post(f"{url}/v1/completions", json=batch, headers={"x-gateway-inference-objective": "chat"}) as r:
            assert r.status == 200 and len((await r.json())["choices"]) == 2
