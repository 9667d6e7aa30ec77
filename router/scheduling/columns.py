"""Per-worker facts as arrays, one slot per worker (in the endpoints' order), kept up to date where they change.

A decision over a thousand workers must not build a thousand objects or call a thousand functions: it reads
these columns and works on arrays. They are refreshed at the start of each decision for the workers whose facts
changed since the last one (the load tracker, the metrics scrapes and the cost model's fits name them), so the
refresh costs the workers that changed, not the fleet. The endpoints' flags, which callers may set directly, are
re-read when any endpoint's field was written (``Endpoint.writes`` counts them). Facts that change behind the
state's back (the index's residency, the event feed's sync) are not held here: the snapshot reads them per
decision.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from router.scheduling.types import Endpoint

try:  # the search below in C (router/scheduling/_fastobjective.c), built where a compiler was
    from router.scheduling._fastobjective import release_waits as compiled_release_waits
except ImportError:  # pragma: no cover - a build without the extension
    compiled_release_waits = None

if TYPE_CHECKING:
    from router.scheduling.state import FleetState

_NAN = float("nan")
ROLE_CODES = {"both": 0, "prefill": 1, "decode": 2}  # ``role_code``; any other role reads as 3


class FleetColumns:
    """The fleet's per-worker columns (float64 arrays indexed by slot). ``None`` facts are NaN (metrics) or 0
    (capacity, load), with ``has_load`` / ``has_metrics`` saying which."""

    LOAD = ("requests", "prompt_tokens", "pending", "decoding", "output_tokens", "active_blocks")
    # the engine view (``FleetState.engine_view``); ``batch_limit`` 0 where none is known
    METRICS = ("waiting", "running", "kv", "scraped_at", "batch_limit")
    OTHER = ("capacity", "ttft_slope", "decode_slope", "decode_intercept")

    def __init__(self, state: FleetState) -> None:
        self._state = state
        self.ids: list[str] = []
        self.slot: dict[str, int] = {}
        self.endpoints: list[Endpoint] = []
        self._generation = 0  # +1 at each rebuild (the slots changed)
        self._index_maps: tuple[Any, int, int, np.ndarray, np.ndarray] | None = None
        self._flags_at = -1  # ``Endpoint.writes`` when the flags were read
        self._rebuild()

    # ---- upkeep -----------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Bring the columns up to date: re-read the workers that changed (all of them if the fleet did)."""
        st = self._state
        eps = st.endpoints
        if len(eps) != len(self.ids) or list(eps) != self.ids:
            self._rebuild()
        else:
            changed = st.load.changed | st.changed | st.cost.changed
            slot = self.slot
            for wid in changed:
                i = slot.get(wid)
                if i is not None:
                    self._read(i, wid)
        st.load.changed.clear()
        st.changed.clear()
        st.cost.changed.clear()
        endpoints = list(eps.values())
        # (list equality: identity first, so a thousand unchanged endpoints compare at C speed; an endpoint
        # replaced by an equal one keeps the same flags)
        if Endpoint.writes != self._flags_at or endpoints != self.endpoints:
            self._read_flags(endpoints)
        self.endpoints = endpoints

    def _rebuild(self) -> None:
        st = self._state
        self.ids = list(st.endpoints)
        self.slot = {w: i for i, w in enumerate(self.ids)}
        self.id_array = np.array(self.ids, dtype=object)  # (a ranking's ids in one indexing, not one call each)
        self._generation += 1
        n = len(self.ids)
        for name in (*self.LOAD, *self.METRICS, *self.OTHER):
            setattr(self, name, np.zeros(n))
        self.has_load = np.zeros(n, dtype=bool)
        self.has_metrics = np.zeros(n, dtype=bool)
        # each worker's memory-release schedule (``LoadTracker.release_schedule``) as padded rows: finish times
        # (padded with the last one) and blocks freed by then (padded with +inf); ``release_step`` is the decode
        # step a row was made for (NaN: none yet, or stale)
        self.release_step = np.full(n, _NAN)
        self.release_ends = np.zeros((n, 1))
        self.release_freed = np.full((n, 1), np.inf)
        for i, wid in enumerate(self.ids):
            self._read(i, wid)
        self.endpoints = list(st.endpoints.values())
        self._read_flags(self.endpoints)  # (and ``refresh``, finding the same list, does not read them again)

    def _read_flags(self, endpoints: list[Endpoint]) -> None:
        """The endpoints' flags as read-only arrays by slot (what the filters and the snapshot ask of every
        worker at each decision), re-read only when some endpoint's field was written (``Endpoint.writes``)."""
        self._flags_at = Endpoint.writes
        n = len(endpoints)

        def column(values: Any, dtype: type) -> np.ndarray:
            arr = np.fromiter(values, dtype=dtype, count=n)
            arr.flags.writeable = False
            return arr

        self.healthy = column((ep.healthy for ep in endpoints), bool)
        self.draining = column((ep.draining for ep in endpoints), bool)
        self.publishes = column((ep.events for ep in endpoints), bool)
        self.role_code = column((ROLE_CODES.get(ep.role, len(ROLE_CODES)) for ep in endpoints), np.int8)
        self.all_publish = bool(self.publishes.all())
        self.all_roles_both = bool((self.role_code == ROLE_CODES["both"]).all())
        self.any_models = any(ep.models for ep in endpoints)

    def _read(self, i: int, wid: str) -> None:
        st = self._state
        w = st.load.workers.get(wid)
        if w is None:
            self.has_load[i] = False
            self.requests[i] = self.prompt_tokens[i] = self.pending[i] = 0.0
            self.decoding[i] = self.output_tokens[i] = self.active_blocks[i] = 0.0
        else:
            self.has_load[i] = True
            self.requests[i], self.prompt_tokens[i] = w.requests, w.prompt_tokens
            self.pending[i], self.decoding[i] = w.pending_prefill_tokens, w.decoding
            self.output_tokens[i], self.active_blocks[i] = w.output_tokens, w.active_blocks
        m = st.metrics.get(wid)
        if m is None:
            self.has_metrics[i] = False
            self.waiting[i] = self.running[i] = self.kv[i] = self.scraped_at[i] = _NAN
            self.batch_limit[i] = 0.0
        else:
            v = st.engine_view(wid, m)
            assert v is not None
            self.has_metrics[i] = True
            self.scraped_at[i] = m.scraped_at
            self.waiting[i] = _NAN if v.waiting is None else v.waiting
            self.running[i] = _NAN if v.running is None else v.running
            self.kv[i] = _NAN if v.kv_usage is None else v.kv_usage
            self.batch_limit[i] = v.batch_limit or 0
        self.capacity[i] = st.cache_tokens.get(wid) or 0
        prof = st.cost.profile(wid)
        self.ttft_slope[i] = prof.ttft.slope
        self.decode_slope[i], self.decode_intercept[i] = prof.decode.slope, prof.decode.intercept
        self.release_step[i] = _NAN

    # ---- the index's slots -------------------------------------------------------------------------
    def index_slots(self, index: Any) -> tuple[np.ndarray, np.ndarray]:
        """(the index's slot (``slot_of``) of each fleet slot, the fleet slot of each index slot), -1 where there
        is none: what turns the index's answers by its own slot (``match_lengths``, ``blocks_by_slot``) into this
        fleet's columns. Rebuilt only when the fleet's slots or the index's change (``slot_epoch``)."""
        maps = self._index_maps
        if maps is None or maps[0] is not index or maps[1:3] != (index.slot_epoch, self._generation):
            to_index = np.fromiter((-1 if s is None else s for s in map(index.slot_of, self.ids)), dtype=np.int64,
                                   count=len(self.ids))
            to_fleet = np.full(int(to_index.max(initial=-1)) + 1, -1, dtype=np.int64)
            held = np.flatnonzero(to_index >= 0)
            to_fleet[to_index[held]] = held
            self._index_maps = maps = (index, index.slot_epoch, self._generation, to_index, to_fleet)
        return maps[3], maps[4]

    # ---- memory release ---------------------------------------------------------------------------
    def release_waits(self, slots: np.ndarray, blocks: np.ndarray, steps: np.ndarray, now: float) -> np.ndarray:
        """``LoadTracker.release_wait_s`` for each of ``slots`` (every one with requests in flight), freeing
        ``blocks`` at decode step ``steps``: one binary search per row, all rows at once."""
        stale = np.flatnonzero(~(self.release_step[slots] == steps))  # positions in ``slots``
        if len(stale):
            tracker, ids = self._state.load, self.ids
            rows = []
            for i, step in zip(slots[stale].tolist(), steps[stale].tolist(), strict=True):
                rows.append((i, step, *tracker.release_schedule(tracker.workers[ids[i]], step)))
            width = max(len(ends) for _, _, ends, _ in rows) + 1  # one pad at least: every search finds a slot
            if width > self.release_ends.shape[1]:
                n, old = len(self.ids), self.release_ends.shape[1]
                ends = np.zeros((n, width))
                ends[:, :old] = self.release_ends
                ends[:, old:] = self.release_ends[:, old - 1 : old]
                freed = np.full((n, width), np.inf)
                freed[:, :old] = self.release_freed
                self.release_ends, self.release_freed = ends, freed
            for i, step, ends_i, freed_i in rows:
                k = len(ends_i)
                self.release_ends[i, :k] = ends_i
                self.release_ends[i, k:] = ends_i[-1]
                self.release_freed[i, :k] = freed_i
                self.release_freed[i, k:] = np.inf
                self.release_step[i] = step
        if compiled_release_waits is not None:  # each row's search in C: ``search_release_rows``' steps, one pass
            out = np.empty(len(slots))
            compiled_release_waits(self.release_freed, self.release_ends, slots, np.asarray(blocks, dtype=float),
                                   now, out)
            return out
        return search_release_rows(self.release_freed, self.release_ends, slots, blocks, now)


def search_release_rows(freed: np.ndarray, ends: np.ndarray, slots: np.ndarray, blocks: np.ndarray,
                        now: float) -> np.ndarray:
    """``FleetColumns.release_waits``' search in numpy (the reference of the compiled one): bisect_left on every
    row at once, a few gathers of one value per row (the rows end in +inf, so the last column always answers),
    whatever the widest worker's schedule."""
    lo = np.zeros(len(slots), dtype=np.int64)
    hi = np.full(len(slots), freed.shape[1] - 1, dtype=np.int64)
    for _ in range(int(freed.shape[1] - 1).bit_length()):
        mid = (lo + hi) // 2
        enough = freed[slots, mid] >= blocks
        hi = np.where(enough, mid, hi)
        lo = np.where(enough, lo, mid + 1)
    return np.maximum(0.0, ends[slots, lo] - now)
