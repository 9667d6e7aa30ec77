"""The routing core: filters, then a policy's ranking, with the reasons kept. Pure: callers pass ``now``.

The proxy, the endpoint picker and the simulator all hold one ``RoutingCore`` and call ``decide`` per
request, then ``dispatched`` / ``first_token`` / ``completed`` as the request moves. The index is fed
separately (``IndexFeeder``); the core only reads it, and gives a worker prefix credit only while its
index is synced and fresh (and credit for what it sent there in the last seconds, the speculative prefix,
also while that index resyncs).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from router.events.feed import IndexFeeder
from router.index import KvIndex, Medium, PrefixMatch
from router.index.speculative import SpeculativePrefixes
from router.load import EngineMetrics, LoadTracker, WorkerLoad, tail_blocks
from router.scheduling.cost import CostModel, CostParams
from router.scheduling.filters import FILTERS, SATURATED
from router.scheduling.policies import POLICIES, Policy
from router.scheduling.types import CandidateReport, Decision, Endpoint, RouteRequest


@dataclass
class RoutingConfig:
    policy: str = "precise"
    block_size: int = 16
    stale_after_s: float = 10.0  # no events this long while taking requests: no prefix credit
    speculative_ttl_s: float = 2.0
    max_inflight_requests: int | None = 512
    max_inflight_tokens: int | None = None
    metrics_max_age_s: float = 2.0
    approx_capacity_blocks: int = 2_000_000
    cost: CostParams = field(default_factory=CostParams)
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose from {sorted(POLICIES)}")
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")


class RoutingCore:
    def __init__(self, config: RoutingConfig | None = None, feeder: IndexFeeder | None = None) -> None:
        self.config = config or RoutingConfig()
        self.feeder = feeder or IndexFeeder(KvIndex(), block_size=self.config.block_size)
        self.index = self.feeder.index
        self.load = LoadTracker()
        self.cost = CostModel(self.config.cost)
        self.speculative = SpeculativePrefixes(self.config.speculative_ttl_s)
        self.metrics: dict[str, EngineMetrics] = {}
        self.cache_tokens: dict[str, int] = {}  # per worker: GPU KV-cache capacity in tokens, when reported
        self.endpoints: dict[str, Endpoint] = {}
        self.rng = random.Random(self.config.seed)
        # per worker: the first dispatch not yet followed by any KV event (for staleness)
        self._awaiting_events_since: dict[str, float] = {}
        self.policy: Policy = POLICIES[self.config.policy](self)
        self._now = 0.0

    # ---- fleet -------------------------------------------------------------------------------
    def upsert_endpoint(self, ep: Endpoint) -> None:
        self.endpoints[ep.worker_id] = ep

    def remove_endpoint(self, worker_id: str) -> None:
        self.endpoints.pop(worker_id, None)
        self.feeder.remove_worker(worker_id)
        self.load.forget_worker(worker_id)
        self.speculative.forget_worker(worker_id)
        self.metrics.pop(worker_id, None)
        self.cache_tokens.pop(worker_id, None)
        self._awaiting_events_since.pop(worker_id, None)

    def update_metrics(self, worker_id: str, metrics: EngineMetrics) -> None:
        self.metrics[worker_id] = metrics
        if metrics.cache_tokens:
            self.cache_tokens[worker_id] = metrics.cache_tokens

    def resident_tokens(self, worker_id: str) -> int:
        """What the worker's GPU cache holds, by the index."""
        return self.index.blocks_held_on(worker_id, Medium.GPU) * self.config.block_size

    def fresh_metrics(self, worker_id: str, now: float | None = None) -> EngineMetrics | None:
        """The worker's engine metrics if scraped within ``metrics_max_age_s`` of ``now`` (default: the time of
        the decision being made)."""
        m = self.metrics.get(worker_id)
        return m.fresh(self._now if now is None else now, self.config.metrics_max_age_s) if m else None

    def index_state(self, worker_id: str, now: float) -> str:
        """synced | unsynced | unverified | stale | no-events: only 'synced' earns prefix credit. A query: no
        side effects.

        A worker not heard from yet counts as synced and empty (that never over-credits it). It is unverified
        after failing to answer, until its next batch shows whether it restarted. It turns stale when it has
        been taking requests for ``stale_after_s`` without publishing a single event.
        """
        ep = self.endpoints.get(worker_id)
        if ep is not None and not ep.events:
            return "no-events"
        feed = self.feeder.feeds.get(worker_id)
        if feed is not None and not feed.synced:
            return "unsynced"
        if feed is not None and feed.suspect_since is not None:
            return "unverified"
        since = self._awaiting_events_since.get(worker_id)
        if since is not None and not self._heard_since(worker_id, since) and now - since > self.config.stale_after_s:
            return "stale"
        return "synced"

    def _heard_since(self, worker_id: str, since: float) -> bool:
        feed = self.feeder.feeds.get(worker_id)
        return feed is not None and feed.last_event_at is not None and feed.last_event_at >= since

    def worker_failed(self, worker_id: str, now: float) -> None:
        """A worker failed to answer (probe or request): it may be restarting with an empty cache, so its
        prefix credit, from the index and from what was just sent there, ends until its events prove its state."""
        self.feeder.suspend(worker_id, now)
        self.speculative.forget_worker(worker_id)

    def memory_wait_s(self, worker_id: str, req: RouteRequest, load: WorkerLoad | None, capacity: int | None,
                      now: float) -> float:
        """Until the requests in flight there free room for this request's KV blocks; 0 if they fit now."""
        if not capacity or load is None or not load.requests:
            return 0.0
        # its prompt blocks no request in flight holds, and its partial block and output: engines admit on
        # what is free now, but a cache that cannot hold every request to its last token preempts (recompute)
        tail = tail_blocks(req.prompt_tokens, len(req.keys), req.max_tokens, req.block_size)
        room = capacity // req.block_size - load.active_blocks
        if len(req.keys) + tail <= room:
            return 0.0  # fits even without the blocks it shares with requests in flight
        over = len(req.keys) - load.shared_prefix_blocks(req.keys) + tail - room
        if over <= 0:
            return 0.0
        return self.load.release_wait_s(worker_id, over, now, self.cost.params.decode_step_s)

    # ---- deciding ----------------------------------------------------------------------------
    def decide(self, req: RouteRequest, now: float) -> Decision:
        self._now = now
        policy = self.policy
        decision = Decision(policy.name)
        eligible: list[CandidateReport] = []
        filtered: list[CandidateReport] = []
        for ep in self.endpoints.values():
            reason = None
            for f in FILTERS:
                reason = f(ep, req, self)
                if reason:
                    break
            report = CandidateReport(ep.worker_id, filtered=reason)
            (filtered if reason else eligible).append(report)
        if not eligible:
            saturated = any(r.filtered == SATURATED for r in filtered)
            decision.outcome = "shed" if saturated else "no_endpoint"
            decision.reason = "every eligible worker is saturated" if saturated else (
                "no eligible endpoint: " + "; ".join(f"{r.worker_id}: {r.filtered}" for r in filtered)
                if filtered else "no endpoints known")
            decision.candidates = filtered
            return decision

        matches = self.index.match(req.keys) if req.keys else {}
        spec = self.speculative.match(req.keys, now) if req.keys else {}
        credited = 0
        held: dict[str, PrefixMatch | None] = {}
        for r in eligible:
            r.state = self.index_state(r.worker_id, now)
            r.prefix_credit = r.state == "synced"
            m = matches.get(r.worker_id) if r.prefix_credit else None
            if m is not None:
                r.matched_gpu, r.matched_cpu, r.matched_storage = m.gpu, m.cpu, m.storage
            # what we sent there in the last seconds stays true while its index resyncs (a replay in flight)
            r.speculative = spec.get(r.worker_id, 0) if r.state in ("synced", "unsynced") else 0
            if r.speculative > r.matched_gpu + r.matched_cpu + r.matched_storage:
                # blocks on their way to this worker: count them as they will be (on GPU)
                r.matched_gpu, r.matched_cpu, r.matched_storage = r.speculative, 0, 0
                m = PrefixMatch(r.speculative)
            held[r.worker_id] = m
            credited += r.prefix_credit
        best_held = max((r.matched_gpu + r.matched_cpu + r.matched_storage for r in eligible), default=0)
        for r in eligible:
            load = self.load.workers.get(r.worker_id)
            r.inflight = load.requests if load else 0
            duplicate = (best_held - r.matched_gpu - r.matched_cpu - r.matched_storage) * req.block_size
            capacity = self.cache_tokens.get(r.worker_id)
            est = self.cost.estimate(r.worker_id, req.prompt_tokens, req.block_size, held[r.worker_id], load,
                                     self.fresh_metrics(r.worker_id), duplicate,
                                     self.resident_tokens(r.worker_id) if capacity else 0, capacity,
                                     self.memory_wait_s(r.worker_id, req, load, capacity, now))
            r.queue_s, r.prefill_s, r.decode_s, r.ttft_s = est.queue_s, est.prefill_s, est.decode_s, est.ttft_s
            r.interference_s, r.eviction_s = est.interference_s, est.eviction_s
            r.score = est.score
        decision.ranked = policy.rank(req, eligible)
        by_id = {r.worker_id: r for r in eligible}
        chosen = by_id[decision.ranked[0]]
        decision.uncached_tokens = req.prompt_tokens - min(
            (chosen.matched_gpu + chosen.matched_cpu + chosen.matched_storage) * req.block_size,
            max(req.prompt_tokens - 1, 0))
        decision.predicted_ttft_s = chosen.ttft_s
        if policy.uses_prefix and not credited:
            decision.reason = "load only: no worker's index is synced and fresh"
        elif policy.uses_prefix:
            decision.reason = f"min estimated TTFT {chosen.ttft_s * 1e3:.1f} ms"
        else:
            decision.reason = policy.name
        decision.candidates = eligible + filtered
        return decision

    # ---- request lifecycle ---------------------------------------------------------------------
    def dispatched(self, req: RouteRequest, worker_id: str, decision: Decision, now: float) -> None:
        report = next((c for c in decision.candidates if c.worker_id == worker_id), None)
        if report is not None:
            hit = (report.matched_gpu + report.matched_cpu + report.matched_storage) * req.block_size
            uncached = req.prompt_tokens - min(hit, max(req.prompt_tokens - 1, 0))
            predicted = report.ttft_s
        else:
            uncached, predicted = decision.uncached_tokens, decision.predicted_ttft_s
        self.load.dispatch(req.request_id, worker_id, req.prompt_tokens, uncached, req.max_tokens, now, predicted,
                           req.keys, req.block_size)
        since = self._awaiting_events_since.get(worker_id)
        if since is None or self._heard_since(worker_id, since):  # the first dispatch not yet followed by events
            self._awaiting_events_since[worker_id] = now
        if req.keys:
            self.speculative.record(worker_id, req.keys, now)
        self.policy.on_dispatch(req, worker_id, now)

    def first_token(self, request_id: str, now: float, learn: bool = True) -> None:
        """``learn``: fold this TTFT into the worker's cost factor (only when the first token was seen as such)."""
        r = self.load.first_token(request_id, now)
        if r is not None and learn:
            self.cost.observe(r.worker_id, r.predicted_ttft_s, now - r.dispatched_at)

    def completed(self, request_id: str, now: float) -> None:
        self.load.complete(request_id, now)
