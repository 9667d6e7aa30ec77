"""The routing core: cost model, filters, staleness fallback, policies, admission, explain."""

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.events.codec import BlockStored, EventBatch
from router.index import PrefixMatch
from router.keys import request_keys
from router.load import EngineMetrics, LoadTracker, WorkerLoad, parse_engine_metrics
from router.scheduling import CostModel, CostParams, Endpoint, RouteRequest, RoutingConfig, RoutingCore
from sim.runner import SimConfig, Simulation
from sim.workload import SimRequest, tokens_for_block
from workers.engine import EngineConfig

BS = 16


def core_with(n: int, policy: str = "precise", **kw) -> RoutingCore:
    core = RoutingCore(RoutingConfig(policy=policy, block_size=BS, seed=1, **kw))
    for i in range(n):
        core.upsert_endpoint(Endpoint(f"w{i}", f"10.0.0.{i}:8000"))
    return core


def feed_prefix(core: RoutingCore, worker: str, tokens: list[int], now: float, seq: int = 0) -> None:
    n = len(tokens) // BS
    ev = BlockStored(list(range(1000 * seq + 1, 1000 * seq + 1 + n)), None, tokens[: n * BS], BS, None, "GPU")
    assert core.feeder.offer(worker, seq, EventBatch(now, [ev], 0), now) is None


def request(tokens: list[int], rid: str = "r", **kw) -> RouteRequest:
    return RouteRequest(rid, request_keys(tokens, BS), len(tokens), BS, **kw)


# ---- cost model -------------------------------------------------------------------------------------

def linear(prefill_ms_per_token: float = 0.1, step_ms: float = 0.0, decode_ms: float = 0.0,
           decode_ms_per_p: float = 0.0, **kw) -> CostParams:
    """Hand-computable engine timing: prefill ``step_ms + T x prefill_ms_per_token``, decode step ``decode_ms +
    p x decode_ms_per_p``; nothing learned."""
    return CostParams(prefill_a=0.0, prefill_b=prefill_ms_per_token, prefill_c=step_ms, decode_a=0.0,
                      decode_b=decode_ms_per_p, decode_c=decode_ms, learn=False, **kw)


def test_cost_model_hand_computed():
    p = linear(0.1, step_ms=10.0, decode_ms=1.0, load_back_ms_per_token=0.01, storage_ms_per_token=0.1)
    cm = CostModel(p)
    # 1000-token prompt, nothing cached, idle: 0.01 + 0.1
    assert cm.estimate("a", 1000, 16, None, None, None).ttft_s == pytest.approx(0.11)
    # 50 GPU blocks + 10 CPU blocks of 16: 800 + 160 hit; 40 uncached; load-back 160 * 1e-5
    est = cm.estimate("a", 1000, 16, PrefixMatch(gpu=50, cpu=10), None, None)
    assert est.uncached_tokens == 40
    assert est.prefill_s == pytest.approx(0.01 + 40e-4 + 160e-5)
    # queue: 5000 pending prefill tokens batch with this request's 1000 (one 8192-token step): the wait is
    # their per-token cost, the step overhead is shared
    load = WorkerLoad(requests=7, pending_prefill_tokens=5000, decoding=4)
    est = cm.estimate("a", 1000, 16, None, load, None, max_tokens=10)
    assert est.queue_s == pytest.approx(5000e-4)
    assert est.decode_s == pytest.approx(10 * 1e-3)  # its 10 decode steps of 1 ms
    # its 0.11 s prefill step replaces one 1 ms decode step of each of the 4 running requests
    assert est.interference_s == pytest.approx(4 * (0.11 - 0.001))
    # past the step budget, pending work takes steps of its own: 20000 + 1000 tokens = 3 steps
    est = cm.estimate("a", 1000, 16, None, WorkerLoad(requests=3, pending_prefill_tokens=20000), None)
    assert est.queue_s == pytest.approx(2 * 0.01 + 20000e-4)
    # engine metrics say more is waiting than we sent (another router): the excess counts
    est = cm.estimate("a", 1000, 16, None, None, EngineMetrics(waiting=2, running=9, kv_usage=0.5, scraped_at=0))
    assert est.queue_s == pytest.approx(2 * p.waiting_prompt_tokens * 1e-4)  # 5096 tokens: one step
    # a full hit still prefills the last token
    assert cm.estimate("a", 32, 16, PrefixMatch(gpu=2), None, None).uncached_tokens == 1


