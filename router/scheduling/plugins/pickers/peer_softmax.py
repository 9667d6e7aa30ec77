"""``softmax``: NVIDIA Dynamo's worker sampling over costs (lower is better).

Described in ai-dynamo/dynamo's KV router selector (``softmax_sample`` in ``lib/kv-router/src/scheduling/selector.rs``,
earlier ``lib/llm/src/kv_router/scheduler.rs``) and its ``--router-temperature`` option. ``temperature`` 0: the
lowest cost, equal costs (to 1e-9) in seeded random order (Dynamo picks at random among them). Above 0: one candidate
is drawn with probability proportional to ``exp(-(cost - min) / ((max - min) x temperature))``, i.e. Dynamo rescales
the costs to [0, 1] by their range before the softmax (all equal: uniform); ``normalize: false`` samples
``exp(-(cost - min) / temperature)`` on the raw costs instead. The draw uses the profile's seeded rng. The drawn
candidate comes first, the rest follow by cost (the fallbacks).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from router.scheduling.plugins.base import Picker
from router.scheduling.snapshot import Candidate, Snapshot


@dataclass(frozen=True)
class SoftmaxParams:
    temperature: float = 0.0
    normalize: bool = True  # Dynamo divides by the cost range first

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0 or math.isinf(self.temperature):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")


def softmax_probabilities(scores: Sequence[float], temperature: float, normalize: bool = True) -> list[float]:
    """Each candidate's probability of being drawn (temperature > 0)."""
    lo, hi = min(scores), max(scores)
    if hi == lo:
        return [1.0 / len(scores)] * len(scores)
    scale = (hi - lo) * temperature if normalize else temperature
    weights = [math.exp(-(s - lo) / scale) for s in scores]
    total = sum(weights)
    return [w / total for w in weights]


class Softmax(Picker):
    type_name = "softmax"
    Params = SoftmaxParams

    def pick(self, snap: Snapshot, cands: Sequence[Candidate], scores: Sequence[float]) -> list[str]:
        rng = self.rng
        order = sorted(range(len(cands)), key=lambda i: (round(scores[i], 9), rng.random()))
        t = self.params.temperature
        if t > 0 and len(cands) > 1:
            probs = softmax_probabilities(scores, t, self.params.normalize)
            u, acc, drawn = rng.random(), 0.0, len(cands) - 1
            for i, pr in enumerate(probs):
                acc += pr
                if u <= acc:
                    drawn = i
                    break
            order.remove(drawn)
            order.insert(0, drawn)
        return [cands[i].worker_id for i in order]
