"""The router's own view of each worker's load. Pure: callers pass ``now``.

Updated on dispatch, first token and completion. Prefill work not yet done (uncached prompt tokens of
requests that have no first token yet) is what makes a new request wait; decodes in flight slow every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class InFlight:
    worker_id: str
    prompt_tokens: int
    uncached_tokens: int  # the router's estimate of prefill work at dispatch
    max_tokens: int
    dispatched_at: float
    predicted_ttft_s: float | None = None
    first_token_at: float | None = None


@dataclass(slots=True)
class WorkerLoad:
    requests: int = 0
    prompt_tokens: int = 0
    pending_prefill_tokens: int = 0  # uncached tokens of requests still waiting for their first token
    decoding: int = 0  # requests past their first token
    dispatched_total: int = 0
    last_dispatch_at: float | None = None


@dataclass
class LoadTracker:
    workers: dict[str, WorkerLoad] = field(default_factory=dict)
    inflight: dict[str, InFlight] = field(default_factory=dict)

    def load(self, worker_id: str) -> WorkerLoad:
        w = self.workers.get(worker_id)
        if w is None:
            w = self.workers[worker_id] = WorkerLoad()
        return w

    def dispatch(self, request_id: str, worker_id: str, prompt_tokens: int, uncached_tokens: int,
                 max_tokens: int, now: float, predicted_ttft_s: float | None = None) -> None:
        if request_id in self.inflight:
            self.complete(request_id, now)  # a retry on another worker replaces the first attempt
        self.inflight[request_id] = InFlight(worker_id, prompt_tokens, uncached_tokens, max_tokens, now,
                                             predicted_ttft_s)
        w = self.load(worker_id)
        w.requests += 1
        w.prompt_tokens += prompt_tokens
        w.pending_prefill_tokens += uncached_tokens
        w.dispatched_total += 1
        w.last_dispatch_at = now

    def first_token(self, request_id: str, now: float) -> InFlight | None:
        r = self.inflight.get(request_id)
        if r is None or r.first_token_at is not None:
            return None
        r.first_token_at = now
        w = self.load(r.worker_id)
        w.pending_prefill_tokens -= r.uncached_tokens
        w.decoding += 1
        return r

    def complete(self, request_id: str, now: float) -> InFlight | None:
        r = self.inflight.pop(request_id, None)
        if r is None:
            return None
        w = self.load(r.worker_id)
        w.requests -= 1
        w.prompt_tokens -= r.prompt_tokens
        if r.first_token_at is None:
            w.pending_prefill_tokens -= r.uncached_tokens
        else:
            w.decoding -= 1
        return r

    def forget_worker(self, worker_id: str) -> None:
        for rid in [rid for rid, r in self.inflight.items() if r.worker_id == worker_id]:
            del self.inflight[rid]
        self.workers.pop(worker_id, None)
