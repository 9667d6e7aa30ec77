"""Flow control on the event loop (router/frontends/flow_gate.py) over a real routing core: requests wait while
the fleet is saturated, go when a request in flight ends, leave at once when cancelled, and expire with a shed."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from router.frontends.flow_gate import FlowGate
from router.scheduling import Endpoint, RouteRequest, RoutingConfig, RoutingCore
from router.scheduling.flow import FlowParams, rule
from router.scheduling.slo import NO_OBJECTIVE, ServiceObjective
from sim.workload import tokens_for_block
from tests.sim_helpers import workers
from tests.test_proxy import proxy, spec_of
from tests.test_routing_core import request
from tests.zmq_helpers import wait_until

BIG = tokens_for_block(1, 8000).tolist()
T0 = 1000.0  # the gates' and the decisions' clock, stopped where it matters: the busy worker stays busy


def at_t0() -> float:
    return T0


def occupy(core: RoutingCore, worker: str, now: float, tag: str = "") -> list:
    """8 long prompts sent to ``worker`` and waiting for their prefill (the router's own requests in flight): a
    new request would queue there well over a second, until ``free``. Real load as the core counts it, on any
    front end's core (the simulated workers answer at once, too fast to hold anything)."""
    handles = []
    for i in range(8):
        r = request(tokens_for_block(100 + i, 8000).tolist(), f"busy{tag}{worker}{i}", max_tokens=64,
                    subset=frozenset({worker}))
        handles.append(core.dispatch(r, core.decide(r, now), worker, now))
    return handles


def free(handles: list, now: float) -> None:
    """The requests ``occupy`` sent end (each end tells the flow gate: capacity moved)."""
    for h in handles:
        h.first_token(now)
        h.complete(now, output_tokens=64)


def busy_core() -> tuple[RoutingCore, list]:
    """One worker with 8 long prompts waiting for their prefill: a new request would queue well over a second."""
    core = RoutingCore(RoutingConfig(policy="precise", seed=1))
    core.upsert_endpoint(Endpoint("w0", "10.0.0.1:8000"))
    return core, occupy(core, "w0", T0)


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
    # (what the gate rules on arrival: held while the queue wait passes the threshold)
    assert rule(gate.params, rreq.objective, core.decide(rreq, T0), 0.0).action == "hold"
    idle = RoutingCore(RoutingConfig(policy="precise", seed=1))
    idle.upsert_endpoint(Endpoint("w0", "10.0.0.1:8000"))
    assert rule(FlowParams(enabled=True), rreq.objective, idle.decide(rreq, T0), 0.0).action == "send"


@pytest.mark.parametrize("policy", ["least_loaded", "round_robin"])
async def test_profiles_without_predictions_are_never_held(policy):
    core = RoutingCore(RoutingConfig(policy=policy, seed=1))
    core.upsert_endpoint(Endpoint("w0", "10.0.0.1:8000"))
    gate = FlowGate(core, FlowParams(enabled=True))
    rreq = request(BIG, "x", objective=ServiceObjective(1e-6, None, 0))
    d = core.decide(rreq, T0)
    assert await gate.admit(rreq, d, decider(core, rreq)) is d


# ---- issue 50: one request cannot hold the queue; a request for another worker does not wait behind one ------
HOPELESS = ServiceObjective(1e-3, None, 10)  # a 1 ms TTFT target at the top priority: no worker can ever meet it


DISPATCHED: dict[str, object] = {}  # request id: its dispatch (``sent``), for a test to end it


async def sent(gate: FlowGate, core: RoutingCore, rreq: RouteRequest, tenant: str | None = None):
    """``admit`` as a front end uses it: the request dispatched as soon as it is let out (the gate's next release
    then sees its load)."""
    decision = await admit(gate, core, rreq, tenant)
    if decision.outcome == "routed":
        DISPATCHED[rreq.request_id] = core.dispatch(rreq, decision, decision.chosen, gate.clock())
    return decision


async def test_a_target_no_wait_can_reach_is_sent_at_once_on_an_idle_fleet_and_held_only_while_it_is_busy():
    idle = RoutingCore(RoutingConfig(policy="precise", seed=1))
    idle.upsert_endpoint(Endpoint("w0", "10.0.0.1:8000"))
    gate = FlowGate(idle, FlowParams(enabled=True), clock=at_t0)
    hopeless = request(BIG, "h", objective=HOPELESS)
    d = idle.decide(hopeless, T0)
    assert d.outcome == "routed" and d.report("w0").queue_s == 0.0 and d.report("w0").ttft_s > 1e-3
    # sent at once (before: held until queue_timeout_s, then shed)
    assert (await asyncio.wait_for(admit(gate, idle, hopeless), 10)).outcome == "routed"
    assert len(gate.queue) == 0 and gate.waiting_by_priority() == {}
    for i in range(3):  # nothing is held, so nobody behind it waits either
        other = request(BIG, f"o{i}", objective=ServiceObjective(None, None, i % 2))
        assert (await asyncio.wait_for(admit(gate, idle, other, "bob"), 10)).outcome == "routed"

    core, handles = busy_core()  # on a busy fleet it waits as a request without a target would
    gate = FlowGate(core, FlowParams(enabled=True), clock=at_t0)
    task = asyncio.create_task(admit(gate, core, request(BIG, "h", objective=HOPELESS)))
    while gate.waiting == 0:
        await asyncio.sleep(0)
    assert gate.waiting_by_priority() == {10: 1}
    free(handles, T0)  # and it is sent, not shed, once the fleet has room (before: held to its deadline, then 429)
    decision = await asyncio.wait_for(task, 10)
    assert decision.outcome == "routed" and gate.waiting_by_priority() == {10: 0}


def two_workers() -> tuple[RoutingCore, list]:
    core = RoutingCore(RoutingConfig(policy="precise", seed=1))
    core.upsert_endpoint(Endpoint("w0", "10.0.0.1:8000"))
    core.upsert_endpoint(Endpoint("w1", "10.0.0.2:8000"))
    return core, occupy(core, "w0", T0)


async def test_a_request_for_an_idle_worker_does_not_wait_behind_one_held_for_a_busy_worker():
    core, w0_load = two_workers()
    gate = FlowGate(core, FlowParams(enabled=True), clock=at_t0)
    only_w0 = asyncio.create_task(sent(gate, core, request(BIG, "x", subset=frozenset({"w0"}))))
    while gate.waiting == 0:
        await asyncio.sleep(0)
    # a request of the same priority that can only go to the idle w1 is sent at once (before: queued behind x)
    elsewhere = request(BIG, "y", subset=frozenset({"w1"}))
    assert (await asyncio.wait_for(sent(gate, core, elsewhere), 10)).chosen == "w1"
    assert not only_w0.done()
    free([DISPATCHED.pop("y")], T0)

    w1_load = occupy(core, "w1", T0, "again")  # now both are busy: the next one for w1 waits too
    for_w1 = asyncio.create_task(sent(gate, core, request(BIG, "z", subset=frozenset({"w1"}))))
    while gate.waiting < 2:
        await asyncio.sleep(0)
    free(w1_load, T0)  # w1 has room: z goes though x is ahead of it in the queue (x cannot use w1)
    assert (await asyncio.wait_for(for_w1, 10)).chosen == "w1"  # (before: held behind x until x's deadline)
    assert not only_w0.done() and gate.waiting == 1
    free(w0_load, T0)
    assert (await asyncio.wait_for(only_w0, 10)).chosen == "w0"


async def test_a_request_behind_never_takes_a_worker_a_held_one_ahead_of_it_could_use():
    core, w0_load = two_workers()
    w1_load = occupy(core, "w1", T0, "more")
    gate = FlowGate(core, FlowParams(enabled=True), clock=at_t0)
    order: list[str] = []

    async def one(rid: str, priority: int, subset: frozenset[str] | None) -> None:
        d = await sent(gate, core, request(BIG, rid, objective=ServiceObjective(None, None, priority),
                                           subset=subset, max_tokens=4000))
        order.append(f"{rid}@{d.chosen}")

    urgent = asyncio.create_task(one("urgent", 1, None))  # either worker will do
    while gate.waiting < 1:
        await asyncio.sleep(0)
    later = asyncio.create_task(one("later", 0, frozenset({"w1"})))  # behind it, and w1 is one it could use
    while gate.waiting < 2:
        await asyncio.sleep(0)
    free(w1_load, T0)
    await asyncio.wait_for(urgent, 10)
    assert order == ["urgent@w1"]  # the urgent one took w1's room first; the later one waits for room again
    free(w0_load, T0)  # room on w0 is none of the later one's
    for _ in range(10):
        await asyncio.sleep(0)
    assert order == ["urgent@w1"] and gate.waiting == 1
    free([DISPATCHED.pop("urgent")], T0)
    await asyncio.wait_for(later, 10)
    assert order == ["urgent@w1", "later@w1"]


# ---- through the real proxy: the issue's configuration ----------------------------------------------------
ISSUE_SLO = {"objectives": {"premium": {"priority": 10, "ttft_ms": 2000}, "interactive": {"priority": 1},
                            "standard": {"priority": 0}, "batch": {"priority": -1}},
             "default": "standard", "tenants": {"nightly-eval": "batch", "vip": "premium", "carol": "interactive"}}
ISSUE_FLOW = {"enabled": True, "queue_timeout_s": 10, "max_queued": 200}
BODY = {"model": "sim-model", "prompt": "the quick brown fox " * 20, "max_tokens": 4}


@pytest.mark.sockets
async def test_the_proxy_sends_a_hopeless_target_at_once_and_nobody_waits_behind_it():
    async with workers(1) as ws, proxy([spec_of(ws[0], "w0")], slo=ISSUE_SLO, flow_control=ISSUE_FLOW,
                                       tenant_header="x-tenant") as (server, url, _), aiohttp.ClientSession() as s:
        await wait_until(lambda: server.core.endpoints["w0"].healthy, 10)

        async def ask(tenant: str, ttft_ms: str | None = None) -> tuple[int, dict]:
            headers = {"x-tenant": tenant, **({"x-llm-d-slo-ttft-ms": ttft_ms} if ttft_ms else {})}
            async with s.post(f"{url}/v1/completions", json=BODY, headers=headers) as r:
                return r.status, await r.json()

        # the top objective with a target no worker meets, and another tenant at the same time: both answered
        # (before: the first held for queue_timeout_s, 10 s, then a 429 on an idle fleet; the other behind it)
        (top, _), (other, _) = await asyncio.gather(ask("vip", "1"), ask("bob"))
        assert top == 200 and other == 200
        status, out = await ask("nightly-eval", "1")  # sheddable, its target out of reach: refused at once
        assert status == 429 and "meet" in out["message"]
        assert server.gate.waiting == 0 and len(server.gate.queue) == 0


@pytest.mark.sockets
async def test_the_proxy_holds_a_completions_batch_as_one_request_while_the_fleet_is_busy():
    async with workers(1) as ws, proxy([spec_of(ws[0], "w0")], slo=ISSUE_SLO, flow_control=ISSUE_FLOW,
                                       tenant_header="x-tenant") as (server, url, _), aiohttp.ClientSession() as s:
        await wait_until(lambda: server.core.endpoints["w0"].healthy, 10)
        gate, core = server.gate, server.core
        load = occupy(core, "w0", time.monotonic())

        async def ask(tenant: str, body: dict) -> tuple[int, dict]:
            async with s.post(f"{url}/v1/completions", json=body, headers={"x-tenant": tenant}) as r:
                return r.status, await r.json()

        batch = asyncio.create_task(ask("nightly-eval", {**BODY, "prompt": ["first " * 30, "second " * 30]}))
        await wait_until(lambda: gate.waiting == 1, 10)  # (before: answered at once, past the queue)
        held = gate.queue.head()
        assert held is not None and held.objective.priority == -1 and gate.waiting_by_priority()[-1] == 1
        assert held.cost_tokens > held.payload[0].prompt_tokens + held.payload[0].max_tokens  # both prompts' work
        chat = asyncio.create_task(ask("carol", BODY))
        await wait_until(lambda: gate.waiting == 2, 10)
        head = gate.queue.head()
        assert head is not None and head.objective.priority == 1  # the interactive request goes first
        assert not batch.done()
        free(load, time.monotonic())
        (b_status, b_out), (c_status, _) = await asyncio.wait_for(asyncio.gather(batch, chat), 30)
        assert b_status == 200 and len(b_out["choices"]) == 2 and c_status == 200
        assert gate.waiting == 0 and len(gate.queue) == 0
