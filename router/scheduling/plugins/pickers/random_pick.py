"""``random``: a seeded shuffle; scores are not read."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from router.scheduling.plugins.base import Picker
from router.scheduling.snapshot import Candidate, Snapshot


class RandomPick(Picker):
    type_name = "random"

    def pick(self, snap: Snapshot, cands: Sequence[Candidate], scores: Sequence[float]) -> list[str]:
        ids = [c.worker_id for c in cands]
        self.rng.shuffle(ids)
        return ids

    def rank(self, snap: Snapshot, slots: np.ndarray, scores: Sequence[float]) -> list[str]:
        ids = [snap.ids[i] for i in slots.tolist()]
        self.rng.shuffle(ids)
        return ids
