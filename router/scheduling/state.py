"""The one owner of what the router knows about each worker. Pure: every query takes ``now``, none changes
anything.

Endpoint (address, models, health, draining), index sync (the event feed), engine metrics and cache capacity,
the router's own in-flight load, what it just sent where (speculative prefixes) and the engine costs learned
from observed TTFTs. The adapters (health probes, metric scrapes, the event subscriber, the simulator) write
it through the methods here; the scheduler reads it through a per-decision ``Snapshot``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from router.events.feed import IndexFeeder, WorkerFeed
from router.index import KvIndex, Medium
from router.index.speculative import SpeculativePrefixes
from router.load import BatchLimit, EngineMetrics, LoadTracker
from router.load.exchange import LoadExchange
from router.scheduling.columns import FleetColumns
from router.scheduling.cost import CostModel, CostParams
from router.scheduling.lora import AdapterLoads, LoraResidency
from router.scheduling.reuse import ReuseTracker
from router.scheduling.types import Endpoint

# index states in which a worker may be sent requests without harm to readiness (load-only or exact)
SERVABLE_STATES = ("synced", "unverified", "no-events")


class FleetState:
    def __init__(self, block_size: int, *, stale_after_s: float = 10.0, speculative_ttl_s: float = 2.0,
                 metrics_max_age_s: float = 2.0, cost: CostParams | None = None,
                 feeder: IndexFeeder | None = None) -> None:
        self.block_size = block_size
        self.stale_after_s = stale_after_s
        self.metrics_max_age_s = metrics_max_age_s
        self.feeder = feeder or IndexFeeder(KvIndex(), block_size=block_size)
        self.index = self.feeder.index
        self.load = LoadTracker()
        # set when replicas (or processes) share their in-flight load: the lifecycle publishes into it, and it
        # folds theirs into ``load`` (router/load/exchange.py)
        self.shared_load: LoadExchange | None = None
        self.speculative = SpeculativePrefixes(speculative_ttl_s)
        self.cost = CostModel(cost or CostParams())
        self.reuse = ReuseTracker(prior=self.cost.params.reuse_prior)  # P(an evicted block is asked for again)
        self.feeder.on_gpu_evicted = self.reuse.evicted
        self.endpoints: dict[str, Endpoint] = {}
        self.prefill_only: set[str] = set()  # workers whose role is prefill: the fleet is disaggregated if any
        self.metrics: dict[str, EngineMetrics] = {}
        self.cache_tokens: dict[str, int] = {}  # per worker: GPU KV-cache capacity in tokens, when reported
        # per worker: its batch limit as its scrapes have shown it (``BatchLimit``), once they have shown any
        self.batch_limits: dict[str, BatchLimit] = {}
        # per worker: the router's own (waiting, running, KV blocks) there when its metrics were scraped, and
        # when the scrape now under way was sent (the engine's counts are taken somewhere between the two)
        self.own_at_scrape: dict[str, tuple[int, int, float]] = {}
        self.own_at_scrape_sent: dict[str, tuple[int, int, float]] = {}
        # per worker: the first dispatch not yet followed by any KV event (for staleness)
        self.awaiting_events_since: dict[str, float] = {}
        self.changed: set[str] = set()  # workers whose metrics or capacity changed since the columns read them
        self.columns = FleetColumns(self)  # the per-worker facts a decision reads, as arrays
        self.loras = LoraResidency()  # the LoRA adapters each worker holds (router/scheduling/lora.py)
        self.adapter_loads = AdapterLoads(self.cost.params.lora_load_ms / 1000.0)  # and how long a load takes
        # how many requests flow control holds now (its owner sets this: router/frontends/flow_gate.py, the
        # simulator): each would wait behind a choice's prefill somewhere (the objective's ``behind`` term)
        self.held_requests: Callable[[], int] = _none_held

    # ---- writes ------------------------------------------------------------------------------
    def upsert_endpoint(self, ep: Endpoint) -> None:
        self.endpoints[ep.worker_id] = ep
        if ep.role == "prefill":
            self.prefill_only.add(ep.worker_id)
        else:
            self.prefill_only.discard(ep.worker_id)

    def remove_endpoint(self, worker_id: str) -> None:
        self.loras.forget(worker_id)
        self.endpoints.pop(worker_id, None)
        self.prefill_only.discard(worker_id)
        self.feeder.remove_worker(worker_id)
        self.load.forget_worker(worker_id)
        self.speculative.forget_worker(worker_id)
        self.metrics.pop(worker_id, None)
        self.own_at_scrape.pop(worker_id, None)
        self.own_at_scrape_sent.pop(worker_id, None)
        self.cache_tokens.pop(worker_id, None)
        self.batch_limits.pop(worker_id, None)
        self.cost.forget(worker_id)
        self.awaiting_events_since.pop(worker_id, None)

    def _own_counts(self, worker_id: str) -> tuple[int, int, float]:
        """The router's own (waiting, running, KV blocks in use) on a worker now; the blocks as
        ``cost.blocks_in_use`` counts them without the engine's figure: the footprint less the output still to
        come, so a dispatch since a scrape adds what its request holds, not its last token's blocks."""
        w = self.load.workers.get(worker_id)
        if w is None:
            return (0, 0, 0.0)
        held = w.active_blocks - self.cost.params.remaining_fraction * w.output_tokens / self.block_size
        return (w.requests - w.decoding, w.decoding, max(0.0, held))

    def scrape_sent(self, worker_id: str) -> None:
        """A metrics scrape of the worker is leaving now. The engine counts its requests at some moment before
        the answer comes back; a request of ours that ended in between is in its counts but not in ours at
        receipt, and would read as another router's until the next scrape."""
        self.own_at_scrape_sent[worker_id] = self._own_counts(worker_id)

    def update_metrics(self, worker_id: str, metrics: EngineMetrics) -> None:
        """A scrape. The engine's work counters going backwards mean a new process, even one that restarted
        between two probes without ever failing one: its cache is empty, so its credit ends until its events
        prove its state. What is the router's own in the engine's counts is the larger of its own counts when
        the scrape left (``scrape_sent``) and when it came back: the engine counted somewhere between, and
        taking the larger never counts one of ours as another router's. The engine's batch limit is learned
        from its counts (``BatchLimit``); a new process may run with other flags, so it learns anew."""
        prev = self.metrics.get(worker_id)
        if (prev is not None and prev.work_tokens is not None and metrics.work_tokens is not None
                and metrics.work_tokens < prev.work_tokens):
            self.worker_failed(worker_id, metrics.scraped_at)
            self.batch_limits.pop(worker_id, None)
        seen = self.batch_limits.get(worker_id) or BatchLimit()
        self.batch_limits[worker_id] = seen.seen(metrics, self._budget_bound(worker_id))
        self.metrics[worker_id] = metrics
        self.changed.add(worker_id)
        now_own, sent = self._own_counts(worker_id), self.own_at_scrape_sent.pop(worker_id, None)
        self.own_at_scrape[worker_id] = now_own if sent is None else tuple(map(max, now_own, sent))
        if metrics.cache_tokens and self.cache_tokens.get(worker_id) != metrics.cache_tokens:
            self.cache_tokens[worker_id] = metrics.cache_tokens
            self.reuse.set_window(sum(self.cache_tokens.values()) // self.block_size)  # the fleet's cache

    def _budget_bound(self, worker_id: str) -> bool:
        """Whether the prefill of the router's own requests not yet started on the worker (their uncached
        tokens: sizes it knows, unlike other routers') fills a step's token budget: requests may then wait
        there for the budget, not for a place in the batch."""
        w = self.load.workers.get(worker_id)
        return w is not None and w.pending_prefill_tokens >= self.cost.params.step_token_budget

    def set_healthy(self, worker_id: str, healthy: bool) -> bool:
        """Health as the probes (or requests) found it; returns whether it changed."""
        ep = self.endpoints.get(worker_id)
        if ep is None or ep.healthy == healthy:
            return False
        ep.healthy = healthy
        return True

    def set_draining(self, worker_id: str, draining: bool) -> bool:
        """Draining takes no new requests (``/admin/drain``, a terminating pod); False for an unknown worker."""
        ep = self.endpoints.get(worker_id)
        if ep is None:
            return False
        ep.draining = draining
        return True

    def worker_failed(self, worker_id: str, now: float) -> None:
        """A worker failed to answer (probe or request): it may be restarting with an empty cache, so its
        prefix credit, from the index and from what was just sent there, ends until its events prove its state."""
        self.feeder.suspend(worker_id, now)
        self.speculative.forget_worker(worker_id)

    def note_dispatch(self, worker_id: str, now: float) -> Callable[[], None] | None:
        """Start the staleness clock at the first dispatch not yet followed by events from the worker; returns how
        to take that back (the worker refused the request: nothing was computed, no event is owed)."""
        since = self.awaiting_events_since.get(worker_id)
        if since is not None and not self._heard_since(worker_id, since):
            return None
        self.awaiting_events_since[worker_id] = now

        def undo() -> None:
            if self.awaiting_events_since.get(worker_id) == now:
                if since is None:
                    del self.awaiting_events_since[worker_id]
                else:
                    self.awaiting_events_since[worker_id] = since

        return undo

    # ---- queries -----------------------------------------------------------------------------
    def lora_of(self, model: str | None) -> str | None:
        """``model`` when some worker serves it as a LoRA adapter (requests for it then key on the adapter)."""
        if model and any(model in ep.loras for ep in self.endpoints.values()):
            return model
        return None

    def resident_tokens(self, worker_id: str) -> int:
        """What the worker's GPU cache holds, by the index."""
        return self.index.blocks_held_on(worker_id, Medium.GPU) * self.block_size

    def fresh_metrics(self, worker_id: str, now: float) -> EngineMetrics | None:
        """The worker's engine metrics if scraped within ``metrics_max_age_s`` of ``now``; stale ones are
        unknown, never zero (a dead scrape must not make a busy worker look idle)."""
        m = self.metrics.get(worker_id)
        return m.fresh(now, self.metrics_max_age_s) if m else None

    def engine_view(self, worker_id: str, metrics: EngineMetrics | None) -> EngineMetrics | None:
        """A scrape brought up to date: the engine's counts are the router's own requests plus others' (other
        routers'); the scrape is up to a scrape interval old, and the router knows exactly what of its own has
        started and ended since, so only the part of the counts beyond its own at scrape time is taken from the
        engine. (A raw scrape would keep a worker that has just drained looking busy until the next one.)

        The engine may count as running one the router still counts as waiting (its first token is on the
        way): the router's waiting beyond the engine's waiting count are running there, so only the engine's
        running beyond those and the router's running are another router's.

        The KV in use is the engine's at the scrape with what the router's own have taken (dispatches) or freed
        (completions) since, each at what it holds (``_own_counts``: the footprint less the output to come): the
        engine's figure is the ground truth of the blocks in use
        now, which its own requests' footprints (every output to its last token) are not. (Before, the router's
        footprint at the scrape was taken off and the present one added back, so a worker whose requests hold
        far less now than at their ends read as full as their footprints: issue 51.)

        The view carries the engine's batch limit as learned (``batch_limits``): what the objective needs to
        count the requests there that wait for a place in its batch."""
        if metrics is None:
            return None
        seen = self.batch_limits.get(worker_id)
        limit = seen.limit if seen is not None else None
        at = self.own_at_scrape.get(worker_id)
        w = self.load.workers.get(worker_id)
        own = self._own_counts(worker_id)
        if at is None or w is None or at == own:
            return metrics if metrics.batch_limit == limit else replace(metrics, batch_limit=limit)
        waiting, running = own[0], own[1]
        m, cap = metrics, self.cache_tokens.get(worker_id)
        kv = m.kv_usage
        if kv is not None and cap:
            blocks = cap // self.block_size
            kv = min(1.0, max(0.0, kv * blocks + (own[2] - at[2])) / blocks)
        started = max(0.0, at[0] - m.waiting) if m.waiting is not None else 0.0  # ours waiting here, running there
        return EngineMetrics(None if m.waiting is None else max(0.0, m.waiting - at[0]) + waiting,
                             None if m.running is None else max(0.0, m.running - at[1] - started) + running,
                             kv, m.scraped_at, m.cache_tokens, m.work_tokens, m.loras_running, m.loras_waiting,
                             m.max_loras, limit)

    def index_state(self, worker_id: str, now: float) -> str:
        """synced | unsynced | unverified | stale | no-events: only 'synced' earns prefix credit.

        A worker not heard from yet counts as synced and empty (that never over-credits it). It is unverified
        after failing to answer, until its next batch shows whether it restarted. It turns stale when it has
        been taking requests for ``stale_after_s`` without publishing a single event.
        """
        return self.index_state_of(worker_id, self.endpoints.get(worker_id), self.feeder.feeds.get(worker_id), now)

    def index_state_of(self, worker_id: str, ep: Endpoint | None, feed: WorkerFeed | None, now: float) -> str:
        """``index_state`` with the endpoint and feed already looked up (once per candidate per decision)."""
        if ep is not None and not ep.events:
            return "no-events"
        if feed is not None and not feed.synced:
            return "unsynced"
        if feed is not None and feed.suspect_since is not None:
            return "unverified"
        since = self.awaiting_events_since.get(worker_id)
        if since is not None and now - since > self.stale_after_s and not (
                feed is not None and feed.last_event_at is not None and feed.last_event_at >= since):
            return "stale"
        return "synced"

    def _heard_since(self, worker_id: str, since: float) -> bool:
        feed = self.feeder.feeds.get(worker_id)
        return feed is not None and feed.last_event_at is not None and feed.last_event_at >= since

    def readiness(self, now: float) -> tuple[bool, str]:
        """Ready to pick: some endpoint is healthy, and every healthy one has an index that is exact or routed
        on load only, and engine metrics fresh at ``now`` (an idle picker sees metrics age out too)."""
        eps = list(self.endpoints.values())
        if not eps:
            return False, "no endpoints known"
        healthy = [ep for ep in eps if ep.healthy]
        if not healthy:
            return False, "no healthy endpoint"
        for ep in healthy:
            state = self.index_state(ep.worker_id, now)
            if state not in SERVABLE_STATES:
                return False, f"{ep.worker_id}: index {state}"
            if self.fresh_metrics(ep.worker_id, now) is None:
                return False, f"{ep.worker_id}: no engine metrics within {self.metrics_max_age_s} s"
        return True, "ready"


def _none_held() -> int:
    """No flow control: nothing is held."""
    return 0