def test_a_prefill_step_lasts_at_least_the_decode_step_beside_it():
    """The engine runs prefill and decode in one step of max(prefill, decode): a short prefill on a worker whose
    decodes are slow waits a whole decode step, and costs the decodes nothing."""
    cm = CostModel(linear(0.1, decode_ms=50.0))
    est = cm.estimate("a", 100, 16, None, WorkerLoad(requests=3, decoding=3), None)
    assert est.prefill_s == pytest.approx(0.05)  # its 10 ms of prefill inside a 50 ms decode step
    assert est.interference_s == 0.0


def test_kv_load_prices_its_own_decode_and_the_slowdown_it_brings_to_the_others():
    """decode step = 10 ms + 100 ms x p (p: KV fraction in use). A 100-block cache, 40 blocks held by 2
    requests (the engine's kv_usage: 0.4) with 100 tokens of output each (half, 50, still to come on average);
    this request adds 20 blocks and generates 40 tokens. It decodes beside the others for min(1, 50/40) of its
    steps: at p = (40 + 20)/100, 70 ms a step; its 20 blocks make every step of the others 100 ms x 0.2 = 20 ms
    longer (50 -> 70 ms), over their 2 x 50 = 100 remaining tokens, but only while it runs: at most 2 x 40 of
    them. Its 10 ms prefill runs inside one 50 ms decode step: it stalls no one."""
    cm = CostModel(linear(0.1, decode_ms=10.0, decode_ms_per_p=100.0))
    tracker = LoadTracker()
    for i in range(2):
        keys = request_keys(list(range(i * 10_000, i * 10_000 + 320)), BS)  # 20 blocks, 0 tail (max_tokens 0)
        tracker.dispatch(f"r{i}", "a", 320, 0, 100, now=0.0, keys=keys, block_size=BS)
        tracker.first_token(f"r{i}", now=0.0)
    load = tracker.load("a")
    load.tail_blocks = 0  # hold exactly the 40 prompt blocks (their output blocks are not counted here)
    assert load.active_blocks == 40
    est = cm.estimate("a", 100, BS, None, load, EngineMetrics(None, None, 0.4, scraped_at=0.0), max_tokens=40,
                      new_blocks=20, capacity_tokens=100 * BS)
    assert est.step_s == pytest.approx(0.070)
    assert est.decode_s == pytest.approx(40 * 0.070)
    assert est.prefill_s == pytest.approx(0.050)
    assert est.interference_s == pytest.approx(80 * (0.070 - 0.050))


def test_the_trap_a_long_hit_behind_a_3s_queue_loses_to_an_idle_cold_worker():
    """Worker A holds the whole prefix but has 3 s of queued prefill; the hit saves only 0.8 s."""
    core = RoutingCore(RoutingConfig(block_size=BS, cost=linear(0.1), seed=0))
    core.upsert_endpoint(Endpoint("holder", "10.0.0.1:1"))
    core.upsert_endpoint(Endpoint("idle", "10.0.0.2:1"))
    prompt = list(range(8001))  # an 8000-token hit (500 blocks) saves 0.8 s at 1e-4 s/token
    feed_prefix(core, "holder", prompt, now=0.0)
    core.load.dispatch("queued", "holder", 30_000, 30_000, 10, now=0.0)  # 3 s of prefill ahead
    d = core.decide(request(prompt), now=0.1)
    by = {c.worker_id: c for c in d.candidates}
    assert by["holder"].matched_gpu == 500 and by["holder"].queue_s == pytest.approx(3.0)
    assert by["idle"].prefill_s == pytest.approx(0.8001) and by["holder"].prefill_s == pytest.approx(1e-4)
    assert d.chosen == "idle"
    # with the queue gone, the holder wins
    core.load.complete("queued", 0.2)
    assert core.decide(request(prompt, "r2"), now=0.3).chosen == "holder"


