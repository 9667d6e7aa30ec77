"""Flow control's queue depth per priority as a Prometheus gauge (issue 50, "Also": there was no metric of it):
``kvrouter_flow_queue_depth{priority}``, read from the gate at each scrape, for the proxy and the picker; the
configured objectives' priorities are there at 0 while nothing of theirs waits."""

from __future__ import annotations

import asyncio
import re
import time

from router.config import load_config
from router.frontends.epp import EndpointPicker
from router.frontends.fleet import Fleet
from router.frontends.flow_gate import FlowGate
from router.frontends.metrics import RouterMetrics
from router.frontends.proxy import ProxyServer
from router.scheduling import Endpoint, RoutingConfig, RoutingCore
from router.scheduling.flow import FlowParams
from router.scheduling.slo import ServiceObjective, parse_slo_config
from router.tokenizer import load_tokenizer
from sim.workload import tokens_for_block
from tests.test_routing_core import request

T0 = 1000.0  # the gate's and the decisions' clock, stopped: the busy worker stays busy
DEPTH = re.compile(r'^kvrouter_flow_queue_depth\{priority="(-?\d+)"\} (\S+)$', re.M)
SLO = {"objectives": {"batch": {"priority": -1}, "premium": {"priority": 10, "ttft_ms": 2000}}}


def depth(metrics: RouterMetrics) -> dict[int, float]:
    return {int(p): float(n) for p, n in DEPTH.findall(metrics.exposition().decode())}


async def test_the_gauge_counts_the_requests_waiting_per_priority_as_they_come_and_go():
    core = RoutingCore(RoutingConfig(policy="precise", seed=1))
    core.upsert_endpoint(Endpoint("w0", "10.0.0.1:8000"))
    handles = []
    for i in range(8):  # long prompts waiting for their prefill: a new request would queue well over a second
        r = request(tokens_for_block(100 + i, 8000).tolist(), f"busy{i}", max_tokens=64)
        handles.append(core.dispatch(r, core.decide(r, T0), "w0", T0))
    gate = FlowGate(core, FlowParams(enabled=True), clock=lambda: T0)
    metrics = RouterMetrics(Fleet(core))
    metrics.watch_flow(gate, {0, 10})
    assert depth(metrics) == {0: 0.0, 10: 0.0}
    big = tokens_for_block(1, 8000).tolist()
    tasks = []
    for i, priority in enumerate((1, 0, 0)):
        rreq = request(big, f"q{i}", objective=ServiceObjective(1.0, None, priority))
        assert core.decide(rreq, T0).report("w0").ttft_s > 1.0  # it would miss its target now: it waits
        tasks.append(asyncio.create_task(gate.admit(rreq, core.decide(rreq, T0),
                                                    lambda now, rreq=rreq: core.decide(rreq, now))))
    while gate.waiting < 3:
        await asyncio.sleep(0)  # (one turn of the loop: each task reaches the queue)
    assert depth(metrics) == {0: 2.0, 1: 1.0, 10: 0.0}
    tasks[1].cancel()  # a client leaves
    await asyncio.gather(tasks[1], return_exceptions=True)
    assert depth(metrics) == {0: 1.0, 1: 1.0, 10: 0.0}
    for h in handles:  # the fleet drains: the rest are sent
        h.first_token(T0)
        h.complete(T0, output_tokens=64)
    await asyncio.wait_for(asyncio.gather(tasks[0], tasks[2]), 10)
    assert depth(metrics) == {0: 0.0, 1: 0.0, 10: 0.0}


async def test_the_proxy_and_the_picker_export_their_own_gates_depth():
    cfg = load_config(None, {"slo": SLO, "flow_control": {"enabled": True}})
    proxy = ProxyServer(cfg)
    try:
        assert depth(proxy.metrics) == {-1: 0.0, 0: 0.0, 10: 0.0}
        core = proxy.core  # a request waiting in the proxy's own gate shows in its /metrics
        core.upsert_endpoint(Endpoint("w0", "10.0.0.1:8000"))
        now = time.monotonic()
        handles = []
        for i in range(8):
            r = request(tokens_for_block(100 + i, 8000).tolist(), f"busy{i}", max_tokens=64)
            handles.append(core.dispatch(r, core.decide(r, now), "w0", now))
        rreq = request(tokens_for_block(1, 8000).tolist(), "q", objective=ServiceObjective(1.0, None, 10))
        task = asyncio.create_task(proxy.gate.admit(rreq, core.decide(rreq, now), lambda t: core.decide(rreq, t)))
        while proxy.gate.waiting < 1:
            await asyncio.sleep(0)
        assert depth(proxy.metrics) == {-1: 0.0, 0: 0.0, 10: 1.0}
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert depth(proxy.metrics) == {-1: 0.0, 0: 0.0, 10: 0.0}
    finally:
        await proxy.stop()
    core = RoutingCore(RoutingConfig(block_size=16))
    metrics = RouterMetrics(Fleet(core))
    EndpointPicker(core, Fleet(core), lambda _: load_tokenizer(), 16, metrics, slo=parse_slo_config(SLO),
                   flow=FlowParams(enabled=True))
    assert depth(metrics) == {-1: 0.0, 0: 0.0, 10: 0.0}
