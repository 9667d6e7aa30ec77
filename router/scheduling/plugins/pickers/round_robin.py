"""``round-robin``: the candidates in worker-id order, starting one further each decision."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from router.scheduling.plugins.base import Picker
from router.scheduling.snapshot import Candidate, Snapshot


class RoundRobin(Picker):
    type_name = "round-robin"

    def __init__(self, *args, **kw) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kw)
        self.next = 0

    def pick(self, snap: Snapshot, cands: Sequence[Candidate], scores: Sequence[float]) -> list[str]:
        ids = sorted(c.worker_id for c in cands)
        start = self.next % len(ids)
        self.next += 1
        return ids[start:] + ids[:start]

    def rank(self, snap: Snapshot, slots: np.ndarray, scores: Sequence[float]) -> list[str]:
        ids = sorted(snap.ids[i] for i in slots.tolist())
        start = self.next % len(ids)
        self.next += 1
        return ids[start:] + ids[:start]
