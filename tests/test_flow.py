"""Flow control (router/scheduling/flow.py): priority bands, deficit round robin between tenants, deadlines, and
the simulator holding requests the fleet cannot start yet."""

from __future__ import annotations

import subprocess
import sys
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.scheduling.flow import (
    MAX_COST_TOKENS,
    FlowParams,
    FlowQueue,
    Queued,
    parse_flow_params,
    rule,
    saturated,
)
from router.scheduling.slo import NO_OBJECTIVE, ServiceObjective
from router.scheduling.types import CandidateReport, Decision
from sim.runner import SimConfig, Simulation, summarise
from sim.suite import SYNTH_ENGINE
from sim.workload import SimRequest, merged, shared_prefix, tokens_for_block, with_objective

LOW = ServiceObjective(None, None, -1)
HIGH = ServiceObjective(0.3, None, 1)


def item(rid: str, at: float = 0.0, cost: int = 100, objective: ServiceObjective = NO_OBJECTIVE,
         tenant: str | None = None) -> Queued:
    return Queued(rid, at, cost, objective, tenant)


def drain(q: FlowQueue) -> list[str]:
    out = []
    while (head := q.head()) is not None:
        q.pop(head)
        out.append(head.request_id)
    return out


def test_the_highest_priority_goes_first_and_order_holds_inside_a_flow():
    q = FlowQueue(FlowParams(enabled=True))
    for rid, obj in (("low1", LOW), ("mid1", NO_OBJECTIVE), ("high1", HIGH), ("low2", LOW), ("high2", HIGH)):
        assert q.push(item(rid, objective=obj))
    assert q.waiting_at_or_above(1) and not q.waiting_at_or_above(2)
    assert drain(q) == ["high1", "high2", "mid1", "low1", "low2"]
    assert len(q) == 0 and q.head() is None


def test_tenants_share_a_band_by_work_and_weight_not_by_request_count():
    # a noisy tenant's 40 requests queued first; the quiet tenant's 10 still get every other quantum
    q = FlowQueue(FlowParams(enabled=True, quantum_tokens=100))
    for i in range(40):
        q.push(item(f"n{i}", tenant="noisy"))
    for i in range(10):
        q.push(item(f"q{i}", tenant="quiet"))
    first20 = drain(q)[:20]
    assert sum(r.startswith("q") for r in first20) == 10  # alternating: one request (100 tokens) a turn each

    weighted = FlowQueue(FlowParams(enabled=True, quantum_tokens=100, tenant_weights={"gold": 3.0}))
    for i in range(30):
        weighted.push(item(f"s{i}", tenant="silver"))
        weighted.push(item(f"g{i}", tenant="gold"))
    first = drain(weighted)[:40]
    assert sum(r.startswith("g") for r in first) == 30  # three of gold's per one of silver's

    by_tokens = FlowQueue(FlowParams(enabled=True, quantum_tokens=100))
    for i in range(40):
        by_tokens.push(item(f"big{i}", cost=400, tenant="a"))
        by_tokens.push(item(f"small{i}", cost=100, tenant="b"))
    order = drain(by_tokens)
    head = order[:25]  # both flows still busy: their tokens served differ by at most one quantum and request
    a_tokens, b_tokens = 400 * sum(r.startswith("big") for r in head), 100 * sum(r.startswith("small") for r in head)
    assert sum(r.startswith("big") for r in head) >= 3 and abs(a_tokens - b_tokens) <= 500


def test_an_idle_flow_keeps_no_credit():
    q = FlowQueue(FlowParams(enabled=True, quantum_tokens=100))
    q.push(item("a0", tenant="a", cost=100))
    q.push(item("b0", tenant="b", cost=100))
    drain(q)
    for i in range(3):
        q.push(item(f"a{i + 1}", tenant="a"))
        q.push(item(f"b{i + 1}", tenant="b"))
    assert drain(q) == ["a1", "b1", "a2", "b2", "a3", "b3"]


