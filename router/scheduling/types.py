"""What the routing core is asked and what it answers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Protocol

from router.scheduling.slo import NO_OBJECTIVE, ServiceObjective


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
    # how many field writes every Endpoint has seen (its own class attribute, not a field): callers may set a
    # flag directly (``ep.healthy = False``), and the fleet's columns of flags are rebuilt when this moves
    writes: ClassVar[int] = 0

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        Endpoint.writes += 1

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
    objective: ServiceObjective = NO_OBJECTIVE  # TTFT/TPOT targets and priority (router/scheduling/slo.py)


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
    adapter_load_s: float = 0.0  # the LoRA adapter's load priced there (router/scheduling/lora.py; 0: none, or
    # one that would also wait for a slot)
    behind_s: float = 0.0  # the wait its prefill adds to the requests waiting there, all of them together
    preempt_s: float = 0.0  # its expected recompute, should decode there run out of KV blocks (cost.py)
    score: float = 0.0
    inflight: int = 0

    @property
    def matched_blocks(self) -> int:
        return self.matched_gpu + self.matched_cpu + self.matched_storage

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in REPORT_FIELDS}


REPORT_FIELDS = tuple(f.name for f in fields(CandidateReport))


class DecisionReports(Protocol):
    """Where a decision's candidate reports come from when they are built on demand."""

    def report(self, worker_id: str) -> CandidateReport | None: ...

    def all(self) -> list[CandidateReport]: ...

    def prefix_credited(self) -> bool: ...


@dataclass(slots=True)
class Decision:
    policy: str
    # chosen first, then fallbacks (a list, or a picker's ``Sequence`` that orders its tail when read)
    ranked: Sequence[str] = field(default_factory=list)
    outcome: str = "routed"  # routed | shed | no_endpoint
    reason: str = ""
    retry_after_s: float = 1.0
    uncached_tokens: int = 0  # estimated on the chosen worker
    predicted_ttft_s: float | None = None
    predicted_tpot_s: float | None = None  # the decode step predicted on the chosen worker
    disagg: dict[str, Any] | None = None  # the prefill/decode split considered for it (PrefillPlan.explain)
    # the candidates' reports: a list, or built from the decision's snapshot when first read (``attach``)
    _candidates: list[CandidateReport] | None = field(default=None, repr=False)
    _source: DecisionReports | None = field(default=None, repr=False)

    @property
    def chosen(self) -> str | None:
        return self.ranked[0] if self.ranked else None

    @property
    def candidates(self) -> list[CandidateReport]:
        """Every candidate's report: the eligible ones in the fleet's order, then the filtered ones (built on
        first read when the decision came with a source: a thousand workers cost a thousand objects only when
        someone asks for all of them)."""
        if self._candidates is None:
            self._candidates = self._source.all() if self._source is not None else []
        return self._candidates

    @candidates.setter
    def candidates(self, reports: list[CandidateReport]) -> None:
        self._candidates, self._source = list(reports), None

    def attach(self, source: DecisionReports) -> None:
        """Build the candidates' reports from ``source`` when read."""
        self._candidates, self._source = None, source

    def report(self, worker_id: str) -> CandidateReport | None:
        """The report of one candidate (the chosen worker, a fallback), without building the others'."""
        if self._candidates is None and self._source is not None:
            return self._source.report(worker_id)
        return next((c for c in self.candidates if c.worker_id == worker_id), None)

    @property
    def prefix_credited(self) -> bool:
        """Whether any eligible candidate could be credited a prefix (what the decision metrics count), without
        building the reports."""
        if self._candidates is None and self._source is not None:
            return self._source.prefix_credited()
        return any(c.prefix_credit for c in self.candidates if not c.filtered)

    def as_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "outcome": self.outcome, "reason": self.reason, "ranked": list(self.ranked),
                "uncached_tokens": self.uncached_tokens, "predicted_ttft_s": self.predicted_ttft_s,
                "predicted_tpot_s": self.predicted_tpot_s, "disagg": self.disagg,
                "candidates": [c.as_dict() for c in self.candidates]}
