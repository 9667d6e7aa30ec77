"""``healthy``: a worker its health probes (or requests) found failing is not a candidate."""

from __future__ import annotations

from operator import attrgetter

import numpy as np

from router.scheduling.plugins.base import Filter
from router.scheduling.snapshot import Candidate, Snapshot

_HEALTHY = attrgetter("healthy")


class Healthy(Filter):
    type_name = "healthy"

    def filter(self, snap: Snapshot, cand: Candidate) -> str | None:
        return None if cand.endpoint.healthy else "unhealthy"

    def mask(self, snap: Snapshot) -> np.ndarray:
        return np.fromiter(map(_HEALTHY, snap.endpoint_list), dtype=bool, count=snap.size)

    def reason(self, snap: Snapshot, slot: int) -> str:
        return "unhealthy"