def test_deadlines_expire_and_a_sheddable_request_leaves_once_its_ttft_target_is_out_of_reach():
    q = FlowQueue(FlowParams(enabled=True, queue_timeout_s=10.0))
    q.push(item("plain", at=0.0))
    q.push(item("sheddable-with-target", at=0.0, objective=ServiceObjective(0.5, None, -1)))
    q.push(item("kept-with-target", at=0.0, objective=ServiceObjective(0.5, None, 0)))
    assert q.next_deadline() == 0.5
    gone = q.expire(1.0)
    assert [(g.request_id, g.left) for g in gone] == [("sheddable-with-target", "unreachable")]
    assert {g.request_id: g.left for g in q.expire(10.0)} == {"plain": "expired", "kept-with-target": "expired"}
    assert len(q) == 0 and q.next_deadline() is None


def test_remove_take_all_and_the_bound():
    q = FlowQueue(FlowParams(enabled=True, max_queued=3))
    assert all(q.push(item(f"r{i}", tenant=f"t{i % 2}")) for i in range(3))
    assert not q.push(item("r3")) and not q.push(item("r0"))  # full; and an id already held
    removed = q.remove("r1")
    assert removed is not None and removed.left == "removed" and "r1" not in q
    assert q.remove("r1") is None
    assert drain(q) == ["r0", "r2"]
    q.push(item("x"))
    assert [i.left for i in q.take_all()] == ["expired"] and len(q) == 0
    q.push(item("late", at=5.0))
    assert q.expire(5.0 + 60.0 - 1e-6) == []  # the stale deadline of a request gone does not linger


@pytest.mark.parametrize(("raw", "why"), [
    ({"enabled": True, "queue_timeout": 3}, "unknown key"),
    ({"saturation_queue_s": -1}, "saturation_queue_s"),
    ({"tenant_weights": {"a": 0}}, "weight"),
    ({"tenant_weights": [1, 2]}, "tenant_weights"),
    # issue 50: a weight of 1e-9 made one pass of deficit round robin take ~84 s; weights are bounded now
    ({"tenant_weights": {"a": 1e-9}}, "tenant_weights.a"),
    ({"tenant_weights": {"a": 1e9}}, "tenant_weights.a"),
    ({"tenant_weights": {"a": float("nan")}}, "tenant_weights.a"),
    ({"tenant_weights": {"a": float("inf")}}, "tenant_weights.a"),
    ({"tenant_weights": {"a": "heavy"}}, "tenant_weights.a"),
    ({"tenant_weights": {"a": True}}, "tenant_weights.a"),
    ({"quantum_tokens": 0}, "quantum_tokens"),
    ({"quantum_tokens": 2**40}, "quantum_tokens"),
    ({"queue_timeout_s": float("inf")}, "queue_timeout_s"),
    ({"saturation_queue_s": float("nan")}, "saturation_queue_s"),
])
def test_bad_flow_config_is_an_error_naming_the_key(raw, why):
    with pytest.raises(ValueError, match=why):
        parse_flow_params(raw)
    assert parse_flow_params({"enabled": True, "tenant_weights": {"gold": 2}}).tenant_weights == {"gold": 2.0}


