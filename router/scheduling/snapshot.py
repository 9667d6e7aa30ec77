"""The per-decision view plugins see: the request, ``now`` and one ``Candidate`` per worker. Built once per
decision; plugins never see the core or the state behind it.

Cheap facts (endpoint, load, fresh metrics, capacity, index state) are read when the snapshot is made; the
prefix match, which walks the index, is computed on first use and only for the candidates left after the
filters, so a profile without a prefix-aware scorer never pays for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.index import Medium, PrefixMatch
from router.load import EngineMetrics, WorkerLoad, tail_blocks
from router.scheduling.cost import CostModel
from router.scheduling.state import FleetState
from router.scheduling.types import REPORT_FIELDS, CandidateReport, Endpoint, RouteRequest

# the CandidateReport fields from queue_s to score, as a new candidate starts them
_NO_COSTS = (0.0,) * (REPORT_FIELDS.index("score") - REPORT_FIELDS.index("queue_s") + 1)


@dataclass(slots=True)
class Candidate(CandidateReport):
    """One worker in one decision: what the decision reports about it (its ``CandidateReport`` fields, filled by
    the snapshot and the scorers) and the live facts plugins read."""

    endpoint: Endpoint | None = None
    load: WorkerLoad | None = None  # the router's in-flight accounting there
    metrics: EngineMetrics | None = None  # the engine's own, if fresh, with the router's own part brought up to now
    capacity_tokens: int | None = None  # GPU KV-cache capacity the engine reports

    @property
    def report(self) -> CandidateReport:
        return self

    @property
    def busy(self) -> float:
        """Requests in flight: the router's count, or the engine's when that is higher (other routers)."""
        load = float(self.inflight)
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
        loads, metrics, capacity, feeds = state.load.workers, state.metrics, state.cache_tokens, state.feeder.feeds
        max_age, index_state, add = state.metrics_max_age_s, state.index_state_of, self.candidates.append
        view = state.engine_view
        for wid, ep in state.endpoints.items():
            load = loads.get(wid)
            m = metrics.get(wid)
            st = index_state(wid, ep, feeds.get(wid), now)
            # positional (the CandidateReport fields, then the live facts): a decision builds one per worker
            add(Candidate(wid, None, st, st == "synced", 0, 0, 0, 0, *_NO_COSTS, load.requests if load else 0, ep, load,
                          view(wid, m.fresh(now, max_age)) if m else None, capacity.get(wid)))
        self.eligible: list[Candidate] = self.candidates
        self._matched: dict[str, PrefixMatch | None] | None = None
        self._best_held = 0
        self._tail: int | None = None

    @property
    def costs(self) -> CostModel:
        """The engines' cost model, with what each worker's observed TTFTs and inter-token times taught it."""
        return self._state.cost

    @property
    def reuse(self) -> float:
        """P(a block the fleet evicts is asked for again), as the fleet has shown it."""
        return self._state.reuse.probability

    # ---- prefix matches (lazy) -----------------------------------------------------------------
    def prefix(self, cand: Candidate) -> PrefixMatch | None:
        """The prompt's blocks the candidate holds, per tier, as far as the router may credit them."""
        return self.matches().get(cand.worker_id)

    def matches(self) -> dict[str, PrefixMatch | None]:
        """``prefix`` of every eligible candidate, by worker id."""
        if self._matched is None:
            self._match()
        assert self._matched is not None
        return self._matched

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
        best = 0
        for c in self.eligible:
            r = c
            m = matches.get(c.worker_id) if r.prefix_credit else None
            blocks = 0
            if m is not None:
                r.matched_gpu, r.matched_cpu, r.matched_storage = m.gpu, m.cpu, m.storage
                blocks = m.gpu + m.cpu + m.storage
            # what we sent there in the last seconds stays true while its index resyncs (a replay in flight)
            r.speculative = spec.get(c.worker_id, 0) if spec and c.state in ("synced", "unsynced") else 0
            if r.speculative > blocks:
                # blocks on their way to this worker: count them as they will be (on GPU)
                r.matched_gpu, r.matched_cpu, r.matched_storage = r.speculative, 0, 0
                m = PrefixMatch(r.speculative)
                blocks = r.speculative
            held[c.worker_id] = m
            if blocks > best:
                best = blocks
        self._matched = held
        self._best_held = best

    # ---- memory ----------------------------------------------------------------------------------
    def resident_tokens(self, cand: Candidate) -> int:
        """What the candidate's GPU cache holds, by the index."""
        return self._state.index.blocks_held_on(cand.worker_id, Medium.GPU) * self._state.block_size

    def memory_wait_s(self, cand: Candidate, decode_step_s: float) -> float:
        """Until the requests in flight there free room for this request's KV blocks; 0 if they fit now."""
        req, load, capacity = self.request, cand.load, cand.capacity_tokens
        if not capacity or load is None or not load.requests:
            return 0.0
        # its prompt blocks no request in flight holds, and its partial block and output: engines admit on
        # what is free now, but a cache that cannot hold every request to its last token preempts (recompute)
        if self._tail is None:  # the same for every candidate: once per decision
            self._tail = tail_blocks(req.prompt_tokens, len(req.keys), req.max_tokens, req.block_size)
        tail, n = self._tail, len(req.keys)
        room = capacity // req.block_size - load.active_blocks
        if n + tail <= room:
            return 0.0  # fits even without the blocks it shares with requests in flight
        over = n - load.shared_prefix_blocks(req.keys) + tail - room
        if over <= 0:
            return 0.0
        return self._state.load.release_wait_s(cand.worker_id, over, self.now, decode_step_s)


def worker_ids(cands: Sequence[Candidate]) -> list[str]:
    return [c.worker_id for c in cands]
