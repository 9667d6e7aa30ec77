"""``serves-model``: only workers serving the requested model (or LoRA adapter) in the requested role (a
prefill-only worker never generates; a decode-only one never prefills for another)."""

from __future__ import annotations

from router.scheduling.plugins.base import Filter
from router.scheduling.snapshot import Candidate, Snapshot


class ServesModel(Filter):
    type_name = "serves-model"

    def filter(self, snap: Snapshot, cand: Candidate) -> str | None:
        req = snap.request
        if cand.endpoint.serves(req.model, req.lora, req.role):
            return None
        if cand.endpoint.role not in ("both", req.role):
            return f"role {cand.endpoint.role}: not a {req.role} worker"
        return f"does not serve {'LoRA ' + req.lora if req.lora else 'model ' + str(req.model)}"
