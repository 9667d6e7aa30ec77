"""``min-score``: lowest total cost first; equal totals (to 1e-9) in seeded random order, so identical
workers share the load."""

from __future__ import annotations

from collections.abc import Sequence

from router.scheduling.plugins.base import Picker
from router.scheduling.snapshot import Candidate, Snapshot


class MinScore(Picker):
    type_name = "min-score"

    def pick(self, snap: Snapshot, cands: Sequence[Candidate], scores: Sequence[float]) -> list[str]:
        rng = self.rng
        order = sorted(zip(cands, scores, strict=True), key=lambda cs: (round(cs[1], 9), rng.random()))
        return [c.worker_id for c, _ in order]
