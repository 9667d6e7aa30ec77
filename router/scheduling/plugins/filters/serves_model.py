"""``serves-model``: only workers serving the requested model (or LoRA adapter) in the requested role (a
prefill-only worker never generates; a decode-only one never prefills for another)."""

from __future__ import annotations

from operator import attrgetter

import numpy as np

from router.scheduling.plugins.base import Filter
from router.scheduling.snapshot import Candidate, Snapshot
from router.scheduling.types import Endpoint

_MODELS, _ROLE = attrgetter("models"), attrgetter("role")


class ServesModel(Filter):
    type_name = "serves-model"

    def filter(self, snap: Snapshot, cand: Candidate) -> str | None:
        assert cand.endpoint is not None
        return self._why(snap, cand.endpoint)

    def mask(self, snap: Snapshot) -> np.ndarray:
        req = snap.request
        model, lora, role, eps = req.model, req.lora, req.role, snap.endpoint_list
        every_role = list(map(_ROLE, eps)).count("both") == len(eps)
        if every_role and not lora and (model is None or not any(map(_MODELS, eps))):
            return np.ones(snap.size, dtype=bool)  # the usual fleet: every worker serves every model, both roles
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
        return f"does not serve {'LoRA ' + req.lora if req.lora else 'model ' + str(req.model)}"
