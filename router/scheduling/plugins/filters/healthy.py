"""``healthy``: a worker its health probes (or requests) found failing is not a candidate."""

from __future__ import annotations

import numpy as np

from router.scheduling.plugins.base import Filter
from router.scheduling.snapshot import Candidate, Snapshot


class Healthy(Filter):
    type_name = "healthy"

    def filter(self, snap: Snapshot, cand: Candidate) -> str | None:
        return None if cand.endpoint.healthy else "unhealthy"

    def mask(self, snap: Snapshot) -> np.ndarray:
        return snap.cols.healthy

    def reason(self, snap: Snapshot, slot: int) -> str:
        return "unhealthy"