def _overloaded(quick_n: int = 240) -> list:
    """Interactive chats with a TTFT target and sheddable 4K-token batch jobs, offered past the fleet's capacity."""
    chats = with_objective(shared_prefix(8, quick_n * 2 // 3 // 8, 1024, 128, 64, rate=60.0, seed=3),
                           ServiceObjective(0.3, 0.05, 0), "chat", "i-")
    batch = with_objective(shared_prefix(quick_n // 3, 1, 4096, 64, 384, rate=30.0, seed=4),
                           ServiceObjective(None, None, -1), "batch", "b-")
    return merged(chats, batch)


def test_the_simulator_holds_batch_behind_interactive_when_the_fleet_is_saturated():
    reqs = _overloaded()
    def run(flow: FlowParams | None) -> dict:
        return summarise(Simulation(reqs, SimConfig(workers=2, policy="precise", engine=SYNTH_ENGINE,
                                                    flow=flow)).run())

    without, held = run(None), run(FlowParams(enabled=True))
    chat_without = without["slo_by_priority"]["0"]["attainment"]
    chat_held = held["slo_by_priority"]["0"]["attainment"]
    assert chat_held > chat_without  # the engines' FCFS queues no longer hold chats behind batch
    assert held["completed"] + held["shed"] == held["requests"]  # every request served or refused
    # the batch jobs were delayed rather than the chats: their mean TTFT rose
    assert held["ttft_mean_s"] != without["ttft_mean_s"]
    disabled = run(FlowParams(enabled=False))
    assert {k: v for k, v in disabled.items() if k != "wall_s"} == {k: v for k, v in without.items()
                                                                    if k != "wall_s"}


def test_a_queue_timeout_sheds_what_waits_too_long():
    reqs = _overloaded()
    s = summarise(Simulation(reqs, SimConfig(workers=1, policy="precise", engine=SYNTH_ENGINE,
                                             flow=FlowParams(enabled=True, queue_timeout_s=0.5))).run())
    assert s["shed"] > 0 and s["completed"] + s["shed"] == s["requests"]


# ---- issue 50: the work of each call bounded, whatever a request's cost or a tenant's weight ------------------
def test_a_cost_past_any_real_request_is_clamped_and_served_in_bounded_work():
    # a request with n = 10^13 (prompt + max_tokens x n) in a queue with tenants weighing a thousandth: one
    # quantum a loop, deficit round robin would loop 10^16 times (before: the event loop pinned for 30+ s)
    q = FlowQueue(FlowParams(enabled=True, quantum_tokens=1, tenant_weights={"light": 1e-3, "heavy": 1e3}))
    q.push(item("huge", cost=100 + 64 * 10**13, tenant="light"))
    q.push(item("negative", cost=-(10**9), tenant="heavy"))
    q.push(item("also-huge", cost=10**30, tenant="heavy"))
    assert [q._by_id[r].cost_tokens for r in ("huge", "negative", "also-huge")] == [MAX_COST_TOKENS, 0,
                                                                                  MAX_COST_TOKENS]
    before = q.work
    order = drain(q)
    assert sorted(order) == ["also-huge", "huge", "negative"] and order[0] == "negative"
    assert order.index("also-huge") < order.index("huge")  # the heavy tenant's turn comes a million times sooner
    assert q.work - before <= 3 * 10  # a few passes over three flows per request, not 10^16 loops


def naive_drr(costs: dict[str, list[int]], quantum: int, weights: dict[str, float]) -> list[str]:
    """The reference: deficit round robin one quantum at a time (what ``head`` did before), on small numbers."""
    flows = {t: deque(c) for t, c in costs.items() if c}
    active, deficit, out = deque(flows), dict.fromkeys(flows, 0.0), []
    while active:
        t = active[0]
        if deficit[t] >= flows[t][0]:
            deficit[t] -= flows[t].popleft()
            out.append(t)
            if not flows[t]:
                active.popleft()
                del deficit[t]
            continue
        deficit[t] += quantum * weights.get(t, 1.0)
        active.rotate(-1)
    return out


@settings(max_examples=200, deadline=None)
@given(costs=st.dictionaries(st.sampled_from("abcd"), st.lists(st.integers(0, 400), min_size=1, max_size=6),
                             min_size=1),
       quantum=st.integers(1, 50), weights=st.dictionaries(st.sampled_from("abcd"), st.sampled_from([0.5, 1.0, 2.0,
                                                                                                       4.0])))
def test_counting_the_rounds_at_once_serves_the_order_one_quantum_at_a_time_would(costs, quantum, weights):
    q = FlowQueue(FlowParams(enabled=True, quantum_tokens=quantum, tenant_weights=weights))
    for t, cs in costs.items():
        for i, c in enumerate(cs):
            q.push(item(f"{t}{i}", cost=c, tenant=t))
    order = []
    while True:
        before, flows = q.work, len(q._bands[0].flows) if len(q) else 0
        head = q.head()
        assert q.work - before <= 4 * flows + 4  # a few passes over the flows, however many rounds it counted
        if head is None:
            break
        q.pop(head)
        order.append(head.tenant)
    assert order == naive_drr(costs, quantum, weights)


def test_each_head_is_bounded_by_a_few_passes_over_the_flows():
    q = FlowQueue(FlowParams(enabled=True, quantum_tokens=1, tenant_weights={f"t{i}": 1e-3 for i in range(50)}))
    for i in range(50):
        q.push(item(f"r{i}", cost=MAX_COST_TOKENS - i, tenant=f"t{i}"))
    while len(q):
        before = q.work
        head = q.head()
        assert head is not None and q.work - before <= 4 * len(q) + 4
        q.pop(head)


# ---- issue 50: saturated means the fleet is busy, never that the request is hopeless --------------------------
def decided(queue_s: float, service_s: float) -> Decision:
    d = Decision("p", ranked=["w0"])
    d.candidates = [CandidateReport("w0", queue_s=queue_s, prefill_s=service_s, ttft_s=queue_s + service_s)]
    return d


@pytest.mark.parametrize(("objective", "queue_s", "service_s", "waited_s", "action"), [
    (ServiceObjective(1e-3, None, 10), 0.0, 0.1, 0.0, "send"),  # hopeless on an idle fleet: sent at once
    (ServiceObjective(1e-3, None, 10), 0.5, 0.1, 0.0, "hold"),  # ... held while the fleet is busy, as without one
    (ServiceObjective(0.3, None, 0), 0.0, 0.9, 0.0, "send"),  # a 20K-token prompt, 300 ms, idle fleet: sent
    (ServiceObjective(1e-3, None, -1), 0.0, 0.1, 0.0, "shed"),  # sheddable and hopeless: shed at once
    (ServiceObjective(0.3, None, -1), 0.0, 0.1, 0.25, "shed"),  # sheddable, its wait put it out of reach
    (ServiceObjective(0.3, None, 0), 0.25, 0.1, 0.0, "hold"),  # reachable, missed now: waits for the queue
    (ServiceObjective(0.3, None, 0), 0.1, 0.1, 0.25, "send"),  # the fleet has room for its target's sake
    (NO_OBJECTIVE, 0.06, 0.1, 0.0, "hold"),
    (NO_OBJECTIVE, 0.04, 0.1, 0.0, "send"),
])
def test_the_ruling_holds_only_for_a_busy_fleet(objective, queue_s, service_s, waited_s, action):
    assert rule(FlowParams(enabled=True), objective, decided(queue_s, service_s), waited_s).action == action


def test_the_simulator_sends_a_hopeless_request_at_once_and_nobody_waits_behind_it():
    """An idle fleet, flow control on: a request with a 1 ms target (priority 1) and, after it, others of its
    priority and lower. Before: the first was held until queue_timeout_s (then shed), and every one after it
    waited behind it."""
    reqs = [SimRequest("hopeless", 0.0, tokens_for_block(1, 512), 8, objective=ServiceObjective(1e-3, None, 1))]
    reqs += [SimRequest(f"r{i}", 0.5 + i, tokens_for_block(10 + i, 512), 8, tenant=f"t{i % 2}",
                        objective=ServiceObjective(None, None, i % 2)) for i in range(6)]
    res = Simulation(reqs, SimConfig(workers=2, policy="precise", engine=SYNTH_ENGINE,
                                     flow=FlowParams(enabled=True, queue_timeout_s=10.0))).run()
    for rec in res.records:
        assert rec.outcome == "routed" and rec.dispatched_at == rec.arrival, rec


def test_the_router_refuses_a_config_whose_tenant_weight_would_stall_the_queue(tmp_path):
    """What ``kvrouter serve`` and ``kvrouter epp`` read: a clear one-line error naming the key, exit status 2
    (before: accepted, and a weight of 1e-9 made one pass of deficit round robin take ~84 s)."""
    conf = tmp_path / "kvrouter.yaml"
    conf.write_text("flow_control: {enabled: true, tenant_weights: {nightly: 1.0e-9}}\n")
    out = subprocess.run([sys.executable, "-m", "router.cli", "serve", "--config", str(conf)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "flow_control.tenant_weights.nightly: expected a weight from 0.001 to 1000" \
        in out.stderr, out.stderr


def test_a_stated_target_can_make_a_request_wait_earlier_never_later_than_its_configured_rule():
    """A client sending a day-long target (or a hopeless one) on a ``standard`` request must not skip the queue
    that the operator's rule for ``standard`` (hold once the engine queue passes ``saturation_queue_s``) keeps."""
    from router.scheduling.slo import SloConfig, objective_for

    params = FlowParams(enabled=True, saturation_queue_s=0.05)
    config = SloConfig({"standard": ServiceObjective(None, None, 0, "standard"),
                        "chat": ServiceObjective(2.0, None, 1, "chat")}, tenants={"alice": "chat"},
                       default="standard")
    day = objective_for({"x-llm-d-slo-ttft-ms": "86400000"}, config)
    assert day.ttft_s == 86400.0 and day.configured is not None
    busy_queue, ttft = 0.5, 0.6
    assert saturated(params, config.objectives["standard"], busy_queue, ttft)
    assert saturated(params, day, busy_queue, ttft)  # held, as any standard request on this fleet
    assert not saturated(params, day, 0.01, 0.1)  # and sent when the fleet has room
    # a configured target tightened by the client to something hopeless still waits while the configured one would
    hopeless = objective_for({"x-llm-d-slo-ttft-ms": "0.001"}, config, tenant="alice")
    assert hopeless.ttft_s == 1e-6
    # 40 ms of queue (under saturation_queue_s) before 1.99 s of service: the configured 2 s target would be
    # missed by waiting there, so it is held, though the hopeless stated one alone would send it
    assert saturated(params, hopeless, 0.04, 2.03)
    assert not saturated(params, hopeless, 0.02, 0.5)


def test_one_request_the_fleet_is_busy_for_reserves_only_the_worker_it_waits_for():
    """Issue 50's review: a near-context prompt whose predicted wait passes the threshold on its chosen worker is
    held; before, it reserved every worker its decision ranked, so every later request of its priority or lower
    queued though other workers had room. Now it reserves the worker it waits for, and a request for another,
    idle worker goes at once; one for the same worker still waits behind it (it is not starved)."""
    params = FlowParams(enabled=True)
    q = FlowQueue(params)

    def on(worker: str, queue_s: float, others: tuple[str, ...] = ("w0", "w1", "w2")) -> Decision:
        ranked = [worker, *(w for w in others if w != worker)]
        d = Decision("precise", ranked=ranked)
        d.candidates = [CandidateReport(w, queue_s=queue_s if w == worker else 9.0, prefill_s=0.1,
                                        ttft_s=(queue_s if w == worker else 9.0) + 0.1) for w in ranked]
        return d

    giant = rule(params, NO_OBJECTIVE, on("w0", 5.0), 0.0)
    assert giant.action == "hold" and giant.eligible == frozenset({"w0"})
    assert q.push(item("giant"), giant.eligible)
    small_elsewhere = rule(params, NO_OBJECTIVE, on("w2", 0.0), 0.0)
    assert small_elsewhere.action == "send" and not q.must_wait(small_elsewhere, 0)
    small_same = rule(params, NO_OBJECTIVE, on("w0", 0.0), 0.0)
    assert q.must_wait(small_same, 0)  # w0 is left to drain for the one that waits for it
