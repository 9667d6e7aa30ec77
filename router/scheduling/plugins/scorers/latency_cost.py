"""``latency-cost``: the routing objective (router/scheduling/cost.py), in seconds of user-visible latency: this
request's own TTFT and decode on each candidate plus what sending it there costs the requests already there
(their decodes stalled by its prefill and slowed by its KV) and the expected re-prefill of the cached blocks it
pushes out. Inputs: event-fed residency, the router's in-flight accounting, fresh engine metrics, each worker's
fitted engine profile and the fleet's observed reuse of evicted blocks. The ``precise`` profile's one scorer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.load import tail_blocks
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
        estimate, resident, memory_wait, reuse = costs.estimate, snap.resident_tokens, snap.memory_wait_s, snap.reuse
        weight = self.params.kv_load_weight
        out = []
        for c in cands:
            r = c
            load, capacity = c.load, c.capacity_tokens
            new = len(keys) - (load.shared_prefix_blocks(keys) if load else 0) + tail
            step = costs.profile(c.worker_id).decode_step_s(
                load.active_blocks * block_size / capacity if load and capacity else 0.0)
            est = estimate(c.worker_id, prompt, block_size, matches.get(c.worker_id), load, c.metrics,
                           max_tokens=req.max_tokens, new_blocks=new,
                           resident_tokens=resident(c) if capacity else 0, capacity_tokens=capacity,
                           memory_wait_s=memory_wait(c, step), reuse=reuse)
            r.queue_s, r.prefill_s, r.decode_s, r.ttft_s = est.queue_s, est.prefill_s, est.decode_s, est.ttft_s
            r.interference_s, r.eviction_s, r.step_s = est.interference_s, est.eviction_s, est.step_s
            r.stall_s = est.stall_s
            r.model_ttft_s, r.model_step_s = est.model_ttft_s, est.model_step_s
            if weight is not None:
                est.kv_load_weight = weight
            out.append(est.score)
        return out
