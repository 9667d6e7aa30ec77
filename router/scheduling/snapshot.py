"""The per-decision view plugins see: the request, ``now`` and one ``Candidate`` per worker. Built once per
decision; plugins never see the core or the state behind it.

Cheap facts (endpoint, load, fresh metrics, capacity, index state) are read when the snapshot is made; the
prefix match, which walks the index, is computed on first use and only for the candidates left after the
filters, so a profile without a prefix-aware scorer never pays for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.index import PrefixMatch
from router.load import EngineMetrics, WorkerLoad, tail_blocks
from router.scheduling.cost import CostModel
from router.scheduling.state import FleetState
from router.scheduling.types import CandidateReport, Endpoint, RouteRequest


@dataclass(slots=True)
class Candidate:
    endpoint: Endpoint
    report: CandidateReport  # what the decision says about it (filled by the snapshot and the scorers)
    load: WorkerLoad | None  # the router's in-flight accounting there
    metrics: EngineMetrics | None  # the engine's own, if fresh
    capacity_tokens: int | None  # GPU KV-cache capacity the engine reports
    state: str  # index state: synced | unsynced | unverified | stale | no-events

    @property
    def worker_id(self) -> str:
        return self.endpoint.worker_id

    @property
    def inflight(self) -> float:
        """Requests in flight: the router's count, or the engine's when that is higher (other routers)."""
        load = float(self.load.requests) if self.load else 0.0
        m = self.metrics
        if m is not None and m.running is not None and m.waiting is not None:
            load = max(load, m.running + m.waiting)
        return load


class Snapshot:
    def __init__(self, state: FleetState, request: RouteRequest, now: float) -> None:
        self.request = request
        self.now = now
        self._state = state
        self.candidates: list[Candidate] = []
        for ep in state.endpoints.values():
            wid = ep.worker_id
            load = state.load.workers.get(wid)
            cand = Candidate(ep, CandidateReport(wid, inflight=load.requests if load else 0), load,
                             state.fresh_metrics(wid, now), state.cache_tokens.get(wid), state.index_state(wid, now))
            cand.report.state = cand.state
            cand.report.prefix_credit = cand.state == "synced"
            self.candidates.append(cand)
        self.eligible: list[Candidate] = self.candidates
        self._matched: dict[str, PrefixMatch | None] | None = None
        self._best_held = 0

    @property
    def costs(self) -> CostModel:
        """The engines' cost model, with what each worker's observed TTFTs taught it."""
        return self._state.cost

    # ---- prefix matches (lazy) -----------------------------------------------------------------
    def prefix(self, cand: Candidate) -> PrefixMatch | None:
        """The prompt's blocks the candidate holds, per tier, as far as the router may credit them."""
        if self._matched is None:
            self._match()
        assert self._matched is not None
        return self._matched.get(cand.worker_id)

    def best_held(self) -> int:
        """The most prompt blocks any eligible candidate holds."""
        if self._matched is None:
            self._match()
        return self._best_held

    def _match(self) -> None:
        req, state = self.request, self._state
        matches = state.index.match(req.keys) if req.keys else {}
        spec = state.speculative.match(req.keys, self.now) if req.keys else {}
        held: dict[str, PrefixMatch | None] = {}
        for c in self.eligible:
            r = c.report
            m = matches.get(c.worker_id) if r.prefix_credit else None
            if m is not None:
                r.matched_gpu, r.matched_cpu, r.matched_storage = m.gpu, m.cpu, m.storage
            # what we sent there in the last seconds stays true while its index resyncs (a replay in flight)
            r.speculative = spec.get(c.worker_id, 0) if c.state in ("synced", "unsynced") else 0
            if r.speculative > r.matched_blocks:
                # blocks on their way to this worker: count them as they will be (on GPU)
                r.matched_gpu, r.matched_cpu, r.matched_storage = r.speculative, 0, 0
                m = PrefixMatch(r.speculative)
            held[c.worker_id] = m
        self._matched = held
        self._best_held = max((c.report.matched_blocks for c in self.eligible), default=0)

    # ---- memory ----------------------------------------------------------------------------------
    def resident_tokens(self, cand: Candidate) -> int:
        return self._state.resident_tokens(cand.worker_id)

    def memory_wait_s(self, cand: Candidate, decode_step_s: float) -> float:
        """Until the requests in flight there free room for this request's KV blocks; 0 if they fit now."""
        req, load, capacity = self.request, cand.load, cand.capacity_tokens
        if not capacity or load is None or not load.requests:
            return 0.0
        # its prompt blocks no request in flight holds, and its partial block and output: engines admit on
        # what is free now, but a cache that cannot hold every request to its last token preempts (recompute)
        tail = tail_blocks(req.prompt_tokens, len(req.keys), req.max_tokens, req.block_size)
        room = capacity // req.block_size - load.active_blocks
        if len(req.keys) + tail <= room:
            return 0.0  # fits even without the blocks it shares with requests in flight
        over = len(req.keys) - load.shared_prefix_blocks(req.keys) + tail - room
        if over <= 0:
            return 0.0
        return self._state.load.release_wait_s(cand.worker_id, over, self.now, decode_step_s)


def worker_ids(cands: Sequence[Candidate]) -> list[str]:
    return [c.worker_id for c in cands]