def test_the_holders_decode_batch_makes_a_second_copy_of_a_hot_prefix_worth_its_prefill():
    """A hot 8K-token prefix: its holder runs 20 requests that share it (42% of 2,000 blocks in use now: the
    prefix, their own blocks and half their output, so every decode step there takes 10 + 100 x 0.42 ms); an
    idle worker would prefill the 8,192 tokens (0.82 s at 0.1 ms a token) but decode 100 tokens at
    10 + 100 x 0.26 ms: 1.65 s less, the copy wins."""
    core = RoutingCore(RoutingConfig(block_size=BS, cost=linear(0.1, decode_ms=10.0, decode_ms_per_p=100.0),
                                     seed=0, speculative_ttl_s=0))
    for w in ("holder", "idle"):
        core.upsert_endpoint(Endpoint(w, f"10.0.0.{len(core.endpoints)}:1"))
        core.update_metrics(w, EngineMetrics(None, None, None, scraped_at=0.0, cache_tokens=2000 * BS))
    prefix = list(range(8192))  # 512 blocks
    feed_prefix(core, "holder", prefix, now=0.0)
    for i in range(20):  # each: the prefix + 4 blocks of its own, and 400 tokens (25 blocks) of output
        own = prefix + list(range(100_000 + i * 1000, 100_000 + i * 1000 + 64))
        core.load.dispatch(f"run{i}", "holder", len(own), 0, 400, now=0.0, keys=request_keys(own, BS),
                           block_size=BS)
        core.load.first_token(f"run{i}", now=0.0)
    assert core.load.load("holder").active_blocks == 512 + 20 * 4 + 20 * 25  # the prefix held once: 1,092
    req = request(prefix + list(range(900_000, 900_016)), "hot", max_tokens=100)  # 513 blocks + 7 of output
    d = core.decide(req, now=0.1)
    by = {c.worker_id: c for c in d.candidates}
    assert by["holder"].matched_gpu == 512 and by["idle"].matched_gpu == 0
    assert by["idle"].step_s == pytest.approx(0.010 + 0.1 * (513 + 7) / 2000)
    assert by["idle"].ttft_s == pytest.approx(0.8208, abs=1e-4)
    # holder: the others have 200 tokens each still to come (more than its 100): it decodes beside all of them,
    # which hold 1,092 - 20 x 200 / 16 = 842 blocks now, adding its 1 own prompt block and 7 output blocks
    assert by["holder"].step_s == pytest.approx(0.010 + 0.1 * (842 + 8) / 2000)
    assert by["holder"].decode_s - by["idle"].decode_s == pytest.approx(100 * 0.1 * (850 - 520) / 2000)
    assert d.chosen == "idle"


def test_a_second_copy_into_a_full_cache_pays_for_what_it_pushes_out():
    """A holder with a short queue vs an idle worker: the copy is faster while caches have room; once the fleet's
    caches are full it pushes out as many cached tokens as it stores, each re-asked with P(reuse), and the
    holder wins."""
    core = RoutingCore(RoutingConfig(block_size=BS, cost=linear(0.1, reuse_prior=1.0), seed=0,
                                     speculative_ttl_s=0))
    for w in ("holder", "idle"):
        core.upsert_endpoint(Endpoint(w, f"10.0.0.{len(core.endpoints)}:1"))
    prompt = list(range(1601))  # 100 blocks held: a cold copy costs 0.16 s
    feed_prefix(core, "holder", prompt, now=0.0)
    core.load.dispatch("queued", "holder", 3000, 3000, 10, now=0.0)  # 0.3 s queued
    d = core.decide(request(prompt, "a", max_tokens=0), now=0.1)
    by = {c.worker_id: c for c in d.candidates}
    assert d.chosen == "idle" and by["idle"].eviction_s == 0  # capacity unknown: no eviction cost
    # both caches reported full: the copy's 1,601 new tokens push out as many cached ones (0.1601 s of prefill)
    feed_prefix(core, "holder", list(range(200_000, 206_400)), now=0.0, seq=1)
    feed_prefix(core, "idle", list(range(50_000, 58_000)), now=0.0)
    for w in ("holder", "idle"):
        core.update_metrics(w, EngineMetrics(None, None, None, scraped_at=0.0, cache_tokens=8000))
    assert core.resident_tokens("idle") >= core.cache_tokens["idle"]  # full
    d = core.decide(request(prompt, "b", max_tokens=0), now=0.1)
    by = {c.worker_id: c for c in d.candidates}
    assert by["idle"].eviction_s == pytest.approx(0.1601)
    assert by["holder"].eviction_s == pytest.approx(1e-4)  # its one uncached token
    assert d.chosen == "holder"


