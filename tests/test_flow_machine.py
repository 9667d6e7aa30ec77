"""A state machine over flow control's pure queue and release logic (router/scheduling/flow.py: ``rule``,
``FlowQueue.must_wait``, ``next_out``, ``expire``, ``remove``), driven as the front ends and the simulator drive
it, against a small model of a fleet: three workers with a few free slots each, requests of three priorities and
four tenants, each able to use some of the workers, with no target, a reachable one, or one no wait can reach, and
costs from nothing to far past any real request's (10^30 tokens). The invariants:

- every request admitted to the queue leaves it exactly once (sent, shed, refused, expired or removed);
- after a release none waits while the fleet has room for it and nothing ahead of it (more urgent, or earlier in
  deficit round robin's turn) could use that room: a request ruled ``send`` still waiting is behind one that could
  use its worker; one ruled ``hold`` has no free worker; one to be shed or refused is behind requests that
  reserve the whole fleet (the release stopped looking there);
- the work of each call (``FlowQueue.work``: loop iterations, not time) is bounded by the queue's shape (its
  flows, the scan, the fleet), whatever the costs and the tenants' weights say.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from router.scheduling.flow import FlowParams, FlowQueue, Queued, Ruling
from router.scheduling.flow import rule as flow_rule
from router.scheduling.slo import ServiceObjective
from router.scheduling.types import CandidateReport, Decision

WORKERS = ("w0", "w1", "w2")
SLOTS = 1  # free slots per worker when idle
MAX_QUEUED = 24
SERVICE_S = 0.1  # every request's predicted service time (prefill) on a free worker
BUSY_QUEUE_S = 1.0  # the predicted queue wait on a worker with no free slot
# tenants' weights at the bounds FlowParams allows, and a quantum of one token: a 2^32-token request would take
# four trillion rounds of one quantum each
PARAMS = FlowParams(enabled=True, queue_timeout_s=5.0, max_queued=MAX_QUEUED, quantum_tokens=1,
                    tenant_weights={"a": 1e-3, "b": 1e3, "c": 1.0})
TARGETS = {"none": None, "reachable": 0.5, "hopeless": 0.001}


@dataclass
class Spec:
    """What the model fleet knows of one request."""

    eligible: tuple[str, ...]
    served: bool = True  # False: its model left the fleet (the decision: no_endpoint)


class FlowMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.q = FlowQueue(PARAMS, scan=MAX_QUEUED)  # the whole queue is looked at: the invariant covers it all
        self.free = dict.fromkeys(WORKERS, SLOTS)
        self.running: list[str] = []  # the worker of each request sent and not finished
        self.now = 0.0
        self.specs: dict[str, Spec] = {}
        self.admitted: set[str] = set()
        self.left: dict[str, str] = {}
        self.ids = 0

    # ---- the model fleet, and the caller's judge (a front end decides afresh, then ``rule``s) ----------
    def decide(self, rid: str) -> Decision:
        spec = self.specs[rid]
        if not spec.served:
            return Decision("model", outcome="no_endpoint", reason="gone")
        ranked = sorted(spec.eligible, key=lambda w: (self.free[w] == 0, w))  # a free worker first
        reports = []
        for w in ranked:
            queue = 0.0 if self.free[w] > 0 else BUSY_QUEUE_S
            reports.append(CandidateReport(w, queue_s=queue, prefill_s=SERVICE_S, ttft_s=queue + SERVICE_S))
        d = Decision("model", ranked=ranked)
        d.candidates = reports
        return d

    def judge(self, item: Queued) -> Ruling:
        return flow_rule(PARAMS, item.objective, self.decide(item.request_id), self.now - item.arrived_at)

    def leave(self, item: Queued, why: str) -> None:
        assert item.request_id in self.admitted and item.request_id not in self.left, item.request_id
        assert item.request_id not in self.q
        self.left[item.request_id] = why

    def send(self, worker: str) -> None:
        assert self.free[worker] > 0, "sent to a worker with no room"
        self.free[worker] -= 1
        self.running.append(worker)

    def bound(self) -> int:
        """The most work one call may do: a few passes over the flows per request looked at, and the fleet."""
        flows = sum(len(b.flows) for b in self.q._bands.values()) + 1
        return (self.q.scan + 1) * (8 * flows + len(WORKERS) + 8)

    def counted(self, call):  # type: ignore[no-untyped-def]
        before = self.q.work
        out = call()
        assert self.q.work - before <= self.bound(), (self.q.work - before, self.bound())
        return out

    # ---- rules ------------------------------------------------------------------------------------
    @rule(priority=st.sampled_from([-1, 0, 1]), tenant=st.sampled_from([None, "a", "b", "c"]),
          cost=st.one_of(st.integers(0, 5000), st.integers(2**31, 10**30), st.integers(-(10**6), -1)),
          eligible=st.sets(st.sampled_from(WORKERS), min_size=1).map(lambda s: tuple(sorted(s))),
          goal=st.sampled_from(sorted(TARGETS)))
    def arrive(self, priority: int, tenant: str | None, cost: int, eligible: tuple[str, ...], goal: str) -> None:
        rid = f"r{self.ids}"
        self.ids += 1
        self.specs[rid] = Spec(eligible)
        objective = ServiceObjective(TARGETS[goal], None, priority)
        ruling = flow_rule(PARAMS, objective, self.decide(rid), 0.0)
        if ruling.action == "shed":  # sheddable, its target out of reach even on an idle fleet: refused at once
            assert objective.sheddable and goal == "hopeless"
            return
        if not self.q.must_wait(ruling, priority):
            assert ruling.action == "send"
            self.send(ruling.decision.chosen)  # type: ignore[arg-type]
            return
        assert not (goal == "hopeless" and any(self.free[w] for w in eligible)) or ruling.action == "send", \
            "a hopeless target held on a fleet with room"
        if self.counted(lambda: self.q.push(Queued(rid, self.now, cost, objective, tenant), ruling.eligible)):
            self.admitted.add(rid)

    @rule()
    def release(self) -> None:
        """Let out what can leave, as a front end does when capacity moves; then check nothing waits wrongly."""
        for item in self.counted(lambda: self.q.expire(self.now)):
            self.leave(item, item.left or "")
        while (out := self.counted(lambda: self.q.next_out(self.judge, WORKERS))) is not None:
            item, ruling = out
            self.leave(item, ruling.action)
            if ruling.action == "send":
                self.send(ruling.decision.chosen)  # type: ignore[arg-type]
        self.check_nothing_waits_wrongly()

    def check_nothing_waits_wrongly(self) -> None:
        reserved: set[str] = set()
        order = list(self.q.candidates())
        assert len(order) == len(self.q)  # every held request is in the order, once
        for item in order:
            ruling = self.judge(item)
            eligible = self.specs[item.request_id].eligible
            if ruling.action == "send":  # room for it, taken by nobody: one ahead of it could use that worker
                assert ruling.decision.chosen in reserved, (item.request_id, ruling.decision.chosen, reserved)
            elif ruling.action == "hold":  # saturated means the fleet is busy for it, never that it is hopeless
                assert not any(self.free[w] for w in eligible)
            else:  # shed or refused: only where the release stopped looking (the fleet all reserved ahead)
                assert reserved >= set(WORKERS)
            reserved |= set(ruling.eligible) if ruling.action != "end" else set()

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        worker = self.running.pop(data.draw(st.integers(0, len(self.running) - 1)))
        self.free[worker] += 1

    @precondition(lambda self: len(self.q) > 0)
    @rule(data=st.data())
    def client_leaves(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.q._by_id)))
        item = self.counted(lambda: self.q.remove(rid))
        assert item is not None and item.left == "removed"
        self.leave(item, "removed")
        assert self.q.remove(rid) is None  # once

    @precondition(lambda self: len(self.q) > 0)
    @rule(data=st.data())
    def model_leaves(self, data: st.DataObject) -> None:
        self.specs[data.draw(st.sampled_from(sorted(self.q._by_id)))].served = False

    @rule(dt=st.sampled_from([0.0, 0.01, 0.3, 0.6, 2.0, 6.0]))
    def time_passes(self, dt: float) -> None:
        self.now += dt

    @rule()
    def head_is_stable(self) -> None:
        """``head`` then ``head`` again: the same request (the turn moved once), with bounded work."""
        first = self.counted(self.q.head)
        assert self.counted(self.q.head) is first

    # ---- invariants -------------------------------------------------------------------------------------
    @invariant()
    def each_admitted_request_is_held_or_has_left_once(self) -> None:
        held = set(self.q._by_id)
        assert held | set(self.left) == self.admitted and not held & set(self.left)
        assert len(self.q) <= MAX_QUEUED
        assert sum(self.q.waiting_by_priority().values()) == len(self.q)
        for band in self.q._bands.values():  # each worker's count of held requests waiting for it is exact
            items = [i for f in band.flows.values() for i in f]
            expected: dict[str, int] = {}
            for i in items:
                for w in i.holds:
                    expected[w] = expected.get(w, 0) + 1
            assert band.holds == expected

    def teardown(self) -> None:
        for item in self.q.take_all():
            self.leave(item, "closed")
        assert set(self.left) == self.admitted


FlowMachine.TestCase.settings = settings(max_examples=400, stateful_step_count=50, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
test_flow_queue_state_machine = FlowMachine.TestCase
