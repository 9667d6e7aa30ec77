"""``admission``: per-worker limits on requests and prompt tokens in flight; past them a worker is saturated
(every candidate saturated: the request is shed with 429 and Retry-After)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from router.scheduling.masks import all_slots
from router.scheduling.plugins.base import Filter
from router.scheduling.snapshot import Candidate, Snapshot

SATURATED = "saturated"


@dataclass(frozen=True)
class AdmissionParams:
    max_inflight_requests: int | None = 512
    max_inflight_tokens: int | None = None


class Admission(Filter):
    type_name = "admission"
    Params = AdmissionParams

    def filter(self, snap: Snapshot, cand: Candidate) -> str | None:
        load = cand.load
        if load is None:
            return None
        p = self.params
        if p.max_inflight_requests is not None and load.requests >= p.max_inflight_requests:
            return SATURATED
        tokens = load.prompt_tokens + snap.request.prompt_tokens
        if p.max_inflight_tokens is not None and tokens > p.max_inflight_tokens:
            return SATURATED if load.requests else None  # one oversized request alone is still admitted
        return None

    def mask(self, snap: Snapshot) -> np.ndarray:
        p, cols = self.params, snap.cols
        ok = all_slots(snap.size)
        if p.max_inflight_requests is not None:
            ok &= ~(cols.has_load & (cols.requests >= p.max_inflight_requests))
        if p.max_inflight_tokens is not None:
            busy = cols.has_load & (cols.requests > 0)
            ok &= ~(busy & (cols.prompt_tokens + snap.request.prompt_tokens > p.max_inflight_tokens))
        return ok

    def reason(self, snap: Snapshot, slot: int) -> str:
        return SATURATED