def test_a_new_prefix_goes_where_it_evicts_nothing():
    core = core_with(2, cost=linear(0.1, reuse_prior=1.0), speculative_ttl_s=0)
    feed_prefix(core, "w0", list(range(8000)), now=0.0)  # full
    feed_prefix(core, "w1", list(range(10_000, 14_000)), now=0.0)  # half full: room for 4,000 tokens
    for w in ("w0", "w1"):
        core.update_metrics(w, EngineMetrics(None, None, None, scraped_at=0.0, cache_tokens=8000))
    picks = Counter()
    for i in range(20):
        d = core.decide(request(list(range(100_000 * (i + 1), 100_000 * (i + 1) + 1601)), f"n{i}", max_tokens=0),
                        now=0.1)
        by = {c.worker_id: c for c in d.candidates}
        assert by["w0"].eviction_s == pytest.approx(0.1601) and by["w1"].eviction_s == 0
        picks[d.chosen] += 1
    assert picks == {"w1": 20}
    # once both are full, storing it costs the same everywhere: load decides, the pushed-out price does not
    feed_prefix(core, "w1", list(range(20_000, 24_000)), now=0.0, seq=1)
    d = core.decide(request(list(range(900_000, 901_601)), "full", max_tokens=0), now=0.1)
    assert {c.worker_id: round(c.eviction_s, 6) for c in d.candidates} == {"w0": 0.1601, "w1": 0.1601}


def test_eviction_is_priced_by_how_often_the_fleet_asks_again_for_what_it_evicted():
    """The ghost list: of the blocks the workers' events say were evicted, the share later requests ask for."""
    from router.events.codec import BlockRemoved

    core = core_with(1, cost=linear(0.1, reuse_prior=0.5), speculative_ttl_s=0)
    state = core.state
    assert state.reuse.probability == pytest.approx(0.5)  # the prior, before anything was seen
    tokens = list(range(16 * 400))
    feed_prefix(core, "w0", tokens, now=0.0)
    removed = BlockRemoved(list(range(1, 401)), "GPU")
    assert core.feeder.offer("w0", 1, EventBatch(0.1, [removed], 0), 0.1) is None
    assert len(state.reuse) == 400
    state.reuse.set_window(400)
    # requests ask again for the first 100 evicted blocks; then 400 new evictions push the rest out unasked
    req = request(tokens[: 16 * 100 + 1], "again")
    core.dispatch(req, core.decide(req, now=0.2), "w0", now=0.2)
    state.reuse.evicted(range(10**6, 10**6 + 400))
    p = state.reuse.probability
    assert 0.2 < p < 0.35  # ~100 reused of ~400 resolved, with the prior's 64 pseudo-samples at 0.5


