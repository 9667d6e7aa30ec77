"""The peers' algorithms as built-in profiles (issue 15, item 4): llmd, llmd_affinity, dynamo, aibrix, sglang and
preble. Hand-computed small cases pin each rule; every profile builds, runs through the simulator and is listed by
``kvrouter plugins --json``. In-process, no sockets."""

import json
import math
import random
import subprocess
import sys

import numpy as np
import pytest

from router.events.codec import BlockStored, EventBatch
from router.keys import request_keys
from router.load import EngineMetrics
from router.scheduling import Endpoint, RouteRequest, RoutingConfig, RoutingCore
from router.scheduling.plugins.pickers.peer_softmax import Softmax, SoftmaxParams, softmax_probabilities
from router.scheduling.plugins.registry import REGISTRY
from router.scheduling.profiles import ProfileError, builtin_profiles, describe, parse_scheduling
from router.scheduling.snapshot import Snapshot
from sim.runner import SimConfig, Simulation
from sim.workload import SimRequest
from tests.golden_scenarios import play
from workers.engine import EngineConfig

BS = 16
PEERS = ("llmd", "llmd_affinity", "dynamo", "aibrix", "sglang", "preble")
PROMPT = list(range(1000, 1000 + 10 * BS))  # 10 full blocks, 160 tokens


def fleet(n: int, policy: str = "dynamo", **kw) -> RoutingCore:
    core = RoutingCore(RoutingConfig(policy=policy, block_size=BS, seed=1, **kw))
    for i in range(n):
        core.upsert_endpoint(Endpoint(f"w{i}", f"10.0.0.{i}:8000"))
    return core


def hold(core: RoutingCore, wid: str, gpu: int, cpu: int = 0, storage: int = 0, tokens=PROMPT) -> None:
    """The worker's engine reports the prompt's first ``gpu`` blocks on GPU, the next ``cpu`` on CPU, then storage."""
    start, parent, seq = 0, None, 0
    for n, medium in ((gpu, "GPU"), (cpu, "CPU"), (storage, "STORAGE")):
        if not n:
            continue
        hashes = list(range(start + 1, start + n + 1))
        batch = EventBatch(0.0, [BlockStored(hashes, parent, tokens[start * BS:(start + n) * BS], BS, None, medium)], 0)
        core.feeder.offer(wid, seq, batch, 0.0)
        seq, parent, start = seq + 1, hashes[-1], start + n


def request(tokens=PROMPT, rid: str = "r", max_tokens: int = 8) -> RouteRequest:
    return RouteRequest(rid, request_keys(tokens, BS), len(tokens), BS, max_tokens)


def metrics(core: RoutingCore, wid: str, waiting: float = 0, running: float = 0, kv: float = 0.0,
            now: float = 1.0, cache_tokens: int | None = None) -> None:
    core.update_metrics(wid, EngineMetrics(waiting, running, kv, scraped_at=now, cache_tokens=cache_tokens))


def scores(core: RoutingCore, type_name: str, req: RouteRequest, now: float = 1.0, **params) -> dict[str, float]:
    cls = REGISTRY[type_name]
    scorer = cls(cls.Params(**params), rng=random.Random(0))
    snap = Snapshot(core.state, req, now)
    return dict(zip([c.worker_id for c in snap.candidates], scorer.score(snap, snap.candidates), strict=True))


# ---- llmd ------------------------------------------------------------------------------------------------------

def test_llmd_precise_prefix_weights_tiers_and_normalises_by_the_prompt():
    core = fleet(3, "llmd")
    hold(core, "w0", 4, cpu=4)  # (4 x 1.0 + 4 x 0.8) / 10 = 0.72
    hold(core, "w1", 2, storage=5)  # (2 + 5 x 0.3) / 10 = 0.35
    got = scores(core, "llmd-precise-prefix", request())
    assert got == pytest.approx({"w0": 1 - 0.72, "w1": 1 - 0.35, "w2": 1.0})


def test_llmd_queue_is_min_max_normalised_and_kv_is_usage():
    core = fleet(4, "llmd")
    for wid, waiting, kv in (("w0", 0, 0.25), ("w1", 5, 0.5), ("w2", 10, 1.0)):
        metrics(core, wid, waiting=waiting, kv=kv)
    # w3 has no metrics: unscored in llm-d (adds 0 to a "higher is better" sum), the worst cost here
    assert scores(core, "llmd-queue", request()) == pytest.approx({"w0": 0.0, "w1": 0.5, "w2": 1.0, "w3": 1.0})
    assert scores(core, "llmd-kv-utilization", request()) == pytest.approx(
        {"w0": 0.25, "w1": 0.5, "w2": 1.0, "w3": 1.0})
    for wid in ("w0", "w1", "w2", "w3"):
        metrics(core, wid, waiting=3)
    assert set(scores(core, "llmd-queue", request()).values()) == {0.0}  # equal queues: all best


