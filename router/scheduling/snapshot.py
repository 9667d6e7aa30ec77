"""The per-decision view plugins see: the request, ``now`` and the fleet, one slot per worker. Built once per
decision; plugins never see the core or the state behind it.

A decision reads the fleet's columns (router/scheduling/columns.py) and works on arrays over the slots: the
vector forms of the filters, scorers and pickers (``Filter.mask``, ``Scorer.score_slots``, ``Picker.rank``)
never build a per-worker object. ``Candidate`` objects, what a per-candidate plugin (``filter(snap, cand)``,
``score(snap, cands)``) and the decision's reports read, are built on first use, per slot, and kept: the chosen
worker's and the fallbacks' are built when read, all of them only when something asks for the full list. The
prefix match, which walks the index, is computed on first use and only for the slots left after the filters,
so a profile without a prefix-aware scorer never pays for it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from router.index import Medium, PrefixMatch
from router.load import EngineMetrics, WorkerLoad, tail_blocks
from router.scheduling.cost import CostModel
from router.scheduling.masks import all_set, all_slots, any_set
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


POSITIONS_TABLE = 64  # up to this many slots ``_positions`` builds a table (a lookup in it: tens of ns)
# up to this many workers, ``match_arrays`` works on Python lists (a dozen numpy calls and numpy's scalars cost
# more than a few rows; tests run both)
LIST_MATCH_UP_TO = 8


class Snapshot:
    def __init__(self, state: FleetState, request: RouteRequest, now: float) -> None:
        self.request = request
        self.now = now
        self._state = state
        cols = state.columns
        cols.refresh()
        self.cols = cols
        self.ids: list[str] = cols.ids  # by slot (shared with the columns: never changed here)
        self.slot: dict[str, int] = cols.slot
        self.endpoint_list: list[Endpoint] = cols.endpoints
        self.size = n = len(self.ids)
        # index states: "synced" but for the few workers something marks (no events, a feed not synced or
        # suspect, dispatches not followed by events for a while), each then asked the state's own rule
        self.states: dict[int, str] = {}
        marked = set() if cols.all_publish else set(np.flatnonzero(~cols.publishes).tolist())
        slot, feeds = self.slot, state.feeder.feeds
        for wid, f in feeds.items():
            if not f.synced or f.suspect_since is not None:
                i = slot.get(wid)
                if i is not None:
                    marked.add(i)
        stale_before, awaiting = now - state.stale_after_s, state.awaiting_events_since
        if awaiting and min(awaiting.values()) < stale_before:
            for wid, since in awaiting.items():
                if since < stale_before:
                    i = slot.get(wid)
                    if i is not None:
                        marked.add(i)
        for i in marked:
            wid = self.ids[i]
            st = state.index_state_of(wid, self.endpoint_list[i], feeds.get(wid), now)
            if st != "synced":
                self.states[i] = st
        self.credit = all_slots(n)  # prefix credit: only a synced index earns it
        if self.states:
            self.credit[list(self.states)] = False
        self.inflight = cols.requests.copy()  # as the decision saw it (the columns move on)
        self.fresh = cols.has_metrics & (now - cols.scraped_at <= state.metrics_max_age_s)
        self._cands: list[Candidate | None] = [None] * n
        self._built: list[int] = []
        self._eligible = np.arange(n)
        self._eligible_list: list[Candidate] | None = None
        self.reasons: dict[int, str] = {}  # why each filtered slot was dropped
        self._reports: dict[str, np.ndarray] = {}  # report fields the scorers set, by slot
        self._scores: list[Any] | None = None  # the decision's totals, in ``eligible_slots`` order
        self._score_pos: Callable[[int], int | None] | None = None
        self._match_arrays: dict[str, np.ndarray] | None = None
        self._matched: dict[str, PrefixMatch | None] | None = None
        self._tail: int | None = None

    @property
    def costs(self) -> CostModel:
        """The engines' cost model, with what each worker's observed TTFTs and inter-token times taught it."""
        return self._state.cost

    @property
    def reuse(self) -> float:
        """P(a block the fleet evicts is asked for again), as the fleet has shown it."""
        return self._state.reuse.probability

    @property
    def tail(self) -> int:
        """The request's KV blocks beyond its full prompt blocks (its partial block and output)."""
        if self._tail is None:
            req = self.request
            self._tail = tail_blocks(req.prompt_tokens, len(req.keys), req.max_tokens, req.block_size)
        return self._tail

    # ---- slots and candidates ------------------------------------------------------------------
    @property
    def eligible_slots(self) -> np.ndarray:
        """The slots left after the filters (all of them before), in the fleet's order."""
        return self._eligible

    def set_eligible_slots(self, slots: np.ndarray) -> None:
        self._eligible = slots
        self._eligible_list = None
        self._match_arrays = self._matched = None

    def prefix_credited(self) -> bool:
        """Whether any eligible slot's index earns prefix credit (else the decision was on load alone)."""
        return any_set(self.credit[self._eligible])

    def index_state(self, i: int) -> str:
        return self.states.get(i, "synced")

    def candidate(self, i: int) -> Candidate:
        """Slot ``i``'s candidate, built on first use (with what the decision has set on it so far) and kept."""
        c = self._cands[i]
        if c is not None:
            return c
        state, wid = self._state, self.ids[i]
        load = state.load.workers.get(wid)
        m = state.metrics.get(wid) if self.fresh[i] else None
        st = self.states.get(i, "synced")
        c = Candidate(wid, self.reasons.get(i), st, st == "synced", 0, 0, 0, 0, *_NO_COSTS,
                      int(self.inflight[i]), self.endpoint_list[i], load,
                      state.engine_view(wid, m) if m else None, state.cache_tokens.get(wid))
        if self._match_arrays is not None:
            for name, arr in self._match_arrays.items():
                setattr(c, name, int(arr[i]))
        for name, arr in self._reports.items():
            setattr(c, name, float(arr[i]))
        if self._score_pos is not None:
            pos = self._score_pos(i)
            if pos is not None:
                c.score = self._scores[pos]  # type: ignore[index]
        self._cands[i] = c
        self._built.append(i)
        return c

    def candidates_at(self, slots: Sequence[int] | np.ndarray) -> list[Candidate]:
        get = self.candidate
        return [get(i) for i in (slots.tolist() if isinstance(slots, np.ndarray) else slots)]

    @property
    def candidates(self) -> list[Candidate]:
        """Every worker's candidate (builds them all: the per-candidate plugins' view)."""
        return self.candidates_at(range(self.size))

    @property
    def eligible(self) -> list[Candidate]:
        """The candidates left after the filters (builds them)."""
        if self._eligible_list is None:
            self._eligible_list = self.candidates_at(self._eligible)
        return self._eligible_list

    @eligible.setter
    def eligible(self, cands: list[Candidate]) -> None:
        slot = self.slot
        self.set_eligible_slots(np.array([slot[c.worker_id] for c in cands], dtype=np.int64))
        self._eligible_list = list(cands)

    def set_reports(self, slots: np.ndarray, **fields: np.ndarray) -> None:
        """Report fields (``CandidateReport``'s float terms) for ``slots``, as arrays in their order: what a
        vector scorer writes; the candidates built already get them now, the others when built."""
        n = self.size
        whole = len(slots) == n and (n == 0 or (slots[0] == 0 and slots[-1] == n - 1))  # every slot, in order
        for name, values in fields.items():
            if whole:
                self._reports[name] = values
                continue
            arr = self._reports.get(name)
            if arr is None:
                arr = self._reports[name] = np.zeros(n)
            arr[slots] = values
        if self._built:
            pos = _positions(slots)
            for i in self._built:
                k = pos(i)
                if k is not None:
                    c = self._cands[i]
                    for name, values in fields.items():
                        setattr(c, name, float(values[k]))

    def report_values(self, name: str, slots: np.ndarray) -> np.ndarray:
        """A report field of ``slots``, as a scorer wrote it (zeros where none did)."""
        arr = self._reports.get(name)
        return np.zeros(len(slots)) if arr is None else np.asarray(arr, dtype=float)[slots]

    def set_scores(self, slots: np.ndarray, totals: list[Any]) -> None:
        """The decision's totals for ``slots`` (the candidates' ``score``)."""
        self._scores = totals
        self._score_pos = pos = _positions(slots)
        for i in self._built:
            k = pos(i)
            if k is not None:
                self._cands[i].score = totals[k]  # type: ignore[union-attr]

    # ---- prefix matches (lazy) -----------------------------------------------------------------
    def prefix(self, cand: Candidate) -> PrefixMatch | None:
        """The prompt's blocks the candidate holds, per tier, as far as the router may credit them."""
        return self.matches().get(cand.worker_id)

    def matches(self) -> dict[str, PrefixMatch | None]:
        """``prefix`` of every eligible candidate, by worker id."""
        if self._matched is None:
            spec = self.match_arrays()["speculative"]
            ids, credit, held = self.ids, self.credit, {}
            rg, rc, rs = self._raw_matches
            for i in self._eligible.tolist():
                m = PrefixMatch(int(rg[i]), int(rc[i]), int(rs[i])) if credit[i] and rg[i] + rc[i] + rs[i] else None
                if spec[i] > (0 if m is None else m.gpu + m.cpu + m.storage):
                    m = PrefixMatch(int(spec[i]))
                held[ids[i]] = m
            self._matched = held
        return self._matched

    def best_held(self) -> int:
        """The most prompt blocks any eligible candidate holds (computed when asked: no decision of the built-in
        profiles reads it)."""
        a = self.match_arrays()
        return int((a["matched_gpu"] + a["matched_cpu"] + a["matched_storage"]).max()) if self.size else 0

    def match_arrays(self) -> dict[str, np.ndarray]:
        """The eligible slots' credited prefix, by tier, and the speculative one (0 elsewhere): int arrays by
        slot, ``matched_gpu``, ``matched_cpu``, ``matched_storage``, ``speculative``. What was sent to a worker
        in the last seconds stays true while its index resyncs (a replay in flight): when more than the index
        credits, it counts as held on GPU."""
        if self._match_arrays is not None:
            return self._match_arrays
        req, state, n = self.request, self._state, self.size
        spec = state.speculative.match(req.keys, self.now) if req.keys else {}
        found = state.index.match_lengths(req.keys) if req.keys else None
        held = found is not None and len(found[0]) > 0
        # a few workers: Python lists, made arrays once at the end (numpy's calls and its scalars cost more than
        # the work); more: arrays throughout
        small = n <= LIST_MATCH_UP_TO
        rows: Any = [[0] * n for _ in range(7)] if small else np.zeros((7, n), dtype=np.int64)
        raw = (rows[0], rows[1], rows[2])
        g, c, s, sp = rows[3], rows[4], rows[5], rows[6]
        if small:
            eligible: Any = [False] * n
            for i in self._eligible.tolist():
                eligible[i] = True
            credit: Any = self.credit.tolist()
        elif spec or held:
            eligible = np.zeros(n, dtype=bool)
            eligible[self._eligible] = True
            credit = self.credit
        # the index's answer by the index's own slots, moved to this fleet's (workers it knows, the fleet not)
        if held and small:
            to_fleet = self.cols.index_slots(state.index)[1]
            for islot, *tiers in zip(*(column.tolist() for column in found), strict=True):
                i = int(to_fleet[islot]) if islot < len(to_fleet) else -1
                if i < 0:
                    continue
                take = eligible[i] and credit[i]
                for full, part, vals in zip(raw, (g, c, s), tiers, strict=True):
                    full[i] = vals
                    if take:
                        part[i] = vals
        elif held:
            to_fleet = self.cols.index_slots(state.index)[1]
            islots = found[0]
            inside = islots < len(to_fleet)
            where = np.full(len(islots), -1, dtype=np.int64)
            where[inside] = to_fleet[islots[inside]]
            known = where >= 0
            at = where[known]
            take = eligible[at] & credit[at]
            for full, part, tier in zip(raw, (g, c, s), found[1:], strict=True):
                vals = tier[known]
                full[at] = vals
                part[at[take]] = vals[take]
        slot = self.slot
        for wid, blocks in spec.items():
            i = slot.get(wid)
            if i is None or not eligible[i] or self.states.get(i, "synced") not in ("synced", "unsynced"):
                continue
            sp[i] = blocks
            if blocks > g[i] + c[i] + s[i]:  # blocks on their way to this worker: count them as they will be
                g[i], c[i], s[i] = blocks, 0, 0
        if small:
            rows = np.array(rows, dtype=np.int64).reshape(7, n)
            raw = (rows[0], rows[1], rows[2])
            g, c, s, sp = rows[3], rows[4], rows[5], rows[6]
        self._raw_matches = raw
        self._match_arrays = a = {"matched_gpu": g, "matched_cpu": c, "matched_storage": s, "speculative": sp}
        for i in self._built:
            cand = self._cands[i]
            for name, arr in a.items():
                setattr(cand, name, int(arr[i]))
        return a

    # ---- memory ----------------------------------------------------------------------------------
    def resident_tokens(self, cand: Candidate) -> int:
        """What the candidate's GPU cache holds, by the index."""
        return self._state.index.blocks_held_on(cand.worker_id, Medium.GPU) * self._state.block_size

    def resident_blocks(self, slots: np.ndarray) -> np.ndarray:
        """``resident_tokens`` / block size of each of ``slots``, as an array."""
        index = self._state.index
        to_index = self.cols.index_slots(index)[0][slots]
        held = index.blocks_by_slot(Medium.GPU)
        out = np.zeros(len(slots))
        known = (to_index >= 0) & (to_index < len(held))
        out[known] = held[to_index[known]]
        return out

    def shared_prefix_blocks(self, slots: np.ndarray) -> np.ndarray:
        """``WorkerLoad.shared_prefix_blocks`` of the request's keys for each of ``slots`` (0 without load)."""
        keys, tracker = self.request.keys, self._state.load
        out = np.zeros(len(slots))
        if not keys or keys[0] not in tracker.first_key_holders:  # no request in flight anywhere starts with it
            return out
        k0, loads, ids = keys[0], tracker.workers, self.ids
        get = loads.get
        for k, i in enumerate(slots.tolist()):
            w = get(ids[i])
            if w is not None and k0 in w.active_keys:
                out[k] = w.shared_prefix_blocks(keys)
        return out

    def memory_wait_s(self, cand: Candidate, decode_step_s: float) -> float:
        """Until the requests in flight there free the blocks this request lacks to be admitted (the engine's
        rule, ``CostModel.memory_lack``: its prompt's new blocks against those free now); 0 if it has them."""
        req, load, capacity = self.request, cand.load, cand.capacity_tokens
        if not capacity or load is None or not load.requests:
            return 0.0
        over = self.costs.memory_lack(req.prompt_tokens, len(req.keys), load.shared_prefix_blocks(req.keys),
                                      req.block_size, load, cand.metrics, capacity)
        if over <= 0:
            return 0.0
        return self._state.load.release_wait_s(cand.worker_id, int(over), self.now, decode_step_s)


def _positions(slots: np.ndarray) -> Callable[[int], int | None]:
    """Where each slot is in ``slots`` (None: not there): a table, or for many slots in order (as the filters
    leave them) a binary search, which builds nothing."""
    if len(slots) > POSITIONS_TABLE and all_set(slots[1:] > slots[:-1]):
        def find(i: int) -> int | None:
            k = int(slots.searchsorted(i))
            return k if k < len(slots) and slots[k] == i else None
        return find
    return {s: k for k, s in enumerate(slots.tolist())}.get


def worker_ids(cands: Sequence[Candidate]) -> list[str]:
    return [c.worker_id for c in cands]