def test_a_workers_fit_learns_its_speed_and_shrugs_off_outliers():
    """Observed TTFT = 2x the model's + 2 ms of overhead (HTTP, tokenizing): the fit, a line through the origin that
    long TTFTs weigh most, finds the 2x; a 10 s stall in every 50 does not move it. Requests with a queue ahead
    are not learned from (their queue estimate's error would be)."""
    core = core_with(1, speculative_ttl_s=0)
    for i in range(160):
        size = 500 + 100 * (i % 40)
        req = request(list(range(i * 10_000, i * 10_000 + size)), f"r{i}", max_tokens=2)
        d = core.decide(req, now=float(i))
        model = d.candidates[0].model_ttft_s
        assert model > 0  # nothing queued: learned from
        core.dispatch(req, d, "w0", now=float(i))
        core.first_token(f"r{i}", now=i + (10.0 if i % 50 == 7 else 0.002 + 2.0 * model))
        core.completed(f"r{i}", now=i + 0.5)
    fit = core.cost.profile("w0").ttft
    assert fit.slope == pytest.approx(2.0, rel=0.05) and fit.intercept == 0.0
    req = request(list(range(5_000_000, 5_003_000)), "next")
    d = core.decide(req, now=200.0)
    assert d.predicted_ttft_s == pytest.approx(fit.slope * d.candidates[0].model_ttft_s)
    core.load.dispatch("ahead", "w0", 4000, 4000, 10, now=200.0)
    assert core.decide(request(list(range(6_000_000, 6_000_500)), "queued"), now=200.0).candidates[0].model_ttft_s == 0


def test_a_workers_decode_fit_learns_its_inter_token_time():
    core = core_with(1, speculative_ttl_s=0)
    for i in range(40):
        req = request(list(range(i * 10_000, i * 10_000 + 200)), f"r{i}", max_tokens=11)
        d = core.decide(req, now=float(i))
        step = d.candidates[0].model_step_s
        core.dispatch(req, d, "w0", now=float(i))
        core.first_token(f"r{i}", now=i + 0.05)
        core.completed(f"r{i}", now=i + 0.05 + 10 * 3.0 * step, output_tokens=11)  # 3x slower steps
    # 40 samples at 3x against the prior's 4 pseudo-samples at 1x (the timing as given); it refits every 8
    # samples: fit the last one in now
    fit = core.cost.profile("w0").decode
    assert len(fit) == 40
    fit.fit()
    assert fit.slope == pytest.approx((40 * 3.0 + 4 * 1.0) / 44)


# ---- hot prefix ----------------------------------------------------------------------------------------

def test_a_hot_prefix_spreads_once_queueing_outweighs_the_saving():
    """One shared 6000-token system prompt + 1000 own tokens, arrivals rising 1 -> 80 req/s, on engine models."""
    system = tokens_for_block(1, 6000)
    reqs, t = [], 0.0
    rng = np.random.default_rng(0)
    for i in range(800):
        rate = 1.0 + 79.0 * i / 800
        t += float(rng.exponential(1.0 / rate))
        tokens = np.concatenate([system, tokens_for_block(100 + i, 1000)])
        reqs.append(SimRequest(f"r{i}", t, tokens, 20))
    result = Simulation(reqs, SimConfig(workers=4, policy="precise",
                                        engine=EngineConfig(num_gpu_blocks=8000, block_size=BS))).run()
    recs = sorted(result.records, key=lambda r: r.arrival)
    calm = Counter(r.worker for r in recs[:60])
    busy = Counter(r.worker for r in recs[-200:])
    assert calm.most_common(1)[0][1] >= 50  # at low load, affinity: almost all to the holder
    # at high load the holder alone would queue: the load is shared, no worker takes most of it
    assert len(busy) >= 2 and max(busy.values()) <= 120
    assert busy.most_common(1)[0][1] <= 130
    assert all(r.finished_at is not None for r in recs)


# ---- staleness ------------------------------------------------------------------------------------------