def test_llmd_weighs_prefix_queue_and_kv_two_one_one():
    core = fleet(3, "llmd")
    hold(core, "w0", 10)  # all of it: prefix cost 0, but the longest queue and a fuller cache
    hold(core, "w1", 5)  # half: prefix cost 0.5
    metrics(core, "w0", waiting=10, kv=0.9)
    metrics(core, "w1", waiting=0, kv=0.5)
    metrics(core, "w2", waiting=0, kv=0.0)
    d = core.decide(request(), 1.0)
    total = {c.worker_id: c.score for c in d.candidates}
    # 2 x prefix + 1 x queue + 1 x kv
    assert total == pytest.approx({"w0": 2 * 0.0 + 1.0 + 0.9, "w1": 2 * 0.5 + 0.0 + 0.5, "w2": 2 * 1.0 + 0 + 0})
    assert d.ranked == ["w1", "w0", "w2"]


# ---- llmd_affinity ---------------------------------------------------------------------------------------------

def test_llmd_affinity_keeps_the_sticky_pods_until_their_ttft_penalty_passes_the_limit():
    core = fleet(3, "llmd_affinity")
    hold(core, "w0", 9)  # 0.9 >= 0.80: sticky
    hold(core, "w1", 7)  # 0.7: not
    assert scores(core, "llmd-prefix-affinity", request()) == {"w0": 0.0, "w1": 1000.0, "w2": 1000.0}
    assert core.decide(request(), 1.0).chosen == "w0"
    # 17 s of backlog at 15,928 tok/s on the sticky pod: within the 18 s penalty, it stays sticky
    core.load.load("w0").pending_prefill_tokens = 17 * 15_928
    assert core.decide(request(), 1.0).chosen == "w0"
    # 20 s: stickiness breaks, every pod is kept and the token load decides
    core.load.load("w0").pending_prefill_tokens = 20 * 15_928
    assert set(scores(core, "llmd-prefix-affinity", request()).values()) == {0.0}
    d = core.decide(request(), 1.0)
    assert d.chosen == "w1"  # w1's own uncached part (160 - 112 tokens) is less than w2's (160)
    load = {c.worker_id: c.score for c in d.candidates}
    assert load["w1"] == pytest.approx((160 - 7 * BS) / 4_194_304)
    assert load["w2"] == pytest.approx(160 / 4_194_304)
    # the penalty is the best sticky pod against the best other one, whatever the rest carry
    core.load.load("w1").pending_prefill_tokens = 10 ** 6
    core.load.load("w2").pending_prefill_tokens = 2 * 15_928  # 20 - 2 = 18 s: not more than the limit
    assert scores(core, "llmd-prefix-affinity", request())["w0"] == 0.0
    assert scores(core, "llmd-prefix-affinity", request())["w2"] == 1000.0


def test_llmd_affinity_without_a_sticky_pod_keeps_all():
    core = fleet(3, "llmd_affinity")
    hold(core, "w0", 7)
    assert set(scores(core, "llmd-prefix-affinity", request()).values()) == {0.0}
    assert core.decide(request(), 1.0).chosen == "w0"  # the token load sees its hit
    with pytest.raises(ProfileError, match="affinity_threshold"):
        RoutingCore(RoutingConfig(policy="x", scheduling=parse_scheduling({
            "plugins": [{"type": "llmd-prefix-affinity", "parameters": {"affinity_threshold": 1.5}}],
            "profiles": [{"name": "x", "plugins": ["llmd-prefix-affinity"]}]})))


def test_llmd_and_llmd_affinity_differ_on_a_backlogged_holder():
    """llm-d's weighted sum reads the engines' queues and caches, not the router's backlog; the gate reads the
    backlog (as a TTFT) and nothing else: two materially different algorithms, hence two profiles."""
    core_a, core_b = fleet(2, "llmd"), fleet(2, "llmd_affinity")
    for core in (core_a, core_b):
        hold(core, "w0", 10)
        metrics(core, "w0", waiting=4, kv=0.8)
        metrics(core, "w1", waiting=0, kv=0.1)
    # llmd: w0 = 0 + 1 + 0.8 = 1.8, w1 = 2 + 0 + 0.1 = 2.1: the holder
    assert core_a.decide(request(), 1.0).chosen == "w0"
    # llmd_affinity: w0 is sticky and its backlog is none: the holder too
    assert core_b.decide(request(), 1.0).chosen == "w0"
    # a 2-minute backlog on the holder: llm-d's weighted sum does not read it, the gate does
    for core in (core_a, core_b):
        core.load.load("w0").pending_prefill_tokens = 120 * 15_928
    assert core_a.decide(request(), 1.0).chosen == "w0"
    assert core_b.decide(request(), 1.0).chosen == "w1"


