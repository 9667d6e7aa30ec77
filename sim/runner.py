"""Discrete-event replay on a virtual clock: N engine models, one routing core, one index.

Nothing about routing or caching is re-implemented here: requests are keyed by ``router.keys``, decided by
``RoutingCore`` (the live router's core), executed by ``workers.engine.EngineModel`` (the simulated worker's
engine), and the index is fed by the engines' own events through ``IndexFeeder``. What the simulator adds
is time: arrivals, step completions, event delivery (optionally delayed, dropped or stopped per worker) and
metric scrapes: every ``scrape_interval_s`` each engine's metrics reach the core as the fleet's probe loop
hands them over, read by ``workers.engine.metrics.engine_scrape`` (what the router's parser reads from the
``/metrics`` text the simulated worker serves, without formatting and parsing that text 64 times a second).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from router.events.codec import EventBatch
from router.heap import rare_collections
from router.keys import chain_keys, request_keys
from router.scheduling import Decision, Endpoint, RouteRequest, RoutingConfig, RoutingCore
from router.scheduling.flow import FlowParams, FlowQueue, Queued, Ruling, rule
from router.scheduling.slo import NO_OBJECTIVE, ServiceObjective
from sim.oracle import sim_routing
from sim.workload import SimRequest
from workers.engine import EngineConfig, EngineModel, EngineRequest, StepResult
from workers.engine.metrics import engine_scrape

SCRAPE, ARRIVE, STEP_END, EVENTS, RESTART, KV_ARRIVE, JOIN, DRAIN = 0, 1, 2, 3, 4, 5, 6, 7


@dataclass
class EventFaults:
    """Per-worker event-stream faults, to exercise staleness and gap handling."""

    delay_s: float = 0.0
    stop_at: float | None = None  # no events published from this time on
    resume_at: float | None = None
    drop_every: int = 0  # every Nth batch lost on the wire (filled by replay when replay=True)
    replay: bool = True
    # the engine process restarts at this time: its cache is empty, the requests it held fail (outcome
    # "failed"), its events start again at seq 0 with no AllBlocksCleared and its work counters from 0, as a
    # restarted vLLM's do; the router learns it only from those (the feed's seq rule, the metrics' counters)
    restart_at: float | None = None


@dataclass
class SimConfig:
    workers: int = 8
    policy: str = "precise"
    engine: EngineConfig = field(default_factory=EngineConfig)
    engines: dict[int, EngineConfig] = field(default_factory=dict)  # per-worker overrides (same block size)
    routing: RoutingConfig | None = None  # default: RoutingConfig(policy, block size of the engine)
    # prefill/decode disaggregation: per worker index, prefill | decode | both (default both); the KV transfer
    # between them takes the routing config's DisaggParams.transfer_s (the router prices the link it has)
    roles: dict[int, str] = field(default_factory=dict)
    faults: dict[int, EventFaults] = field(default_factory=dict)
    seed: int = 0
    scrape_interval_s: float = 1.0  # the live fleet's probe interval (0: no metrics)
    # at this time the worker holding the most cached blocks (then the most requests) restarts, as
    # EventFaults.restart_at: the restart that costs each policy the most cache, whichever worker that is
    restart_busiest_at: float | None = None
    # flow control (router/scheduling/flow.py): requests held in the router while the fleet is saturated, as the
    # live router holds them with the same queue; None or disabled: every request is dispatched on arrival
    flow: FlowParams | None = None
    # a fleet that changes: per worker index, the time it joins (with an empty cache; not an endpoint before:
    # discovery has not seen it), and the time it is drained (no new requests; it finishes its own, then leaves
    # the fleet and the index, as a terminating pod does)
    joins: dict[int, float] = field(default_factory=dict)
    drains: dict[int, float] = field(default_factory=dict)
    loras: frozenset[str] = frozenset()  # LoRA adapters every worker serves (its engine loads them on demand)


@dataclass
class RequestRecord:
    request_id: str
    arrival: float
    worker: str | None
    prompt_tokens: int
    output_tokens: int = 0
    cached_tokens: int = 0
    first_token_at: float | None = None
    finished_at: float | None = None
    # routed | shed | no_endpoint | rejected (the engine refused it: an HTTP 400) | failed (its worker restarted)
    outcome: str = "routed"
    error: str | None = None  # why the engine rejected it, or why it failed
    objective: ServiceObjective = NO_OBJECTIVE
    tenant: str | None = None
    # what the router predicted when it sent it (the chosen candidate's report; None: the profile predicts
    # nothing), and when it sent it (a held request's wait in the router is not the engine's to predict)
    dispatched_at: float | None = None
    predicted_ttft_s: float | None = None
    predicted_tpot_s: float | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None without a second token."""
        if self.finished_at is None or self.first_token_at is None or self.output_tokens < 2:
            return None
        return (self.finished_at - self.first_token_at) / (self.output_tokens - 1)

    @property
    def met_objective(self) -> bool:
        """Served to its end within its TTFT and TPOT targets (a shed, refused or failed request met nothing)."""
        return self.outcome == "routed" and self.finished_at is not None and self.objective.met(self.ttft, self.tpot)


