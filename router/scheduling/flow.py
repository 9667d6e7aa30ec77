"""Flow control under saturation: the router holds requests the fleet cannot start yet, and chooses which goes
next by priority, then fairly between tenants. Pure: no I/O, no clock of its own (every call takes ``now`` or a
caller's ``judge`` that has one); the simulator and the front ends drive the same queue and the same release
logic (``rule``, ``FlowQueue.next_out``).

Why hold a request in the router at all: an engine serves its queue first come, first served, so a request sent
to a busy engine waits there behind whatever arrived before it, whatever its priority. Held here it waits the
same time (it is sent the moment the fleet could start it) while a later, more urgent request can go first,
and a tenant that floods cannot push the others back. The Gateway API Inference Extension's flow control has
this shape (bands per priority, a fairness policy between the flows of a band, a saturation detector, a TTL);
what is kvrouter's own is the saturation detector: the routing objective's predicted queue wait at the worker
it would choose (``Decision``'s chosen candidate's ``queue_s``), so "saturated" means "this request would queue
in the engine anyway", in the objective's seconds rather than a queue-depth threshold.

"Saturated" always means the fleet is busy, never that the request is hopeless: a TTFT target makes a request
wait only while the fleet could meet it (its predicted service time without the queue within the target). A
request whose target no wait can bring within reach (a 1 ms target, a 20K-token prompt with a 300 ms one) is
held only as a request without a target would be, and a sheddable one is shed at once (and one whose wait has put
its target out of reach, as soon as a release sees it); otherwise one hopeless request at the head would hold
everyone behind it until its deadline, on an idle fleet.

The order: the highest priority band first; inside a band, deficit round robin (Shreedhar and Varghese) over
the tenants' flows, each flow's quantum scaled by its tenant's weight and each request costing its prompt and
output tokens, so a tenant's share is of work, not of requests. A release looks past a held request (up to
``SCAN`` of them) for one that can go to a worker none of those ahead of it could use (another model's, another
subset's), so one busy worker does not stall the rest of the fleet, and nothing more urgent or earlier in turn
ever loses a worker to a request behind it. A queued request leaves by being dispatched, by its deadline (a 429
with Retry-After), as soon as its target is out of reach if it is sheddable, or at once when its client goes
away (``remove``).

Every call's work is bounded whatever the requests say: a request's cost is clamped (``MAX_COST_TOKENS``), the
tenants' weights are bounded (``MIN_WEIGHT``..``MAX_WEIGHT``), and deficit round robin counts the rounds that
would serve nobody arithmetically instead of looping one quantum at a time (``head``: at most a few passes over
the band's flows). ``work`` counts the loop iterations, for the tests.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from router.scheduling.slo import ServiceObjective
from router.scheduling.types import Decision

# a request's cost is clamped here: far above any real request (a million-token prompt with a million-token answer
# a thousand times), low enough that deficits stay exact in a float64 (2^53) over any queue of them
MAX_COST_TOKENS = 2**32
MIN_WEIGHT, MAX_WEIGHT = 1e-3, 1e3  # a tenant's weight: a million to one between the lightest and the heaviest
SCAN = 8  # how many held requests one ``next_out`` looks at (each costs the caller a routing decision)


@dataclass(frozen=True)
class FlowParams:
    """``flow_control:`` in the router's config (off by default: the router dispatches every request at once)."""

    enabled: bool = False
    # hold a request without a TTFT target (or with one out of reach) while the worker the objective would choose
    # is predicted to make it wait longer than this before its prefill starts (one engine step's order: the router
    # releases on the engines' step ends); one with a reachable target, while it would miss it there (``saturated``)
    saturation_queue_s: float = 0.05
    queue_timeout_s: float = 60.0  # the longest a request waits here; then a 429 with Retry-After
    # a sheddable request (priority < 0) with a TTFT target is shed as soon as the target is out of reach (at once
    # when it is so on arrival): it would only take a slot from one that can meet its own
    shed_unreachable: bool = True
    max_queued: int = 10_000  # requests held at once (bounded memory); past it a new one is refused at once
    quantum_tokens: int = 4096  # a flow's credit per round of deficit round robin, times its tenant's weight
    tenant_weights: Mapping[str, float] = field(default_factory=dict)  # unlisted tenants weigh 1

    def __post_init__(self) -> None:
        finite = all(math.isfinite(v) for v in (self.saturation_queue_s, self.queue_timeout_s))
        if not finite or self.saturation_queue_s < 0 or self.queue_timeout_s <= 0 or self.max_queued <= 0:
            raise ValueError("flow_control: saturation_queue_s >= 0 and queue_timeout_s > 0 (finite), "
                             "max_queued > 0")
        if not 1 <= self.quantum_tokens <= MAX_COST_TOKENS:
            raise ValueError(f"flow_control.quantum_tokens: expected 1 to {MAX_COST_TOKENS}, "
                             f"got {self.quantum_tokens}")
        for tenant, w in self.tenant_weights.items():
            if not (isinstance(w, int | float) and MIN_WEIGHT <= w <= MAX_WEIGHT):  # (NaN fails the comparison)
                raise ValueError(f"flow_control.tenant_weights.{tenant}: expected a weight from {MIN_WEIGHT:g} to "
                                 f"{MAX_WEIGHT:g}, got {w!r}")