def test_stale_worker_loses_prefix_credit_and_regains_it():
    core = core_with(2, stale_after_s=5.0)
    prompt = list(range(4000))
    feed_prefix(core, "w0", prompt, now=0.0)
    feed_prefix(core, "w1", list(range(50_000, 50_016)), now=0.0)
    assert core.decide(request(prompt), now=1.0).chosen == "w0"
    # w0 keeps taking requests but its events stop
    for i in range(10):
        r = request(list(range(100_000 + i * 100, 100_000 + i * 100 + 40)), f"x{i}")
        core.dispatch(r, core.decide(r, now=1.0 + i), "w0", now=1.0 + i)
        core.completed(f"x{i}", now=1.5 + i)
    d = core.decide(request(prompt, "after"), now=12.0)
    w0 = next(c for c in d.candidates if c.worker_id == "w0")
    assert w0.state == "stale" and not w0.prefix_credit and w0.matched_gpu == 0
    # events resume: credit returns
    feed_prefix(core, "w0", list(range(60_000, 60_032)), now=12.5, seq=1)
    d = core.decide(request(prompt, "resumed"), now=13.0)
    assert next(c for c in d.candidates if c.worker_id == "w0").prefix_credit
    assert d.chosen == "w0"


def test_all_stale_means_a_load_only_decision():
    core = core_with(3, stale_after_s=1.0)
    for i, w in enumerate(("w0", "w1", "w2")):
        r = request(list(range(i * 100, i * 100 + 64)), f"x{i}")
        core.dispatch(r, core.decide(r, now=0.0), w, now=0.0)
    d = core.decide(request(list(range(100))), now=5.0)
    assert "load only" in d.reason
    assert all(not c.prefix_credit for c in d.candidates)


def test_idle_worker_without_events_is_not_stale():
    core = core_with(1, stale_after_s=1.0)
    feed_prefix(core, "w0", list(range(64)), now=0.0)
    assert core.index_state("w0", now=100.0) == "synced"  # no requests sent: silence is expected


# ---- filters, admission, explain ---------------------------------------------------------------------

def test_filters_admission_and_reasons():
    core = core_with(3, max_inflight_requests=1)
    core.endpoints["w0"].healthy = False
    core.endpoints["w1"].draining = True
    d = core.decide(request(list(range(64))), now=0.0)
    assert d.chosen == "w2"
    reasons = {c.worker_id: c.filtered for c in d.candidates}
    assert reasons == {"w0": "unhealthy", "w1": "draining", "w2": None}
    req = request(list(range(64)), "a")
    core.dispatch(req, d, "w2", 0.0)
    d = core.decide(request(list(range(64)), "b"), now=0.1)
    assert d.outcome == "shed" and d.chosen is None
    core.completed("a", 0.2)
    core.endpoints["w2"].healthy = False
    d = core.decide(request(list(range(64)), "c"), now=0.3)
    assert d.outcome == "no_endpoint" and "w2: unhealthy" in d.reason


def test_subset_hint_and_model_filters():
    core = core_with(3)
    core.endpoints["w0"].models = frozenset({"llama"})
    core.endpoints["w1"].loras = frozenset({"sql"})
    d = core.decide(request(list(range(32)), subset=frozenset({"10.0.0.1:8000", "w2"})), now=0)
    assert set(d.ranked) == {"w1", "w2"}
    d = core.decide(request(list(range(32)), model="mistral"), now=0)
    assert "w0" not in d.ranked
    d = core.decide(request(list(range(32)), lora="sql"), now=0)
    assert d.ranked == ["w1"]


def test_identical_idle_workers_share_load_at_random():
    core = core_with(4)
    chosen = Counter(core.decide(request(list(range(i * 64, i * 64 + 64)), f"r{i}"), now=0).chosen
                     for i in range(400))
    assert len(chosen) == 4 and min(chosen.values()) > 50


