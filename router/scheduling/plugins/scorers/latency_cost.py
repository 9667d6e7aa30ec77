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
        best_held = snap.best_held()
        out = []
        for c in cands:
            r = c.report
            match = snap.prefix(c)
            duplicate = (best_held - r.matched_blocks) * req.block_size
            capacity = c.capacity_tokens
            est = costs.estimate(c.worker_id, req.prompt_tokens, req.block_size, match, c.load, c.metrics, duplicate,
                                 snap.resident_tokens(c) if capacity else 0, capacity,
                                 snap.memory_wait_s(c, costs.params.decode_step_s))
            r.queue_s, r.prefill_s, r.decode_s, r.ttft_s = est.queue_s, est.prefill_s, est.decode_s, est.ttft_s
            r.interference_s, r.eviction_s = est.interference_s, est.eviction_s
            out.append(est.score)
        return out
