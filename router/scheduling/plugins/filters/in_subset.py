"""``in-subset``: the gateway's subset hint (``x-gateway-destination-endpoint-subset``) bounds the choice."""

from __future__ import annotations

import numpy as np

from router.scheduling.masks import all_slots
from router.scheduling.plugins.base import Filter
from router.scheduling.snapshot import Candidate, Snapshot

NOT_IN_SUBSET = "not in subset hint"


class InSubset(Filter):
    type_name = "in-subset"

    def filter(self, snap: Snapshot, cand: Candidate) -> str | None:
        subset = snap.request.subset
        if subset is None or cand.worker_id in subset or cand.endpoint.address in subset:
            return None
        return NOT_IN_SUBSET

    def mask(self, snap: Snapshot) -> np.ndarray:
        subset = snap.request.subset
        if subset is None:
            return all_slots(snap.size)
        return np.fromiter((wid in subset or ep.address in subset for wid, ep in zip(snap.ids, snap.endpoint_list,
                                                                                    strict=True)),
                           dtype=bool, count=snap.size)

    def reason(self, snap: Snapshot, slot: int) -> str:
        return NOT_IN_SUBSET
