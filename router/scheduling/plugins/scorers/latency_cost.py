"""``latency-cost``: the routing objective (router/scheduling/cost.py), in seconds of user-visible latency: this
request's own TTFT and decode on each candidate plus what sending it there costs the requests already there
(their decodes stalled by its prefill and slowed by its KV) and the expected re-prefill of the cached blocks it
pushes out. Inputs: event-fed residency, the router's in-flight accounting, fresh engine metrics, each worker's
fitted engine profile and the fleet's observed reuse of evicted blocks. The ``precise`` profile's one scorer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.load import tail_blocks
from router.scheduling.cost import Columns
from router.scheduling.plugins.base import Scorer
from router.scheduling.snapshot import Candidate, Snapshot


@dataclass(frozen=True)
class LatencyCostParams:
    # how the KV-load terms (own decode, the slowdown brought to others) count; None: the cost model's
    # ``kv_load_weight`` (1: every second alike); 0: TTFT first, as the ``precise_ttft`` profile
    kv_load_weight: float | None = None


class LatencyCost(Scorer):
    type_name = "latency-cost"
    Params = LatencyCostParams
    uses_prefix = True

    def score(self, snap: Snapshot, cands: Sequence[Candidate]) -> list[float]:
        req, costs = snap.request, snap.costs
        matches = snap.matches()
        prompt, block_size, keys = req.prompt_tokens, req.block_size, req.keys
        tail = tail_blocks(prompt, len(keys), req.max_tokens, block_size)
        resident, memory_wait, profile = snap.resident_tokens, snap.memory_wait_s, costs.profile
        cols = Columns(prompt, block_size, req.max_tokens)
        add = cols.add
        for c in cands:
            load, capacity = c.load, c.capacity_tokens
            new = len(keys) - (load.shared_prefix_blocks(keys) if load else 0) + tail
            wait = 0.0
            if capacity and load is not None and load.requests:  # a memory wait needs requests to wait for
                wait = memory_wait(c, profile(c.worker_id).decode_step_s(load.active_blocks * block_size / capacity))
            add(costs, c.worker_id, matches.get(c.worker_id), load, c.metrics, new,
                resident(c) if capacity else 0, capacity, wait)
        est = costs.estimate_many(cols, snap.reuse)
        out = est.scores(self.params.kv_load_weight)
        ttft = est.queue_s + est.prefill_s
        for c, q, pf, dec, t, stall, slow, ev, st, mt, ms in zip(
                cands, est.queue_s.tolist(), est.prefill_s.tolist(), est.decode_s.tolist(), ttft.tolist(),
                est.stall_s.tolist(), est.slowdown_s.tolist(), est.eviction_s.tolist(), est.step_s.tolist(),
                est.model_ttft_s.tolist(), est.model_step_s.tolist(), strict=True):
            c.queue_s, c.prefill_s, c.decode_s, c.ttft_s = q, pf, dec, t  # what /debug/decision shows
            c.stall_s, c.interference_s, c.eviction_s, c.step_s = stall, stall + slow, ev, st
            c.model_ttft_s, c.model_step_s = mt, ms
        return out.tolist()
