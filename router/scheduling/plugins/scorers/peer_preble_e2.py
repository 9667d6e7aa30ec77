"""``preble-e2``: Preble's E2 (exploit / explore) placement, as costs that rank its choice first.

Described in Srivatsa et al., "Preble: Efficient Distributed Prompt Scheduling for LLM Serving" (ICLR 2025), section
3.2 and Algorithm 1 (E2), and its code (WukLab/preble ``multi_node/global_scheduler_with_time.py``; AIBrix ships a
port as ``prefix-cache-preble``):
- exploit: when the prompt's cached part (at the worker holding the longest prefix of it) is longer than its uncached
  part, go to the holders of that longest prefix, the least loaded of them first;
- explore: otherwise every worker is priced as load + eviction cost + this request's prefill, and the cheapest wins:
  load = prefill time x miss rate of its requests + their decode time; eviction = what recomputing the cached tokens
  this request would push out costs; prefill = this request's uncached prefill there.

Approximations (stated): Preble's load sums the requests of a 3-minute window; here it is what the router has in
flight there: the prefill time of its pending uncached tokens (``WorkerLoad.pending_prefill_tokens``, already net of
hits: the miss rate) plus decode = running requests (the router's decoding count, or the engine's running count when
higher) x this request's ``max_tokens`` x the worker's decode step at its KV usage (half when unknown; Preble:
active requests x mean output length x time per output token). Eviction: the uncached tokens beyond the worker's
free room (capacity from ``vllm:cache_config_info`` minus what the index says it holds), at their prefill price;
unknown capacity, none. Times are the engines' cost model (``snap.costs.prefill_s``, as ``latency-cost`` prices
prefill). Preble's replication of a prefix whose TTFT doubled inside the window, and its rebalancing, are not
modelled.
Costs: in exploit the holders cost ``-1 / (1 + load)`` (below every explore cost, the least loaded first), the
others their explore cost (the fallbacks); in explore every worker costs its explore cost, in seconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.scheduling.plugins.base import Scorer
from router.scheduling.snapshot import Candidate, Snapshot
from router.scheduling.types import hit_tokens


@dataclass(frozen=True)
class PrebleParams:
    exploit_ratio: float = 1.0  # exploit when cached tokens > exploit_ratio x uncached tokens (Preble: 1)
    eviction_weight: float = 1.0


class PrebleE2(Scorer):
    type_name = "preble-e2"
    Params = PrebleParams
    uses_prefix = True

    def load_s(self, snap: Snapshot, cand: Candidate) -> tuple[float, float]:
        """(prefill time of the work pending there, decode time of the requests running there)."""
        costs, load, m = snap.costs, cand.load, cand.metrics
        queue = costs.prefill_s(load.pending_prefill_tokens) if load else 0.0
        running = load.decoding if load else 0
        if m is not None and m.running is not None:
            running = max(running, int(m.running))
        usage = m.kv_usage if m is not None and m.kv_usage is not None else 0.5
        return queue, running * snap.request.max_tokens * costs.profile(cand.worker_id).decode_step_s(usage)

    def score(self, snap: Snapshot, cands: Sequence[Candidate]) -> list[float]:
        req, costs, p = snap.request, snap.costs, self.params
        prompt, bs = req.prompt_tokens, req.block_size
        held = [(m.total if m else 0) for m in (snap.prefix(c) for c in cands)]
        best = max(held)
        cached = hit_tokens(best, bs, prompt)
        exploit = best > 0 and cached > p.exploit_ratio * (prompt - cached)
        out = []
        for c, blocks in zip(cands, held, strict=True):
            queue, decode = self.load_s(snap, c)
            load = queue + decode
            uncached = prompt - hit_tokens(blocks, bs, prompt)
            prefill = costs.prefill_s(uncached)
            eviction = 0.0
            if c.capacity_tokens:
                free = max(0, c.capacity_tokens - snap.resident_tokens(c))
                eviction = costs.prefill_s(uncached - free)
            c.queue_s, c.prefill_s, c.eviction_s = queue, prefill, eviction  # what /debug/decision shows
            if exploit and blocks == best:
                out.append(-1.0 / (1.0 + load))
            else:
                out.append(load + p.eviction_weight * eviction + prefill)
        return out
