"""``llmd-kv-utilization``: llm-d's ``kv-cache-utilization-scorer``, as a cost.

Described in llm-d/llm-d-router ``pkg/epp/framework/plugins/scheduling/scorer/kvcacheutilization``: score = 1 - the
engine's KV-cache usage (``vllm:kv_cache_usage_perc``); a pod without metrics is unscored (0 in llm-d's sum). As a
cost: ``1 - score`` = the usage itself, and 1 for a pod without fresh metrics.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.scheduling.plugins.base import Scorer
from router.scheduling.snapshot import Candidate, Snapshot


class LlmdKvUtilization(Scorer):
    type_name = "llmd-kv-utilization"

    def score(self, snap: Snapshot, cands: Sequence[Candidate]) -> list[float]:
        out = []
        for c in cands:
            usage = c.metrics.kv_usage if c.metrics is not None else None
            out.append(1.0 if usage is None else min(1.0, max(0.0, usage)))
        return out