# ---- dynamo ----------------------------------------------------------------------------------------------------

def test_dynamo_credits_device_host_and_disk_overlap():
    core = fleet(4, "dynamo")
    hold(core, "w0", 4, cpu=4)  # credit 4 x 1.0 + 4 x 0.75 = 7 of 10 prompt blocks
    hold(core, "w1", 2, storage=3)  # credit 2 + 3 x 0.25 = 2.75
    # w3: a request in flight there with the same prompt, its 160 tokens still to prefill, 320 to generate
    core.load.dispatch("x", "w3", 160, 160, 320, 0.0, keys=request().keys, block_size=BS)
    got = scores(core, "dynamo-cost", request())
    assert got == pytest.approx({
        "w0": max(10 - 7, 0) + 10,  # decode: none active + this request's 10 blocks
        "w1": max(10 - 2.75, 0) + 10,
        "w2": 10 + 10,
        # prefill (160 pending + 160) / 16 = 20, no credit; decode: its 10 blocks + 1 partial (Dynamo's
        # ceil(isl / block size); output blocks untracked by default), none new: this prompt shares them
        "w3": 20 + 11 + 0})
    # with output tracking: the router's count of the request's blocks to its last token (10 + 20 output)
    assert scores(core, "dynamo-cost", request(), track_output_blocks=True)["w3"] == pytest.approx(20 + 30 + 0)
    assert core.decide(request(), 1.0).ranked == ["w0", "w1", "w2", "w3"]
    assert scores(core, "dynamo-cost", request(), prefill_load_scale=2.0)["w0"] == pytest.approx(2 * 3 + 10)
    # the credit never makes prefill negative
    hold(core, "w2", 10)
    assert scores(core, "dynamo-cost", request(), overlap_score_credit=2.0)["w2"] == pytest.approx(0 + 10)


def test_softmax_picker_samples_dynamos_distribution_with_the_seeded_rng():
    costs = [0.0, 1.0, 2.0]
    # Dynamo rescales by the range (2) first: p ~ exp(-c / (2 x T))
    want = [math.exp(-c / 2.0) for c in costs]
    want = [w / sum(want) for w in want]
    assert softmax_probabilities(costs, 1.0) == pytest.approx(want)
    raw = [math.exp(-c / 0.5) for c in costs]
    assert softmax_probabilities(costs, 0.5, normalize=False) == pytest.approx([r / sum(raw) for r in raw])
    assert softmax_probabilities([3.0, 3.0], 1.0) == [0.5, 0.5]

    core = fleet(3, "dynamo")
    snap = Snapshot(core.state, request(), 0.0)
    cands = snap.candidates

    def draws(seed: int, temperature: float, n: int = 20_000) -> list[str]:
        picker = Softmax(SoftmaxParams(temperature), rng=random.Random(seed))
        return [picker.pick(snap, cands, costs)[0] for _ in range(n)]

    got = draws(7, 1.0)
    freq = [got.count(w) / len(got) for w in ("w0", "w1", "w2")]
    assert freq == pytest.approx(want, abs=0.015)
    assert got[:200] == draws(7, 1.0, 200)  # the profile's seeded rng: reproducible
    assert set(draws(7, 0.0, 200)) == {"w0"}  # temperature 0: argmin
    ranked = Softmax(SoftmaxParams(1.0), rng=random.Random(3)).pick(snap, cands, costs)
    assert sorted(ranked) == ["w0", "w1", "w2"] and ranked[1:] == sorted(ranked[1:])  # fallbacks by cost
    ties = {Softmax(SoftmaxParams(0.0), rng=random.Random(s)).pick(snap, cands, [1.0, 1.0, 2.0])[0]
            for s in range(20)}
    assert ties == {"w0", "w1"}  # equal costs: random among them