def reachable(objective: ServiceObjective, queue_s: float, ttft_s: float, waited_s: float = 0.0) -> bool:
    """Whether ``objective``'s TTFT target can still be met by a request that has waited ``waited_s`` and whose
    chosen worker predicts ``ttft_s``, ``queue_s`` of it waiting: only the queue can shrink, so it can while
    the rest (the service itself) fits in what is left of the target. False without a target."""
    target = objective.ttft_s
    return target is not None and waited_s + max(ttft_s - queue_s, 0.0) <= target


def saturated(params: FlowParams, objective: ServiceObjective, queue_s: float, ttft_s: float) -> bool:
    """Whether to hold a request whose chosen worker is predicted to make it wait ``queue_s`` before its prefill
    and to give its first token after ``ttft_s``: whether the fleet is busy for it. With a TTFT target the fleet
    can meet at all (its service there, ``ttft_s - queue_s``, within it): while it would miss it there (sending
    it would only lengthen that engine's queue for the requests behind it, and holding it lets the queue's order
    pick who goes next). Without one, or with one no wait can bring within reach: once it would wait in the
    engine more than ``saturation_queue_s``, so that the engines' queues stay short for the requests that have
    targets. What the request has already waited does not count here: it says nothing of the fleet, and a
    request held for its age would hold the band behind it (``rule`` sheds a sheddable one whose wait put its
    target out of reach). A request whose own headers changed its targets is held whenever the objective config
    gave it would be too (``ServiceObjective.configured``)."""
    if objective.configured is not None and saturated(params, objective.configured, queue_s, ttft_s):
        return True  # the operator's rule for it holds it: a client's stated target cannot send it sooner
    if reachable(objective, queue_s, ttft_s):
        assert objective.ttft_s is not None
        return ttft_s > objective.ttft_s
    return queue_s > params.saturation_queue_s


@dataclass(frozen=True, slots=True)
class Ruling:
    """What flow control makes of a request's fresh decision: ``send`` it now, ``hold`` it (the fleet is busy),
    ``shed`` it (sheddable, its TTFT target out of reach: ``reason`` says so), or ``end`` (the decision itself
    refused it: the picker shed it, or no worker serves it)."""

    action: str  # send | hold | shed | end
    decision: Decision
    reason: str = ""

    @property
    def eligible(self) -> frozenset[str]:
        """The worker the request waits for while held: the one its decision chose (the objective's best, busy
        now). Only that one is reserved: reserving every worker it could use let one request the fleet is busy
        for (a near-context prompt whose memory wait passes the threshold everywhere) hold every request behind
        it while other workers had room (issue 50 review); a request behind takes only a worker nobody ahead of
        it waits for, so none loses its chosen worker to one behind it, and a worker whose held request waits is
        left to drain for it."""
        chosen = self.decision.chosen
        return frozenset(self.decision.ranked if chosen is None else (chosen,))


