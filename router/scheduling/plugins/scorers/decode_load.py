"""``decode-load``: the decode time a request spends, and adds to the others, at a candidate's KV load.

A decode step reads every running request's KV, so its length grows with the fraction of the cache in use
(engines are memory-bound there): ``step(p) = a p^2 + b p + c`` ms, ``p`` the fraction of KV blocks held by
requests in flight (Dynamo's mocker fit by default, the engine model's own). Sending a request to a worker
raises that worker's ``p`` by the blocks it adds beyond what its requests in flight already share (a prefix
they hold costs nothing; a second copy of it costs all its blocks), so the request decodes at ``step(p1)``,
and every request already there decodes the rest of its output one ``step(p1) - step(p0)`` slower per token.
Both are seconds users wait: ``max_tokens x step(p1) + remaining x (step(p1) - step(p0))``. This is what keeps
one hot prefix from piling every request onto its holder while its cache fills with their decodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.load import tail_blocks
from router.scheduling.plugins.base import Scorer
from router.scheduling.snapshot import Candidate, Snapshot


@dataclass(frozen=True)
class DecodeLoadParams:
    step_ms_a: float = -25.74  # decode step ms = a p^2 + b p + c (p: KV fraction in use)
    step_ms_b: float = 54.01
    step_ms_c: float = 5.74
    remaining_fraction: float = 0.5  # of the requests in flight's output still to come, on average


class DecodeLoad(Scorer):
    type_name = "decode-load"
    Params = DecodeLoadParams

    def step_s(self, p: float) -> float:
        q = self.params
        p = min(max(p, 0.0), 1.0)
        return max(0.0, q.step_ms_a * p * p + q.step_ms_b * p + q.step_ms_c) / 1000.0

    def score(self, snap: Snapshot, cands: Sequence[Candidate]) -> list[float]:
        req = snap.request
        tail = tail_blocks(req.prompt_tokens, len(req.keys), req.max_tokens, req.block_size)
        out = []
        for c in cands:
            cap = c.capacity_tokens
            if not cap:
                out.append(0.0)
                continue
            cap_blocks = max(1, cap // req.block_size)
            load = c.load
            used = float(load.active_blocks) if load else 0.0
            if c.metrics is not None and c.metrics.kv_usage is not None:
                used = max(used, c.metrics.kv_usage * cap_blocks)  # the engine's own view (other routers too)
            new = len(req.keys) - (load.shared_prefix_blocks(req.keys) if load else 0) + tail
            s0, s1 = self.step_s(used / cap_blocks), self.step_s((used + new) / cap_blocks)
            remaining = self.params.remaining_fraction * (load.output_tokens if load else 0)
            out.append(req.max_tokens * s1 + remaining * (s1 - s0))
        return out