def test_dynamo_temperature_and_scale_come_from_config():
    sched = parse_scheduling({
        "plugins": [{"type": "dynamo-cost", "parameters": {"prefill_load_scale": 4.0}},
                    {"type": "softmax", "parameters": {"temperature": 0.5}}],
        "profiles": [{"name": "dynamo-hot", "plugins": ["healthy", "dynamo-cost", "softmax"]}]})
    core = RoutingCore(RoutingConfig(policy="dynamo-hot", block_size=BS, seed=1, scheduling=sched))
    assert core.profile.scorers[0][0].params.prefill_load_scale == 4.0
    assert core.profile.picker.params.temperature == 0.5
    with pytest.raises(ProfileError, match="temperature"):
        RoutingCore(RoutingConfig(policy="x", scheduling=parse_scheduling({
            "plugins": [{"type": "softmax", "parameters": {"temperature": -1.0}}],
            "profiles": [{"name": "x", "plugins": ["softmax"]}]})))


# ---- aibrix ----------------------------------------------------------------------------------------------------

def test_aibrix_goes_least_loaded_past_the_imbalance_switch():
    core = fleet(3, "aibrix")
    hold(core, "w1", 10)
    metrics(core, "w1", running=16)
    metrics(core, "w2", running=5)
    # max - min = 16, not more than 16: the holder (16 <= mean 7 + 2 x 6.68)
    assert scores(core, "aibrix-prefix-cache", request()) == {"w0": 0.0, "w1": -1.0, "w2": 5.0}
    assert core.decide(request(), 1.0).chosen == "w1"
    # one sigma (the code's current constant) would cut at 13.7 and fall back to the least loaded
    assert scores(core, "aibrix-prefix-cache", request(), std_dev_factor=1.0) == {"w0": 0.0, "w1": 16.0, "w2": 5.0}
    metrics(core, "w1", running=17)  # 17 > 16: imbalanced, the least loaded
    assert scores(core, "aibrix-prefix-cache", request()) == {"w0": 0.0, "w1": 17.0, "w2": 5.0}
    assert core.decide(request(), 1.0).chosen == "w0"


def test_aibrix_takes_the_best_match_within_mean_plus_two_sigma():
    core = fleet(6, "aibrix")
    hold(core, "w0", 10)  # 100% but 10 running
    hold(core, "w1", 5)  # 50%, idle
    hold(core, "w2", 5)
    metrics(core, "w0", running=10)
    metrics(core, "w2", running=1)
    # loads [10, 0, 1, 0, 0, 0]: mean 1.833, pstdev 3.671, cut 9.18 < 10: w0 is skipped; among the 50% matches the
    # one with fewer running requests
    loads = [10, 0, 1, 0, 0, 0]
    mean = sum(loads) / 6
    cut = mean + 2 * math.sqrt(sum((x - mean) ** 2 for x in loads) / 6)
    assert 9 < cut < 10
    got = scores(core, "aibrix-prefix-cache", request())
    assert got == {"w0": 10.0, "w1": -1.0, "w2": 1.0, "w3": 0.0, "w4": 0.0, "w5": 0.0}
    assert core.decide(request(), 1.0).chosen == "w1"
    # three sigma admits the full match
    assert scores(core, "aibrix-prefix-cache", request(), std_dev_factor=3.0)["w0"] == -1.0
    # no match at all: least loaded (ties among the idle ones at random)
    other = [7] * (10 * BS)
    assert {core.decide(request(other, f"o{i}"), 1.0).chosen for i in range(20)} <= {"w1", "w3", "w4", "w5"}


# ---- sglang ----------------------------------------------------------------------------------------------------

def test_sglang_is_the_approx_prefix_scorer_with_its_defaults():
    profiles = builtin_profiles()
    assert profiles["sglang"] == profiles["approx_prefix"]
    core = fleet(2, "sglang")
    p = core.profile.scorers[0][0].params
    assert (p.match_threshold, p.balance_abs, p.balance_rel) == (0.5, 32, 1.1)  # SGLang cache_aware's defaults
    assert play("sglang", 2) == play("approx_prefix", 2)


# ---- preble ----------------------------------------------------------------------------------------------------

def test_preble_exploits_when_the_cached_part_is_longer_than_the_rest():
    core = fleet(3, "preble")
    hold(core, "w0", 6)  # 96 cached > 64 uncached: exploit
    hold(core, "w1", 6)
    core.load.load("w0").pending_prefill_tokens = 4096  # the busier holder
    d = core.decide(request(), 1.0)
    assert d.ranked == ["w1", "w0", "w2"]  # the holders first, the less loaded of them first; w2 is idle
    s = {c.worker_id: c.score for c in d.candidates}
    q = core.cost.prefill_s(4096)
    assert s["w1"] == pytest.approx(-1.0) and s["w0"] == pytest.approx(-1.0 / (1.0 + q))
    assert s["w2"] == pytest.approx(core.cost.prefill_s(160))  # explore cost of a non-holder: its prefill


