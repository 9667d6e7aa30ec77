"""``latency-cost``: the routing objective (router/scheduling/cost.py), in seconds of user-visible latency: this
request's own TTFT and decode on each candidate plus what sending it there costs the requests already there
(their decodes stalled by its prefill and slowed by its KV) and the expected re-prefill of the cached blocks it
pushes out. Inputs: event-fed residency, the router's in-flight accounting, fresh engine metrics, each worker's
fitted engine profile and the fleet's observed reuse of evicted blocks. The ``precise`` profile's one scorer.

It reads the fleet's columns and prices every candidate in one pass of router/scheduling/_fastobjective.c where
that is built; ``_inputs`` and ``CostModel.terms`` are the formula, written once, which it follows operation by
operation (the same scores to the last bit) and which prices the candidates without it: on arrays, or, up to
``SCALAR_CANDIDATES`` of them, on each one's floats. The per-worker work left in Python is the index's residency
count and, only where the request's blocks do not fit beside the requests in flight, the search for the blocks
it shares with them and for when enough of them end."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np

from router.scheduling.cost import (
    CostParams,
    Estimate,
    Estimates,
    admission_lack,
    blocks_in_use,
    prompt_blocks_to_admit,
    slot_steps,
)
from router.scheduling.engine_profile import StepTiming
from router.scheduling.lora import adapter_cost
from router.scheduling.masks import all_set, any_set, set_slots
from router.scheduling.plugins.base import Scorer
from router.scheduling.scalar_ops import SCALAR_OPS
from router.scheduling.snapshot import Candidate, Snapshot

try:
    from router.scheduling._fastobjective import add_waits as compiled_add_waits
    from router.scheduling._fastobjective import price as compiled_price
except ImportError:  # built without a C compiler: the formula in Python prices every candidate
    compiled_price = compiled_add_waits = None


@dataclass(frozen=True)
class LatencyCostParams:
    # how the KV-load terms (own decode, the slowdown brought to others) count; None: the cost model's
    # ``kv_load_weight`` (1: every second alike); 0: TTFT first, as the ``precise_ttft`` profile
    kv_load_weight: float | None = None


# up to this many workers needing a memory wait, each is asked its own (``LoadTracker.release_wait_s``); more:
# one binary search over the fleet's padded release schedules (the same answer; tests run both)
SCALAR_WAITS = 32
# up to this many candidates the objective is priced on each one's floats: a numpy call costs about a microsecond
# whatever its size, and the objective is a hundred of them (router/scheduling/scalar_ops.py; tests run both).
# Measured (docs/benchmarks.md, tenth session): a whole decision costs the same either way at about 10 candidates
SCALAR_CANDIDATES = 8

_REPORTED = ("queue_s", "prefill_s", "decode_s", "ttft_s", "stall_s", "interference_s", "eviction_s", "step_s",
             "model_ttft_s", "model_step_s", "behind_s", "preempt_s")
# the rows ``compiled_price`` writes, one value per candidate: the reports (the queue, TTFT and score before any
# memory wait), then whether it must wait for memory, how many blocks it lacks room for, the slowdown term and
# the wait for a place in the batch (a memory wait adds only beyond it)
OBJECTIVE_ROWS = (*_REPORTED, "score", "need", "over", "slowdown_s", "batch_wait_s")
_ROW = {name: i for i, name in enumerate(OBJECTIVE_ROWS)}


class LatencyCost(Scorer):
    type_name = "latency-cost"
    Params = LatencyCostParams
    uses_prefix = True

    def score(self, snap: Snapshot, cands: Sequence[Candidate]) -> list[float]:
        slot = snap.slot
        slots = np.array([slot[c.worker_id] for c in cands], dtype=np.int64)
        out = self.score_slots(snap, slots)
        for c, i in zip(cands, slots.tolist(), strict=True):
            own = snap.candidate(i)
            if own is not c:  # a candidate from elsewhere: it gets the terms too
                for name in _REPORTED:
                    setattr(c, name, getattr(own, name))
        return out.tolist()

    def score_slots(self, snap: Snapshot, slots: np.ndarray) -> np.ndarray:
        """The objective of every candidate (``objective``), with a LoRA request's adapter priced where it is not
        loaded (``_with_adapter``)."""
        scores = self.objective(snap, slots)
        if snap.request.lora and snap.costs.params.lora_load_ms > 0:
            return self._with_adapter(snap, slots, np.asarray(scores, dtype=float))
        return scores

    def _with_adapter(self, snap: Snapshot, slots: np.ndarray, scores: np.ndarray) -> np.ndarray:
        """router/scheduling/lora.py: the adapter's load (and a wait for a slot where every slot is held by an
        adapter in use) joins this request's queue and TTFT, the load's stall to the requests running there joins
        what it costs them, and the expected reload of the adapter it pushes out joins the eviction term. The wait
        for a slot is taken as the rest of a request's decode there, as long as this one's would take
        (``remaining_fraction`` of it)."""
        state, p = snap._state, snap.costs.params
        load_s = state.adapter_loads.load_s(snap.request.lora or "")
        queue, ttft = snap.report_values("queue_s", slots), snap.report_values("ttft_s", slots)
        stall, interference = snap.report_values("stall_s", slots), snap.report_values("interference_s", slots)
        decode, eviction = snap.report_values("decode_s", slots), snap.report_values("eviction_s", slots)
        loads = np.zeros(len(slots))
        reuse = p.reuse_prior if snap.reuse is None else snap.reuse
        adapter = snap.request.lora
        assert adapter is not None
        for k, i in enumerate(slots.tolist()):
            wid = snap.ids[i]
            m = state.metrics.get(wid) if snap.fresh[i] else None
            running = max(float(snap.cols.decoding[i]), m.running if m is not None and m.running is not None else 0.0)
            cost = adapter_cost(state.loras.view(wid, m), adapter, load_s, running,
                                p.remaining_fraction * float(decode[k]), reuse)
            queue[k] += cost.ttft_s
            ttft[k] += cost.ttft_s
            stall[k] += cost.stall_s
            interference[k] += cost.stall_s
            eviction[k] += cost.eviction_s
            loads[k] = cost.load_s  # what the engines teach the load on (not where it also waits for a slot)
            scores[k] += cost.ttft_s + cost.stall_s + cost.eviction_s
        snap.set_reports(slots, queue_s=queue, ttft_s=ttft, stall_s=stall, interference_s=interference,
                         eviction_s=eviction, adapter_load_s=loads)
        return scores

    def objective(self, snap: Snapshot, slots: np.ndarray) -> np.ndarray:
        """Every candidate priced by one formula (``_inputs``, then ``CostModel.terms``): compiled, in one pass
        over the candidates; without the extension on arrays over them, or, up to ``SCALAR_CANDIDATES`` of them,
        on each one's floats (the same scores every way)."""
        if compiled_price is not None:
            return self._priced_compiled(snap, slots)
        if len(slots) <= SCALAR_CANDIDATES:
            return self._priced_each(snap, slots)
        match = snap.match_arrays()
        # every worker in order (the usual case): the columns as they are, no copies
        sel = _selection(snap, slots)
        c = SimpleNamespace(**{name: column[sel] for name, column in _candidate_columns(snap, match).items()},
                            shared=snap.shared_prefix_blocks(slots))
        est = self._priced_at_once(snap, slots, c)
        snap.set_reports(slots, queue_s=est.queue_s, prefill_s=est.prefill_s, decode_s=est.decode_s,
                         ttft_s=est.queue_s + est.prefill_s, stall_s=est.stall_s,
                         interference_s=est.stall_s + est.slowdown_s, eviction_s=est.eviction_s, step_s=est.step_s,
                         model_ttft_s=est.model_ttft_s, model_step_s=est.model_step_s, behind_s=est.behind_s,
                         preempt_s=est.preempt_s)
        return est.scores(self.params.kv_load_weight)

    def _priced_at_once(self, snap: Snapshot, slots: np.ndarray, c: SimpleNamespace) -> Estimates:
        req, costs = snap.request, snap.costs
        bs, n_keys, tail = req.block_size, len(req.keys), snap.tail
        pending, running, kv, cap, used, new, need, over = _inputs(np, c, n_keys, tail, bs, costs.params,
                                                                   _partial(req))
        # memory wait: only where its blocks do not fit beside what the requests in flight hold
        wait = np.zeros(len(slots))
        if any_set(need):
            at = set_slots(need)
            wait[at] = _memory_waits(snap, slots[at], over[at], c.active[at], c.capacity[at])
        known = c.capacity > 0
        resident = np.zeros(len(slots))
        if any_set(known):
            resident[known] = snap.resident_blocks(slots[known]) * snap._state.block_size
        arrays = _objective_columns(np, snap, c, pending, running, kv, cap, used, new, resident, wait, held_share(snap))
        return costs.estimate_many(arrays, snap.reuse)  # type: ignore[arg-type]

    def _priced_compiled(self, snap: Snapshot, slots: np.ndarray) -> np.ndarray:
        """``score_slots`` by ``compiled_price``: the objective's rows for every candidate in one call, which
        also adds the memory wait where a candidate's blocks do not fit (each worker's own search, up to
        ``SCALAR_WAITS`` of them; more are left to one search over every schedule, added here alike)."""
        req, p = snap.request, snap.costs.params
        reuse = snap.reuse
        w = p.kv_load_weight if self.params.kv_load_weight is None else self.params.kv_load_weight
        out = np.empty((len(OBJECTIVE_ROWS), len(slots)))

        def wait_of(slot: int, blocks: float, active: float, capacity: float) -> float:
            return _release_wait_s(snap, slot, blocks, active, capacity)

        left = compiled_price(
            tuple(_candidate_columns(snap, snap.match_arrays()).values()), slots, snap.shared_prefix_blocks(slots),
            snap.resident_blocks(slots) * snap._state.block_size,
            (len(req.keys), snap.tail, req.block_size, req.prompt_tokens, req.max_tokens),
            (*_compiled_params(p), p.reuse_prior if reuse is None else reuse, w, held_share(snap)), out, wait_of,
            SCALAR_WAITS)
        if left:
            at = set_slots(out[_ROW["need"]] > 0)
            need, cols = slots[at], snap.cols
            compiled_add_waits(out, at, _memory_waits(snap, need, out[_ROW["over"], at], cols.active_blocks[need],
                                                      cols.capacity[need]), w)
        snap.set_reports(slots, **dict(zip(_REPORTED, out, strict=False)))
        return out[_ROW["score"]]

    def _priced_each(self, snap: Snapshot, slots: np.ndarray) -> np.ndarray:
        """``score_slots`` candidate by candidate, on Python numbers from end to end: each one's inputs read off
        the columns as floats, ``_inputs`` and ``CostModel.terms`` with ``SCALAR_OPS``, each candidate's terms an
        ``Estimate``, whose reports and score add them in ``Estimates``' order (IEEE doubles either way: the same
        to the last bit)."""
        req, costs = snap.request, snap.costs
        p = costs.params
        bs, n_keys, tail, reuse = req.block_size, len(req.keys), snap.tail, snap.reuse
        partial, held = _partial(req), held_share(snap)
        sel = _selection(snap, slots)
        at = slots.tolist()
        named = _candidate_columns(snap, snap.match_arrays())
        names = [*named, "shared"]
        columns = [column[sel].tolist() for column in named.values()]
        columns.append(snap.shared_prefix_blocks(slots).tolist())
        state, ids = snap._state, snap.ids
        w = p.kv_load_weight if self.params.kv_load_weight is None else self.params.kv_load_weight
        priced = []
        one = SimpleNamespace()
        for i, values in zip(at, zip(*columns, strict=True), strict=True):
            one.__dict__.update(zip(names, values, strict=True))
            pending, running, kv, cap, used, new, need, over = _inputs(SCALAR_OPS, one, n_keys, tail, bs, p,
                                                                       partial)
            wait = _release_wait_s(snap, i, over, one.active, one.capacity) if need else 0.0
            resident = float(state.resident_tokens(ids[i])) if one.capacity > 0 else 0.0
            one_row = _objective_columns(SCALAR_OPS, snap, one, pending, running, kv, cap, used, new, resident, wait,
                                         held)
            est = Estimate(*costs.terms(SCALAR_OPS, one_row, reuse))  # type: ignore[arg-type]
            est.kv_load_weight = w  # (the scorer's own weight, as ``Estimates.scores(w)`` takes it)
            priced.append(est)
        snap.set_reports(slots, **{name: [getattr(e, name) for e in priced] for name in _REPORTED})
        return np.array([e.score for e in priced])


