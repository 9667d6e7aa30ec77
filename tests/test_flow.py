"""Flow control (router/scheduling/flow.py): priority bands, deficit round robin between tenants, deadlines, and
the simulator holding requests the fleet cannot start yet."""

from __future__ import annotations

import pytest

from router.scheduling.flow import FlowParams, FlowQueue, Queued, parse_flow_params
from router.scheduling.slo import NO_OBJECTIVE, ServiceObjective
from sim.runner import SimConfig, Simulation, summarise
from sim.suite import SYNTH_ENGINE
from sim.workload import merged, shared_prefix, with_objective

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
