"""Prometheus metrics of the router itself (one registry per router instance).

Under ``--processes N`` (router/frontends/processes.py) the children run in prometheus_client's multiprocess
mode: every counter and histogram is kept in per-process files in ``PROMETHEUS_MULTIPROC_DIR``, and a scrape of
any child sums them, so the pod's ``/metrics`` is one router's whatever process answers it. The fleet gauges
(in-flight load, index state, health) are computed at scrape time from the answering process's own state, the
same in every process: each has the whole index from the events and the pod's load from the exchange.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from router.frontends.diagnosis import PROBLEMS

if TYPE_CHECKING:
    from router.frontends.fleet import Fleet
    from router.frontends.flow_gate import FlowGate
    from router.scheduling import Decision, Dispatch
    from router.scheduling.slo import ServiceObjective

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's own variable: set, the counters are per-process files

# a request's observed time over the objective's prediction for it (1: exact): how good the predictor is
PREDICTION_RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.1, 1.25, 1.5, 2.0, 4.0, 8.0)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0, 60.0)


class _FleetState:
    """Gauges and counters read from the core and the feed at scrape time."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def collect(self):  # type: ignore[no-untyped-def]
        core = self.fleet.core
        now = self.fleet.clock()
        inflight = GaugeMetricFamily("kvrouter_worker_inflight_requests", "Requests in flight per worker.",
                                     labels=["worker"])
        pending = GaugeMetricFamily("kvrouter_worker_pending_prefill_tokens",
                                    "Uncached prompt tokens sent and not yet prefilled, per worker.", labels=["worker"])
        state = GaugeMetricFamily("kvrouter_worker_index_state", "1 for the worker's current index state.",
                                  labels=["worker", "state"])
        healthy = GaugeMetricFamily("kvrouter_worker_healthy", "1 if the worker is a candidate.", labels=["worker"])
        blocks = GaugeMetricFamily("kvrouter_index_blocks", "Blocks the index holds per worker and medium.",
                                   labels=["worker", "medium"])
        events = CounterMetricFamily("kvrouter_kv_events", "KV events applied.", labels=["worker", "type"])
        gaps = CounterMetricFamily("kvrouter_kv_event_gaps", "Sequence gaps seen.", labels=["worker", "filled"])
        malformed = CounterMetricFamily("kvrouter_kv_event_malformed", "Malformed frames or events skipped.",
                                        labels=["worker"])
        problem = GaugeMetricFamily("kvrouter_worker_problem", "1 for the worker's current problem (the likely "
                                    "cause: /admin/workers, the router's log).", labels=["worker", "problem"])
        # by worker, not by name: the names are in the log and /admin/workers
        conflicts = GaugeMetricFamily("kvrouter_model_name_conflicts", "LoRA adapter names the worker lists that "
                                      "another worker serves as a base model: refused there (docs/fleet.md).",
                                      labels=["worker"])
        refused = self.fleet.name_conflicts
        diagnoses = self.fleet.diagnose()
        stale = 0
        for wid, ep in core.endpoints.items():
            load = core.load.workers.get(wid)
            inflight.add_metric([wid], load.requests if load else 0)
            pending.add_metric([wid], load.pending_prefill_tokens if load else 0)
            st = core.index_state(wid, now)
            found = diagnoses.get(wid)
            for p in PROBLEMS:
                problem.add_metric([wid, p], 1.0 if found is not None and found.problem == p else 0.0)
            stale += st != "synced"
            for s in ("synced", "unsynced", "unverified", "stale", "no-events"):
                state.add_metric([wid, s], 1.0 if s == st else 0.0)
            healthy.add_metric([wid], 1.0 if ep.healthy and not ep.draining else 0.0)
            conflicts.add_metric([wid], len(refused.get(wid, ())))
            for medium, n in core.index.blocks_held(wid).items():
                blocks.add_metric([wid, medium.name], n)
            feed = core.feeder.feeds.get(wid)
            if feed is not None:
                for kind, n in feed.events.items():
                    events.add_metric([wid, kind], n)
                gaps.add_metric([wid, "true"], feed.gaps_filled)
                gaps.add_metric([wid, "false"], feed.gaps - feed.gaps_filled)
                malformed.add_metric([wid], feed.malformed)
        yield from (inflight, pending, state, healthy, blocks, events, gaps, malformed, problem, conflicts)
        yield GaugeMetricFamily("kvrouter_index_entries", "Resident (worker, medium, block) entries.",
                                value=len(core.index))
        yield GaugeMetricFamily("kvrouter_workers_without_prefix_credit",
                                "Workers routed on load only (unsynced, stale or without events).", value=stale)
        yield from getattr(self.fleet.subscriber, "metric_families", tuple)()  # the event bus's, when on one


