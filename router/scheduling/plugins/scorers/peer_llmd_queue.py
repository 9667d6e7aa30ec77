"""``llmd-queue``: llm-d's ``queue-scorer``, as a cost.

Described in llm-d/llm-d-router ``pkg/epp/framework/plugins/scheduling/scorer/queuedepth/queue.go``: each pod's
waiting-queue size (the engine's ``num_requests_waiting``), min-max normalised across the pods that have metrics: the
shortest queue scores 1, the longest 0, all equal score 1; a pod without metrics is left unscored (adds 0 to llm-d's
weighted sum). As a cost: ``1 - score`` (the shortest queue costs 0, the longest 1, a pod without fresh metrics 1).
"""

from __future__ import annotations

from collections.abc import Sequence

from router.scheduling.plugins.base import Scorer
from router.scheduling.snapshot import Candidate, Snapshot


class LlmdQueue(Scorer):
    type_name = "llmd-queue"

    def score(self, snap: Snapshot, cands: Sequence[Candidate]) -> list[float]:
        waiting = [c.metrics.waiting if c.metrics is not None and c.metrics.waiting is not None else None
                   for c in cands]
        known = [w for w in waiting if w is not None]
        if not known:
            return [1.0] * len(cands)
        lo, hi = min(known), max(known)
        out = []
        for w in waiting:
            if w is None:
                out.append(1.0)
            elif hi == lo:
                out.append(0.0)
            else:
                out.append(1.0 - (hi - w) / (hi - lo))
        return out
