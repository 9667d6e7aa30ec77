"""``latency-cost``: the estimated cost of sending the request to each candidate, from event-fed residency,
load and the engines' learned costs (router/scheduling/cost.py): its own TTFT (queue, uncached prefill,
load-back, decode interference, memory wait) plus what it costs others (weighted interference, compute and
evicted cache). The ``precise`` profile's one scorer."""

from __future__ import annotations

from collections.abc import Sequence

from router.scheduling.plugins.base import Scorer
from router.scheduling.snapshot import Candidate, Snapshot


class LatencyCost(Scorer):
    type_name = "latency-cost"
    uses_prefix = True

    def score(self, snap: Snapshot, cands: Sequence[Candidate]) -> list[float]:
        req, costs = snap.request, snap.costs
        matches, best_held = snap.matches(), snap.best_held()
        prompt, block_size, step_s = req.prompt_tokens, req.block_size, costs.params.decode_step_s
        estimate, resident, memory_wait = costs.estimate, snap.resident_tokens, snap.memory_wait_s
        out = []
        for c in cands:
            r = c
            match = matches.get(c.worker_id)
            duplicate = (best_held - r.matched_gpu - r.matched_cpu - r.matched_storage) * block_size
            capacity = c.capacity_tokens
            est = estimate(c.worker_id, prompt, block_size, match, c.load, c.metrics, duplicate,
                           resident(c) if capacity else 0, capacity, memory_wait(c, step_s))
            r.queue_s, r.prefill_s, r.decode_s, r.ttft_s = est.queue_s, est.prefill_s, est.decode_s, est.ttft_s
            r.interference_s, r.eviction_s = est.interference_s, est.eviction_s
            out.append(est.score)
        return out
