"""Routing policies as small plug-ins: each ranks the eligible candidates, best first.

A policy sees the core (index, load, cost model) and the per-candidate reports the core filled in (prefix
matches, credit, estimates). Adding a policy: one class here and one line in ``POLICIES``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar

import xxhash

from router.index import KvIndex, Medium
from router.scheduling.types import CandidateReport, RouteRequest

if TYPE_CHECKING:
    from router.scheduling.core import RoutingCore


def _ranked(reports: Sequence[CandidateReport], key: Callable[[CandidateReport], float],
            rng: random.Random) -> list[str]:
    """Ascending by key; equal keys in random order so identical workers share the load."""
    return [r.worker_id for r in sorted(reports, key=lambda r: (round(key(r), 9), rng.random()))]


class Policy:
    name: ClassVar[str]
    uses_prefix: ClassVar[bool] = False  # whether it reads the event-fed index

    def __init__(self, core: RoutingCore) -> None:
        self.core = core
        self.rng = core.rng

    def rank(self, req: RouteRequest, reports: list[CandidateReport]) -> list[str]:
        raise NotImplementedError

    def on_dispatch(self, req: RouteRequest, worker_id: str, now: float) -> None:
        """Hook for policies that keep their own state about routed requests."""


class RandomPolicy(Policy):
    name = "random"

    def rank(self, req: RouteRequest, reports: list[CandidateReport]) -> list[str]:
        ids = [r.worker_id for r in reports]
        self.rng.shuffle(ids)
        return ids


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self, core: RoutingCore) -> None:
        super().__init__(core)
        self.next = 0

    def rank(self, req: RouteRequest, reports: list[CandidateReport]) -> list[str]:
        ids = sorted(r.worker_id for r in reports)
        start = self.next % len(ids)
        self.next += 1
        return ids[start:] + ids[:start]


def load_of(core: RoutingCore, report: CandidateReport) -> float:
    """Requests in flight, by the router's count or the engine's when that is higher (other routers)."""
    load = float(report.inflight)
    m = core.fresh_metrics(report.worker_id)
    if m is not None and m.running is not None and m.waiting is not None:
        load = max(load, m.running + m.waiting)
    return load


class LeastLoaded(Policy):
    name = "least_loaded"

    def rank(self, req: RouteRequest, reports: list[CandidateReport]) -> list[str]:
        return _ranked(reports, lambda r: load_of(self.core, r), self.rng)


class SessionHash(Policy):
    """Consistent (rendezvous) hashing on a session key, as Envoy's ring hash / Nginx ``hash consistent``."""

    name = "session_hash"

    def rank(self, req: RouteRequest, reports: list[CandidateReport]) -> list[str]:
        if not req.session:  # no key: spread at random, as a ring hash with no header does
            ids = [r.worker_id for r in reports]
            self.rng.shuffle(ids)
            return ids
        weight = {r.worker_id: xxhash.xxh3_64_intdigest(f"{req.session}\x00{r.worker_id}".encode()) for r in reports}
        return sorted(weight, key=weight.__getitem__, reverse=True)


class ApproxPrefix(Policy):
    """SGLang-style cache-aware routing from a tree of previously routed prefixes, no engine events.

    If load is imbalanced (max - min > 32 and max > 1.1 * min in flight) go least-loaded; else if some
    worker was sent more than half of this prompt's blocks before, go there; else least-loaded.
    """

    name = "approx_prefix"
    balance_abs = 32
    balance_rel = 1.1
    match_threshold = 0.5

    def __init__(self, core: RoutingCore) -> None:
        super().__init__(core)
        self.tree = KvIndex(capacity=core.config.approx_capacity_blocks)

    def rank(self, req: RouteRequest, reports: list[CandidateReport]) -> list[str]:
        by_load = _ranked(reports, lambda r: load_of(self.core, r), self.rng)
        loads = [load_of(self.core, r) for r in reports]
        if max(loads) - min(loads) > self.balance_abs and max(loads) > self.balance_rel * min(loads):
            return by_load
        if req.keys:
            matched = self.tree.match(req.keys)
            eligible = {r.worker_id for r in reports}
            best = max(((m.gpu, w) for w, m in matched.items() if w in eligible), default=None)
            if best and best[0] / len(req.keys) > self.match_threshold:
                return [best[1]] + [w for w in by_load if w != best[1]]
        return by_load

    def on_dispatch(self, req: RouteRequest, worker_id: str, now: float) -> None:
        self.tree.store(worker_id, req.keys, req.keys, Medium.GPU)


class Precise(Policy):
    """Ours: minimum cost score (estimated TTFT plus interference), from event-fed residency and load."""

    name = "precise"
    uses_prefix = True

    def rank(self, req: RouteRequest, reports: list[CandidateReport]) -> list[str]:
        return _ranked(reports, lambda r: r.score, self.rng)


POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (RandomPolicy, RoundRobin, LeastLoaded, SessionHash, ApproxPrefix, Precise)
}
