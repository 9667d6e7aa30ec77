"""``meets-objective``: routing to a request's service objective (router/scheduling/slo.py) on the latency
scorer's own predictions, and ``min-score`` exactly for a request without targets.

A request with TTFT/TPOT targets is placed by three rules, in this order:
1. among the candidates predicted to meet both targets with ``margin`` to spare (the predictions are each
   worker's fitted TTFT and decode step, so a slower worker is judged as slow as it is), the one that costs
   *the others* least: the decode stalls and slowdown its prefill and KV bring to the requests already there, and
   the re-prefill of what it evicts. Its own latency is already good enough; what it takes from the rest of the
   fleet is what decides how many of *them* still meet theirs (goodput);
2. if none is predicted to meet them and the request is sheddable (GIE priority < 0), it is refused
   (``Unservable``: the decision is ``shed``, a 429 with Retry-After) rather than sent to miss its objective and
   slow everyone else down;
3. otherwise the least violation: the smallest ratio of prediction to target over its two targets.

Predictions come from the profile's latency scorer (``latency-cost``). Under a profile without one, every
candidate's prediction is zero and this picker ranks as ``min-score`` does: the peers' profiles ignore targets,
as the peers do.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from router.scheduling.plugins.base import Unservable
from router.scheduling.plugins.pickers.min_score import MinScore
from router.scheduling.slo import ServiceObjective
from router.scheduling.snapshot import Candidate, Snapshot


@dataclass(frozen=True)
class MeetsObjectiveParams:
    # a candidate meets a target only if predicted within (1 - margin) of it: the predictions' own error (the
    # fits' residuals are a few percent on a steady engine, more while load moves) must not turn a predicted
    # hit into a miss
    margin: float = 0.1

    def __post_init__(self) -> None:
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"margin must be in [0, 1), got {self.margin}")


class MeetsObjective(MinScore):
    type_name = "meets-objective"
    Params = MeetsObjectiveParams

    def pick(self, snap: Snapshot, cands: Sequence[Candidate], scores: Sequence[float]) -> list[str]:
        objective = snap.request.objective
        if not objective.has_targets or not _predicted(cands):
            return super().pick(snap, cands, scores)
        return self._to_objective(objective, list(cands), list(scores))

    def rank(self, snap: Snapshot, slots: np.ndarray, scores: Sequence[float]) -> Sequence[str]:
        objective = snap.request.objective
        if not objective.has_targets:
            return super().rank(snap, slots, scores)
        cands = snap.candidates_at(slots)
        if not _predicted(cands):
            return super().rank(snap, slots, scores)
        return self._to_objective(objective, cands, list(scores))

    def _to_objective(self, objective: ServiceObjective, cands: list[Candidate], scores: list[float]) -> list[str]:
        keep = 1.0 - self.params.margin
        rng = self.rng
        meeting, missing = [], []
        for c, score in zip(cands, scores, strict=True):
            ratio = violation(objective, c.ttft_s, c.step_s)
            if ratio <= keep:
                meeting.append((round(c.interference_s + c.eviction_s, 9), round(score, 9), rng.random(), c))
            else:
                missing.append((round(ratio, 9), round(score, 9), rng.random(), c))
        if not meeting and objective.sheddable:
            best = min(missing, key=lambda m: m[:3])[3]
            raise Unservable(f"no worker meets its objective: best predicted TTFT {best.ttft_s * 1e3:.0f} ms, "
                             f"TPOT {best.step_s * 1e3:.1f} ms on {best.worker_id}{targets_text(objective)}")
        meeting.sort(key=lambda m: m[:3])
        missing.sort(key=lambda m: m[:3])
        return [m[3].worker_id for m in (*meeting, *missing)]


def violation(objective: ServiceObjective, ttft_s: float, tpot_s: float) -> float:
    """The larger of prediction / target over the objective's targets (<= 1: predicted to meet both). Safe for
    any target: one so small that the quotient overflows is infinitely violated, a zero target (no header or
    config can give one, but a ServiceObjective can be built so) violated by any positive prediction."""
    ratio = 0.0
    if objective.ttft_s is not None:
        ratio = _over(ttft_s, objective.ttft_s)
    if objective.tpot_s is not None:
        ratio = max(ratio, _over(tpot_s, objective.tpot_s))
    return ratio


def _over(predicted: float, target: float) -> float:
    if predicted <= 0.0:
        return 0.0
    return predicted / target if target > 0.0 else math.inf


def _predicted(cands: Sequence[Candidate]) -> bool:
    """Whether the profile's scorers predicted latencies (the latency scorer sets every candidate's TTFT)."""
    return any(c.ttft_s > 0 or c.step_s > 0 for c in cands)


def targets_text(objective: ServiceObjective) -> str:
    """`` (targets TTFT 300 ms, TPOT 50 ms, priority 1)``: for decision reasons."""
    parts = []
    if objective.ttft_s is not None:
        parts.append(f"TTFT {objective.ttft_s * 1e3:.6g} ms")
    if objective.tpot_s is not None:
        parts.append(f"TPOT {objective.tpot_s * 1e3:.6g} ms")
    return f" (targets {', '.join(parts)}, priority {objective.priority})"