def rule(params: FlowParams, objective: ServiceObjective, decision: Decision, waited_s: float) -> Ruling:
    """The ruling on a request with ``objective`` that has waited ``waited_s``, on its ``decision`` now."""
    if decision.outcome != "routed":
        return Ruling("end", decision)
    chosen = decision.report(decision.chosen) if decision.chosen is not None else None
    if chosen is None:  # (a decision without reports: nothing predicted, nothing to hold it on)
        return Ruling("send", decision)
    target = objective.ttft_s
    if (target is not None and objective.sheddable and params.shed_unreachable
            and not reachable(objective, chosen.queue_s, chosen.ttft_s, waited_s)):
        service = max(chosen.ttft_s - chosen.queue_s, 0.0)
        return Ruling("shed", decision, f"it can no longer meet its TTFT target ({target * 1e3:.6g} ms; waited "
                                        f"{waited_s * 1e3:.0f} ms, predicted service {service * 1e3:.0f} ms)")
    if saturated(params, objective, chosen.queue_s, chosen.ttft_s):
        return Ruling("hold", decision)
    return Ruling("send", decision)


@dataclass(eq=False)
class Queued:
    """One held request: what the caller needs to dispatch it later (``payload``), and what orders it."""

    request_id: str
    arrived_at: float
    cost_tokens: int  # prompt + output tokens: what deficit round robin charges its flow (clamped by ``push``)
    objective: ServiceObjective
    tenant: str | None = None
    payload: Any = None
    deadline: float = 0.0
    left: str | None = None  # None while queued; then dispatched | expired | unreachable | refused | removed
    holds: frozenset[str] = frozenset()  # the workers it waits for: no request behind it may take them first


class _Band:
    """One priority's flows, one per tenant, served by deficit round robin; ``holds`` counts, per worker, the
    held requests of this band that wait for it."""

    __slots__ = ("active", "deficit", "flows", "holds", "size")

    def __init__(self) -> None:
        self.flows: dict[str | None, deque[Queued]] = {}
        self.active: deque[str | None] = deque()  # tenants with queued requests, in round order
        self.deficit: dict[str | None, float] = {}
        self.holds: dict[str, int] = {}
        self.size = 0


def _clamped_cost(cost: Any) -> int:
    """A request's cost as deficit round robin may charge it: 0 to ``MAX_COST_TOKENS`` (NaN: 0)."""
    if not cost >= 0:
        return 0
    return MAX_COST_TOKENS if cost >= MAX_COST_TOKENS else int(cost)


