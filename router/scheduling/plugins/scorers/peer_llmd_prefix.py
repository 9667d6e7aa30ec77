"""``llmd-precise-prefix``: llm-d's precise prefix-cache scorer, as a cost.

Described in llm-d/llm-d-router ``pkg/epp/framework/plugins/scheduling/scorer/preciseprefixcache`` (the score is
``score / totalBlocks`` clipped to [0, 1]) and llm-d-kv-cache's ``LongestPrefixScorer`` (``pkg/kvcache``): walk the
request's blocks from block 0 while the pod holds each one; every block adds the weight of the best tier holding it
(``DefaultKVCacheBackendConfig``: gpu 1.0, cpu 0.8, storage 0.3). The denominator is the prompt's full blocks.
llm-d scores are "higher is better" in [0, 1]; ours are costs, so this returns ``1 - score`` (a pod holding none of the
prompt costs 1, one holding all of it on GPU costs 0), and the weighted sum is ranked by ``min-score`` exactly as
llm-d's weighted sum is by ``max-score-picker``.

From the router's index: ``snap.prefix(c)`` splits the consecutive prefix by the cheapest tier holding it (GPU blocks,
then blocks extending it on CPU, then on storage), so a block past the GPU run counts 0.8 even when the GPU also
holds it (llm-d would count it 1.0): a gap in the GPU run is the only case where the two differ.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.scheduling.plugins.base import Scorer
from router.scheduling.snapshot import Candidate, Snapshot


@dataclass(frozen=True)
class LlmdPrefixParams:
    gpu_weight: float = 1.0
    cpu_weight: float = 0.8
    storage_weight: float = 0.3


class LlmdPrecisePrefix(Scorer):
    type_name = "llmd-precise-prefix"
    Params = LlmdPrefixParams
    uses_prefix = True

    def score(self, snap: Snapshot, cands: Sequence[Candidate]) -> list[float]:
        p, total = self.params, len(snap.request.keys)
        if not total:
            return [1.0] * len(cands)
        out = []
        for c in cands:
            m = snap.prefix(c)
            held = 0.0 if m is None else p.gpu_weight * m.gpu + p.cpu_weight * m.cpu + p.storage_weight * m.storage
            out.append(1.0 - min(1.0, max(0.0, held / total)))
        return out
