"""``not-draining``: a worker being drained (``/admin/drain``, a terminating pod) takes no new request."""

from __future__ import annotations

import numpy as np

from router.scheduling.plugins.base import Filter
from router.scheduling.snapshot import Candidate, Snapshot


class NotDraining(Filter):
    type_name = "not-draining"

    def filter(self, snap: Snapshot, cand: Candidate) -> str | None:
        return "draining" if cand.endpoint.draining else None

    def mask(self, snap: Snapshot) -> np.ndarray:
        return ~snap.cols.draining

    def reason(self, snap: Snapshot, slot: int) -> str:
        return "draining"
