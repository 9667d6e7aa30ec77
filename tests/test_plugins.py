"""The scheduling framework (issue 14): plugins from outside router/, profiles in config, the request
lifecycle's undo and reassignment, readiness that ages with no traffic. In-process, no sockets."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from router.config import ConfigError, load_config
from router.events.codec import BlockStored, EventBatch
from router.keys import request_keys
from router.load import EngineMetrics
from router.scheduling import Endpoint, RouteRequest, RoutingConfig, RoutingCore
from router.scheduling.profiles import parse_scheduling
from sim.runner import SimConfig, Simulation
from sim.workload import SimRequest
from workers.engine import EngineConfig

BS = 16
EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "examples" / "kv_pressure_scorer.py"


def core_with(n: int, policy: str = "precise", **kw) -> RoutingCore:
    core = RoutingCore(RoutingConfig(policy=policy, block_size=BS, seed=1, **kw))
    for i in range(n):
        core.upsert_endpoint(Endpoint(f"w{i}", f"10.0.0.{i}:8000"))
    return core


def route(tokens: list[int], rid: str = "r") -> RouteRequest:
    return RouteRequest(rid, request_keys(tokens, BS), len(tokens), BS, 8)


def scheduling_with_example(weight: float) -> dict:
    return {"version": 1, "imports": [str(EXAMPLE)],
            "plugins": [{"type": "kv-pressure", "name": "pressure", "parameters": {"seconds_when_full": 5.0}}],
            "profiles": [{"name": "roomy", "plugins": ["healthy", "admission", "latency-cost",
                                                        {"ref": "pressure", "weight": weight}, "min-score"]}]}


# ---- a scorer from a file outside router/, through the registry and config alone ----------------------

def test_an_outside_scorer_loaded_by_config_changes_decisions_in_the_simulator(tmp_path):
    import random

    rng = random.Random(5)
    prefixes = [[rng.randrange(4000) for _ in range(256)] for _ in range(24)]
    reqs = [SimRequest(f"r{i}", i * 0.05, np.array(rng.choice(prefixes) + [rng.randrange(4000) for _ in range(32)],
                                                   dtype=np.uint32), 64) for i in range(240)]
    config = tmp_path / "router.yaml"
    config.write_text(json.dumps({"scheduling": scheduling_with_example(1.0), "routing": {"policy": "roomy"}}))
    routing = load_config(config).routing  # the scorer's file is imported by the config, nothing else
    assert [type(s).__name__ for s, _ in RoutingCore(routing).profile.scorers] == ["LatencyCost", "KvPressure"]

    def placements(routing_config: RoutingConfig) -> list[str | None]:
        engine = EngineConfig(num_gpu_blocks=256, block_size=BS)
        sim = Simulation(reqs, SimConfig(workers=4, engine=engine, routing=routing_config))
        return [r.worker for r in sim.run().records]

    plain = placements(RoutingConfig(policy="precise", block_size=BS, seed=0))
    roomy = placements(RoutingConfig(policy="roomy", block_size=BS, seed=0,
                                     scheduling=parse_scheduling(scheduling_with_example(1.0))))
    zero = placements(RoutingConfig(policy="roomy", block_size=BS, seed=0,
                                    scheduling=parse_scheduling(scheduling_with_example(0.0))))
    assert zero == plain  # weight 0: the same decisions as precise, so the scorer is what changed them
    assert sum(a != b for a, b in zip(plain, roomy, strict=True)) >= 10


def test_config_errors_name_the_key(tmp_path):
    bad = scheduling_with_example(1.0)
    bad["plugins"][0]["parameters"] = {"seconds_when_ful": 1.0}
    path = tmp_path / "bad.yaml"
    path.write_text(json.dumps({"scheduling": bad, "routing": {"policy": "roomy"}}))
    with pytest.raises(ConfigError, match=r"scheduling.plugins\[0\].parameters.*seconds_when_ful"):
        load_config(path)
    bad = scheduling_with_example(1.0)
    bad["profiles"][0]["plugins"][2] = {"ref": "latency-cots"}
    path.write_text(json.dumps({"scheduling": bad, "routing": {"policy": "roomy"}}))
    with pytest.raises(ConfigError, match=r"scheduling.profiles\[0\].plugins\[2\].ref: unknown plugin 'latency-cots'"):
        load_config(path)
    path.write_text(json.dumps({"scheduling": {"version": 1, "profiles": [{"name": "x", "plugins": [
        "random", "min-score"]}]}, "routing": {"policy": "x"}}))
    with pytest.raises(ConfigError, match="one picker"):
        load_config(path)
    path.write_text(json.dumps({"routing": {"policy": "nope"}}))
    with pytest.raises(ConfigError, match="unknown policy 'nope'"):
        load_config(path)


def test_approx_prefix_thresholds_are_configurable():
    sched = parse_scheduling({"plugins": [{"type": "approx-prefix", "name": "strict",
                                           "parameters": {"match_threshold": 0.99}}],
                              "profiles": [{"name": "strict", "plugins": ["healthy", "strict"]}]})
    tokens = list(range(40 * BS))
    for policy, expect_holder in (("approx_prefix", True), ("strict", False)):
        core = RoutingCore(RoutingConfig(policy=policy, block_size=BS, seed=3, scheduling=sched))
        for i in range(4):
            core.upsert_endpoint(Endpoint(f"w{i}", f"10.0.0.{i}:1"))
        first = core.decide(route(tokens, "a"), 0.0)
        core.dispatch(route(tokens, "a"), first, "w2", 0.0).complete(0.1)
        # 30 of 40 blocks shared: over 0.5 of the prompt, under 0.99
        other = tokens[: 30 * BS] + [7] * (10 * BS)
        holder_first = [core.decide(route(other, f"b{i}"), 1.0).chosen == "w2" for i in range(8)]
        assert all(holder_first) if expect_holder else not all(holder_first)


def test_kvrouter_plugins_lists_every_plugin_and_profile(tmp_path):
    config = tmp_path / "router.yaml"
    config.write_text(json.dumps({"scheduling": scheduling_with_example(1.0)}))
    out = subprocess.run([sys.executable, "-m", "router.cli", "plugins", "--json", "--config", str(config)],
                         capture_output=True, text=True, check=True).stdout
    data = json.loads(out)
    assert set(data) == {"filters", "scorers", "pickers", "profiles"}
    assert {"healthy", "admission"} <= {p["type"] for p in data["filters"]}
    assert {"latency-cost", "approx-prefix", "kv-pressure"} <= {p["type"] for p in data["scorers"]}
    assert {"min-score", "round-robin"} <= {p["type"] for p in data["pickers"]}
    assert {"random", "round_robin", "least_loaded", "session_hash", "approx_prefix", "precise", "roomy"} <= set(
        data["profiles"])
    approx = next(p for p in data["scorers"] if p["type"] == "approx-prefix")
    assert {q["name"] for q in approx["parameters"]} >= {"balance_abs", "match_threshold"}


# ---- the lifecycle ------------------------------------------------------------------------------------

def test_a_retry_undoes_the_abandoned_choices_speculative_credit():
    core = core_with(3)
    tokens = list(range(20 * BS))
    d = core.decide(route(tokens, "a"), 0.0)
    handle = core.dispatch(route(tokens, "a"), d, "w0", 0.0)
    assert core.state.speculative.match(route(tokens).keys, 0.1) == {"w0": 20}
    handle.reassign("w1", 0.1)  # w0 refused the connection: the request is on w1 now
    assert core.state.speculative.match(route(tokens).keys, 0.2) == {"w1": 20}
    assert set(core.load.inflight) == {"a"} and core.load.inflight["a"].worker_id == "w1"
    assert core.load.workers["w0"].requests == 0 and core.load.workers["w1"].requests == 1
    handle.fail(0.3)  # and w1 failed too: nothing was served anywhere
    assert core.state.speculative.match(route(tokens).keys, 0.4) == {}
    assert not core.load.inflight and not core.dispatches


def test_a_retry_keeps_an_earlier_requests_speculative_credit():
    core = core_with(3)
    tokens = list(range(20 * BS))
    core.dispatch(route(tokens, "a"), core.decide(route(tokens, "a"), 0.0), "w0", 0.0)
    later = core.dispatch(route(tokens, "b"), core.decide(route(tokens, "b"), 0.1), "w1", 0.1)
    later.fail(0.2)  # b's record is taken back: a's, which it had overwritten, is true again
    assert core.state.speculative.match(route(tokens).keys, 0.3) == {"w0": 20}


def test_an_envoy_fallback_moves_the_inflight_accounting_and_the_approx_tree():
    core = core_with(3, policy="approx_prefix")
    tokens = list(range(20 * BS))
    d = core.decide(route(tokens, "a"), 0.0)
    picked = d.chosen
    served = next(w for w in ("w0", "w1", "w2") if w != picked)
    handle = core.dispatch(route(tokens, "a"), d, picked, 0.0)
    handle.reassign(served, 0.05)  # Envoy's upstream.address says another endpoint served it
    handle.first_token(0.1)
    assert core.load.workers[picked].requests == 0 and core.load.workers[served].decoding == 1
    tree = core.profile.scorers[0][0].tree
    assert set(tree.match(route(tokens).keys)) == {served}  # the tree learned where it really went
    handle.complete(0.5)
    assert core.load.workers[served].requests == 0 and not core.dispatches


def test_random_and_round_robin_never_walk_the_index():
    for policy, walks in (("random", False), ("round_robin", False), ("least_loaded", False), ("precise", True)):
        core = core_with(3, policy=policy)
        calls = []
        real = core.index.match_lengths
        core.state.index.match_lengths = lambda keys, _real=real, _calls=calls: (_calls.append(1), _real(keys))[1]
        core.feeder.offer("w0", 0, EventBatch(0.0, [BlockStored(list(range(1, 11)), None, list(range(10 * BS)), BS,
                                                                None, "GPU")], 0), 0.0)
        d = core.decide(route(list(range(10 * BS))), 0.1)
        assert bool(calls) is walks, policy
        assert (d.candidates[0].ttft_s > 0) is walks  # no cost estimates where no scorer asks for them


def test_readiness_turns_not_ready_when_metrics_age_out_with_no_traffic():
    core = core_with(2)
    for w in ("w0", "w1"):
        core.update_metrics(w, EngineMetrics(0, 0, 0.1, scraped_at=10.0))
    assert core.readiness(10.5) == (True, "ready")
    ready, why = core.readiness(10.0 + core.config.metrics_max_age_s + 0.1)  # no decision in between
    assert not ready and "metrics" in why
    core.endpoints["w0"].healthy = core.endpoints["w1"].healthy = False
    assert core.readiness(10.5) == (False, "no healthy endpoint")
