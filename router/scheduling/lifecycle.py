"""One request lifecycle for every front end: the proxy, the endpoint picker and the simulator all drive a
``Dispatch`` handle from the routing core, so the bookkeeping cannot drift between them.

``dispatch`` records the choice (in-flight accounting, the staleness clock, speculative prefixes, the
profile's post-dispatch hooks); ``reassign`` moves it to another worker (a retry, or Envoy falling back to
the next endpoint) and takes back what the abandoned choice recorded; ``first_token`` learns the engine's
real TTFT; ``complete`` and ``fail`` end it. Pure: callers pass ``now``.
"""

from __future__ import annotations

from collections.abc import Callable

from router.load import InFlight
from router.scheduling.plugins.base import Plugin
from router.scheduling.state import FleetState
from router.scheduling.types import CandidateReport, Decision, RouteRequest, hit_tokens

Undo = Callable[[], None]


class Dispatch:
    def __init__(self, state: FleetState, plugins: list[Plugin], req: RouteRequest, decision: Decision,
                 worker_id: str, now: float, on_end: Callable[[str], None]) -> None:
        self.state = state
        self.plugins = plugins
        self.request = req
        self.decision = decision
        self.worker_id = worker_id
        self.attempts = 0
        self.ended = False
        self.dispatched_at = now
        self.first_token_at: float | None = None  # when its first token came (or, not streamed, its answer)
        self._on_end = on_end
        self._undo: list[Undo] = []
        self._record(worker_id, now)

    # ---- what the router expects here --------------------------------------------------------------
    @property
    def report(self) -> CandidateReport | None:
        return self.decision.report(self.worker_id)

    @property
    def expected_hit_tokens(self) -> int:
        """Prompt tokens the router expects cached on the worker serving it (0 where it did not look)."""
        r = self.report
        return hit_tokens(r.matched_blocks, self.request.block_size, self.request.prompt_tokens) if r else 0

    # ---- transitions ---------------------------------------------------------------------------------
    def reassign(self, worker_id: str, now: float) -> None:
        """Serve it on ``worker_id`` instead: what the abandoned choice recorded is taken back, the in-flight
        accounting moves."""
        if self.ended or worker_id == self.worker_id:
            return
        self._forget(now, published=False)
        self.worker_id = worker_id
        self._record(worker_id, now, reassigned=True)

    def first_token(self, now: float, learn: bool = True) -> None:
        """``learn``: fit this TTFT into the worker's engine profile (only when the first token was seen as such)."""
        if self.first_token_at is None:
            self.first_token_at = now
        r = self.state.load.first_token(self.request.request_id, now)
        shared = self.state.shared_load
        if r is not None and shared is not None:
            shared.local_first_token(self.request.request_id)
        if r is None or not learn:
            return
        observed = now - r.dispatched_at
        report = self.report
        if report is not None:
            load = report.adapter_load_s
            if load > 0 and self.request.lora and report.model_ttft_s > 0 and self.state.cost.params.learn:
                # nothing was queued ahead of it: what it waited beyond the rest of its TTFT was its adapter's load
                self.state.adapter_loads.observe(self.request.lora, observed - (report.ttft_s - load))
            # the worker's speed is learned on its prefill alone, not on the adapter's load
            self.state.cost.observe_ttft(r.worker_id, report.model_ttft_s, observed - load)
        for p in self.plugins:
            p.on_first_token(r.worker_id, r.predicted_ttft_s, observed, now)
            p.on_observed(self.request, r.worker_id, report, observed, None, now)

    def observed_cached(self, cached_tokens: int, now: float) -> None:
        """The worker's own count of the prompt tokens it found cached. Far fewer than the index promised (more
        than a block short) means the index is wrong for that worker (a restart no probe saw, an eviction the
        events have not told yet): its credit ends until its next batch shows its state."""
        if cached_tokens + self.request.block_size < self.expected_hit_tokens:
            self.state.worker_failed(self.worker_id, now)

    def complete(self, now: float, served: bool = True, output_tokens: int | None = None) -> None:
        """Answered. ``served``: the worker computed it (a 2xx, or a stream cut part way), so what was recorded
        stays true; a refusal (4xx/5xx) computed nothing: as ``fail``, the records are taken back.
        ``output_tokens``: how many it generated, when known: the inter-token time is fitted into the worker's
        engine profile."""
        if self.ended:
            return
        if not served:
            self.fail(now)
            return
        r = self.state.load.complete(self.request.request_id, now)
        if self.state.shared_load is not None:
            self.state.shared_load.local_ended(self.request.request_id)
        report = self.report
        if (r is not None and r.first_token_at is not None and output_tokens and output_tokens > 1
                and report is not None):
            step = (now - r.first_token_at) / (output_tokens - 1)
            self.state.cost.observe_step(r.worker_id, report.model_step_s, step)
            for p in self.plugins:
                p.on_observed(self.request, r.worker_id, report, None, step, now)
        self._end()

    def fail(self, now: float) -> None:
        """No worker served it: the accounting ends and what the choice recorded is taken back."""
        if self.ended:
            return
        self._forget(now)
        self._end()

    # ---- internals -----------------------------------------------------------------------------------
    def _record(self, worker_id: str, now: float, reassigned: bool = False) -> None:
        req, state = self.request, self.state
        self.attempts += 1
        if self.attempts == 1:
            state.reuse.requested(req.keys)  # asked again for blocks the fleet evicted: what evicting costs
        report = self.report
        if report is not None:
            matched = report.matched_blocks
            uncached = req.prompt_tokens - hit_tokens(matched, req.block_size, req.prompt_tokens)
            predicted = report.ttft_s or None
        else:
            matched, uncached, predicted = 0, req.prompt_tokens, None
        state.load.dispatch(req.request_id, worker_id, req.prompt_tokens, uncached, req.max_tokens, now, predicted,
                            req.keys, req.block_size)
        state.loras.dispatched(worker_id, req.request_id, req.lora)
        if state.shared_load is not None:  # the other replicas (or processes) count it too
            r = state.load.inflight[req.request_id]
            (state.shared_load.local_reassigned if reassigned else state.shared_load.local_dispatched)(
                req.request_id, r)
        # only a prompt with a full block beyond what the worker is credited with owes events (an engine
        # publishes the whole blocks it computes): a worker serving short prompts, or prompts it holds, publishes
        # nothing and is not stale for it
        owes = req.prompt_tokens // req.block_size > matched
        recorded = (state.note_dispatch(worker_id, now) if owes else None,
                    state.speculative.record(worker_id, req.keys, now))
        self._undo = [u for u in recorded if u is not None]
        for p in self.plugins:
            u = p.on_dispatch(req, worker_id, now)
            if u is not None:
                self._undo.append(u)

    def _forget(self, now: float, published: bool = True) -> None:
        """``published``: tell the other replicas it ended (not when it moves: ``reassign`` tells them that)."""
        self.state.load.complete(self.request.request_id, now)
        if published and self.state.shared_load is not None:
            self.state.shared_load.local_ended(self.request.request_id)
        for undo in reversed(self._undo):
            undo()
        self._undo = []

    def _end(self) -> None:
        self.ended = True
        self.state.loras.ended(self.request.request_id)
        self._on_end(self.request.request_id)

    @property
    def inflight(self) -> InFlight | None:
        return self.state.load.inflight.get(self.request.request_id)
