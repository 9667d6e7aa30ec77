"""``load``: requests in flight (the router's count, or the engine's when higher: other routers feed it too)."""

from __future__ import annotations

from collections.abc import Sequence

from router.scheduling.plugins.base import Scorer
from router.scheduling.snapshot import Candidate, Snapshot


class Load(Scorer):
    type_name = "load"

    def score(self, snap: Snapshot, cands: Sequence[Candidate]) -> list[float]:
        return [c.busy for c in cands]