@dataclass
class SimResult:
    policy: str
    records: list[RequestRecord]
    makespan_s: float
    per_worker_prompt_tokens: dict[str, int]
    timeline: list[tuple[float, float, list[int]]]  # (time, cumulative hit rate, in-flight per worker)
    decisions: int
    wall_s: float = 0.0
    membership: list[tuple[float, str, str]] = field(default_factory=list)  # (time, worker, joined|drained|left)


class Simulation:
    def __init__(self, requests: Sequence[SimRequest], config: SimConfig) -> None:
        self.requests = sorted(requests, key=lambda r: r.arrival)
        self.config = config
        ec = config.engine
        self.block_size = ec.block_size
        self.core = RoutingCore(config.routing or sim_routing(config.policy, ec.block_size, config.seed))
        self.ids = [f"w{i}" for i in range(config.workers)]
        self.engine_configs = {w: config.engines.get(i, ec) for i, w in enumerate(self.ids)}
        if any(c.block_size != ec.block_size for c in self.engine_configs.values()):
            raise ValueError("every engine of a simulation has the same block size")
        self.engines = {w: EngineModel(self.engine_configs[w]) for w in self.ids}
        self.generation = dict.fromkeys(self.ids, 0)  # engine process generation: a restart starts a new one
        for i in range(len(self.ids)):
            if i not in config.joins:
                self.core.upsert_endpoint(self._endpoint(i))
        self.leaving: set[str] = set()  # drained, still finishing their requests
        self.membership: list[tuple[float, str, str]] = []
        self.disaggregated = any(r in ("prefill", "decode") for r in config.roles.values())
        # split requests: prefill request id -> (the client's request, its tokens, its decode worker, prefill worker)
        self.prefilling: dict[str, tuple[SimRequest, np.ndarray, str, str]] = {}
        self.busy = dict.fromkeys(self.ids, False)
        self.seq = dict.fromkeys(self.ids, 0)
        self.faults = {w: config.faults.get(i) for i, w in enumerate(self.ids)}
        # the replay buffer, of the workers whose batches can be lost on the wire (drop_every, with replay): only
        # they can ever see a gap (otherwise batches arrive in order), and every batch of every worker kept for
        # a whole run was the simulator's largest use of memory (tens of GB for a million requests)
        self.published: dict[str, list[EventBatch]] = {
            w: [] for w, f in self.faults.items() if f is not None and f.drop_every and f.replay}
        self.heap: list[tuple[float, int, int, object]] = []
        self.counter = itertools.count()
        self.records: dict[str, RequestRecord] = {}
        self.route_reqs: dict[str, RouteRequest] = {}
        self.deciding: tuple[SimRequest, np.ndarray] | None = None  # the arrival being decided, for sim plugins
        self.restarts: list[tuple[float, str]] = []  # (time, worker) of each engine restart
        self.flow = FlowQueue(config.flow) if config.flow is not None and config.flow.enabled else None
        if self.flow is not None:  # what it holds waits behind a choice's prefill (the objective's ``behind``)
            self.core.state.held_requests = self.flow.__len__
        for plugin in self.core.profile.plugins:  # plugins that read the simulation itself (sim/oracle.py)
            attach = getattr(plugin, "attach_simulation", None)
            if attach is not None:
                attach(self)

    def _endpoint(self, i: int) -> Endpoint:
        return Endpoint(self.ids[i], f"10.0.0.{i + 1}:8000", loras=self.config.loras,
                        role=self.config.roles.get(i, "both"))

    def _join(self, i: int, now: float) -> None:
        self.core.upsert_endpoint(self._endpoint(i))
        self.membership.append((now, self.ids[i], "joined"))

    def _drain(self, i: int, now: float) -> None:
        w = self.ids[i]
        self.core.set_draining(w, True)
        self.membership.append((now, w, "drained"))
        self.leaving.add(w)
        self._leave_if_done(w, now)

    def _leave_if_done(self, w: str, now: float) -> None:
        """A drained worker with nothing left to do (nothing running, queued, or prefilled for it) leaves."""
        if w in self.leaving and not self.engines[w].has_work and not any(
                split[2] == w for split in self.prefilling.values()):
            self.leaving.discard(w)
            self.core.remove_endpoint(w)
            self.membership.append((now, w, "left"))

    def _push(self, t: float, kind: int, data: object) -> None:
        heapq.heappush(self.heap, (t, next(self.counter), kind, data))

    def run(self, progress: Callable[[int, int], None] | None = None) -> SimResult:
        with rare_collections():  # (router/heap.py)
            return self._run(progress)

    def _run(self, progress: Callable[[int, int], None] | None) -> SimResult:
        import time as _time

        started = _time.perf_counter()
        self.next_arrival = 0
        if self.requests:
            if self.config.scrape_interval_s > 0:
                self._push(0.0, SCRAPE, None)
            self._push(self.requests[0].arrival, ARRIVE, self.requests[0])
            for i, f in self.config.faults.items():
                if f.restart_at is not None and i < len(self.ids):
                    self._push(f.restart_at, RESTART, self.ids[i])
            if self.config.restart_busiest_at is not None:
                self._push(self.config.restart_busiest_at, RESTART, None)
            for i, t in self.config.joins.items():
                self._push(t, JOIN, i)
            for i, t in self.config.drains.items():
                self._push(t, DRAIN, i)
        done = 0
        total = len(self.requests)
        now = 0.0
        timeline: list[tuple[float, float, list[int]]] = []
        hit = prompt = 0
        next_sample = 0.0
        sample_every = max(self.requests[-1].arrival / 200, 1e-3) if self.requests else 1.0
        end = 0.0  # the last event that was not a scrape: the makespan
        while self.heap:
            now, _, kind, data = heapq.heappop(self.heap)
            if kind != SCRAPE:
                end = now
            if kind == ARRIVE:
                self.next_arrival += 1
                if self.next_arrival < total:
                    nxt = self.requests[self.next_arrival]
                    self._push(nxt.arrival, ARRIVE, nxt)
                if not self._arrive(data, now):  # type: ignore[arg-type]
                    done += 1  # shed, no endpoint or rejected: it is over already
                    if progress:
                        progress(done, total)
            elif kind == STEP_END:
                w, gen, result = data  # type: ignore[misc]
                if gen != self.generation[w]:
                    continue  # a step of an engine process that has restarted since
                finished = self._step_end(w, result, now)
                for rec in finished:
                    hit += rec.cached_tokens
                    prompt += rec.prompt_tokens
                done += len(finished)
                if self.flow is not None and self.flow:
                    done += self._release_held(now)  # a step's end is where the fleet may have room again
                if progress and finished:
                    progress(done, total)
            elif kind == SCRAPE:
                self._scrape(now)
                if self.next_arrival < total or any(e.has_work for e in self.engines.values()):
                    self._push(now + self.config.scrape_interval_s, SCRAPE, None)
            elif kind == KV_ARRIVE:
                self._kv_arrived(data, now)  # type: ignore[arg-type]
            elif kind == JOIN:
                self._join(data, now)  # type: ignore[arg-type]
            elif kind == DRAIN:
                self._drain(data, now)  # type: ignore[arg-type]
            elif kind == RESTART:
                lost = self._restart(data, now)  # type: ignore[arg-type]
                done += lost
                if progress and lost:
                    progress(done, total)
            else:
                w, gen, batch = data  # type: ignore[misc]
                if gen == self.generation[w]:  # what a dead process had not yet sent is lost with it
                    self._deliver(w, batch, now)
            if now >= next_sample:
                loads = [self.core.load.load(w).requests for w in self.ids]
                timeline.append((now, hit / prompt if prompt else 0.0, loads))
                next_sample = now + sample_every
        if self.flow is not None:  # nothing runs and nothing will arrive: what is still held is refused
            for item in self.flow.take_all():
                self.records[item.request_id].outcome = "shed"
        records = list(self.records.values())
        per_worker: dict[str, int] = dict.fromkeys(self.ids, 0)
        for rec in records:
            if rec.worker and rec.outcome == "routed":
                per_worker[rec.worker] += rec.prompt_tokens
        return SimResult(self.core.policy_name, records, end, per_worker, timeline, len(records),
                         _time.perf_counter() - started, self.membership)

    # ---- events ----------------------------------------------------------------------------------
    def route_request(self, r: SimRequest, tokens: np.ndarray) -> RouteRequest:
        # an adapter's blocks are keyed with its name, as vLLM's (and the engine model's) are
        keys = (request_keys(tokens, self.block_size, lora_name=r.lora) if r.lora
                else chain_keys(tokens, self.block_size))
        return RouteRequest(r.request_id, keys, len(tokens), self.block_size, r.output_len, lora=r.lora,
                            session=r.session, objective=r.objective)

    def decide(self, r: SimRequest, now: float, tokens: np.ndarray | None = None) -> tuple[RouteRequest, Decision]:
        """The core's decision for ``r`` at ``now`` (plugins reading the simulation see it as ``deciding``)."""
        tokens = r.tokens if tokens is None else tokens
        rr = self.route_request(r, tokens)
        self.deciding = (r, tokens)
        try:
            return rr, self.core.decide(rr, now)
        finally:
            self.deciding = None

    def _arrive(self, r: SimRequest, now: float) -> bool:
        """Route one arrival; ``False`` when it ends here (shed, no endpoint, or rejected by the engine)."""
        tokens = r.tokens
        rr, decision = self.decide(r, now, tokens)
        rec = RequestRecord(r.request_id, now, decision.chosen, len(tokens), objective=r.objective, tenant=r.tenant)
        self.records[r.request_id] = rec
        if decision.outcome != "routed":
            rec.outcome, rec.worker = decision.outcome, None
            return False
        flow = self.flow
        if flow is not None:  # flow control (router/scheduling/flow.py), as the front ends' FlowGate.admit
            ruling = rule(flow.params, r.objective, decision, 0.0)
            if ruling.action == "shed":  # sheddable, its TTFT target out of reach even on an idle fleet
                rec.outcome, rec.worker = "shed", None
                return False
            if flow.must_wait(ruling, r.objective.priority):
                rec.worker = None
                item = Queued(r.request_id, now, len(tokens) + r.output_len, r.objective, r.tenant, (r, tokens))
                if flow.push(item, ruling.eligible):
                    return True
                rec.outcome = "shed"  # the router's queue is full: a 429 at once
                return False
        return self._dispatch(r, tokens, rr, decision, rec, now)

    def _release_held(self, now: float) -> int:
        """Dispatch held requests while the fleet has room (highest priority first, tenants in turn), after
        taking out those past their deadline; returns how many ended here (expired or shed)."""
        flow = self.flow
        assert flow is not None
        ended = 0
        for item in flow.expire(now):
            self.records[item.request_id].outcome = "shed"
            ended += 1
        judged: dict[str, RouteRequest] = {}

        def judge(held: Queued) -> Ruling:
            r, tokens = held.payload
            judged[r.request_id], decision = self.decide(r, now, tokens)
            return rule(flow.params, r.objective, decision, now - held.arrived_at)

        fleet = frozenset(w for w, ep in self.core.endpoints.items() if ep.healthy and not ep.draining)
        while (out := flow.next_out(judge, fleet)) is not None:
            item, ruling = out
            r, tokens = item.payload
            rec = self.records[r.request_id]
            if ruling.action != "send":  # shed by the picker or by its target, or nobody serves it any more
                rec.outcome = ruling.decision.outcome if ruling.action == "end" else "shed"
                ended += 1
                continue
            rec.worker = ruling.decision.chosen
            if not self._dispatch(r, tokens, judged[r.request_id], ruling.decision, rec, now):
                ended += 1
        return ended

    def _dispatch(self, r: SimRequest, tokens: np.ndarray, rr: RouteRequest, decision: Decision,
                  rec: RequestRecord, now: float) -> bool:
        """Send a routed request to its worker (and its prefill worker, when split); ``False`` when the engine
        refused it (an HTTP 400: it ends here)."""
        w = decision.ranked[0]
        rec.dispatched_at = now
        report = decision.report(w)
        if report is not None and report.ttft_s > 0:
            rec.predicted_ttft_s = report.ttft_s
            rec.predicted_tpot_s = report.step_s if report.step_s > 0 else None
        plan = None
        if self.disaggregated:
            self.deciding = (r, tokens)  # the prefill worker's decision is this request's too (sim plugins)
            try:
                plan = self.core.plan_prefill(rr, decision, now)
            finally:
                self.deciding = None
        self.core.dispatch(rr, decision, w, now)
        if plan is not None:  # the prompt is computed there, then its KV sent to ``w``
            w = plan.worker_id
            self.core.dispatch(plan.request, plan.decision, w, now)
            self.prefilling[plan.request.request_id] = (r, tokens, decision.ranked[0], w)
            rid, out_len = plan.request.request_id, 1
        else:
            rid, out_len = r.request_id, r.output_len
        try:
            self.engines[w].add_request(EngineRequest(rid, tokens, out_len, arrival=now, lora_name=r.lora))
        except ValueError as e:
            # what a real engine (and workers.sim) answers with a 400: the router sees the request end at once
            rec.outcome, rec.error = "rejected", str(e)
            self.core.completed(r.request_id, now, served=False)
            if plan is not None:
                del self.prefilling[rid]
                self.core.completed(rid, now, served=False)
            return False
        if not self.busy[w]:
            self._start_step(w, now)
        return True

    def _scrape(self, now: float) -> None:
        update, endpoints = self.core.update_metrics, self.core.state.endpoints
        for w, engine in self.engines.items():
            if w in endpoints:  # a worker not yet joined, or gone, is not scraped
                update(w, engine_scrape(engine, now))

    def _start_step(self, w: str, now: float) -> None:
        # nothing reaches this engine before the next arrival: let pure decode runs fast-forward to it
        until = self.requests[self.next_arrival].arrival if self.next_arrival < len(self.requests) else float("inf")
        if self.flow is not None and self.flow:
            until = now  # a held request may be sent here at any engine's step end: no decode runs ahead
        result = self.engines[w].step(now, until)
        self.busy[w] = True
        self._push(now + result.duration_s, STEP_END, (w, self.generation[w], result))

    def _step_end(self, w: str, result: StepResult, now: float) -> list[RequestRecord]:
        finished = []
        records, prefilling = self.records, self.prefilling
        # only first tokens and finishes: a decode token changes nothing here (a request's token count is its
        # engine request's, read when it finishes), so the engine's array batch makes no object for it
        for out in result.notable:
            rid = out.request.request_id
            if prefilling:
                split = prefilling.pop(rid, None)
                if split is not None:  # a prefill done: its KV goes to the decode worker
                    self._prefilled(out.request, split, now)
                    continue
            rec = records[rid]
            if out.first:
                rec.first_token_at = now
                rec.cached_tokens = out.request.num_cached_tokens or 0
                self.core.first_token(rec.request_id, now)
            if out.finished:
                rec.output_tokens = out.request.n_out
                rec.finished_at = now
                self.core.completed(rec.request_id, now, output_tokens=rec.output_tokens)
                finished.append(rec)
        if result.events:
            self._publish(w, result.events, now)
        self.busy[w] = False
        if self.engines[w].has_work:
            self._start_step(w, now)
        elif self.leaving:
            self._leave_if_done(w, now)
        return finished

    def _prefilled(self, req: EngineRequest, split: tuple[SimRequest, np.ndarray, str, str], now: float) -> None:
        r, tokens, decode, _ = split
        self.core.first_token(req.request_id, now, learn=False)
        self.core.completed(req.request_id, now, output_tokens=1)
        rec = self.records[r.request_id]
        rec.cached_tokens = req.num_cached_tokens or 0  # the prompt's prefix hit was the prefill worker's
        full = len(tokens) // self.block_size * self.block_size
        arrive = now + self.core.config.disaggregation.transfer_s(full)
        self._push(arrive, KV_ARRIVE, (decode, self.generation[decode], r, tokens, full))

    def _kv_arrived(self, item: tuple[str, int, SimRequest, np.ndarray, int], now: float) -> None:
        w, gen, r, tokens, full = item
        rec = self.records[r.request_id]
        if gen != self.generation[w] or rec.outcome != "routed":
            return  # the decode worker restarted meanwhile: the request failed with it
        self.engines[w].add_request(EngineRequest(r.request_id, tokens, r.output_len, arrival=r.arrival,
                                                  remote_kv_tokens=full, lora_name=r.lora))
        if not self.busy[w]:
            self._start_step(w, now)

    def _publish(self, w: str, events: list, now: float) -> None:
        f = self.faults[w]
        if f is not None and f.stop_at is not None and now >= f.stop_at and (f.resume_at is None or now < f.resume_at):
            return  # the engine's publisher is stopped: nothing is sent, nothing buffered
        batch = EventBatch(now, events, 0)
        seq = self.seq[w]
        self.seq[w] += 1
        replay = self.published.get(w)
        if replay is not None:
            replay.append(batch)
        if f is not None and f.drop_every and (seq + 1) % f.drop_every == 0:
            return  # lost on the wire; noticed at the next batch
        self._push(now + (f.delay_s if f else 0.0), EVENTS, (w, self.generation[w], (seq, batch)))

    def _restart(self, w: str | None, now: float) -> int:
        """The engine process of ``w`` (None: the one holding the most cached blocks) restarts, instantly: a
        fresh engine, an empty cache, events from seq 0 and no replay history, work counters from 0. What it
        held fails; returns how many requests that was."""
        if w is None:
            w = max(self.ids, key=lambda i: (len(self.engines[i].pool.cached),
                                             self.engines[i].num_running + self.engines[i].num_waiting))
        self.restarts.append((now, w))
        lost = 0
        # every request there not yet answered in full, those of the step in progress included
        for rec in self.records.values():
            if rec.worker != w or rec.outcome != "routed" or rec.finished_at is not None:
                continue
            rec.outcome, rec.error = "failed", "worker restarted"
            d = self.core.dispatches.get(rec.request_id)
            if d is not None:  # the client's stream ends in an error
                (d.complete if rec.first_token_at is not None else d.fail)(now)
            lost += 1
        for rid, (r, tokens, decode, prefill) in list(self.prefilling.items()):
            if prefill == w:  # its prefill worker died: the decode worker prefills it itself (the proxy's fallback)
                del self.prefilling[rid]
                d = self.core.dispatches.get(rid)
                if d is not None:
                    d.fail(now)
                if decode != w:
                    self.engines[decode].add_request(EngineRequest(r.request_id, tokens, r.output_len, lora_name=r.lora,
                                                                   arrival=r.arrival))
                    if not self.busy[decode]:
                        self._start_step(decode, now)
        self.engines[w] = EngineModel(self.engine_configs[w])
        self.generation[w] += 1
        self.busy[w] = False
        self.seq[w] = 0
        if w in self.published:
            self.published[w] = []
        return lost

    def _deliver(self, w: str, item: tuple[int, EventBatch], now: float) -> None:
        seq, batch = item
        feeder = self.core.feeder
        gap = feeder.offer(w, seq, batch, now)
        if gap is not None:  # a batch was dropped: replay what the engine's buffer holds, unless faults say not
            replay = self.published.get(w)
            replayed = [] if replay is None else [(s, replay[s]) for s in range(gap.first_missing, gap.next_seq)]
            feeder.fill_gap(gap, replayed, batch, now)