class _FlowQueue:
    """Flow control's queue depth per priority (docs/slo.md), read from the gate at scrape time."""

    def __init__(self, gate: FlowGate, priorities: Iterable[int]) -> None:
        self.gate = gate
        self.priorities = frozenset(priorities)  # shown at 0 while none of theirs waits (a series that stays)

    def collect(self):  # type: ignore[no-untyped-def]
        depth = GaugeMetricFamily("kvrouter_flow_queue_depth", "Requests waiting in flow control's queue, per "
                                  "priority (the objective's; 0 without one); under --processes N, the answering "
                                  "process's own queue.", labels=["priority"])
        waiting = {p: 0 for p in self.priorities} | self.gate.waiting_by_priority()
        for priority, n in sorted(waiting.items()):
            depth.add_metric([str(priority)], n)
        yield depth


class RouterMetrics:
    def __init__(self, fleet: Fleet) -> None:
        self.registry = CollectorRegistry()
        self._fleet_state = _FleetState(fleet)
        self.registry.register(self._fleet_state)  # type: ignore[arg-type]
        self._flow: _FlowQueue | None = None
        r = self.registry
        self.decisions = Counter("kvrouter_decisions", "Routing decisions.", ["policy", "outcome", "credit"],
                                 registry=r)
        self.requests = Counter("kvrouter_requests", "Requests by final status.", ["status"], registry=r)
        self.truncated = Counter("kvrouter_responses_truncated", "Responses a worker failed in the middle of: "
                                 "ended to the client as an error, never as a clean end.", registry=r)
        self.retries = Counter("kvrouter_retries", "Requests retried on the next-best worker.", registry=r)
        self.hit_estimated = Counter("kvrouter_prefix_hit_tokens_estimated",
                                     "Prompt tokens the router expected cached on the chosen worker.", registry=r)
        self.hit_reported = Counter("kvrouter_prefix_hit_tokens_reported",
                                    "Prompt tokens the workers reported cached (usage.cached_tokens).", registry=r)
        self.prompt_tokens = Counter("kvrouter_prompt_tokens", "Prompt tokens routed.", registry=r)
        self.disagg = Counter("kvrouter_disagg_requests", "Requests in a fleet with prefill workers, by how they were "
                              "served: split (prefilled elsewhere), local (where they decode, by the decision), "
                              "fallback (the prefill failed: served where they decode).", ["outcome"], registry=r)
        self.ttft = Histogram("kvrouter_time_to_first_token_seconds", "Time to first byte of output, through the "
                              "router.", buckets=TTFT_BUCKETS, registry=r)
        self.decision_seconds = Histogram("kvrouter_decision_seconds", "Time to parse, tokenize and decide.",
                                          buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.1),
                                          registry=r)
        self.ttft_prediction = Histogram(
            "kvrouter_ttft_observed_over_predicted", "A request's TTFT at its worker (from dispatch) over the routing "
            "objective's prediction for the chosen worker: 1 is exact.", buckets=PREDICTION_RATIO_BUCKETS, registry=r)
        self.tpot_prediction = Histogram(
            "kvrouter_tpot_observed_over_predicted", "A streamed request's time per output token after the first over "
            "the predicted decode step.", buckets=PREDICTION_RATIO_BUCKETS, registry=r)
        # per objective and priority, not per tenant: tenants are a header's values, an unbounded label
        self.slo_requests = Counter("kvrouter_slo_requests", "Requests with TTFT/TPOT targets by outcome: met (both "
                                    "within target, TTFT counted from the router's arrival), missed, shed (refused "
                                    "429).", ["objective", "priority", "outcome"], registry=r)
        # label children bound once: ``labels()`` validates and locks on every call, which every request paid
        # two or three times (a few label values each: statuses, and policy x outcome x credit)
        self._by_status: dict[int | str, Counter] = {}
        self._by_decision: dict[tuple[str, str, bool], Counter] = {}

    def watch_flow(self, gate: FlowGate, priorities: Iterable[int] = (0,)) -> None:
        """Export ``gate``'s queue depth per priority (``kvrouter_flow_queue_depth``), read at each scrape;
        ``priorities`` (the configured objectives') are shown at 0 while nothing of theirs waits."""
        if self._flow is not None:
            self.registry.unregister(self._flow)  # type: ignore[arg-type]
        self._flow = _FlowQueue(gate, priorities)
        self.registry.register(self._flow)  # type: ignore[arg-type]

    def count_request(self, status: int | str) -> None:
        """One request answered (or refused) with ``status``."""
        child = self._by_status.get(status)
        if child is None:
            child = self._by_status.setdefault(status, self.requests.labels(str(status)))
        child.inc()

    def count_decision(self, decision: Decision) -> None:
        """One routing decision, by policy, outcome and whether any candidate could be credited a prefix."""
        credited = decision.prefix_credited
        key = (decision.policy, decision.outcome, credited)
        child = self._by_decision.get(key)
        if child is None:
            child = self._by_decision.setdefault(key, self.decisions.labels(decision.policy, decision.outcome,
                                                                            str(credited).lower()))
        child.inc()

    def observe_prediction(self, predicted_ttft_s: float | None, observed_ttft_s: float | None,
                           predicted_tpot_s: float | None = None, observed_tpot_s: float | None = None) -> None:
        """A served request's observed TTFT (and TPOT, when it streamed more than one token) against the
        objective's predictions for its worker; a side without a prediction is skipped."""
        if predicted_ttft_s and observed_ttft_s is not None:
            self.ttft_prediction.observe(observed_ttft_s / predicted_ttft_s)
        if predicted_tpot_s and observed_tpot_s is not None:
            self.tpot_prediction.observe(observed_tpot_s / predicted_tpot_s)

    def observe_request(self, handle: Dispatch, arrived_at: float, now: float, output_tokens: int | None,
                        streamed: bool) -> None:
        """A request served to its end (``now``): its TTFT and (streamed, with its usage) TPOT against the
        objective's predictions for the worker it went to, and, where it had targets, whether it met them (TTFT
        counted from ``arrived_at``, the router's arrival, so a wait in flow control's queue counts; a request
        not streamed has its first token with its answer)."""
        first = handle.first_token_at
        if first is None:
            return
        tpot = None
        if streamed and output_tokens is not None and output_tokens > 1:
            tpot = (now - first) / (output_tokens - 1)
        report = handle.report
        if report is not None:
            self.observe_prediction(report.ttft_s, first - handle.dispatched_at, report.step_s, tpot)
        self.count_objective(handle.request.objective, first - arrived_at, tpot)

    def count_objective(self, objective: ServiceObjective, ttft_s: float | None, tpot_s: float | None,
                        shed: bool = False) -> None:
        """One request with targets, by whether it met them (``ServiceObjective.met``) or was shed."""
        if not objective.has_targets:
            return
        outcome = "shed" if shed else "met" if objective.met(ttft_s, tpot_s) else "missed"
        self.slo_requests.labels(objective.name or "request", str(objective.priority), outcome).inc()

    def exposition(self) -> bytes:
        """The text a scrape gets: this router's registry, or the counters summed over every process of the
        pod in multiprocess mode (plus the fleet gauges, from this process)."""
        directory = os.environ.get(MULTIPROC_ENV)
        if not directory:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        MultiProcessCollector(registry, directory)
        registry.register(self._fleet_state)  # type: ignore[arg-type]
        if self._flow is not None:
            registry.register(self._flow)  # type: ignore[arg-type]
        return generate_latest(registry)
