"""The engine's own queue in the router's prediction (issue 50, finding 9): an engine limited by its batch
(``max_num_seqs``) holds every request beyond it waiting for a running one to finish, and flow control must see
that wait. Before, the router priced only the prefill waiting there: simulated workers at ``--max-num-seqs 4``
under 40 connections reported 12-14 waiting, the router predicted 0.0005 s of queue and held nothing.

The pure prediction first (``BatchLimit``, ``FleetState.engine_view``, ``CostModel``'s batch wait), then
the live proxy with flow control over real simulated workers at ``max_num_seqs`` 4."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import numpy as np
import pytest

from router.load import BatchLimit, EngineMetrics, WorkerLoad
from router.scheduling import Endpoint, RouteRequest, RoutingConfig, RoutingCore
from router.scheduling.cost import CostModel
from router.scheduling.engine_profile import DEFAULT_TIMING
from router.scheduling.flow import FlowParams, saturated
from router.scheduling.slo import NO_OBJECTIVE
from sim.workload import SimRequest
from tests.sim_helpers import workers
from tests.test_proxy import proxy, spec_of
from tests.zmq_helpers import wait_until

BS = 16
NOW = 100.0
MAX_TOKENS = 64
KV = 0.1


def step_s(kv: float = KV) -> float:
    """The decode step the timing shape gives at ``kv`` (an unfitted worker's)."""
    return float(DEFAULT_TIMING.decode_s_array(np.array(kv)))


def core_with(workers_: int = 1) -> RoutingCore:
    core = RoutingCore(RoutingConfig(policy="precise", block_size=BS))
    for i in range(workers_):
        core.upsert_endpoint(Endpoint(f"w{i}", f"10.0.0.{i}:8000", events=False))
    return core


def send(core: RoutingCore, wid: str, n: int, first_tokens: int, prefix: str = "r") -> list[str]:
    """``n`` short requests of the router's own on ``wid`` (20-token prompts, ``MAX_TOKENS`` each), the first
    ``first_tokens`` of them decoding: a small prefill queue, as in the finding."""
    ids = [f"{prefix}{k}" for k in range(n)]
    for k, rid in enumerate(ids):
        core.load.dispatch(rid, wid, 20, 20, MAX_TOKENS, NOW - 1.0)
        if k < first_tokens:
            core.load.first_token(rid, NOW - 0.5)
    return ids


def request(rid: str = "new") -> RouteRequest:
    return RouteRequest(rid, [], 20, BS, MAX_TOKENS)


def chosen(core: RoutingCore, now: float = NOW):
    decision = core.decide(request(), now)
    assert decision.outcome == "routed" and decision.chosen is not None
    return decision.report(decision.chosen)


# ---- the batch limit, learned from the engine's counts ----------------------------------------------------
def m(waiting: float | None, running: float | None) -> EngineMetrics:
    return EngineMetrics(waiting, running, KV, NOW)


def seen(*scrapes: tuple[float | None, float | None], budget_bound: bool = False) -> BatchLimit:
    out = BatchLimit()
    for waiting, running in scrapes:
        out = out.seen(m(waiting, running), budget_bound)
    return out


def full(core: RoutingCore, wid: str, waiting: float, running: float, now: float = NOW) -> None:
    """Two scrapes in a row showing the engine full (what confirms a limit)."""
    for _ in range(2):
        core.update_metrics(wid, EngineMetrics(waiting, running, KV, now))


def test_the_batch_limit_is_the_running_count_while_requests_wait():
    assert seen((12, 4)).limit is None  # once: maybe a moment's queue
    assert seen((12, 4), (12, 4)).limit == 4  # twice in a row at 4 running: 4 is all it runs at once
    assert seen((12, 4), (12, 4), (0, 4)).limit == 4  # kept at its limit with none waiting: still its limit
    assert seen((12, 4), (12, 4), (0, 2)).limit == 4  # room now: the limit stands
    assert seen((12, 4), (12, 4), (1, 3), (1, 3)).limit == 4  # waiting below the most it ran: memory, not batch
    assert seen((12, 4), (12, 4), (0, 5)).limit is None  # ran past it: it was no limit
    assert seen((12, 4), (12, 4), (None, 9), (3, None)).limit == 4  # counts unknown: nothing learned
    assert seen((3, 0), (3, 0)).limit is None  # nothing running: no limit shown
    # a request that arrived since the engine's last step waits a moment at any load; a ramp never shows the
    # same count twice at its most, and below the most the engine has run it shows nothing
    assert seen((1, 28), (1, 31), (2, 35), (1, 30), (1, 30)).limit is None
    # a queue the step's token budget explains (long prompts arriving together) teaches no limit
    assert seen((12, 4), (12, 4), budget_bound=True).limit is None


def test_the_fleet_learns_the_limit_from_scrapes_and_forgets_it_with_the_process():
    core = core_with()
    st = core.state
    send(core, "w0", 16, 4)
    for work in (1000.0, 1500.0):
        core.update_metrics("w0", EngineMetrics(12, 4, KV, NOW, work_tokens=work))
    assert st.batch_limits["w0"].limit == 4
    assert st.engine_view("w0", st.fresh_metrics("w0", NOW)).batch_limit == 4  # the view carries it
    core.update_metrics("w0", EngineMetrics(0, 4, KV, NOW + 1, work_tokens=2000.0))
    assert st.batch_limits["w0"].limit == 4
    core.update_metrics("w0", EngineMetrics(0, 2, KV, NOW + 2, work_tokens=10.0))  # a new process
    assert st.batch_limits["w0"].limit is None
    full(core, "w0", 12, 4, NOW + 3)
    core.remove_endpoint("w0")
    assert st.batch_limits == {}


def test_long_prompts_waiting_for_the_step_budget_teach_no_limit():
    """Waiting requests whose prefill fills a step's token budget may be waiting for the budget: the prefill
    queue prices them, and no batch limit is taken from that scrape."""
    core = core_with()
    for k in range(8):
        core.load.dispatch(f"long{k}", "w0", 4000, 4000, MAX_TOKENS, NOW - 1.0)
    full(core, "w0", 6, 2)
    assert core.state.batch_limits["w0"].limit is None


# ---- the prediction -------------------------------------------------------------------------------------
def test_requests_beyond_the_batch_limit_predict_a_wait_of_decodes_not_of_prefill():
    """The finding's state: 16 short requests of the router's own on an engine that runs 4 (12 waiting). Each
    request beyond the limit waits for one of the 4 places to free: a place frees once per request's decode
    (64 steps), 4 at once, so the new request waits 12 / 4 x 64 steps, far more than the running requests'
    remaining decode and far past flow control's saturation threshold (it predicted 0.0005 s before)."""
    core = core_with()
    send(core, "w0", 16, 4)
    full(core, "w0", 12, 4)
    report = chosen(core)
    batch_wait = 12 / 4 * MAX_TOKENS * step_s()
    # the prefill queue (12 x 20 tokens) is what it predicted before; the batch wait comes on top
    prefill_queue = CostModel().estimate("w0", 20, BS, None, core.load.workers["w0"],
                                         EngineMetrics(12, 4, KV, NOW)).queue_s
    assert prefill_queue < 0.01
    assert report.queue_s == pytest.approx(prefill_queue + batch_wait, rel=1e-9)
    running_left = core.cost.params.remaining_fraction * MAX_TOKENS * step_s()  # a running request's decode left
    assert report.queue_s > running_left
    params = FlowParams(enabled=True)
    assert report.queue_s > params.saturation_queue_s
    assert saturated(params, NO_OBJECTIVE, report.queue_s, report.ttft_s)
    assert report.model_ttft_s == 0.0  # a queue's estimate is not what the TTFT fit learns from


def test_the_engine_counts_and_the_routers_own_are_not_added_twice():
    """The engine's counts include the router's own requests: 16 of ours (4 running, 12 waiting) reported as
    4 running and 12 waiting are 12 beyond the limit, not 28. Requests another router sent show as the
    engine's waiting beyond ours, and do add."""
    core = core_with()
    send(core, "w0", 16, 4)
    full(core, "w0", 20, 4)  # 8 more waiting than ours: another router's
    others = chosen(core).queue_s
    core.update_metrics("w0", EngineMetrics(12, 4, KV, NOW))
    ours = chosen(core).queue_s
    per_request = MAX_TOKENS * step_s()
    assert others - ours == pytest.approx(8 / 4 * per_request + (
        CostModel().estimate("w0", 20, BS, None, core.load.workers["w0"], EngineMetrics(20, 4, KV, NOW)).queue_s
        - CostModel().estimate("w0", 20, BS, None, core.load.workers["w0"], EngineMetrics(12, 4, KV, NOW)).queue_s),
        rel=1e-9)
    assert ours == pytest.approx(12 / 4 * per_request, abs=0.01)


def test_the_wait_follows_the_routers_own_requests_between_scrapes():
    """Between scrapes the router knows what of its own has ended: once its requests there are back within the
    limit, a new request is predicted to start at once, without waiting for the next scrape."""
    core = core_with()
    ids = send(core, "w0", 16, 4)
    full(core, "w0", 12, 4)
    assert chosen(core).queue_s > FlowParams().saturation_queue_s
    for rid in ids[:12]:  # 12 ended (the engine started the waiting ones in their places)
        core.load.complete(rid, NOW + 0.1)
    assert chosen(core, NOW + 0.1).queue_s < FlowParams().saturation_queue_s


def test_no_batch_wait_where_no_limit_binds_or_the_counts_are_stale():
    core = core_with()
    send(core, "w0", 16, 4)
    full(core, "w0", 0, 16)  # all 16 running: no limit shown
    assert core.state.batch_limits["w0"].limit is None
    assert chosen(core).queue_s < 0.01
    core.remove_endpoint("w0")
    core.upsert_endpoint(Endpoint("w0", "10.0.0.0:8000", events=False))
    send(core, "w0", 16, 4)
    full(core, "w0", 12, 4)
    stale = NOW + core.state.metrics_max_age_s + 1.0
    assert chosen(core, stale).queue_s < 0.01  # the limit applies to fresh counts only


def test_the_memory_wait_adds_only_beyond_the_batch_wait():
    """Both waits are for requests there to end: the longer of the two is the wait, never their sum."""
    cm = CostModel()
    load = WorkerLoad(requests=16, pending_prefill_tokens=12 * 20, decoding=4, output_tokens=16 * MAX_TOKENS)
    metrics = EngineMetrics(12, 4, KV, NOW, batch_limit=4)
    base = cm.estimate("w0", 20, BS, None, load, metrics, max_tokens=MAX_TOKENS)
    assert base.batch_wait_s == pytest.approx(12 / 4 * MAX_TOKENS * step_s(), rel=1e-9)
    shorter = cm.estimate("w0", 20, BS, None, load, metrics, max_tokens=MAX_TOKENS,
                          memory_wait_s=base.batch_wait_s / 2)
    assert shorter.queue_s == base.queue_s
    longer = cm.estimate("w0", 20, BS, None, load, metrics, max_tokens=MAX_TOKENS,
                         memory_wait_s=base.batch_wait_s * 3)
    assert longer.queue_s == pytest.approx(base.queue_s + 2 * base.batch_wait_s, rel=1e-9)


def test_the_objective_steers_away_from_the_engine_with_a_queue():
    """Two workers alike but for the engine's queue: the request goes where it starts at once."""
    core = core_with(2)
    send(core, "w0", 16, 4, "a")
    send(core, "w1", 4, 4, "b")
    full(core, "w0", 12, 4)
    full(core, "w1", 0, 4)
    decision = core.decide(request(), NOW)
    assert decision.chosen == "w1"
    assert decision.report("w0").queue_s > decision.report("w1").queue_s + 1.0


# ---- live: the proxy with flow control over simulated workers at max_num_seqs 4 ---------------------------
SLO = {"objectives": {"interactive": {"priority": 1}}, "tenants": {"quiet": "interactive"}}
FLOOD = {"model": "sim-model", "prompt": "a noisy tenant's short question", "max_tokens": 96}


@pytest.mark.sockets
async def test_flow_control_holds_a_flood_the_engines_batch_cannot_take():
    """Two simulated workers at ``max_num_seqs`` 4 and 24 connections of one tenant, each sending again as soon
    as it is answered: the engines report requests waiting, the router's decisions predict the wait beyond
    their batch (past ``saturation_queue_s``) and flow control holds the flood in the router; the limit it
    learned is the engines' own (at most 4). A request of another tenant (priority 1 by config) is served
    while the flood waits."""
    flow = {"enabled": True, "queue_timeout_s": 60.0}
    saturation = FlowParams().saturation_queue_s
    async with workers(2, time_scale=1.0, max_num_seqs=4) as ws, \
            proxy([spec_of(w, f"w{i}") for i, w in enumerate(ws)], slo=SLO, tenant_header="x-tenant",
                  flow_control=flow) as (server, url, admin), aiohttp.ClientSession() as s:
        core, gate = server.core, server.gate
        await wait_until(lambda: all(ep.healthy for ep in core.endpoints.values()), 10)

        async def client() -> None:
            while True:
                async with s.post(f"{url}/v1/completions", json=FLOOD, headers={"x-tenant": "noisy"}) as r:
                    assert r.status == 200, await r.text()
                    await r.read()

        def queue_of(entry: dict) -> float:
            return next(c["queue_s"] for c in entry["candidates"] if c["worker_id"] == entry["ranked"][0])

        flood = [asyncio.create_task(client()) for _ in range(24)]
        try:
            await wait_until(lambda: any((mm.waiting or 0) > 0 for mm in core.state.metrics.values()), 20)
            await wait_until(lambda: gate.waiting >= 8, 20)  # held in the router (before: never, 0.0005 s)
            limits = [b.limit for b in core.state.batch_limits.values()]
            assert limits and all(limit is None or 1 <= limit <= 4 for limit in limits) and any(limits)
            async with s.get(f"{admin}/debug/decision?n=200") as r:
                decisions = (await r.json())["decisions"]
            assert any(d["outcome"] == "routed" and queue_of(d) > saturation for d in decisions)
            async with s.post(f"{url}/v1/completions", json={**FLOOD, "max_tokens": 1},
                              headers={"x-tenant": "quiet"}) as r:
                assert r.status == 200
                await r.read()
            assert gate.waiting > 0  # (the flood still held)
        finally:
            for t in flood:
                t.cancel()
            for t in flood:
                with contextlib.suppress(asyncio.CancelledError):
                    await t


# ---- the simulator: the same core over the engine model --------------------------------------------------
def test_the_simulator_holds_a_flood_beyond_the_engines_batch_and_serves_the_quiet_tenant_first():
    """The simulator scrapes its engines as the live router does and prices them with the same core: two
    engines at ``max_num_seqs`` 4 and short requests of one tenant at twice what they serve; flow control
    holds the flood in the router once the engines show their limit, and a request of another tenant
    (priority 1) arriving later goes ahead of the flood held there: it waits at most for one place, not
    behind the flood."""
    from router.scheduling.slo import ServiceObjective
    from sim.runner import SimConfig, Simulation
    from workers.engine import EngineConfig

    rng = np.random.default_rng(5)
    flood = [SimRequest(f"n{k}", 0.05 * k, rng.integers(10, 900, 24).astype(np.uint32), 128, tenant="noisy")
             for k in range(80)]  # 20/s where the two engines finish about 10/s
    quiet = SimRequest("q", 2.5, rng.integers(10, 900, 24).astype(np.uint32), 8,
                       objective=ServiceObjective(priority=1, name="interactive"), tenant="quiet")
    sim = Simulation([*flood, quiet], SimConfig(workers=2, engine=EngineConfig(num_gpu_blocks=2048, block_size=BS,
                                                                               max_num_seqs=4),
                                                flow=FlowParams(enabled=True), scrape_interval_s=0.25))
    records = {r.request_id: r for r in sim.run().records}
    assert all(r.outcome == "routed" and r.finished_at is not None for r in records.values())
    one_decode = max(records[r.request_id].finished_at - records[r.request_id].first_token_at for r in flood)
    # before: 2.8 s, behind the flood in an engine's queue (the router saw no queue there and held nothing)
    assert records["q"].ttft <= one_decode
    assert {b.limit for b in sim.core.state.batch_limits.values()} == {4}  # learned: the engines' max_num_seqs


@pytest.mark.parametrize("value", ["+Inf", "-Inf", "NaN", "-3"])
def test_an_engine_reporting_a_count_that_is_no_count_is_read_as_not_reporting_it(value):
    """A worker's ``/metrics`` is input: ``+Inf`` running requests overflowed ``BatchLimit``'s int() and left the
    worker's probe broken (issue 50 review); a count that is not a finite non-negative number is not reported."""
    from router.load.metrics import BatchLimit, parse_engine_metrics

    text = (f"vllm:num_requests_running{{model_name=\"m\"}} {value}\n"
            "vllm:num_requests_waiting{model_name=\"m\"} 3\n")
    m = parse_engine_metrics(text, 1.0)
    assert m.running is None and m.waiting == 3
    assert BatchLimit().seen(m) == BatchLimit()
