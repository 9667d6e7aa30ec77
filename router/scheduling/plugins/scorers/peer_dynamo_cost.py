"""``dynamo-cost``: NVIDIA Dynamo's KV-router worker cost, in KV blocks (lower is better, as in Dynamo).

Described in ai-dynamo/dynamo's router docs (router concepts: the cost function) and its selector
(``lib/kv-router/src/scheduling/selector.rs``, ``DefaultWorkerSelector::worker_logit``; earlier
``lib/llm/src/kv_router/scheduler.rs``), defaults from its router config (``overlap_score_credit`` 1.0,
``host_cache_hit_weight`` 0.75, ``disk_cache_hit_weight`` 0.25, ``prefill_load_scale`` 1.0)::

    prefill_blocks = (active prefill tokens at the worker + this prompt's tokens) / block_size
    overlap_credit = 1.0 x device-held + 0.75 x host-held + 0.25 x disk-held prefix blocks
    decode_blocks  = the worker's active KV blocks + this request's blocks not already active there
    cost           = prefill_load_scale x max(prefill_blocks - overlap_credit, 0) + decode_blocks

From the router's own accounting: active prefill tokens are ``WorkerLoad.pending_prefill_tokens`` (uncached tokens of
requests without a first token); active blocks are what Dynamo's sequence tracker counts by default (prompt blocks
only, ``router_track_output_blocks: false``, a prefix shared by requests in flight once): the distinct full prompt
blocks in flight (``WorkerLoad.active_keys``) plus one partial block per request in flight (Dynamo's
``ceil(isl / block_size)``; a prompt that fills its last block exactly is counted one block over);
``track_output_blocks`` counts the router's ``WorkerLoad.active_blocks`` instead (each request's output to its last
token, where Dynamo's option adds output blocks as they are generated). This request's blocks are
``ceil(prompt / block_size)`` less the leading ones a request in flight there already holds. The overlap tiers are
``snap.prefix(c)``: GPU blocks, then the CPU blocks extending them, then storage. Selection is the picker's:
``min-score`` (Dynamo's temperature 0, random among equal costs; Dynamo breaks ties by the smaller radix tree first)
or ``softmax``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.scheduling.plugins.base import Scorer
from router.scheduling.snapshot import Candidate, Snapshot


@dataclass(frozen=True)
class DynamoCostParams:
    prefill_load_scale: float = 1.0
    overlap_score_credit: float = 1.0  # device (GPU) hits
    host_cache_hit_weight: float = 0.75  # CPU-tier hits
    disk_cache_hit_weight: float = 0.25  # storage-tier hits
    track_output_blocks: bool = False  # Dynamo's router_track_output_blocks (off by default)


class DynamoCost(Scorer):
    type_name = "dynamo-cost"
    Params = DynamoCostParams
    uses_prefix = True

    def score(self, snap: Snapshot, cands: Sequence[Candidate]) -> list[float]:
        p, req = self.params, snap.request
        bs = req.block_size
        request_blocks = -(-req.prompt_tokens // bs)
        out = []
        for c in cands:
            m, load = snap.prefix(c), c.load
            credit = 0.0 if m is None else (p.overlap_score_credit * m.gpu + p.host_cache_hit_weight * m.cpu
                                            + p.disk_cache_hit_weight * m.storage)
            pending = load.pending_prefill_tokens if load else 0
            prefill_blocks = (pending + req.prompt_tokens) / bs
            new_blocks = request_blocks - (load.shared_prefix_blocks(req.keys) if load else 0)
            active = 0
            if load is not None:
                active = load.active_blocks if p.track_output_blocks else len(load.active_keys) + load.requests
            decode_blocks = active + new_blocks
            out.append(p.prefill_load_scale * max(prefill_blocks - credit, 0.0) + decode_blocks)
        return out
