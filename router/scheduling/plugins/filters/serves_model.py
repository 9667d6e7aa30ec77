"""``serves-model``: only workers serving the requested model (or LoRA adapter) in the requested role (a
prefill-only worker never generates; a decode-only one never prefills for another)."""

from __future__ import annotations

import numpy as np

from router.scheduling.columns import ROLE_CODES
from router.scheduling.masks import all_slots
from router.scheduling.plugins.base import Filter
from router.scheduling.snapshot import Candidate, Snapshot
from router.scheduling.types import Endpoint


class ServesModel(Filter):
    type_name = "serves-model"

    def filter(self, snap: Snapshot, cand: Candidate) -> str | None:
        assert cand.endpoint is not None
        return self._why(snap, cand.endpoint)

    def mask(self, snap: Snapshot) -> np.ndarray:
        req, cols = snap.request, snap.cols
        model, lora, role, eps = req.model, req.lora, req.role, snap.endpoint_list
        if not lora and (model is None or not cols.any_models):  # every worker serves the model: roles only
            if cols.all_roles_both:
                return all_slots(snap.size)  # the usual fleet
            if role in ROLE_CODES:
                return (cols.role_code == ROLE_CODES["both"]) | (cols.role_code == ROLE_CODES[role])
        # ``Endpoint.serves`` written inline: a method call per worker is most of this filter's cost
        if lora:
            ok = (ep.role in ("both", role) and lora in ep.loras for ep in eps)
        elif model is None:
            ok = (ep.role in ("both", role) for ep in eps)
        else:
            ok = (ep.role in ("both", role) and (not ep.models or model in ep.models) for ep in eps)
        return np.fromiter(ok, dtype=bool, count=snap.size)

    def reason(self, snap: Snapshot, slot: int) -> str:
        why = self._why(snap, snap.endpoint_list[slot])
        assert why is not None
        return why

    @staticmethod
    def _why(snap: Snapshot, ep: Endpoint) -> str | None:
        req = snap.request
        if ep.serves(req.model, req.lora, req.role):
            return None
        if ep.role not in ("both", req.role):
            return f"role {ep.role}: not a {req.role} worker"
        name = req.lora or str(req.model)  # the client's: cut, or a 5 MB name made each decision's reason 15 MB
        return f"does not serve {'LoRA ' if req.lora else 'model '}{name[:256] + '...' if len(name) > 256 else name}"
