"""``approx-prefix``: SGLang-style cache-aware routing from a tree of previously routed prefixes (no engine
events). If load is imbalanced (max - min > ``balance_abs`` and max > ``balance_rel`` x min in flight) every
candidate scores its load; else the candidate that was sent more than ``match_threshold`` of this prompt's
blocks before scores below every load (it goes first), the rest by load."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.index import KvIndex, Medium
from router.scheduling.plugins.base import Scorer, Undo
from router.scheduling.snapshot import Candidate, Snapshot
from router.scheduling.types import RouteRequest

CHOSEN = -1.0  # below any load


@dataclass(frozen=True)
class ApproxPrefixParams:
    balance_abs: float = 32
    balance_rel: float = 1.1
    match_threshold: float = 0.5
    capacity_blocks: int = 2_000_000  # the tree's bound (oldest routed prefixes go first)


class ApproxPrefix(Scorer):
    type_name = "approx-prefix"
    Params = ApproxPrefixParams

    def __init__(self, params: ApproxPrefixParams | None = None, **kw) -> None:  # type: ignore[no-untyped-def]
        super().__init__(params, **kw)
        self.tree = KvIndex(capacity=self.params.capacity_blocks)

    def score(self, snap: Snapshot, cands: Sequence[Candidate]) -> list[float]:
        p, keys = self.params, snap.request.keys
        loads = [c.busy for c in cands]
        if max(loads) - min(loads) > p.balance_abs and max(loads) > p.balance_rel * min(loads):
            return loads
        if keys:
            matched = self.tree.match(keys)
            ids = {c.worker_id for c in cands}
            best = max(((m.gpu, w) for w, m in matched.items() if w in ids), default=None)
            if best and best[0] / len(keys) > p.match_threshold:
                return [CHOSEN if c.worker_id == best[1] else load for c, load in zip(cands, loads, strict=True)]
        return loads

    def on_dispatch(self, req: RouteRequest, worker_id: str, now: float) -> Undo | None:
        if not req.keys:
            return None
        self.tree.store(worker_id, req.keys, req.keys, Medium.GPU)
        return lambda: self.tree.remove(worker_id, req.keys, Medium.GPU)  # refcounted: the prior state again
