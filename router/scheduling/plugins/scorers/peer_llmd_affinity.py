"""``llmd-prefix-affinity``: llm-d's ``prefix-cache-affinity-filter`` ("sticky until saturated"), as a gate.

Described in llm-d/llm-d-router ``pkg/epp/framework/plugins/scheduling/filter/prefixcacheaffinity`` (README and
``plugin.go``): a pod is sticky when its prefix-cache score (matched blocks / the prompt's blocks) is at least
``affinityThreshold`` (0.80). No sticky pod: all are kept. Otherwise only the sticky ones are kept, unless the best
(lowest) estimated TTFT among them exceeds the best among the others by more than ``maxTTFTPenaltyMs`` (18,000 ms), in
which case all are kept again. Estimated TTFT (ms) = in-flight tokens / ``peakPrefillThroughput`` (15,928 tok/s,
calibrated on Qwen 32B, 2x H100 TP=2) x 1000, the in-flight tokens being the uncached prompt tokens of requests
without a first token yet (its ``inflight-load-producer``; here ``WorkerLoad.pending_prefill_tokens``).
``explorationProbability`` (default 0: never) skips the gate with that probability, drawn from the profile's rng.

Our filters judge one candidate at a time and cannot see which others the earlier filters dropped, while this gate
compares the candidates that are left; so it is a scorer: it costs 0 for a pod the gate keeps and ``dropped_cost``
(far above the token-load scorer's range of [0, 1]) for one it drops. With ``min-score`` the choice is the one llm-d's
filter followed by its scorer would make; the dropped pods stay in the ranking as the last fallbacks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.scheduling.plugins.base import Scorer
from router.scheduling.snapshot import Candidate, Snapshot


@dataclass(frozen=True)
class LlmdAffinityParams:
    affinity_threshold: float = 0.80
    max_ttft_penalty_ms: float = 18_000.0  # 0: always stick
    peak_prefill_throughput: float = 15_928.0  # tokens per second
    exploration_probability: float = 0.0
    dropped_cost: float = 1000.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.affinity_threshold <= 1.0:
            raise ValueError(f"affinity_threshold must be in [0, 1], got {self.affinity_threshold}")
        if not 0.0 <= self.exploration_probability <= 1.0:
            raise ValueError(f"exploration_probability must be in [0, 1], got {self.exploration_probability}")
        if self.max_ttft_penalty_ms < 0 or self.peak_prefill_throughput <= 0:
            raise ValueError("max_ttft_penalty_ms must be >= 0 and peak_prefill_throughput > 0")


class LlmdPrefixAffinity(Scorer):
    type_name = "llmd-prefix-affinity"
    Params = LlmdAffinityParams
    uses_prefix = True

    def ttft_ms(self, cand: Candidate) -> float:
        tokens = cand.load.pending_prefill_tokens if cand.load else 0
        return tokens / self.params.peak_prefill_throughput * 1000.0

    def kept(self, snap: Snapshot, cands: Sequence[Candidate]) -> list[bool]:
        """Which candidates llm-d's filter would pass on."""
        p, total = self.params, len(snap.request.keys)
        everyone = [True] * len(cands)
        if len(cands) <= 1 or p.affinity_threshold <= 0 or not total:
            return everyone
        if p.exploration_probability > 0 and self.rng.random() < p.exploration_probability:
            return everyone
        sticky = []
        for c in cands:
            m = snap.prefix(c)
            sticky.append((m.total if m else 0) / total >= p.affinity_threshold)
        if not any(sticky):
            return everyone
        if p.max_ttft_penalty_ms > 0 and not all(sticky):
            best_sticky = min(self.ttft_ms(c) for c, s in zip(cands, sticky, strict=True) if s)
            best_other = min(self.ttft_ms(c) for c, s in zip(cands, sticky, strict=True) if not s)
            if best_sticky - best_other > p.max_ttft_penalty_ms:
                return everyone  # the sticky pods are saturated: stickiness is broken
        return sticky

    def score(self, snap: Snapshot, cands: Sequence[Candidate]) -> list[float]:
        drop = self.params.dropped_cost
        return [0.0 if k else drop for k in self.kept(snap, cands)]
