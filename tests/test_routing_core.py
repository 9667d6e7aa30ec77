"""The routing core: cost model, filters, staleness fallback, policies, admission, explain."""

from collections import Counter

import numpy as np
import pytest

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

def test_cost_model_hand_computed():
    p = CostParams(prefill_s_per_token=1e-4, prefill_s_per_token_sq=0.0, prefill_step_s=0.01,
                   load_back_s_per_token=1e-5, storage_s_per_token=1e-4, decode_s_per_running=1e-3, learn_rate=0)
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
    est = cm.estimate("a", 1000, 16, None, load, None)
    assert est.queue_s == pytest.approx(5000e-4)
    assert est.decode_s == pytest.approx(4e-3)
    # past the step budget, pending work takes steps of its own: 20000 + 1000 tokens = 3 steps
    est = cm.estimate("a", 1000, 16, None, WorkerLoad(requests=3, pending_prefill_tokens=20000), None)
    assert est.queue_s == pytest.approx(2 * 0.01 + 20000e-4)
    # engine metrics say more is waiting than we sent (another router): the excess counts
    est = cm.estimate("a", 1000, 16, None, None, EngineMetrics(waiting=2, running=9, kv_usage=0.5, scraped_at=0))
    assert est.queue_s == pytest.approx(2 * p.waiting_prompt_tokens * 1e-4)  # 5096 tokens: one step
    assert est.decode_s == pytest.approx(9e-3)
    # a full hit still prefills the last token
    assert cm.estimate("a", 32, 16, PrefixMatch(gpu=2), None, None).uncached_tokens == 1


def test_the_trap_a_long_hit_behind_a_3s_queue_loses_to_an_idle_cold_worker():
    """Worker A holds the whole prefix but has 3 s of queued prefill; the hit saves only 0.8 s."""
    p = CostParams(prefill_s_per_token=1e-4, prefill_s_per_token_sq=0.0, prefill_step_s=0.0, learn_rate=0)
    core = RoutingCore(RoutingConfig(block_size=BS, cost=p, seed=0))
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



def test_a_second_copy_into_a_full_cache_pays_for_what_it_pushes_out():
    """A holder with a short queue vs an idle worker: a near tie that a full fleet cache tips to the holder."""
    p = CostParams(prefill_s_per_token=1e-4, prefill_s_per_token_sq=0.0, prefill_step_s=0.0, learn_rate=0,
                   compute_weight=1.0, eviction_weight=1.0, decode_s_per_running=0.0)
    core = RoutingCore(RoutingConfig(block_size=BS, cost=p, seed=0, speculative_ttl_s=0))
    for w in ("holder", "idle"):
        core.upsert_endpoint(Endpoint(w, f"10.0.0.{len(core.endpoints)}:1"))
    prompt = list(range(1601))  # 100 blocks held: a cold copy costs 0.16 s, its compute 0.16 s more
    feed_prefix(core, "holder", prompt, now=0.0)
    core.load.dispatch("queued", "holder", 4000, 4000, 10, now=0.0)  # 0.4 s queued: 0.4 > 2 x 0.16
    d = core.decide(request(prompt, "a"), now=0.1)
    by = {c.worker_id: c for c in d.candidates}
    assert d.chosen == "idle" and by["idle"].eviction_s == 0  # capacity unknown: no eviction cost
    # both caches reported full (500 blocks resident on 8,000-token caches): the copy pushes out 1,601 cached
    # tokens, and its 1,600 duplicated ones are a prefix the fleet no longer has room for: 0.32 s more
    feed_prefix(core, "holder", list(range(200_000, 206_400)), now=0.0, seq=1)
    feed_prefix(core, "idle", list(range(50_000, 58_000)), now=0.0)
    for w in ("holder", "idle"):
        core.update_metrics(w, EngineMetrics(None, None, None, scraped_at=0.0, cache_tokens=8000))
    assert core.resident_tokens("idle") >= core.cache_tokens["idle"]  # full
    d = core.decide(request(prompt, "b"), now=0.1)
    by = {c.worker_id: c for c in d.candidates}
    assert by["idle"].eviction_s == pytest.approx(0.1601 + 0.16)
    assert by["holder"].eviction_s == pytest.approx(1e-4)  # its one uncached token
    assert d.chosen == "holder"


def test_a_new_prefix_goes_where_it_evicts_nothing():
    p = CostParams(prefill_s_per_token=1e-4, prefill_s_per_token_sq=0.0, prefill_step_s=0.0, learn_rate=0,
                   eviction_weight=1.0)
    core = core_with(2, cost=p, speculative_ttl_s=0)
    feed_prefix(core, "w0", list(range(8000)), now=0.0)  # full
    feed_prefix(core, "w1", list(range(10_000, 14_000)), now=0.0)  # half full: room for 4,000 tokens
    for w in ("w0", "w1"):
        core.update_metrics(w, EngineMetrics(None, None, None, scraped_at=0.0, cache_tokens=8000))
    picks = Counter()
    for i in range(20):
        d = core.decide(request(list(range(100_000 * (i + 1), 100_000 * (i + 1) + 1601)), f"n{i}"), now=0.1)
        by = {c.worker_id: c for c in d.candidates}
        assert by["w0"].eviction_s == pytest.approx(0.1601) and by["w1"].eviction_s == 0
        picks[d.chosen] += 1
    assert picks == {"w1": 20}
    # once both are full, storing it costs the same everywhere: load decides, the pushed-out price does not
    feed_prefix(core, "w1", list(range(20_000, 24_000)), now=0.0, seq=1)
    d = core.decide(request(list(range(900_000, 901_601)), "full"), now=0.1)
    assert {c.worker_id: round(c.eviction_s, 6) for c in d.candidates} == {"w0": 0.1601, "w1": 0.1601}