def pooled(results: Sequence[SimResult]) -> SimResult:
    """Several runs of one policy (different seeds) as one: their requests together, their times added."""
    per_worker: dict[str, int] = {}
    for r in results:
        for w, n in r.per_worker_prompt_tokens.items():
            per_worker[w] = per_worker.get(w, 0) + n
    return SimResult(results[0].policy, [rec for r in results for rec in r.records],
                     sum(r.makespan_s for r in results), per_worker, results[0].timeline,
                     sum(r.decisions for r in results), sum(r.wall_s for r in results))


def summarise(result: SimResult) -> dict[str, Any]:
    recs = result.records
    routed = [r for r in recs if r.outcome == "routed" and r.first_token_at is not None]
    ttft = np.array([r.ttft for r in routed]) if routed else np.array([0.0])
    e2e = np.array([r.finished_at - r.arrival for r in routed if r.finished_at is not None]) if routed else ttft
    prompt = sum(r.prompt_tokens for r in routed)
    cached = sum(r.cached_tokens for r in routed)
    out_tokens = sum(r.output_tokens for r in routed)
    loads = np.array(list(result.per_worker_prompt_tokens.values()), dtype=float)
    # time per output token after the first: (finished - first token) / (output tokens - 1)
    tpot = [t for t in (r.tpot for r in routed) if t is not None]
    attainment = slo_attainment(recs, result.makespan_s)
    return {
        "ttft_mean_s": float(ttft.mean()),
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p90_s": float(np.percentile(ttft, 90)),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
        "e2e_mean_s": float(e2e.mean()),
        "e2e_p99_s": float(np.percentile(e2e, 99)),
        "tpot_mean_s": float(np.mean(tpot)) if tpot else 0.0,
        "hit_rate": cached / prompt if prompt else 0.0,
        "throughput_tok_s": out_tokens / result.makespan_s if result.makespan_s else 0.0,
        "load_imbalance": float(loads.max() / loads.mean()) if loads.mean() else 1.0,
        "shed": sum(1 for r in recs if r.outcome == "shed"),
        "no_endpoint": sum(1 for r in recs if r.outcome == "no_endpoint"),
        "rejected": sum(1 for r in recs if r.outcome == "rejected"),
        "failed": sum(1 for r in recs if r.outcome == "failed"),
        "completed": sum(1 for r in recs if r.finished_at is not None),
        "requests": len(recs),
        "wall_s": result.wall_s,
        "slo_attainment": attainment["all"]["attainment"],
        "goodput_rps": attainment["all"]["goodput_rps"],
        "slo_by_priority": attainment["by_priority"],
        "slo_by_tenant": attainment["by_tenant"],
        "fleet_changes": fleet_changes(result),
        "prediction": prediction_quality(routed),
    }


