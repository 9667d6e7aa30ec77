"""Service objectives and flow control through the live front ends, with real sockets: the endpoint picker
behind the real Envoy (and the proxy, tests below). The headers are llm-d's (``x-slo-ttft-ms``,
``x-slo-tpot-ms``) and GIE's (``x-gateway-inference-objective``)."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import pytest

from router.scheduling.flow import FlowParams
from router.scheduling.slo import parse_slo_config
from tests.test_epp_robustness import gateway_with, post, recording_workers
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
        # a target no worker can meet, not sheddable: held while it would miss it, then refused
        async with s.post(f"{url}/v1/completions", json=BODY, headers={"x-slo-ttft-ms": "0.001"}) as r:
            assert r.status == 429 and int(r.headers["retry-after"]) >= 1
            assert "waited" in await r.text()
        assert picker.picker.gate.waiting == 0
        status, _ = await post(s, f"{url}/v1/completions", BODY)  # no target: served at once
        assert status == 200


async def test_a_client_that_leaves_while_held_frees_its_place_through_envoy(tmp_path):
    flow = FlowParams(enabled=True, queue_timeout_s=3600.0)
    async with recording_workers(1) as ws, gateway_with(ws, tmp_path, {"slo": SLO, "flow": flow}) as (url, picker):
        gate = picker.picker.gate
        for _ in range(3):
            async with aiohttp.ClientSession() as s:
                call = asyncio.create_task(s.post(f"{url}/v1/completions", json=BODY,
                                                  headers={"x-slo-ttft-ms": "0.001"}))
                await wait_until(lambda: gate.waiting == 1, 10)
                call.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await call
            await wait_until(lambda: gate.waiting == 0 and len(gate.queue) == 0, 10)  # Envoy reset the stream
        async with aiohttp.ClientSession() as s:  # and the gateway serves on
            status, _ = await post(s, f"{url}/v1/completions", BODY)
            assert status == 200
