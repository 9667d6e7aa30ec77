"""``llmd-lora-affinity``: the Gateway API Inference Extension's (and llm-d's) ``lora-affinity-scorer``, as a cost.

Described in GIE ``pkg/epp/scheduling/framework/plugins/scorer/lora_affinity.go``: a pod whose running requests
use the request's adapter scores 1.0; one with room for another adapter (its active plus waiting adapters fewer
than its ``max_lora``) 0.8; one where the adapter is only waiting 0.6; any other 0. From the engine's
``vllm:lora_requests_info`` alone (a scrape old). As a cost: ``1 - score``; a request without an adapter costs 0
everywhere (it changes nothing in a fleet without adapters).
"""

from __future__ import annotations

from collections.abc import Sequence

from router.scheduling.plugins.base import Scorer
from router.scheduling.snapshot import Candidate, Snapshot


class LlmdLoraAffinity(Scorer):
    type_name = "llmd-lora-affinity"

    def score(self, snap: Snapshot, cands: Sequence[Candidate]) -> list[float]:
        adapter = snap.request.lora
        if not adapter:
            return [0.0] * len(cands)
        out = []
        for c in cands:
            m = c.metrics
            if m is None:
                out.append(1.0)
            elif adapter in m.loras_running:
                out.append(0.0)
            elif m.max_loras is not None and len(m.loras_running) + len(m.loras_waiting) < m.max_loras:
                out.append(0.2)
            elif adapter in m.loras_waiting:
                out.append(0.4)
            else:
                out.append(1.0)
        return out