def test_speculative_record_steers_a_burst_before_events_arrive():
    """A burst of one long prompt: waiting behind its first copy takes as long as prefilling a copy cold, but the
    copy pushes half its size out of a cache with room for the other half; the burst stays together."""
    core = core_with(4)
    for i in range(4):
        feed_prefix(core, f"w{i}", list(range(10**6 * (i + 1), 10**6 * (i + 1) + 12_000)), now=0.0)
        core.update_metrics(f"w{i}", EngineMetrics(None, None, None, scraped_at=0.0, cache_tokens=20_000))
    prompt = list(range(16_000))
    first = core.decide(request(prompt, "a"), now=0.0)
    core.dispatch(request(prompt, "a"), first, first.chosen, now=0.0)
    for i in range(3):
        d = core.decide(request(prompt, f"b{i}"), now=0.01)
        assert d.chosen == first.chosen
        core.dispatch(request(prompt, f"b{i}"), d, d.chosen, now=0.01)
        assert next(c for c in d.candidates if c.worker_id == first.chosen).speculative == len(prompt) // BS
    later = core.decide(request(prompt, "late"), now=5.0)  # TTL over, no events came: no credit left
    assert all(c.speculative == 0 for c in later.candidates)



def test_speculative_credit_survives_a_resync_but_not_staleness():
    core = core_with(2, stale_after_s=1.0)
    prompt = list(range(16_000))
    first = core.decide(request(prompt, "a"), now=0.0)
    core.dispatch(request(prompt, "a"), first, first.chosen, now=0.0)
    # the worker's first event comes with seq 5: the router asks for a replay and the index is unsynced
    gap = core.feeder.offer(first.chosen, 5, EventBatch(0.01, [], 0), now=0.01)
    assert gap is not None and core.index_state(first.chosen, 0.02) == "unsynced"
    core.first_token("a", now=0.015)
    core.completed("a", now=0.015)  # done: nothing queued there, its prompt cached (no event has said so yet)
    d = core.decide(request(prompt, "b"), now=0.02)
    assert d.chosen == first.chosen  # what we just sent there is still there
    assert next(c for c in d.candidates if c.worker_id == first.chosen).speculative == len(prompt) // BS
    core.dispatch(request(prompt, "b"), d, d.chosen, now=0.02)
    other = core_with(2, stale_after_s=0.5)  # a worker taking requests with no events for too long: none
    d = other.decide(request(prompt, "a"), now=0.0)
    other.dispatch(request(prompt, "a"), d, d.chosen, now=0.0)
    assert other.index_state(d.chosen, 1.0) == "stale"
    later = other.decide(request(prompt, "b"), now=1.0)
    assert all(c.speculative == 0 for c in later.candidates)

# ---- other policies -------------------------------------------------------------------------------------

def test_round_robin_session_hash_least_loaded():
    rr = core_with(3, policy="round_robin")
    assert [rr.decide(request([1] * 16, f"r{i}"), 0).chosen for i in range(6)] == ["w0", "w1", "w2"] * 2
    sh = core_with(5, policy="session_hash")
    picks = {sh.decide(request([1] * 16, f"r{i}", session="user-42"), 0).chosen for i in range(10)}
    assert len(picks) == 1
    sh.remove_endpoint("w9")  # removing an unrelated worker keeps the mapping
    assert sh.decide(request([1] * 16, "z", session="user-42"), 0).chosen in picks
    ll = core_with(2, policy="least_loaded")
    ll.load.dispatch("busy", "w0", 10, 10, 1, 0.0)
    assert ll.decide(request([1] * 16), 0).chosen == "w1"


def test_approx_prefix_follows_routed_prefixes_until_imbalanced():
    core = core_with(2, policy="approx_prefix")
    prompt = list(range(640))
    d = core.decide(request(prompt, "a"), 0)
    core.dispatch(request(prompt, "a"), d, d.chosen, 0)
    holder = d.chosen
    other = "w1" if holder == "w0" else "w0"
    assert core.decide(request(prompt + [7] * 16, "b"), 0).chosen == holder
    for i in range(40):  # imbalance: > 32 more in flight on the holder
        core.load.dispatch(f"load{i}", holder, 10, 10, 1, 0.0)
    assert core.decide(request(prompt, "c"), 0).chosen == other


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        RoutingConfig(policy="nope")


# ---- engine metrics ---------------------------------------------------------------------------------------

