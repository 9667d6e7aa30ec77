"""The routing core: composes the fleet state, the configured scheduling profile and the request lifecycle.
Pure: callers pass ``now``.

Per decision a ``Snapshot`` is built once from the state; the profile's filters drop candidates, its
weighted scorers price the rest, its picker orders them. The proxy, the endpoint picker and the simulator
call ``decide`` and then drive the ``Dispatch`` handle ``dispatch`` returns. The index is fed separately
(``IndexFeeder``); prefix credit is given only while a worker's index is synced (and, for what was just sent
there, the speculative prefix, also while that index resyncs).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from router.events.feed import IndexFeeder
from router.index import INDEX_LAYOUTS
from router.load import EngineMetrics
from router.scheduling.cost import CostParams
from router.scheduling.disagg import DisaggParams, PrefillPlan, plan_prefill
from router.scheduling.lifecycle import Dispatch
from router.scheduling.masks import all_set, all_slots, any_set, set_slots
from router.scheduling.plugins.base import Scorer, Unservable
from router.scheduling.plugins.filters.admission import SATURATED
from router.scheduling.plugins.pickers.meets_objective import targets_text
from router.scheduling.profiles import (
    SchedulingConfig,
    build_profile,
    builtin_profiles,
    parse_scheduling,
    profile_names,
)
from router.scheduling.snapshot import Snapshot
from router.scheduling.state import FleetState
from router.scheduling.types import CandidateReport, Decision, Endpoint, RouteRequest, hit_tokens


@dataclass
class RoutingConfig:
    policy: str = "precise"  # a built-in profile or one of scheduling.profiles
    block_size: int = 16
    stale_after_s: float = 10.0  # no events this long while taking requests: no prefix credit
    speculative_ttl_s: float = 2.0
    max_inflight_requests: int | None = 512
    max_inflight_tokens: int | None = None
    metrics_max_age_s: float = 2.0
    approx_capacity_blocks: int = 2_000_000
    index: str = "dicts"  # the KV index's layout: dicts (fastest up to a few hundred workers) | compact (1,000+)
    cost: CostParams = field(default_factory=CostParams)
    disaggregation: DisaggParams = field(default_factory=DisaggParams)  # with prefill workers in the fleet
    scheduling: SchedulingConfig = field(default_factory=SchedulingConfig)
    seed: int | None = None

    def __post_init__(self) -> None:
        self.scheduling = parse_scheduling(self.scheduling)
        if self.policy not in profile_names(self.scheduling):
            raise ValueError(f"unknown policy {self.policy!r}; choose from {profile_names(self.scheduling)}")
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")
        if self.index not in INDEX_LAYOUTS:
            raise ValueError(f"unknown index layout {self.index!r}; choose from {sorted(INDEX_LAYOUTS)}")


SATURATED_REASON = "every eligible worker is saturated"  # the admission filter's shed (the proxy words its own)


class RoutingCore:
    def __init__(self, config: RoutingConfig | None = None, feeder: IndexFeeder | None = None) -> None:
        self.config = cfg = config or RoutingConfig()
        self.state = FleetState(cfg.block_size, stale_after_s=cfg.stale_after_s,
                                speculative_ttl_s=cfg.speculative_ttl_s, metrics_max_age_s=cfg.metrics_max_age_s,
                                cost=cfg.cost, feeder=feeder or IndexFeeder(INDEX_LAYOUTS[cfg.index](),
                                                                            block_size=cfg.block_size))
        self.rng = random.Random(cfg.seed)
        builtin = builtin_profiles(cfg.max_inflight_requests, cfg.max_inflight_tokens, cfg.approx_capacity_blocks)
        self.profile = build_profile(cfg.policy, cfg.scheduling, self.rng, builtin)
        self.dispatches: dict[str, Dispatch] = {}  # in flight, by the router's request id
        self._release_listeners: list[Callable[[], None]] = []  # told when a request in flight ends

    # the state's parts, for the adapters that feed them and the tools that read them
    @property
    def feeder(self) -> IndexFeeder:
        return self.state.feeder

    @property
    def index(self):  # type: ignore[no-untyped-def]
        return self.state.index

    @property
    def load(self):  # type: ignore[no-untyped-def]
        return self.state.load

    @property
    def cost(self):  # type: ignore[no-untyped-def]
        return self.state.cost

    @property
    def endpoints(self) -> dict[str, Endpoint]:
        return self.state.endpoints

    @property
    def cache_tokens(self) -> dict[str, int]:
        return self.state.cache_tokens

    @property
    def policy_name(self) -> str:
        return self.profile.name

    # ---- fleet -------------------------------------------------------------------------------
    def upsert_endpoint(self, ep: Endpoint) -> None:
        self.state.upsert_endpoint(ep)

    def remove_endpoint(self, worker_id: str) -> None:
        for rid in [rid for rid, d in self.dispatches.items() if d.worker_id == worker_id]:
            del self.dispatches[rid]
        self.state.remove_endpoint(worker_id)

    def scrape_sent(self, worker_id: str) -> None:
        self.state.scrape_sent(worker_id)

    def update_metrics(self, worker_id: str, metrics: EngineMetrics) -> None:
        self.state.update_metrics(worker_id, metrics)

    def worker_failed(self, worker_id: str, now: float) -> None:
        self.state.worker_failed(worker_id, now)

    def set_healthy(self, worker_id: str, healthy: bool) -> bool:
        return self.state.set_healthy(worker_id, healthy)

    def set_draining(self, worker_id: str, draining: bool) -> bool:
        return self.state.set_draining(worker_id, draining)

    def serves_nobody(self, req: RouteRequest) -> bool:
        """No endpoint of the fleet, healthy or not, serves the model (or adapter) ``req`` names: the client asked
        for something that does not exist here (a 404), not for something that is down (a 503)."""
        if req.model is None and not req.lora:
            return False
        return not any(ep.serves(req.model, req.lora, req.role) for ep in self.state.endpoints.values())

    def lora_of(self, model: str | None) -> str | None:
        return self.state.lora_of(model)

    def resident_tokens(self, worker_id: str) -> int:
        return self.state.resident_tokens(worker_id)

    def fresh_metrics(self, worker_id: str, now: float) -> EngineMetrics | None:
        return self.state.fresh_metrics(worker_id, now)

    def index_state(self, worker_id: str, now: float) -> str:
        return self.state.index_state(worker_id, now)

    def readiness(self, now: float) -> tuple[bool, str]:
        return self.state.readiness(now)

    # ---- deciding ----------------------------------------------------------------------------
    def decide(self, req: RouteRequest, now: float, exclude: frozenset[str] = frozenset()) -> Decision:
        """``exclude``: workers this decision may not pick (the decode worker, when choosing its prefill one).

        Works on the snapshot's slots: each filter's mask (or, for a filter without one, its per-candidate
        verdict on the slots still in), the scorers' arrays, the picker's order. The decision's candidate
        reports are built when read (``Decision.report``, ``Decision.candidates``)."""
        profile = self.profile
        snap = Snapshot(self.state, req, now)
        decision = Decision(profile.name)
        n = snap.size
        passing = all_slots(n)
        reasons = snap.reasons
        if exclude:
            for wid in exclude:
                i = snap.slot.get(wid)
                if i is not None:
                    passing[i] = False
                    reasons[i] = "excluded: the request's decode worker"
        for f in profile.filters:
            ok = f.mask(snap)
            if ok is None:  # a per-candidate filter: asked of the slots still in
                for i in set_slots(passing).tolist():
                    why = f.filter(snap, snap.candidate(i))
                    if why:
                        passing[i] = False
                        reasons[i] = why
                continue
            if all_set(ok):  # (the usual case: it drops no one)
                continue
            dropped = passing & ~ok
            if any_set(dropped):
                for i in set_slots(dropped).tolist():
                    reasons[i] = f.reason(snap, i)
                passing &= ok
        for i in snap._built:  # candidates a per-candidate filter built carry their verdict
            snap.candidate(i).filtered = reasons.get(i)
        eligible = set_slots(passing)
        filtered = sorted(reasons)
        if not len(eligible):
            saturated = any(reasons[i] == SATURATED for i in filtered)
            decision.outcome = "shed" if saturated else "no_endpoint"
            ids = snap.ids
            decision.reason = SATURATED_REASON if saturated else (
                "no eligible endpoint: " + "; ".join(f"{ids[i]}: {reasons[i]}" for i in filtered)
                if filtered else "no endpoints known")
            decision.candidates = snap.candidates_at(filtered)
            return decision
        snap.set_eligible_slots(eligible)
        scorers = profile.scorers
        if len(scorers) == 1 and scorers[0][1] == 1.0:
            totals = _scores(scorers[0][0], snap, eligible)
            totals = totals.tolist() if isinstance(totals, np.ndarray) else list(totals)
        else:
            acc = np.zeros(len(eligible))
            for scorer, weight in scorers:
                acc += weight * np.asarray(_scores(scorer, snap, eligible), dtype=float)
            totals = acc.tolist()
        snap.set_scores(eligible, totals)
        try:
            ranked = profile.picker.rank(snap, eligible, totals)
            if ranked is None:
                ranked = profile.picker.pick(snap, snap.eligible, totals)
        except Unservable as refusal:
            decision.outcome, decision.reason = "shed", str(refusal)
            decision.attach(SnapshotReports(snap, [*eligible.tolist(), *filtered]))
            return decision
        decision.ranked = ranked
        chosen = snap.candidate(snap.slot[ranked[0]])
        decision.uncached_tokens = req.prompt_tokens - hit_tokens(chosen.matched_blocks, req.block_size,
                                                                  req.prompt_tokens)
        decision.predicted_ttft_s = chosen.ttft_s or None
        decision.predicted_tpot_s = chosen.step_s or None
        if profile.uses_prefix and not snap.prefix_credited():
            decision.reason = "load only: no worker's index is synced and fresh"
        elif chosen.ttft_s and req.objective.has_targets:
            decision.reason = (f"{profile.name}: predicted TTFT {chosen.ttft_s * 1e3:.1f} ms, TPOT "
                               f"{chosen.step_s * 1e3:.1f} ms{targets_text(req.objective)}")
        elif chosen.ttft_s:
            decision.reason = f"{profile.name}: min estimated TTFT {chosen.ttft_s * 1e3:.1f} ms"
        else:
            decision.reason = profile.name if not profile.scorers else f"{profile.name}: score {chosen.score:.4g}"
        decision.attach(SnapshotReports(snap, [*eligible.tolist(), *filtered]))
        return decision

    def plan_prefill(self, req: RouteRequest, decision: Decision, now: float) -> PrefillPlan | None:
        """Prefill/decode disaggregation (router/scheduling/disagg.py): the prefill half of ``decision``'s
        request, when splitting pays (``decision.disagg`` says why, either way); None: served where it decodes."""
        return plan_prefill(self, req, decision, self.config.disaggregation, now)

    # ---- request lifecycle ---------------------------------------------------------------------
    def dispatch(self, req: RouteRequest, decision: Decision, worker_id: str, now: float) -> Dispatch:
        """Send ``req`` to ``worker_id`` (normally ``decision.chosen``): the handle the caller drives."""
        old = self.dispatches.get(req.request_id)
        if old is not None:  # the same id dispatched again replaces the first attempt
            old.fail(now)
        handle = Dispatch(self.state, self.profile.plugins, req, decision, worker_id, now, self._ended)
        self.dispatches[req.request_id] = handle
        return handle

    def _ended(self, request_id: str) -> None:
        self.dispatches.pop(request_id, None)
        for listener in self._release_listeners:
            listener()

    def add_release_listener(self, listener: Callable[[], None]) -> None:
        """``listener()`` is called whenever a request in flight ends (capacity moved: flow control looks again;
        router/frontends/flow_gate.py)."""
        self._release_listeners.append(listener)

    def first_token(self, request_id: str, now: float, learn: bool = True) -> None:
        """For callers that know a request by its id only (the simulator's engine outputs)."""
        d = self.dispatches.get(request_id)
        if d is not None:
            d.first_token(now, learn)

    def completed(self, request_id: str, now: float, served: bool = True, output_tokens: int | None = None) -> None:
        d = self.dispatches.get(request_id)
        if d is not None:
            d.complete(now, served, output_tokens)


def _scores(scorer: Scorer, snap: Snapshot, slots: np.ndarray) -> np.ndarray | Sequence[float]:
    """A scorer's costs for ``slots``: its vector form, or its per-candidate one on the candidates there."""
    out = scorer.score_slots(snap, slots)
    return out if out is not None else scorer.score(snap, snap.eligible)


class SnapshotReports:
    """A decision's candidate reports, built from its snapshot when read: one for the chosen worker or a
    fallback, all of them (eligible first, in the fleet's order, then the filtered) for the full list."""

    __slots__ = ("_order", "_snap")

    def __init__(self, snap: Snapshot, order: list[int]) -> None:
        self._snap, self._order = snap, order

    def report(self, worker_id: str) -> CandidateReport | None:
        i = self._snap.slot.get(worker_id)
        return None if i is None or i >= self._snap.size else self._snap.candidate(i)

    def all(self) -> list[CandidateReport]:
        return list(self._snap.candidates_at(self._order))

    def prefix_credited(self) -> bool:
        return self._snap.prefix_credited()