class FlowQueue:
    """Requests held while the fleet is saturated (``FlowParams``): ``push`` one, ask ``next_out`` which leaves
    next (or ``head`` which is next in turn, and ``pop`` it once dispatched), ``expire`` those past their
    deadline, ``remove`` one whose client left."""

    def __init__(self, params: FlowParams, scan: int = SCAN) -> None:
        self.params = params
        self.scan = scan
        self.work = 0  # loop iterations so far (the tests bound each call's)
        self._bands: dict[int, _Band] = {}
        self._by_id: dict[str, Queued] = {}
        self._deadlines: list[tuple[float, int, Queued]] = []  # a heap; entries of items gone are skipped
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def waiting_at_or_above(self, priority: int) -> bool:
        """Whether a request of ``priority`` or higher is held."""
        return any(p >= priority for p in self._bands)

    def blocked(self, priority: int, worker: str | None) -> bool:
        """Whether a new request of ``priority`` that would go to ``worker`` must queue behind a held one: one of
        ``priority`` or higher waits for that worker (a request sent there now would take its turn)."""
        return any(p >= priority and worker in band.holds for p, band in self._bands.items())

    def must_wait(self, ruling: Ruling, priority: int) -> bool:
        """Whether a new request of ``priority`` ruled ``ruling`` on arrival waits here (``push``): held, or ready
        for a worker a held request of its priority or higher waits for."""
        return ruling.action == "hold" or (ruling.action == "send" and self.blocked(priority, ruling.decision.chosen))

    def waiting_by_priority(self) -> dict[int, int]:
        """How many requests are held, per priority (the priorities with none held are absent)."""
        return {p: band.size for p, band in self._bands.items()}

    def push(self, item: Queued, holds: Collection[str] = ()) -> bool:
        """Hold ``item``, waiting for the workers ``holds`` (those its decision could send it to); False (it is
        not held) when the queue is full."""
        if len(self._by_id) >= self.params.max_queued or item.request_id in self._by_id:
            return False
        p = self.params
        item.cost_tokens = _clamped_cost(item.cost_tokens)
        item.deadline = item.arrived_at + p.queue_timeout_s
        ttft = item.objective.ttft_s
        if p.shed_unreachable and item.objective.sheddable and ttft is not None:
            item.deadline = min(item.deadline, item.arrived_at + ttft)
        band = self._bands.get(item.objective.priority)
        if band is None:
            band = self._bands[item.objective.priority] = _Band()
        flow = band.flows.get(item.tenant)
        if flow is None:
            flow = band.flows[item.tenant] = deque()
            band.active.append(item.tenant)
            band.deficit[item.tenant] = 0.0
        flow.append(item)
        band.size += 1
        self._by_id[item.request_id] = item
        self._set_holds(item, band, frozenset(holds))
        heapq.heappush(self._deadlines, (item.deadline, next(self._order), item))
        return True

    def head(self) -> Queued | None:
        """The request next in turn: the highest band's, its flows taking turns by deficit round robin (the turn
        moves here, so ``head`` then ``pop`` serve the same request). A round in which no flow can pay for its
        first request is followed by the rounds that would serve nobody either, counted at once: at most about
        three passes over the band's flows, whatever the costs and weights."""
        if not self._bands:
            return None
        band = self._bands[max(self._bands)]
        quantum = self.params.quantum_tokens
        weights = self.params.tenant_weights
        active, deficit, flows = band.active, band.deficit, band.flows
        visits = 0
        while True:
            self.work += 1
            tenant = active[0]
            first = flows[tenant][0]
            if deficit[tenant] >= first.cost_tokens:
                return first
            deficit[tenant] += quantum * weights.get(tenant or "", 1.0)
            active.rotate(-1)
            visits += 1
            if visits % len(active) == 0:  # a whole round served nobody
                self._skip_rounds(band)

    def _skip_rounds(self, band: _Band) -> None:
        """Give every flow of ``band`` the quanta of the whole rounds before the first in which one of them can
        pay for its first request (each round adds each flow its quantum, and a whole round leaves the order
        where it was): what looping one quantum at a time would reach, in one pass."""
        quantum = self.params.quantum_tokens
        weights = self.params.tenant_weights
        rounds = None
        for tenant in band.active:
            self.work += 1
            need = band.flows[tenant][0].cost_tokens - band.deficit[tenant]
            k = max(0, math.ceil(need / (quantum * weights.get(tenant or "", 1.0))))
            rounds = k if rounds is None else min(rounds, k)
        if rounds:
            for tenant in band.active:
                self.work += 1
                band.deficit[tenant] += rounds * quantum * weights.get(tenant or "", 1.0)

    def pop(self, item: Queued) -> None:
        """``item`` was dispatched: charge its flow and take it out (one sent ahead of its turn leaves its flow
        in debt, paid in the rounds it then waits)."""
        band = self._bands[item.objective.priority]
        band.deficit[item.tenant] -= item.cost_tokens
        self._take(item, "dispatched")

    def remove(self, request_id: str) -> Queued | None:
        """Take out a request whose client went away (or that the caller refused); None if it is not held."""
        item = self._by_id.get(request_id)
        if item is not None:
            self._take(item, "removed")
        return item

    def candidates(self) -> Iterator[Queued]:
        """The held requests in the order a release considers them: the one next in turn (``head``), then the
        highest band's flows' first requests, their second ones, ..., then the next band's. Lazy: a release
        reads only the first few."""
        first = self.head()
        if first is None:
            return
        yield first
        for priority in sorted(self._bands, reverse=True):
            band = self._bands[priority]
            depth, deeper = 0, True
            while deeper:  # (a level that yields nothing ends the band: the work is bounded by what is read)
                deeper = False
                for tenant in band.active:
                    self.work += 1
                    flow = band.flows[tenant]
                    if depth < len(flow):
                        deeper = True
                        if flow[depth] is not first:
                            yield flow[depth]
                depth += 1

    def next_out(self, judge: Callable[[Queued], Ruling],
                 fleet: Collection[str] = ()) -> tuple[Queued, Ruling] | None:
        """The next request to leave, taken out, and its ruling (``judge``: the caller decides it afresh and
        ``rule``s on that); None when none can. A held request reserves the workers it could use: a request
        behind it (in ``candidates``' order) goes only to a worker none of those ahead of it wait for, so none
        loses its worker to one behind it. Looks at up to ``scan`` requests, and stops once those held reserve
        every worker of ``fleet`` (the workers anyone could be sent to: nobody behind could go anywhere)."""
        reserved: set[str] = set()
        for item in itertools.islice(self.candidates(), self.scan):
            ruling = judge(item)
            if ruling.action == "end":
                self._take(item, "refused")
                return item, ruling
            if ruling.action == "shed":
                self._take(item, "unreachable")
                return item, ruling
            if ruling.action == "send" and ruling.decision.chosen not in reserved:
                self.pop(item)
                return item, ruling
            holds = ruling.eligible  # held, or ready but behind one that waits for its worker
            self.work += len(holds)
            self._set_holds(item, self._bands[item.objective.priority], holds)
            reserved |= holds
            if fleet and len(reserved) >= len(fleet) and reserved.issuperset(fleet):
                break
        return None

    def expire(self, now: float) -> list[Queued]:
        """The requests whose deadline has passed, taken out (``left``: ``expired``, or ``unreachable`` for a
        sheddable one that can no longer meet its TTFT target)."""
        out = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            self.work += 1
            _, _, item = heapq.heappop(heap)
            if item.left is None:
                timeout_at = item.arrived_at + self.params.queue_timeout_s
                self._take(item, "expired" if item.deadline >= timeout_at else "unreachable")
                out.append(item)
        return out

    def take_all(self) -> list[Queued]:
        """Every held request, taken out (``left``: ``expired``): a router shutting down refuses them all."""
        items = list(self._by_id.values())
        for item in items:
            self._take(item, "expired")
        return items

    def next_deadline(self) -> float | None:
        """When ``expire`` next has something to do (for a caller's timer)."""
        heap = self._deadlines
        while heap and heap[0][2].left is not None:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def _set_holds(self, item: Queued, band: _Band, holds: frozenset[str]) -> None:
        if holds == item.holds:
            return
        counts = band.holds
        for w in item.holds:
            if counts[w] == 1:
                del counts[w]
            else:
                counts[w] -= 1
        for w in holds:
            counts[w] = counts.get(w, 0) + 1
        item.holds = holds

    def _take(self, item: Queued, why: str) -> None:
        item.left = why
        del self._by_id[item.request_id]
        priority = item.objective.priority
        band = self._bands[priority]
        self._set_holds(item, band, frozenset())
        band.size -= 1
        flow = band.flows[item.tenant]
        if flow[0] is item:
            flow.popleft()
        else:
            flow.remove(item)
        if not flow:  # an idle flow keeps no credit (deficit round robin's rule): it cannot save up a burst
            del band.flows[item.tenant], band.deficit[item.tenant]
            band.active.remove(item.tenant)
            if not band.flows:
                del self._bands[priority]


