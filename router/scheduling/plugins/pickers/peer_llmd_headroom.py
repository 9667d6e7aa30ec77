"""``llmd-headroom``: llm-d's SLO-aware selection (its ``latency-scorer`` / SLO-aware router, predicted-latency
routing), on the candidates' predicted TTFT and TPOT: in the ``llmd_predicted`` profile llm-d's own kind of
predictors, learned online (``llmd-latency-predictor``), the latency scorer's until they have learned.

llm-d's rule, as its docs and code describe it (``headroomSelectionStrategy``, the headroom weights):
- without targets, the lowest predicted latency (``ttft_weight`` x TTFT + ``tpot_weight`` x TPOT);
- with targets, each candidate's headroom is target minus prediction, TTFT and TPOT; candidates with both
  headrooms >= 0 are "positive". From the positive ones, ``least`` (llm-d's default: bin-packing) takes the one
  closest to the boundary (the smallest blended headroom), ``most`` the one furthest from it; with probability
  ``epsilon_negative`` it draws from the negative ones instead (llm-d's ``EpsilonExploreNeg``);
- none positive: a request of negative priority is shed; any other goes to the smallest blended deficit.

Left out, and said: llm-d's prefix-affinity gate with its epsilon-greedy exploration (the ``llmd_predicted``
profile's predictions already credit the prefix each worker holds), and llm-d's ``sloBufferFactor`` (1.0, its
default, is the same as none; its predictors' p90 is the learned predictor's ``quantile``). The rest of the
ranking follows by blended predicted latency, for the fallbacks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.scheduling.plugins.base import Picker, Unservable
from router.scheduling.snapshot import Candidate, Snapshot


@dataclass(frozen=True)
class LlmdHeadroomParams:
    ttft_weight: float = 0.8  # llm-d's headroomTTFTWeight / negHeadroomTTFTWeight
    tpot_weight: float = 0.2  # llm-d's headroomTPOTWeight / negHeadroomTPOTWeight
    strategy: str = "least"  # llm-d's headroomSelectionStrategy: least | most
    epsilon_negative: float = 0.01  # llm-d's EpsilonExploreNeg: a draw from the negative ones though positive exist

    def __post_init__(self) -> None:
        if self.strategy not in ("least", "most"):
            raise ValueError(f"strategy must be least or most, not {self.strategy!r}")
        if self.ttft_weight < 0 or self.tpot_weight < 0 or not 0.0 <= self.epsilon_negative <= 1.0:
            raise ValueError("weights must be >= 0 and epsilon_negative in [0, 1]")


class LlmdHeadroom(Picker):
    type_name = "llmd-headroom"
    Params = LlmdHeadroomParams

    def pick(self, snap: Snapshot, cands: Sequence[Candidate], scores: Sequence[float]) -> list[str]:
        p = self.params
        objective = snap.request.objective
        latency = {c.worker_id: p.ttft_weight * c.ttft_s + p.tpot_weight * c.step_s for c in cands}
        by_latency = sorted(cands, key=lambda c: (round(latency[c.worker_id], 9), c.worker_id))
        if not objective.has_targets:
            return [c.worker_id for c in by_latency]
        positive, negative = [], []
        for c in cands:
            ttft_room = objective.ttft_s - c.ttft_s if objective.ttft_s is not None else 0.0
            tpot_room = objective.tpot_s - c.step_s if objective.tpot_s is not None else 0.0
            blended = p.ttft_weight * ttft_room + p.tpot_weight * tpot_room
            (positive if ttft_room >= 0 and tpot_room >= 0 else negative).append((blended, c.worker_id))
        if not positive and objective.sheddable:
            raise Unservable("no endpoint has headroom for its objective (llm-d sheds a negative priority)")
        if positive and (not negative or self.rng.random() >= p.epsilon_negative):
            key = (lambda h: (round(h[0], 9), h[1])) if p.strategy == "least" else (lambda h: (-round(h[0], 9), h[1]))
            first = min(positive, key=key)[1]
        else:  # the smallest deficit: the largest (least negative) blended headroom
            first = min(negative, key=lambda h: (-round(h[0], 9), h[1]))[1]
        return [first, *(c.worker_id for c in by_latency if c.worker_id != first)]
