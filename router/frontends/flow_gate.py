"""Flow control on the event loop: the proxy's and the picker's one adapter over the pure queue and its release
logic (router/scheduling/flow.py) that the simulator drives too.

A front end decides a request as always, then asks ``admit``: while flow control rules it ``send`` (the fleet
has room for it, and no request of its priority or higher waits for the worker it would go to) the decision
stands at once; a sheddable request whose TTFT target is out of reach is shed at once; otherwise the request
waits here, and ``admit`` returns the decision it is sent on once the fleet has room (decided again then: the
fleet has moved), or a ``shed`` decision (a 429 with Retry-After) when its deadline passes, its target goes out of
reach (sheddable), or the queue is full. A caller whose client goes away is cancelled in ``admit``, and the request
leaves the queue at once.

The queue is looked at again whenever a request ends or gives its first token (``RoutingCore``'s release
listeners: capacity moved) and, while anything waits, every ``POLL_S`` (work this router does not see: another
router's requests on the same engines) and at the next deadline. A release lets one request out, then the next
release waits until that request's task has resumed and dispatched it (the front ends dispatch before their next
await), so its load counts in the next decision: deciding them all against the same load would send every waiting
request into the room of one. A release answers at most ``MAX_OUT`` sheds or refusals, so the loop is never held
for long.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from router.scheduling.core import RoutingCore
from router.scheduling.flow import FlowParams, FlowQueue, Queued, Ruling, rule
from router.scheduling.types import Decision, RouteRequest

POLL_S = 0.02  # while requests wait: how often the queue is looked at without an event (an engine step's order)
MAX_OUT = 32  # requests answered (shed or refused) in one release; then it goes on at the loop's next turn

Decide = Callable[[float], Decision]


def _shed(policy: str, reason: str, retry_after_s: float) -> Decision:
    return Decision(policy, outcome="shed", reason=reason, retry_after_s=retry_after_s)


class FlowGate:
    """``admit`` each decided request; with ``params.enabled`` false it always answers at once."""

    def __init__(self, core: RoutingCore, params: FlowParams, clock: Callable[[], float] = time.monotonic) -> None:
        self.core = core
        self.params = params
        self.clock = clock
        self.queue = FlowQueue(params) if params.enabled else None
        self._waiters: dict[str, asyncio.Future[Decision]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._again: asyncio.Handle | None = None  # a release on the loop's next turn
        # requests let out whose task has not yet resumed (and dispatched them): no release until they have, or it
        # would decide the next against a load without them and send every waiting request into one's room
        self._sending: set[str] = set()
        self._priorities: set[int] = set()  # every priority ever held (configured objectives': a bounded set)
        self.closed = False  # shutting down (``close``): a request that would wait is shed instead
        if self.queue is not None:
            core.add_release_listener(self._capacity_moved)
            core.state.held_requests = self.queue.__len__  # they wait behind a choice's prefill (cost.py)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def waiting_by_priority(self) -> dict[int, int]:
        """How many requests wait in the queue, per priority: every priority that has ever waited, 0 where none
        waits now (so a gauge per priority falls back to 0 rather than keeping its last value). Priorities come
        from the configured objectives only, so the set is bounded. Empty with flow control off."""
        q = self.queue
        if q is None:
            return {}
        depth = q.waiting_by_priority()
        return {p: depth.get(p, 0) for p in sorted(self._priorities)}

    async def admit(self, request: RouteRequest, decision: Decision, decide: Decide,
                    tenant: str | None = None, cost_tokens: int | None = None) -> Decision:
        """The decision to send ``request`` by: ``decision`` itself, a later one from ``decide(now)`` once the
        fleet has room, or ``shed``. ``cost_tokens``: what deficit round robin charges its flow (default: its
        prompt and output tokens; a batch admitted as one, all of its prompts'). Cancelled (the client left):
        the request leaves the queue."""
        q = self.queue
        if q is None or decision.outcome != "routed":
            return decision
        objective = request.objective
        ruling = rule(self.params, objective, decision, 0.0)
        if ruling.action == "shed":
            return _shed(decision.policy, f"shed: {ruling.reason}", 1.0)
        if not q.must_wait(ruling, objective.priority):
            return decision
        if self.closed:  # the router is draining: nothing waits for a fleet it will not dispatch to much longer
            return _shed(decision.policy, "shed: the router is shutting down", 1.0)
        now = self.clock()
        cost = request.prompt_tokens + request.max_tokens if cost_tokens is None else cost_tokens
        item = Queued(request.request_id, now, cost, objective, tenant, (request, decide))
        if not q.push(item, ruling.eligible):
            return _shed(decision.policy, f"the router's queue is full ({self.params.max_queued} waiting)", 1.0)
        self._priorities.add(objective.priority)
        waiter: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()
        self._waiters[request.request_id] = waiter
        self._arm()
        try:
            return await waiter
        finally:
            q.remove(request.request_id)  # (a no-op once it left by being answered)
            self._waiters.pop(request.request_id, None)
            if not q:  # the last one left: nothing to look at again
                self._disarm()
            if request.request_id in self._sending:  # (its caller dispatches it before its next await)
                self._sending.discard(request.request_id)
                self._soon()

    def _judge(self, item: Queued, now: float) -> Ruling:
        request, decide = item.payload
        return rule(self.params, request.objective, decide(now), now - item.arrived_at)

    def _fleet(self) -> frozenset[str]:
        """The workers a request could be sent to now (a release stops looking once held requests wait for all)."""
        return frozenset(w for w, ep in self.core.endpoints.items() if ep.healthy and not ep.draining)

    def _capacity_moved(self) -> None:
        self._soon()

    def _soon(self) -> None:
        """A release on the loop's next turn (one, however many events ask for it meanwhile)."""
        if self.queue and self._again is None and not self.closed:
            self._again = asyncio.get_running_loop().call_soon(self.release)

    def release(self) -> None:
        """Answer what has expired, then what the queue lets out (``FlowQueue.next_out``): at most one request
        sent a call (the next call comes once its task has dispatched it) and at most ``MAX_OUT`` shed or
        refused."""
        q = self.queue
        if q is None:
            return
        self._again = None
        now = self.clock()
        for item in q.expire(now):
            waited = now - item.arrived_at
            why = ("it can no longer meet its TTFT target" if item.left == "unreachable"
                   else f"it waited {waited:.1f} s for the saturated fleet")
            self._answer(item, _shed(self.core.policy_name, f"shed: {why}", 1.0))
        if self._sending:  # one let out has not been dispatched yet: its task's resumption looks again
            self._arm()
            return
        fleet = self._fleet()
        again = True  # (answered MAX_OUT: the rest on the next turn)
        for _ in range(MAX_OUT):
            out = q.next_out(lambda held: self._judge(held, now), fleet)
            if out is None:
                again = False
                break
            item, ruling = out
            if ruling.action == "shed":
                self._answer(item, _shed(ruling.decision.policy, f"shed: {ruling.reason}", 1.0))
                continue
            answered = self._answer(item, ruling.decision)  # sent (or the decision's own refusal)
            if ruling.action == "send" and answered:
                self._sending.add(item.request_id)
                again = False  # its task looks again once it has dispatched it
                break
        if again:
            self._soon()
        self._arm()

    def _answer(self, item: Queued, decision: Decision) -> bool:
        """Give a waiting request its decision; False if its client has gone already."""
        waiter = self._waiters.get(item.request_id)
        if waiter is None or waiter.done():
            return False
        waiter.set_result(decision)
        return True

    def _arm(self) -> None:
        """While anything waits, look again in ``POLL_S`` or at the next deadline, whichever is first."""
        q = self.queue
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not q:
            return
        delay = POLL_S
        deadline = q.next_deadline()
        if deadline is not None:
            delay = max(0.0, min(delay, deadline - self.clock()))
        self._timer = asyncio.get_running_loop().call_later(delay, self.release)

    def _disarm(self) -> None:
        for handle in (self._timer, self._again):
            if handle is not None:
                handle.cancel()
        self._timer = self._again = None

    def close(self) -> None:
        """Shutting down: every waiting request is answered ``shed``, and so is any that would wait after it."""
        self.closed = True
        self._disarm()
        if self.queue is not None:
            for item in self.queue.take_all():
                self._answer(item, _shed(self.core.policy_name, "shed: the router is shutting down", 1.0))


__all__ = ["POLL_S", "FlowGate"]