def parse_flow_params(raw: Mapping[str, Any] | None) -> FlowParams:
    """``flow_control:`` from YAML; ValueError naming the key."""
    if not raw:
        return FlowParams()
    known = {f for f in FlowParams.__dataclass_fields__}
    unknown = set(raw) - known
    if unknown:
        raise ValueError(f"flow_control: unknown key {sorted(unknown)[0]!r}; known: {sorted(known)}")
    values = dict(raw)
    expected = {"bool": "true or false", "int": "an integer", "float": "a number"}
    for name, f in FlowParams.__dataclass_fields__.items():
        if name not in values or name == "tenant_weights":
            continue
        v, kind = values[name], str(f.type)  # (annotations are strings here: from __future__ import annotations)
        if kind == "bool":
            ok = isinstance(v, bool)
        elif kind == "int":
            ok = isinstance(v, int) and not isinstance(v, bool)
        else:
            ok = isinstance(v, int | float) and not isinstance(v, bool)
        if not ok:
            raise ValueError(f"flow_control.{name}: expected {expected.get(kind, kind)}, got {v!r}")
    if "tenant_weights" in values:
        weights = values["tenant_weights"] or {}
        if not isinstance(weights, Mapping):
            raise ValueError("flow_control.tenant_weights: expected a mapping of tenant to weight")
        for tenant, w in weights.items():
            if not isinstance(w, int | float) or isinstance(w, bool):
                raise ValueError(f"flow_control.tenant_weights.{tenant}: expected a number, got {w!r}")
        values["tenant_weights"] = {str(k): float(v) for k, v in weights.items()}
    return FlowParams(**values)


__all__ = ["MAX_COST_TOKENS", "MAX_WEIGHT", "MIN_WEIGHT", "SCAN", "FlowParams", "FlowQueue", "Queued", "Ruling",
           "parse_flow_params", "reachable", "rule", "saturated"]
