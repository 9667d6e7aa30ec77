"""Flow control on the event loop (router/frontends/flow_gate.py) over a real routing core: requests wait while
the fleet is saturated, go when a request in flight ends, leave at once when cancelled, and expire with a shed."""

from __future__ import annotations

import asyncio

import pytest

from router.frontends.flow_gate import FlowGate
from router.scheduling import Endpoint, RouteRequest, RoutingConfig, RoutingCore
from router.scheduling.flow import FlowParams
from router.scheduling.slo import NO_OBJECTIVE, ServiceObjective
from sim.workload import tokens_for_block
from tests.test_routing_core import request

BIG = tokens_for_block(1, 8000).tolist()
T0 = 1000.0  # the gates' and the decisions' clock, stopped where it matters: the busy worker stays busy


def at_t0() -> float:
    return T0


def busy_core() -> tuple[RoutingCore, list]:
    """One worker with 8 long prompts waiting for their prefill: a new request would queue well over a second."""
    core = RoutingCore(RoutingConfig(policy="precise", seed=1))
    core.upsert_endpoint(Endpoint("w0", "10.0.0.1:8000"))
    handles = []
    for i in range(8):
        r = request(tokens_for_block(100 + i, 8000).tolist(), f"busy{i}", max_tokens=64)
        handles.append(core.dispatch(r, core.decide(r, T0), "w0", T0))
    return core, handles


def decider(core: RoutingCore, rreq: RouteRequest):
    return lambda now: core.decide(rreq, now)


async def admit(gate: FlowGate, core: RoutingCore, rreq: RouteRequest, tenant: str | None = None):
    return await gate.admit(rreq, core.decide(rreq, gate.clock()), decider(core, rreq), tenant)


async def test_disabled_or_unsaturated_the_decision_stands_at_once():
    core, _ = busy_core()
    off = FlowGate(core, FlowParams())
    rreq = request(BIG, "x", objective=ServiceObjective(1e-3, None, 0))
    d = core.decide(rreq, T0)
    assert await off.admit(rreq, d, decider(core, rreq)) is d
    on = FlowGate(core, FlowParams(enabled=True))
    relaxed = request(BIG, "y", objective=ServiceObjective(3600.0, None, 0))
    d = core.decide(relaxed, T0)
    assert await on.admit(relaxed, d, decider(core, relaxed)) is d and on.waiting == 0


async def test_a_request_that_would_miss_its_target_waits_until_a_request_in_flight_ends():
    core, handles = busy_core()
    gate = FlowGate(core, FlowParams(enabled=True), clock=at_t0)
    rreq = request(BIG, "x", objective=ServiceObjective(1.0, None, 0))
    assert core.decide(rreq, T0).report("w0").ttft_s > 1.0
    task = asyncio.create_task(admit(gate, core, rreq))
    while gate.waiting == 0:
        await asyncio.sleep(0)  # (one turn of the loop: the task reaches the queue)
    assert not task.done()
    for h in handles:  # the fleet drains: each end tells the gate, which decides the waiting request again
        h.first_token(T0)
        h.complete(T0, output_tokens=64)
    decision = await asyncio.wait_for(task, 10)
    assert decision.outcome == "routed" and decision.chosen == "w0" and gate.waiting == 0


async def test_clients_that_leave_while_queued_free_their_place_ten_thousand_times():
    core, _ = busy_core()
    gate = FlowGate(core, FlowParams(enabled=True, max_queued=20_000), clock=at_t0)
    for batch in range(10):
        tasks = [asyncio.create_task(admit(gate, core, request(BIG, f"c{batch}-{i}",
                                                               objective=ServiceObjective(1.0, None, 0))))
                 for i in range(1000)]
        while gate.waiting < 1000:
            await asyncio.sleep(0)
        assert len(gate.queue) == 1000
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert gate.waiting == 0 and len(gate.queue) == 0  # nothing left behind: no leak
    assert gate._timer is None  # nothing waits: no timer either


async def test_a_waiting_request_past_its_deadline_is_shed_with_the_reason():
    core, _ = busy_core()
    gate = FlowGate(core, FlowParams(enabled=True, queue_timeout_s=0.05))
    unreachable = ServiceObjective(1e-3, None, 0)  # whatever the core believes by the real clock, it would miss it
    decision = await asyncio.wait_for(admit(gate, core, request(BIG, "x", objective=unreachable)), 10)
    assert decision.outcome == "shed" and "waited" in decision.reason and decision.retry_after_s >= 1
    sheddable = ServiceObjective(0.05, None, -1)
    decision = await asyncio.wait_for(admit(gate, core, request(BIG, "y", objective=sheddable)), 10)
    assert decision.outcome == "shed"  # (the picker refuses it outright: no worker meets its target)


async def test_the_higher_priority_and_the_quieter_tenant_go_first():
    core, handles = busy_core()
    gate = FlowGate(core, FlowParams(enabled=True, quantum_tokens=10_000), clock=at_t0)
    order: list[str] = []

    async def one(rid: str, priority: int, tenant: str) -> None:
        await admit(gate, core, request(BIG, rid, objective=ServiceObjective(1.0, None, priority)), tenant)
        order.append(rid)

    tasks = [asyncio.create_task(one(f"noisy{i}", 0, "noisy")) for i in range(4)]
    tasks += [asyncio.create_task(one("quiet0", 0, "quiet")), asyncio.create_task(one("urgent", 1, "noisy"))]
    while gate.waiting < 6:
        await asyncio.sleep(0)
    for h in handles:
        h.first_token(T0)
        h.complete(T0, output_tokens=64)
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert order[0] == "urgent"
    assert order.index("quiet0") <= 2  # its flow's first turn, not behind the noisy tenant's four


def test_without_an_objective_a_request_uses_the_queue_wait_threshold():
    core, _ = busy_core()
    gate = FlowGate(core, FlowParams(enabled=True, saturation_queue_s=0.05))
    rreq = request(BIG, "x", objective=NO_OBJECTIVE)
    assert gate._saturated(rreq, core.decide(rreq, T0))
    idle = RoutingCore(RoutingConfig(policy="precise", seed=1))
    idle.upsert_endpoint(Endpoint("w0", "10.0.0.1:8000"))
    assert not FlowGate(idle, FlowParams(enabled=True))._saturated(rreq, idle.decide(rreq, T0))


@pytest.mark.parametrize("policy", ["least_loaded", "round_robin"])
async def test_profiles_without_predictions_are_never_held(policy):
    core = RoutingCore(RoutingConfig(policy=policy, seed=1))
    core.upsert_endpoint(Endpoint("w0", "10.0.0.1:8000"))
    gate = FlowGate(core, FlowParams(enabled=True))
    rreq = request(BIG, "x", objective=ServiceObjective(1e-6, None, 0))
    d = core.decide(rreq, T0)
    assert await gate.admit(rreq, d, decider(core, rreq)) is d