def _rank(values: np.ndarray) -> np.ndarray:
    """Ranks with ties given their mean rank (Spearman's convention)."""
    order = np.argsort(values, kind="mergesort")
    ranks = np.empty(len(values))
    ranks[order] = np.arange(len(values), dtype=float)
    _, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, weights=ranks)
    return sums[inverse] / counts[inverse]


def rank_correlation(a: np.ndarray, b: np.ndarray) -> float | None:
    """Spearman's rank correlation; None where either side has no spread (a constant says nothing of order)."""
    if len(a) < 2:
        return None
    ra, rb = _rank(a), _rank(b)
    if ra.std() == 0 or rb.std() == 0:
        return None
    return float(np.corrcoef(ra, rb)[0, 1])


def _errors(predicted: list[float], realised: list[float]) -> dict[str, float | int | None]:
    p, r = np.array(predicted), np.array(realised)
    rel = np.abs(p - r) / np.maximum(r, 1e-9)
    return {"median_rel_error": float(np.median(rel)), "p90_rel_error": float(np.percentile(rel, 90)),
            "rank_corr": rank_correlation(p, r), "n": len(p)}


def prediction_quality(records: Sequence[RequestRecord]) -> dict[str, float | int | None] | None:
    """How well the router predicted what it routed on: per served request, the chosen worker's predicted TTFT
    and time per output token at the decision that sent it, against what the engine then gave (TTFT from that
    dispatch, so a wait in the router's own queue is not counted against the engine's prediction). Median and
    p90 relative error and Spearman's rank correlation; None for a profile that predicts nothing."""
    ttft_p, ttft_r, tpot_p, tpot_r = [], [], [], []
    for rec in records:
        if rec.predicted_ttft_s is None or rec.first_token_at is None or rec.dispatched_at is None:
            continue
        ttft_p.append(rec.predicted_ttft_s)
        ttft_r.append(rec.first_token_at - rec.dispatched_at)
        tpot = rec.tpot
        if rec.predicted_tpot_s is not None and tpot is not None:
            tpot_p.append(rec.predicted_tpot_s)
            tpot_r.append(tpot)
    if not ttft_p:
        return None
    out: dict[str, float | int | None] = {f"ttft_{k}": v for k, v in _errors(ttft_p, ttft_r).items()}
    if tpot_p:
        out.update({f"tpot_{k}": v for k, v in _errors(tpot_p, tpot_r).items()})
    return out


