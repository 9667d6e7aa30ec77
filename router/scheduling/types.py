"""What the routing core is asked and what it answers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any


def hit_tokens(matched_blocks: int, block_size: int, prompt_tokens: int) -> int:
    """Prompt tokens a worker holding ``matched_blocks`` of the prompt skips: the engine always computes the
    last prompt token (its logits start the output), so even a full hit prefills one. The one place this
    rule is written."""
    return min(matched_blocks * block_size, max(prompt_tokens - 1, 0))


@dataclass(slots=True)
class Endpoint:
    """A worker the router may send requests to (one engine, or one data-parallel rank of it)."""

    worker_id: str
    address: str  # "ip:port", what Envoy's destination header carries
    models: frozenset[str] = frozenset()  # empty: serves whatever is asked
    loras: frozenset[str] = frozenset()
    healthy: bool = True
    draining: bool = False
    url: str = ""  # http base URL, for the proxy
    events: bool = True  # publishes KV events (else it can only ever be routed on load)
    role: str = "both"  # prefill | decode | both (prefill/decode disaggregation: router/scheduling/disagg.py)

    def serves(self, model: str | None, lora: str | None, role: str = "decode") -> bool:
        """``role``: what the request asks of it: ``decode`` (generate: every request, aggregated or the decode
        side of a split) or ``prefill`` (compute the prompt's KV for a decode worker)."""
        if self.role != "both" and self.role != role:
            return False
        if lora:
            return lora in self.loras
        return not self.models or model is None or model in self.models


@dataclass(slots=True)
class RouteRequest:
    request_id: str
    keys: Sequence[int]  # block keys of the prompt (router/keys.py)
    prompt_tokens: int
    block_size: int
    max_tokens: int = 16
    model: str | None = None
    lora: str | None = None
    session: str | None = None  # session affinity key (e.g. a header value)
    subset: frozenset[str] | None = None  # worker ids or addresses the gateway allows
    role: str = "decode"  # decode (generate) | prefill (the prefill half of a disaggregated request)


@dataclass(slots=True)
class CandidateReport:
    """Why a candidate was, or was not, chosen: for logs and the debug endpoint."""

    worker_id: str
    filtered: str | None = None
    state: str = "synced"  # index state: synced | unsynced | stale | no-events
    prefix_credit: bool = True
    matched_gpu: int = 0
    matched_cpu: int = 0
    matched_storage: int = 0
    speculative: int = 0
    queue_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    ttft_s: float = 0.0
    interference_s: float = 0.0
    stall_s: float = 0.0  # of interference_s: the decode steps its prefill stalls there
    eviction_s: float = 0.0
    step_s: float = 0.0  # the decode step it would see there (s per output token)
    model_ttft_s: float = 0.0  # its TTFT by the engine timing alone, before the worker's fit (what the fit learns on)
    model_step_s: float = 0.0
    score: float = 0.0
    inflight: int = 0

    @property
    def matched_blocks(self) -> int:
        return self.matched_gpu + self.matched_cpu + self.matched_storage

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in REPORT_FIELDS}


REPORT_FIELDS = tuple(f.name for f in fields(CandidateReport))


@dataclass(slots=True)
class Decision:
    policy: str
    ranked: list[str] = field(default_factory=list)  # chosen first, then fallbacks
    outcome: str = "routed"  # routed | shed | no_endpoint
    reason: str = ""
    candidates: list[CandidateReport] = field(default_factory=list)
    retry_after_s: float = 1.0
    uncached_tokens: int = 0  # estimated on the chosen worker
    predicted_ttft_s: float | None = None
    disagg: dict[str, Any] | None = None  # the prefill/decode split considered for it (PrefillPlan.explain)

    @property
    def chosen(self) -> str | None:
        return self.ranked[0] if self.ranked else None

    def as_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "outcome": self.outcome, "reason": self.reason, "ranked": self.ranked,
                "uncached_tokens": self.uncached_tokens, "predicted_ttft_s": self.predicted_ttft_s,
                "disagg": self.disagg,
                "candidates": [c.as_dict() for c in self.candidates]}
