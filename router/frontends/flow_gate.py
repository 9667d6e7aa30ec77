"""Flow control on the event loop: the proxy's and the picker's one adapter over the pure queue
(router/scheduling/flow.py) that the simulator drives too.

A front end decides a request as always, then asks ``admit``: while the fleet is not saturated (and nobody of
the request's priority or higher waits) the decision stands at once; otherwise the request waits here, and
``admit`` returns the decision it is sent on once the fleet has room (decided again then: the fleet has moved),
or a ``shed`` decision (a 429 with Retry-After) when its deadline passes or the queue is full. A caller whose
client goes away is cancelled in ``admit``, and the request leaves the queue at once.

The queue is looked at again whenever a request ends or gives its first token (``RoutingCore``'s release
listeners: capacity moved) and, while anything waits, every ``POLL_S`` (work this router does not see: another
router's requests on the same engines) and at the next deadline.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from router.scheduling.core import RoutingCore
from router.scheduling.flow import FlowParams, FlowQueue, Queued, saturated
from router.scheduling.types import Decision, RouteRequest

POLL_S = 0.02  # while requests wait: how often the queue is looked at without an event (an engine step's order)

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
        if self.queue is not None:
            core.add_release_listener(self._capacity_moved)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def admit(self, request: RouteRequest, decision: Decision, decide: Decide,
                    tenant: str | None = None) -> Decision:
        """The decision to send ``request`` by: ``decision`` itself, a later one from ``decide(now)`` once the
        fleet has room, or ``shed``. Cancelled (the client left): the request leaves the queue."""
        q = self.queue
        if q is None or decision.outcome != "routed":
            return decision
        objective = request.objective
        if not q.waiting_at_or_above(objective.priority) and not self._saturated(request, decision):
            return decision
        now = self.clock()
        item = Queued(request.request_id, now, request.prompt_tokens + request.max_tokens, objective, tenant,
                      (request, decide))
        if not q.push(item):
            return _shed(decision.policy, f"the router's queue is full ({self.params.max_queued} waiting)", 1.0)
        waiter: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()
        self._waiters[request.request_id] = waiter
        self._arm()
        try:
            return await waiter
        finally:
            q.remove(request.request_id)  # (a no-op once it left by being answered)
            self._waiters.pop(request.request_id, None)
            if not q and self._timer is not None:  # the last one left: nothing to look at again
                self._timer.cancel()
                self._timer = None

    def _saturated(self, request: RouteRequest, decision: Decision) -> bool:
        chosen = decision.report(decision.chosen) if decision.chosen is not None else None
        return chosen is not None and saturated(self.params, request.objective, chosen.queue_s, chosen.ttft_s)

    def _capacity_moved(self) -> None:
        if self.queue:
            asyncio.get_running_loop().call_soon(self.release)

    def release(self) -> None:
        """Answer what has expired, then send waiting requests, the next first, while the fleet has room."""
        q = self.queue
        if q is None:
            return
        now = self.clock()
        for item in q.expire(now):
            waited = now - item.arrived_at
            why = ("it can no longer meet its TTFT target" if item.left == "unreachable"
                   else f"it waited {waited:.1f} s for the saturated fleet")
            self._answer(item, _shed(self.core.policy_name, f"shed: {why}", 1.0))
        while (item := q.head()) is not None:
            request, decide = item.payload
            decision = decide(now)
            if decision.outcome != "routed":
                q.remove(item.request_id)
                self._answer(item, decision)
                continue
            if self._saturated(request, decision):
                break
            q.pop(item)
            self._answer(item, decision)
        self._arm()

    def _answer(self, item: Queued, decision: Decision) -> None:
        waiter = self._waiters.get(item.request_id)
        if waiter is not None and not waiter.done():
            waiter.set_result(decision)

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

    def close(self) -> None:
        """Shutting down: every waiting request is answered ``shed``."""
        if self._timer is not None:
            self._timer.cancel()
        if self.queue is not None:
            for item in self.queue.take_all():
                self._answer(item, _shed(self.core.policy_name, "shed: the router is shutting down", 1.0))


__all__ = ["POLL_S", "FlowGate"]
