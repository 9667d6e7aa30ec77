"""Prefill/decode disaggregation: which decode worker, whether to prefill elsewhere, and on which prefill worker.

Decode-first, as llm-d's default profile handler: the decode worker is the ordinary decision (the profile over
the workers that generate: role ``decode`` or ``both``). Then the split is priced with the routing objective
(``CostModel.estimate``), in seconds:

    local  = the decode worker prefilling the uncached part itself: its queue + prefill + the decode steps that
             prefill stalls for the requests running there (the reason to split at all)
    remote = the best prefill worker's queue + prefill of what *it* lacks + the stall there (none on a pure
             prefill worker) + the KV transfer of the whole prompt (bytes per token from the model shape over
             the link) + the decode worker's queue (the KV is admitted there behind the prefill pending, first
             come first served) + its step for the last, partial block

``conditional`` splits when remote < local (a short uncached part is faster prefilled where it decodes),
``always`` whenever a prefill worker is eligible, ``never`` not at all. The prefill worker is chosen by the same
profile, over the workers that prefill (role ``prefill`` or ``both``, the decode worker excluded), for a request
of one output token. Pure: callers pass ``now``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from router.scheduling.plugins.scorers.latency_cost import LatencyCost
from router.scheduling.snapshot import Candidate, Snapshot
from router.scheduling.types import Decision, RouteRequest

if TYPE_CHECKING:
    from router.scheduling.core import RoutingCore

MODES = ("conditional", "always", "never")


@dataclass(frozen=True)
class DisaggParams:
    mode: str = "conditional"  # conditional | always | never
    # KV bytes per prompt token: 2 (K and V) x layers x KV heads x head dim x dtype bytes (Llama-3-8B in bf16:
    # 2 x 32 x 8 x 128 x 2 = 131072)
    kv_bytes_per_token: int = 131072
    link_gbit_s: float = 100.0  # the KV transfer link between prefill and decode workers
    transfer_setup_s: float = 0.001  # per transfer: the handshake and the first byte

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"disaggregation mode must be one of {MODES}, not {self.mode!r}")
        if self.kv_bytes_per_token <= 0 or self.link_gbit_s <= 0:
            raise ValueError("kv_bytes_per_token and link_gbit_s must be positive")

    def transfer_s(self, tokens: int) -> float:
        return self.transfer_setup_s + tokens * self.kv_bytes_per_token * 8 / (self.link_gbit_s * 1e9)


@dataclass
class PrefillPlan:
    """The prefill half of a split request: where, and why."""

    worker_id: str
    request: RouteRequest  # the prefill request (one output token), for its own dispatch
    decision: Decision  # the prefill worker's decision (its candidates explain it)
    local_s: float
    remote_s: float
    transfer_s: float
    undo_credit: Callable[[], None] | None = None

    def fall_back(self) -> None:
        """The prefill failed: the decode worker prefills it after all (its decision's report says so again)."""
        if self.undo_credit is not None:
            self.undo_credit()
            self.undo_credit = None


def prefill_request(req: RouteRequest) -> RouteRequest:
    return RouteRequest(req.request_id + ":prefill", req.keys, req.prompt_tokens, req.block_size, 1, req.model,
                        req.lora, req.session, req.subset, "prefill")


def plan_prefill(core: RoutingCore, req: RouteRequest, decision: Decision, params: DisaggParams,
                 now: float) -> PrefillPlan | None:
    """Whether the request ``decision`` sends to its decode worker should be prefilled on another worker;
    ``decision.disagg`` says why, either way. None: served where it decodes (aggregated)."""
    decode_id = decision.chosen
    if params.mode == "never" or decode_id is None or decision.outcome != "routed":
        return None
    # a fleet is disaggregated when it has prefill workers; then workers of both roles may prefill too, but a fleet
    # of ordinary workers never splits a request between two of them
    if not core.state.prefill_only:
        return None
    here = _priced(core, req, decode_id, now)
    local_s = here.queue_s + here.prefill_s + here.stall_s + here.eviction_s
    preq = prefill_request(req)
    pdec = core.decide(preq, now, exclude=frozenset({decode_id}))
    transfer = params.transfer_s(req.prompt_tokens)
    info: dict[str, Any] = {"mode": params.mode, "decode": decode_id, "local_s": round(local_s, 6),
                            "transfer_s": round(transfer, 6)}
    decision.disagg = info
    if pdec.outcome != "routed" or pdec.chosen is None:
        info.update(prefill=None, split=False, reason=f"no prefill worker: {pdec.reason}")
        return None
    prefill_id = pdec.chosen
    there = _priced(core, preq, prefill_id, now)
    # the KV arrives to the decode worker's queue: it is admitted behind the prefill pending there (FCFS), then
    # computes its last, partial block beside the decodes: one step
    remote_s = (there.queue_s + there.prefill_s + there.stall_s + there.eviction_s + transfer + here.queue_s
                + here.step_s)
    split = params.mode == "always" or remote_s < local_s
    info.update(prefill=prefill_id, remote_s=round(remote_s, 6), split=split,
                reason=("always split" if params.mode == "always" else
                        f"remote {remote_s * 1e3:.1f} ms {'<' if split else '>='} local {local_s * 1e3:.1f} ms"))
    if not split:
        return None
    undo = _credit_transfer(decision, req)
    return PrefillPlan(prefill_id, preq, pdec, local_s, remote_s, transfer, undo)


def _priced(core: RoutingCore, req: RouteRequest, worker_id: str, now: float) -> Candidate:
    """``req`` on ``worker_id`` priced by the routing objective's own scorer (its queue, prefill, stall, eviction
    and decode step there), whatever the profile's scorers are."""
    snap = Snapshot(core.state, req, now)
    cand = snap.candidate(snap.slot[worker_id])
    snap.eligible = [cand]
    LatencyCost().score(snap, [cand])
    return cand


def _credit_transfer(decision: Decision, req: RouteRequest) -> Callable[[], None]:
    """The prompt's KV arrives at the decode worker by transfer: its dispatch counts no prefill there. Returns
    how to take that back."""
    c = decision.report(decision.chosen)
    assert c is not None
    was = (c.matched_gpu, c.matched_cpu, c.matched_storage, c.prefill_s, c.queue_s, c.stall_s,
           decision.uncached_tokens)
    c.matched_gpu, c.matched_cpu, c.matched_storage = len(req.keys), 0, 0
    c.prefill_s = c.queue_s = c.stall_s = 0.0
    decision.uncached_tokens = req.prompt_tokens - len(req.keys) * req.block_size

    def undo() -> None:
        (c.matched_gpu, c.matched_cpu, c.matched_storage, c.prefill_s, c.queue_s, c.stall_s,
         decision.uncached_tokens) = was
        if decision.disagg is not None:
            decision.disagg["fell_back"] = True

    return undo