def test_preble_explores_by_load_plus_eviction_plus_prefill():
    core = fleet(3, "preble")
    hold(core, "w0", 5)  # 80 cached, 80 uncached: not longer, explore
    costs = core.cost
    # time per output token: the worker's decode step at its KV usage (w1 reports 0; w0's is unknown: half)
    step0, step1 = costs.profile("w0").decode_step_s(0.5), costs.profile("w1").decode_step_s(0.0)
    core.load.load("w0").decoding = 2
    metrics(core, "w1", running=3, cache_tokens=100 * BS)  # the engine's running count; a nearly full cache:
    hold(core, "w1", 95, tokens=list(range(5000, 5000 + 95 * BS)))  # 95 of its 100 blocks hold another prompt
    req = request(max_tokens=8)
    got = scores(core, "preble-e2", req)
    assert got == pytest.approx({
        "w0": 2 * 8 * step0 + costs.prefill_s(80),  # decode load + the uncached half's prefill
        "w1": 3 * 8 * step1 + costs.prefill_s(160 - 5 * BS) + costs.prefill_s(160),  # + evicting 80 past 5 free
        "w2": costs.prefill_s(160)})
    assert core.decide(req, 1.0).chosen == "w2"  # idle and empty beats the holder's running decodes
    core.load.load("w0").decoding = 0
    assert core.decide(req, 1.0).chosen == "w0"  # with the decodes gone, its hit wins
    assert scores(core, "preble-e2", req, exploit_ratio=0.5)["w0"] == pytest.approx(-1.0)  # 80 > 0.5 x 80


# ---- every peer profile: builds, simulates, is listed -------------------------------------------------------------

@pytest.mark.parametrize("policy", PEERS)
def test_peer_profile_runs_through_the_simulator(policy):
    rng = random.Random(3)
    prefixes = [[rng.randrange(4000) for _ in range(256)] for _ in range(12)]
    reqs = [SimRequest(f"r{i}", i * 0.04, np.array(rng.choice(prefixes) + [rng.randrange(4000) for _ in range(32)],
                                                  dtype=np.uint32), 32) for i in range(150)]
    engine = EngineConfig(num_gpu_blocks=512, block_size=BS)
    sim = Simulation(reqs, SimConfig(workers=4, engine=engine,
                                     routing=RoutingConfig(policy=policy, block_size=BS, seed=0)))
    result = sim.run()
    assert result.policy == policy
    assert len(result.records) == 150 and all(r.outcome == "routed" and r.finished_at for r in result.records)
    assert len({r.worker for r in result.records}) >= 2
    assert sum(r.cached_tokens for r in result.records) > 0  # every peer is cache-aware


def test_kvrouter_plugins_lists_the_peer_plugins_and_profiles():
    out = subprocess.run([sys.executable, "-m", "router.cli", "plugins", "--json"],
                         capture_output=True, text=True, check=True).stdout
    data = json.loads(out)
    assert set(PEERS) <= set(data["profiles"])
    assert {"llmd-precise-prefix", "llmd-queue", "llmd-kv-utilization", "llmd-token-load", "llmd-prefix-affinity",
            "llmd-lora-affinity", "dynamo-cost", "aibrix-prefix-cache", "preble-e2"} <= {
        p["type"] for p in data["scorers"]}
    assert "softmax" in {p["type"] for p in data["pickers"]}
    llmd = data["profiles"]["llmd"]["plugins"]
    assert [(p["type"], p.get("weight")) for p in llmd if "weight" in p] == [
        ("llmd-precise-prefix", 2.0), ("llmd-queue", 1.0), ("llmd-kv-utilization", 1.0),
        ("llmd-lora-affinity", 1.0)]
    dynamo = next(p for p in data["scorers"] if p["type"] == "dynamo-cost")
    assert {q["name"]: q["default"] for q in dynamo["parameters"]}["host_cache_hit_weight"] == 0.75
    assert describe()["profiles"]["dynamo"]["plugins"][-1] == {"type": "softmax", "parameters": {"temperature": 0.0}}


def test_every_peer_plugin_cites_its_source():
    for name in ("llmd-precise-prefix", "llmd-queue", "llmd-kv-utilization", "llmd-token-load",
                 "llmd-prefix-affinity", "dynamo-cost", "softmax", "aibrix-prefix-cache", "preble-e2"):
        doc = sys.modules[REGISTRY[name].__module__].__doc__ or ""
        assert any(s in doc for s in ("llm-d/", "ai-dynamo/", "vllm-project/aibrix", "Preble")), name


