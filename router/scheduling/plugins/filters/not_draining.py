"""``not-draining``: a worker being drained (``/admin/drain``, a terminating pod) takes no new request."""

from __future__ import annotations

from operator import attrgetter

import numpy as np

from router.scheduling.plugins.base import Filter
from router.scheduling.snapshot import Candidate, Snapshot

_DRAINING = attrgetter("draining")


class NotDraining(Filter):
    type_name = "not-draining"

    def filter(self, snap: Snapshot, cand: Candidate) -> str | None:
        return "draining" if cand.endpoint.draining else None

    def mask(self, snap: Snapshot) -> np.ndarray:
        return ~np.fromiter(map(_DRAINING, snap.endpoint_list), dtype=bool, count=snap.size)

    def reason(self, snap: Snapshot, slot: int) -> str:
        return "draining"
