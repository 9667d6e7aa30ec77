"""``llmd-token-load``: llm-d's ``token-load-scorer``, as a cost.

Described in llm-d/llm-d-router ``pkg/epp/framework/plugins/scheduling/scorer/tokenload`` (README and
``token_load.go``) with its ``inflight-load-producer`` (``requestcontrol/dataproducer/inflightload``): a pod's load is
the uncached prompt tokens in flight there (booked at dispatch, released at the first token: the router's
``WorkerLoad.pending_prefill_tokens``) plus this request's tokens the pod has not cached; score =
``1 - min(1, load / queueThresholdTokens)`` (default 4,194,304 = 128 requests of 32K). As a cost:
``min(1, load / queueThresholdTokens)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.scheduling.plugins.base import Scorer
from router.scheduling.snapshot import Candidate, Snapshot
from router.scheduling.types import hit_tokens


@dataclass(frozen=True)
class LlmdTokenLoadParams:
    queue_threshold_tokens: int = 4_194_304


class LlmdTokenLoad(Scorer):
    type_name = "llmd-token-load"
    Params = LlmdTokenLoadParams
    uses_prefix = True  # this request's uncached part is discounted by what the pod holds

    def score(self, snap: Snapshot, cands: Sequence[Candidate]) -> list[float]:
        req, limit = snap.request, float(max(self.params.queue_threshold_tokens, 1))
        out = []
        for c in cands:
            m = snap.prefix(c)
            own = req.prompt_tokens - hit_tokens(m.total if m else 0, req.block_size, req.prompt_tokens)
            tokens = (c.load.pending_prefill_tokens if c.load else 0) + own
            out.append(min(1.0, max(0.0, tokens / limit)))
        return out