def test_metrics_parse_vllm_and_sglang_and_go_stale():
    vllm = ('# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine="0",model_name="m"} 3\n'
            '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0",model_name="m"} 5\n'
            '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n')
    m = parse_engine_metrics(vllm, scraped_at=10.0)
    assert (m.waiting, m.running, m.kv_usage) == (3, 5, 0.25)
    sg = ('# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs{tp_rank="0"} 7\n'
          '# TYPE sglang:token_usage gauge\nsglang:token_usage{tp_rank="0"} 0.5\n')
    m2 = parse_engine_metrics(sg, scraped_at=10.0)
    assert (m2.waiting, m2.running, m2.kv_usage) == (7, None, 0.5)
    assert m.fresh(11.0, 2.0) is m and m.fresh(12.5, 2.0) is None
    assert m.cache_tokens is None  # no cache_config_info: capacity unknown
    info = ('# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{block_size="16",enable_prefix_caching="True",'
            'num_cpu_blocks="0",num_gpu_blocks="1024"} 1.0\n')
    assert parse_engine_metrics(vllm + info, scraped_at=10.0).cache_tokens == 16 * 1024
    core = core_with(1, metrics_max_age_s=2.0)
    core.update_metrics("w0", m)
    d = core.decide(request(list(range(64))), now=10.5)
    assert d.candidates[0].queue_s > 0  # fresh: 3 waiting count
    d = core.decide(request(list(range(64))), now=30.0)
    assert d.candidates[0].queue_s == 0  # stale metrics are unknown, not a queue


def test_a_fits_window_keeps_the_last_samples_oldest_first_and_its_medians_are_numpys():
    """RobustLine keeps its samples in a ring and takes medians by partition: the samples read back in arrival
    order (the sums of the fit run over them in that order), the medians are np.median's to the last bit."""
    from router.scheduling.engine_profile import RobustLine, _median

    line = RobustLine(window=5, refit_every=100)
    for i in range(1, 13):
        line.add(float(i), 2.0 * i)
        line.add(-1.0, 1.0)  # refused: not a sample
        assert len(line) == min(i, 5)
        assert line.samples[:, 0].tolist() == [float(j) for j in range(max(1, i - 4), i + 1)]
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 8, 255, 256):
        a = rng.lognormal(size=n)
        assert _median(a) == float(np.median(a))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 6), st.integers(1, 40), st.booleans(),
                          st.integers(0, 5)), min_size=1, max_size=12),
       st.floats(0.001, 0.1))
def test_the_release_schedule_frees_what_no_request_left_holds(requests, step_s):
    """``release_wait_s``'s schedule against its definition: taken in finish order, each request frees its tail
    and every key of the taken ones that no request still in flight holds. Requests share prefixes of three
    key chains (a system prompt), the rest of their keys their own."""
    tracker = LoadTracker()
    chains = [[1000 * c + i for i in range(6)] for c in range(3)]
    for n, (chain, shared, max_tokens, started, own) in enumerate(requests):
        keys = chains[chain][:shared] + [10_000 * (n + 1) + i for i in range(own)]
        tracker.dispatch(f"r{n}", "w", 16 * len(keys) + 3, 16, max_tokens, 0.1 * n, 0.05, keys=keys)
        if started:
            tracker.first_token(f"r{n}", 0.1 * n + 0.02)
    w = tracker.workers["w"]
    ends, freed = tracker.release_schedule(w, step_s)
    order = sorted(w.request_ids, key=lambda rid: (ends_of(tracker.inflight[rid], step_s), rid))
    everything = set(w.active_keys)
    want_ends, want_freed, tails = [], [], 0
    for i, rid in enumerate(order):
        tails += tracker.inflight[rid].tail_blocks
        left = {k for other in order[i + 1:] for k in tracker.inflight[other].keys}
        want_ends.append(ends_of(tracker.inflight[rid], step_s))
        want_freed.append(len(everything - left) + tails)
    assert ends == want_ends and freed == want_freed


def ends_of(r, step_s):
    start = r.first_token_at if r.first_token_at is not None else r.dispatched_at + (r.predicted_ttft_s or 0.0)
    return start + r.max_tokens * step_s
