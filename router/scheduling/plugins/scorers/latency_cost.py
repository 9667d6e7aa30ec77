"""``latency-cost``: the routing objective (router/scheduling/cost.py), in seconds of user-visible latency: this
request's own TTFT and decode on each candidate plus what sending it there costs the requests already there
(their decodes stalled by its prefill and slowed by its KV) and the expected re-prefill of the cached blocks it
pushes out. Inputs: event-fed residency, the router's in-flight accounting, fresh engine metrics, each worker's
fitted engine profile and the fleet's observed reuse of evicted blocks. The ``precise`` profile's one scorer.

It reads the fleet's columns and prices every candidate with a few array operations; the per-worker work left
is the index's residency count and, only where the request's blocks do not fit beside the requests in flight,
the search for the blocks it shares with them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from router.scheduling.cost import CostParams
from router.scheduling.engine_profile import StepTiming
from router.scheduling.plugins.base import Scorer
from router.scheduling.snapshot import Candidate, Snapshot


@dataclass(frozen=True)
class LatencyCostParams:
    # how the KV-load terms (own decode, the slowdown brought to others) count; None: the cost model's
    # ``kv_load_weight`` (1: every second alike); 0: TTFT first, as the ``precise_ttft`` profile
    kv_load_weight: float | None = None


# up to this many workers needing a memory wait, each is asked its own (``LoadTracker.release_wait_s``); more:
# one binary search over the fleet's padded release schedules (the same answer; tests run both)
SCALAR_WAITS = 32

_REPORTED = ("queue_s", "prefill_s", "decode_s", "ttft_s", "stall_s", "interference_s", "eviction_s", "step_s",
             "model_ttft_s", "model_step_s")


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
        req, costs, cols = snap.request, snap.costs, snap.cols
        p: CostParams = costs.params
        bs, n_keys, tail = req.block_size, len(req.keys), snap.tail
        match = snap.match_arrays()
        # every worker in order (the usual case): the columns as they are, no copies
        sel = slice(None) if len(slots) == snap.size and bool((slots == np.arange(snap.size)).all()) else slots
        has_load = cols.has_load[sel]
        requests, decoding = cols.requests[sel], cols.decoding[sel]
        active = cols.active_blocks[sel]
        pending = cols.pending[sel]
        capacity = cols.capacity[sel]
        # the engine's counts, where its metrics are fresh (``Columns.add``'s rules, over arrays)
        fresh = snap.fresh[sel]
        waiting, running_m, kv = cols.waiting[sel], cols.running[sel], cols.kv[sel]
        has_w = fresh & ~np.isnan(waiting)
        has_r = fresh & ~np.isnan(running_m)
        has_kv = fresh & ~np.isnan(kv)
        ours = requests - decoding
        pending = pending + np.where(has_w, np.maximum(0.0, np.trunc(np.where(has_w, waiting, 0.0)) - ours), 0.0) \
            * p.waiting_prompt_tokens
        running = np.where(has_r, np.maximum(decoding, np.trunc(np.where(has_r, running_m, 0.0))), decoding)
        kv = np.where(has_kv, kv, 0.0)
        cap = np.floor_divide(capacity, bs)
        used = np.where((cap > 0) & has_kv, np.maximum(active, kv * cap), active)
        shared = snap.shared_prefix_blocks(slots)
        new = n_keys - shared + tail
        # memory wait: only where its blocks do not fit beside what the requests in flight hold
        wait = np.zeros(len(slots))
        waits = (capacity > 0) & has_load & (requests > 0)
        room = cap - active
        over = n_keys - shared + tail - room
        need = waits & (n_keys + tail > room) & (over > 0)
        if need.any():
            at = np.flatnonzero(need)
            if len(at) <= SCALAR_WAITS:  # a few: each worker's own binary search costs less than the arrays
                ids, profile, release_wait_s = snap.ids, costs.profile, snap._state.load.release_wait_s
                for k, i, blocks, a, c in zip(at.tolist(), slots[at].tolist(), over[at].tolist(),
                                              active[at].tolist(), capacity[at].tolist(), strict=True):
                    step = profile(ids[i]).decode_step_s(int(a) * bs / int(c))
                    wait[k] = release_wait_s(ids[i], int(blocks), snap.now, step)
            else:
                step = _decode_step_s(p.timing, cols.decode_intercept[slots[at]], cols.decode_slope[slots[at]],
                                      active[at] * bs / capacity[at])
                wait[at] = cols.release_waits(slots[at], over[at], step, snap.now)
        known = capacity > 0
        resident = np.zeros(len(slots))
        if known.any():
            resident[known] = snap.resident_blocks(slots[known]) * snap._state.block_size
        arrays = SimpleNamespace(
            prompt_tokens=req.prompt_tokens, block_size=bs, max_tokens=req.max_tokens,
            gpu=match["matched_gpu"][sel], cpu=match["matched_cpu"][sel],
            storage=match["matched_storage"][sel], pending=pending, running=running,
            others_left=p.remaining_fraction * cols.output_tokens[sel], inflight=np.maximum(requests, running),
            cap_blocks=cap, used=used, kv=kv, new_blocks=new, resident=resident, memory_wait=wait,
            ttft_slope=cols.ttft_slope[sel], decode_slope=cols.decode_slope[sel])
        est = costs.estimate_many(arrays, snap.reuse)  # type: ignore[arg-type]
        snap.set_reports(slots, queue_s=est.queue_s, prefill_s=est.prefill_s, decode_s=est.decode_s,
                         ttft_s=est.queue_s + est.prefill_s, stall_s=est.stall_s,
                         interference_s=est.stall_s + est.slowdown_s, eviction_s=est.eviction_s, step_s=est.step_s,
                         model_ttft_s=est.model_ttft_s, model_step_s=est.model_step_s)
        return est.scores(self.params.kv_load_weight)


def _decode_step_s(t: StepTiming, intercept: np.ndarray, slope: np.ndarray, kv_usage: np.ndarray) -> np.ndarray:
    """``EngineProfile.decode_step_s`` over arrays, with the same operations in the same order (the release
    schedules are kept per decode step, so the step must come out the same to the last bit)."""
    p = np.minimum(np.maximum(kv_usage, 0.0), 1.0)
    return intercept + slope * (np.maximum(0.0, t.decode_a * p * p + t.decode_b * p + t.decode_c) / 1000.0)