def test_kv_blocks_in_flight_count_a_shared_prefix_once_and_free_in_finish_order():
    tracker = LoadTracker()
    system = request_keys(list(range(1600)), BS)  # 100 blocks
    a = system + request_keys(list(range(1600)) + [7] * 160, BS)[100:]  # + 10 blocks of its own
    b = system + request_keys(list(range(1600)) + [8] * 160, BS)[100:]
    tracker.dispatch("a", "w", 1760, 1760, 32, now=0.0, keys=a, block_size=BS)  # tail: 2 output blocks
    tracker.dispatch("b", "w", 1760, 1760, 32, now=0.0, keys=b, block_size=BS)
    load = tracker.load("w")
    assert load.active_blocks == 100 + 10 + 10 + 2 + 2
    assert load.shared_prefix_blocks([*system, 1, 2, 3]) == 100 and load.shared_prefix_blocks(a) == 110
    tracker.first_token("a", now=0.1)  # a finishes 32 steps of 10 ms after its first token: at 0.42
    tracker.first_token("b", now=0.2)  # b at 0.52
    # a frees only its own 12 blocks (b still holds the system prompt); b's finish frees the other 112
    assert tracker.release_wait_s("w", 12, now=0.0, decode_step_s=0.01) == pytest.approx(0.42)
    assert tracker.release_wait_s("w", 13, now=0.0, decode_step_s=0.01) == pytest.approx(0.52)
    assert tracker.release_wait_s("w", 10_000, now=0.0, decode_step_s=0.01) == pytest.approx(0.52)
    tracker.complete("a", now=0.42)
    tracker.complete("b", now=0.52)
    assert load.active_blocks == 0 and not load.active_keys


def test_a_worker_whose_cache_is_full_of_running_requests_makes_new_ones_wait():
    p = CostParams(prefill_s_per_token=1e-5, prefill_s_per_token_sq=0.0, prefill_step_s=0.0, learn_rate=0,
                   decode_step_s=0.02)
    core = RoutingCore(RoutingConfig(block_size=BS, cost=p, seed=0, speculative_ttl_s=0))
    for w in ("busy", "free"):
        core.upsert_endpoint(Endpoint(w, f"10.0.0.{len(core.endpoints)}:1"))
        core.update_metrics(w, EngineMetrics(None, None, None, scraped_at=0.0, cache_tokens=16 * 300))
    for i in range(4):  # four decoding requests hold 4 x 70 of the busy worker's 300 blocks
        keys = request_keys(list(range(i * 10_000, i * 10_000 + 1088)), BS)  # 68 blocks + 2 tail
        core.load.dispatch(f"run{i}", "busy", 1088, 0, 32, now=0.0, keys=keys, block_size=BS)
        core.load.first_token(f"run{i}", now=0.1 * i)
    prompt = list(range(100_000, 100_480))  # 30 blocks + 1 output block: 281 + 31 > 300
    d = core.decide(request(prompt, max_tokens=16), now=0.5)
    by = {c.worker_id: c for c in d.candidates}
    # the first to finish (run0: 32 steps of 20 ms after 0.0) frees 70 blocks at 0.64
    assert by["busy"].queue_s == pytest.approx(0.14) and by["free"].queue_s == 0
    assert d.chosen == "free"
    assert core.decide(request(prompt[:304], max_tokens=16), now=0.5).candidates[0].queue_s == 0  # 20 fit

def test_learned_scale_follows_observed_ttft():
    core = core_with(1, speculative_ttl_s=0)
    base = core.cost.prefill_s(6000)  # what an idle, cold worker is modelled to take (over 0.1 s: learned from)
    for i in range(60):
        req = request(list(range(i * 10_000, i * 10_000 + 6000)), f"r{i}")
        d = core.decide(req, now=float(i))
        assert d.predicted_ttft_s == pytest.approx(base * core.cost.scale.get("w0", 1.0))
        core.dispatch(req, d, "w0", now=float(i))
        core.first_token(f"r{i}", now=i + 2.0 * base)  # the worker is really 2x slower than modelled
        core.completed(f"r{i}", now=i + 0.5)
    assert core.cost.scale["w0"] == pytest.approx(2.0, rel=0.02)
    # short (cache-hit sized) TTFTs are mostly fixed overhead: they do not move the factor
    short = request(list(range(900_000, 900_100)), "short")
    d = core.decide(short, now=100.0)
    core.dispatch(short, d, "w0", now=100.0)
    core.first_token("short", now=100.0 + 10 * d.predicted_ttft_s)
    assert core.cost.scale["w0"] == pytest.approx(2.0, rel=0.02)


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
    assert len(busy) >= 2 and sorted(busy.values())[-2] >= 60
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
    core = core_with(4)
    prompt = list(range(16_000))  # long enough that waiting behind its first copy beats a cold prefill
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