FAIR_SHARE_WINDOW_S = 5.0  # a joined worker's share of arrivals is counted over windows this long
FAIR_SHARE_TARGET = 0.8  # "at its fair share": this fraction of 1 / (workers in the fleet)
AROUND_S = 15.0  # the TTFT before and after a join is the mean over arrivals this close to it


def fleet_changes(result: SimResult) -> dict[str, Any] | None:
    """How the fleet took each change: for a joined worker, how long until its share of the arrivals (over
    ``FAIR_SHARE_WINDOW_S`` windows sliding by 1 s) reached ``FAIR_SHARE_TARGET`` of a fair one, and the mean TTFT
    just before and after; for a drained worker, the requests routed to it after the drain (none should be),
    those it failed, and how long it took to finish its own and leave. None: the fleet did not change."""
    if not result.membership:
        return None
    routed = sorted((r for r in result.records if r.worker is not None), key=lambda r: r.arrival)
    arrivals = np.array([r.arrival for r in routed])
    end = float(arrivals[-1]) if len(arrivals) else 0.0
    members = len(result.per_worker_prompt_tokens) - sum(1 for _, _, what in result.membership if what == "joined")
    joins, drains = [], []

    def mean_ttft(lo: float, hi: float) -> float | None:
        ts = [r.ttft for r in routed if lo <= r.arrival < hi and r.ttft is not None]
        return float(np.mean(ts)) if ts else None

    for t, w, what in result.membership:
        if what == "joined":
            members += 1
            fair = 1.0 / members
            reached = None
            k = 0.0
            while t + k + FAIR_SHARE_WINDOW_S <= end:
                lo, hi = np.searchsorted(arrivals, [t + k, t + k + FAIR_SHARE_WINDOW_S])
                window = routed[lo:hi]
                if window and sum(r.worker == w for r in window) / len(window) >= FAIR_SHARE_TARGET * fair:
                    reached = k + FAIR_SHARE_WINDOW_S
                    break
                k += 1.0
            first = [r for r in routed if t <= r.arrival < t + 30.0]
            joins.append({"worker": w, "at_s": t, "fair_share": fair,
                          "time_to_fair_share_s": reached,
                          "share_first_30s": sum(r.worker == w for r in first) / len(first) if first else 0.0,
                          "ttft_mean_before_s": mean_ttft(t - AROUND_S, t),
                          "ttft_mean_after_s": mean_ttft(t, t + AROUND_S)})
        elif what == "drained":
            left = next((lt for lt, lw, lwhat in result.membership if lw == w and lwhat == "left" and lt >= t), None)
            drains.append({"worker": w, "at_s": t,
                           "routed_after_drain": sum(1 for r in routed if r.worker == w and r.arrival > t),
                           "failed": sum(1 for r in result.records if r.worker == w and r.outcome == "failed"),
                           "left_after_s": None if left is None else left - t})
        elif what == "left":
            members -= 1
    return {"joins": joins, "drains": drains}


def slo_attainment(records: Sequence[RequestRecord], makespan_s: float) -> dict[str, Any]:
    """DistServe's and Mooncake's figures: the fraction of requests that met their objective (every request
    counted, a shed one as missed) and goodput, those requests per second of the run; over all requests, per
    priority and per tenant (``"-"``: requests without one). A request without targets meets its objective
    whenever it is served to its end."""
    def figures(recs: list[RequestRecord]) -> dict[str, float | int]:
        met = sum(1 for r in recs if r.met_objective)
        return {"requests": len(recs), "met": met, "attainment": met / len(recs) if recs else 1.0,
                "goodput_rps": met / makespan_s if makespan_s else 0.0}

    by_priority: dict[int, list[RequestRecord]] = {}
    by_tenant: dict[str, list[RequestRecord]] = {}
    for r in records:
        by_priority.setdefault(r.objective.priority, []).append(r)
        by_tenant.setdefault(r.tenant if r.tenant is not None else "-", []).append(r)
    return {"all": figures(list(records)),
            "by_priority": {str(p): figures(by_priority[p]) for p in sorted(by_priority)},
            "by_tenant": {t: figures(by_tenant[t]) for t in sorted(by_tenant)}}
