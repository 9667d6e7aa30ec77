"""``in-subset``: the gateway's subset hint (``x-gateway-destination-endpoint-subset``) bounds the choice."""

from __future__ import annotations

from router.scheduling.plugins.base import Filter
from router.scheduling.snapshot import Candidate, Snapshot


class InSubset(Filter):
    type_name = "in-subset"

    def filter(self, snap: Snapshot, cand: Candidate) -> str | None:
        subset = snap.request.subset
        if subset is None or cand.worker_id in subset or cand.endpoint.address in subset:
            return None
        return "not in subset hint"
