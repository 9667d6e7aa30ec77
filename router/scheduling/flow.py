"""Flow control under saturation: the router holds requests the fleet cannot start yet, and chooses which goes
next by priority, then fairly between tenants. Pure: no I/O, no clock of its own (every call takes ``now``);
the simulator and the front ends drive the same queue.

Why hold a request in the router at all: an engine serves its queue first come, first served, so a request sent
to a busy engine waits there behind whatever arrived before it, whatever its priority. Held here it waits the
same time (it is sent the moment the fleet could start it) while a later, more urgent request can go first,
and a tenant that floods cannot push the others back. The Gateway API Inference Extension's flow control has
this shape (bands per priority, a fairness policy between the flows of a band, a saturation detector, a TTL);
what is kvrouter's own is the saturation detector: the routing objective's predicted queue wait at the worker
it would choose (``Decision``'s chosen candidate's ``queue_s``), so "saturated" means "this request would queue
in the engine anyway", in the objective's seconds rather than a queue-depth threshold.

The order: the highest priority band first; inside a band, deficit round robin (Shreedhar and Varghese) over
the tenants' flows, each flow's quantum scaled by its tenant's weight and each request costing its prompt and
output tokens, so a tenant's share is of work, not of requests. A queued request leaves by being dispatched,
by its deadline (a 429 with Retry-After), or at once when its client goes away (``remove``).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from router.scheduling.slo import ServiceObjective


@dataclass(frozen=True)
class FlowParams:
    """``flow_control:`` in the router's config (off by default: the router dispatches every request at once)."""

    enabled: bool = False
    # hold a request without a TTFT target while the worker the objective would choose is predicted to make it
    # wait longer than this before its prefill starts (one engine step's order: the router releases on the
    # engines' step ends); one with a target, while it would miss it there (``saturated``)
    saturation_queue_s: float = 0.05
    queue_timeout_s: float = 60.0  # the longest a request waits here; then a 429 with Retry-After
    # a sheddable request (priority < 0) with a TTFT target leaves as soon as it has waited that long: it can no
    # longer meet it, and it would only take a slot from one that can
    shed_unreachable: bool = True
    max_queued: int = 10_000  # requests held at once (bounded memory); past it a new one is refused at once
    quantum_tokens: int = 4096  # a flow's credit per round of deficit round robin, times its tenant's weight
    tenant_weights: Mapping[str, float] = field(default_factory=dict)  # unlisted tenants weigh 1

    def __post_init__(self) -> None:
        if self.saturation_queue_s < 0 or self.queue_timeout_s <= 0 or self.max_queued <= 0:
            raise ValueError("flow_control: saturation_queue_s >= 0, queue_timeout_s > 0 and max_queued > 0")
        if self.quantum_tokens <= 0 or any(w <= 0 for w in self.tenant_weights.values()):
            raise ValueError("flow_control: quantum_tokens and every tenant weight must be positive")


def saturated(params: FlowParams, objective: ServiceObjective, queue_s: float, ttft_s: float) -> bool:
    """Whether to hold a request whose chosen worker is predicted to make it wait ``queue_s`` before its
    prefill and to give its first token after ``ttft_s``. With a TTFT target: once it would miss it there anyway
    (sending it would only lengthen that engine's queue for the requests behind it, and holding it lets the
    queue's order pick who goes next). Without one: once it would wait in the engine more than
    ``saturation_queue_s``, so that the engines' queues stay short for the requests that have targets."""
    if objective.ttft_s is not None:
        return ttft_s > objective.ttft_s
    return queue_s > params.saturation_queue_s


@dataclass(eq=False)
class Queued:
    """One held request: what the caller needs to dispatch it later (``payload``), and what orders it."""

    request_id: str
    arrived_at: float
    cost_tokens: int  # prompt + output tokens: what deficit round robin charges its flow
    objective: ServiceObjective
    tenant: str | None = None
    payload: Any = None
    deadline: float = 0.0
    left: str | None = None  # None while queued; then dispatched | expired | unreachable | removed


class _Band:
    """One priority's flows, one per tenant, served by deficit round robin."""

    __slots__ = ("active", "deficit", "flows")

    def __init__(self) -> None:
        self.flows: dict[str | None, deque[Queued]] = {}
        self.active: deque[str | None] = deque()  # tenants with queued requests, in round order
        self.deficit: dict[str | None, float] = {}


class FlowQueue:
    """Requests held while the fleet is saturated (``FlowParams``): ``push`` one, ask ``head`` which goes next
    and ``pop`` it once dispatched, ``expire`` those past their deadline, ``remove`` one whose client left."""

    def __init__(self, params: FlowParams) -> None:
        self.params = params
        self._bands: dict[int, _Band] = {}
        self._by_id: dict[str, Queued] = {}
        self._deadlines: list[tuple[float, int, Queued]] = []  # a heap; entries of items gone are skipped
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def waiting_at_or_above(self, priority: int) -> bool:
        """Whether a request of ``priority`` or higher is held (a new one of ``priority`` must queue behind it)."""
        return any(p >= priority for p in self._bands)

    def push(self, item: Queued) -> bool:
        """Hold ``item``; False (it is not held) when the queue is full."""
        if len(self._by_id) >= self.params.max_queued or item.request_id in self._by_id:
            return False
        p = self.params
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
        self._by_id[item.request_id] = item
        heapq.heappush(self._deadlines, (item.deadline, next(self._order), item))
        return True

    def head(self) -> Queued | None:
        """The request to dispatch next: the highest band's, its flows taking turns by deficit round robin (the
        turn moves here, so ``head`` then ``pop`` serve the same request)."""
        if not self._bands:
            return None
        band = self._bands[max(self._bands)]
        quantum = self.params.quantum_tokens
        weights = self.params.tenant_weights
        while True:
            tenant = band.active[0]
            first = band.flows[tenant][0]
            if band.deficit[tenant] >= first.cost_tokens:
                return first
            band.deficit[tenant] += quantum * weights.get(tenant or "", 1.0)
            band.active.rotate(-1)

    def pop(self, item: Queued) -> None:
        """``item`` (the last ``head``) was dispatched: charge its flow and take it out."""
        band = self._bands[item.objective.priority]
        band.deficit[item.tenant] -= item.cost_tokens
        self._take(item, "dispatched")

    def remove(self, request_id: str) -> Queued | None:
        """Take out a request whose client went away (or that the caller refused); None if it is not held."""
        item = self._by_id.get(request_id)
        if item is not None:
            self._take(item, "removed")
        return item

    def expire(self, now: float) -> list[Queued]:
        """The requests whose deadline has passed, taken out (``left``: ``expired``, or ``unreachable`` for a
        sheddable one that can no longer meet its TTFT target)."""
        out = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
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

    def _take(self, item: Queued, why: str) -> None:
        item.left = why
        del self._by_id[item.request_id]
        priority = item.objective.priority
        band = self._bands[priority]
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
        values["tenant_weights"] = {str(k): float(v) for k, v in weights.items()}
    return FlowParams(**values)


__all__ = ["FlowParams", "FlowQueue", "Queued", "parse_flow_params", "saturated"]