_compiled_params_of: list = [None, ()]  # (the last CostParams, its tuple): a router prices with one set of them


def _compiled_params(p: CostParams) -> tuple[float, ...]:
    """The cost parameters ``compiled_price`` reads, in its order (made once per ``CostParams``: they are
    frozen; compared by identity, as hashing the dataclass would cost more than making the tuple)."""
    if _compiled_params_of[0] is not p:
        t = p.timing
        _compiled_params_of[:] = [p, (p.waiting_prompt_tokens, p.remaining_fraction, p.step_token_budget,
                                      p.storage_ms_per_token, t.prefill_a, t.prefill_b, t.prefill_c, t.decode_a,
                                      t.decode_b, t.decode_c, t.load_back_ms_per_token, p.kv_watermark)]
    return _compiled_params_of[1]


def _selection(snap: Snapshot, slots: np.ndarray) -> slice | np.ndarray:
    """What picks ``slots`` out of the fleet's columns: every worker in order (the usual case) takes the columns
    as they are, no copies."""
    return slice(None) if len(slots) == snap.size and all_set(slots == np.arange(snap.size)) else slots


def _candidate_columns(snap: Snapshot, match: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The fleet's columns ``_inputs`` and ``_objective_columns`` read, by the names they read them by (every
    slot: the caller selects the candidates'); ``shared``, computed per candidate, is the caller's."""
    cols = snap.cols
    return {"has_load": cols.has_load, "requests": cols.requests, "decoding": cols.decoding,
            "active": cols.active_blocks, "pending": cols.pending, "capacity": cols.capacity, "fresh": snap.fresh,
            "waiting": cols.waiting, "running": cols.running, "kv": cols.kv, "gpu": match["matched_gpu"],
            "cpu": match["matched_cpu"], "storage": match["matched_storage"], "output_tokens": cols.output_tokens,
            "ttft_slope": cols.ttft_slope, "decode_slope": cols.decode_slope, "batch_limit": cols.batch_limit}


def _partial(req: Any) -> int:
    """The request's partial last prompt block (0 or 1), admitted with its full ones."""
    return prompt_blocks_to_admit(req.prompt_tokens, len(req.keys), req.block_size)


def held_share(snap: Snapshot) -> float:
    """The requests flow control holds, as many as would wait behind this one on each worker: an even share of
    them (``FleetState.held_requests``)."""
    held = snap._state.held_requests()
    return held / snap.size if held and snap.size else 0.0


def _inputs(xp: Any, c: SimpleNamespace, n_keys: int, tail: int, bs: int, p: CostParams, partial: int) -> tuple:
    """What the objective reads of the candidates ``c`` holds (arrays with ``xp`` numpy, one candidate's numbers
    with ``SCALAR_OPS``): pending prefill tokens, running requests and KV use with the engine's counts where its
    metrics are fresh (``Columns.add``'s rules), the capacity and the blocks in use now (``blocks_in_use``), the
    blocks this request adds, whether it must wait for memory to be admitted and how many blocks it lacks
    (``admission_lack``: its prompt's new blocks, ``partial`` its partial last block, against those free now and
    the prompts of other routers' requests waiting there; the router's own are in the blocks in use already)."""
    has_w = xp.logical_and(c.fresh, xp.logical_not(xp.isnan(c.waiting)))
    has_r = xp.logical_and(c.fresh, xp.logical_not(xp.isnan(c.running)))
    has_kv = xp.logical_and(c.fresh, xp.logical_not(xp.isnan(c.kv)))
    ours = c.requests - c.decoding
    # other routers' requests waiting there: their prompts are not in the blocks in use, and go first
    others = xp.where(has_w, xp.maximum(0.0, xp.trunc(xp.where(has_w, c.waiting, 0.0)) - ours), 0.0) \
        * p.waiting_prompt_tokens
    pending = c.pending + others
    running = xp.where(has_r, xp.maximum(c.decoding, xp.trunc(xp.where(has_r, c.running, 0.0))), c.decoding)
    kv = xp.where(has_kv, c.kv, 0.0)
    cap = xp.floor_divide(c.capacity, bs)
    used = blocks_in_use(xp, xp.logical_and(cap > 0, has_kv), kv, cap, c.active, c.output_tokens, bs,
                         p.remaining_fraction)
    new = n_keys - c.shared + tail
    over = admission_lack(xp, cap, used, others, n_keys - c.shared + partial, bs, p.kv_watermark)
    waits = xp.logical_and(xp.logical_and(c.capacity > 0, c.has_load), c.requests > 0)
    need = xp.logical_and(waits, over > 0)
    return pending, running, kv, cap, used, new, need, over


def _objective_columns(xp: Any, snap: Snapshot, c: SimpleNamespace, pending: Any, running: Any, kv: Any, cap: Any,
                       used: Any, new: Any, resident: Any, wait: Any, held: float = 0.0) -> SimpleNamespace:
    """What ``CostModel.terms`` reads (``Columns``' names), from ``_inputs``' results and the candidates' own:
    the decode steps it waits for a place in the batch where the engine's fresh counts and its batch limit are
    known (``slot_steps``, ``Columns.add``'s rule), and the requests waiting there (the engine's count or the
    router's own, the larger) with ``held``, the share of those flow control holds (``held_share``)."""
    req = snap.request
    limited = xp.logical_and(xp.logical_and(c.fresh, c.batch_limit > 0),
                             xp.logical_and(xp.logical_not(xp.isnan(c.waiting)), xp.logical_not(xp.isnan(c.running))))
    has_w = xp.logical_and(c.fresh, xp.logical_not(xp.isnan(c.waiting)))
    ours = c.requests - c.decoding
    waiting = xp.where(has_w, xp.maximum(ours, xp.trunc(xp.where(has_w, c.waiting, 0.0))), ours)
    return SimpleNamespace(
        prompt_tokens=req.prompt_tokens, block_size=req.block_size, max_tokens=req.max_tokens, gpu=c.gpu, cpu=c.cpu,
        storage=c.storage, pending=pending, running=running,
        others_left=snap.costs.params.remaining_fraction * c.output_tokens, inflight=xp.maximum(c.requests, running),
        cap_blocks=cap, used=used, kv=kv, new_blocks=new, resident=resident, memory_wait=wait,
        ttft_slope=c.ttft_slope, decode_slope=c.decode_slope,
        slot_steps=slot_steps(xp, limited, c.waiting, c.running, c.requests, c.output_tokens, c.batch_limit,
                              req.max_tokens), behind=waiting + held)


def _memory_waits(snap: Snapshot, slots: np.ndarray, blocks: np.ndarray, active: np.ndarray, capacity: np.ndarray
                  ) -> np.ndarray:
    """The memory wait of each of ``slots`` (workers with requests in flight whose room lacks ``blocks``): up to
    ``SCALAR_WAITS`` each worker's own binary search, which costs less than the arrays; more, one search over
    the fleet's padded release schedules (the same answer)."""
    if len(slots) <= SCALAR_WAITS:
        return np.array([_release_wait_s(snap, i, b, a, c) for i, b, a, c in
                         zip(slots.tolist(), blocks.tolist(), active.tolist(), capacity.tolist(), strict=True)])
    cols = snap.cols
    step = _decode_step_s(snap.costs.params.timing, cols.decode_intercept[slots], cols.decode_slope[slots],
                          active * snap.request.block_size / capacity)
    return cols.release_waits(slots, blocks, step, snap.now)


def _release_wait_s(snap: Snapshot, slot: int, blocks: float, active: float, capacity: float) -> float:
    """One worker's memory wait: until its requests in flight free ``blocks`` (its own binary search)."""
    wid = snap.ids[slot]
    step = snap.costs.profile(wid).decode_step_s(int(active) * snap.request.block_size / int(capacity))
    return snap._state.load.release_wait_s(wid, int(blocks), snap.now, step)


def _decode_step_s(t: StepTiming, intercept: np.ndarray, slope: np.ndarray, kv_usage: np.ndarray) -> np.ndarray:
    """``EngineProfile.decode_step_s`` over arrays, with the same operations in the same order (the release
    schedules are kept per decode step, so the step must come out the same to the last bit)."""
    p = np.minimum(np.maximum(kv_usage, 0.0), 1.0)
    return intercept + slope * (np.maximum(0.0, t.decode_a * p * p + t.decode_b * p + t.decode_c) / 1000.0)
