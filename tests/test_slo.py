"""Per-request objectives (router/scheduling/slo.py) and the simulator's attainment and goodput figures."""

from __future__ import annotations

import json

import numpy as np
import pytest
from multidict import CIMultiDict

from router.scheduling.slo import (
    NO_OBJECTIVE,
    ObjectiveError,
    ServiceObjective,
    SloConfig,
    objective_for,
    parse_slo_config,
)
from sim.runner import RequestRecord, SimConfig, SimResult, Simulation, slo_attainment, summarise
from sim.workload import SimRequest, mooncake
from workers.engine import EngineConfig

CONFIG = parse_slo_config({
    "objectives": {"chat": {"priority": 1, "ttft_ms": 300, "tpot_ms": 50},
                   "batch": {"priority": -1},
                   "gold": {"priority": 2, "ttft_ms": 150}},
    "models": {"llama": "chat"},
    "tenants": {"acme": "gold"},
})


def test_a_request_without_objective_headers_or_config_has_no_objective():
    assert objective_for({}, SloConfig()) is NO_OBJECTIVE
    assert not NO_OBJECTIVE.has_targets and not NO_OBJECTIVE.sheddable
    assert objective_for({"x-unrelated": "1"}, CONFIG, model="other") is NO_OBJECTIVE


def test_llm_d_target_headers_are_read_in_milliseconds_case_insensitively():
    o = objective_for(CIMultiDict({"X-SLO-TTFT-MS": "250", "x-slo-tpot-ms": "20.5"}), SloConfig())
    assert (o.ttft_s, o.tpot_s, o.priority) == (0.25, 0.0205, 0)


def test_a_named_objective_gives_its_priority_and_targets_and_headers_only_tighten_the_targets():
    o = objective_for({"x-gateway-inference-objective": "batch"}, CONFIG)
    assert o == ServiceObjective(None, None, -1, "batch") and o.sheddable
    o = objective_for({"x-gateway-inference-objective": "chat", "x-slo-ttft-ms": "100"}, CONFIG)
    assert (o.ttft_s, o.tpot_s, o.priority, o.name) == (0.1, 0.05, 1, "chat")
    # a looser target than the objective's is not the client's to take: flow control would hold it later
    o = objective_for({"x-gateway-inference-objective": "chat", "x-slo-ttft-ms": "900"}, CONFIG)
    assert (o.ttft_s, o.tpot_s, o.priority, o.name) == (0.3, 0.05, 1, "chat")


def test_defaults_come_from_the_tenant_before_the_model_and_the_header_before_both():
    assert objective_for({}, CONFIG, model="llama").name == "chat"
    assert objective_for({}, CONFIG, model="llama", tenant="acme").name == "gold"
    assert objective_for({"x-gateway-inference-objective": "batch"}, CONFIG, model="llama",
                         tenant="acme").name == "batch"


@pytest.mark.parametrize("headers", [
    {"x-slo-ttft-ms": "fast"}, {"x-slo-ttft-ms": "-5"}, {"x-slo-ttft-ms": "0"}, {"x-slo-tpot-ms": "nan"},
    {"x-slo-tpot-ms": "inf"}, {"x-slo-ttft-ms": "1e12"}, {"x-gateway-inference-objective": "platinum"},
])
def test_a_bad_objective_header_is_an_error_naming_the_header(headers):
    with pytest.raises(ObjectiveError) as e:
        objective_for(headers, CONFIG)
    assert next(iter(headers)) in str(e.value)


@pytest.mark.parametrize(("raw", "key"), [
    ({"objectives": {"a": {"priority": "high"}}}, "slo.objectives.a.priority"),
    ({"objectives": {"a": {"ttft": 3}}}, "ttft"),
    ({"objectives": {"a": {"ttft_ms": -1}}}, "slo.objectives.a.ttft_ms"),
    ({"models": {"m": "missing"}}, "slo.models.m"),
    ({"tenants": {"t": "missing"}}, "slo.tenants.t"),
    ({"default": "missing"}, "slo.default"),
    ({"objective": {}}, "objective"),
])
def test_bad_slo_config_names_the_key(raw, key):
    with pytest.raises(ObjectiveError) as e:
        parse_slo_config(raw)
    assert key in str(e.value)


def test_met_needs_both_targets_and_a_first_token():
    o = ServiceObjective(0.3, 0.05)
    assert o.met(0.3, 0.05) and not o.met(0.31, 0.01) and not o.met(0.1, 0.06) and not o.met(None, None)
    assert o.met(0.2, None)  # one output token: no TPOT to miss
    assert ServiceObjective(None, 0.05).met(100.0, 0.01)


def _record(rid: str, ttft: float, tpot: float, objective: ServiceObjective, tenant: str | None = None,
            outcome: str = "routed") -> RequestRecord:
    rec = RequestRecord(rid, 0.0, "w0" if outcome == "routed" else None, 100, output_tokens=11, objective=objective,
                        tenant=tenant, outcome=outcome)
    if outcome == "routed":
        rec.first_token_at, rec.finished_at = ttft, ttft + 10 * tpot
    return rec


def test_attainment_and_goodput_per_priority_and_tenant_count_a_shed_request_as_missed():
    chat, batch = ServiceObjective(0.3, 0.05, 1), ServiceObjective(None, None, -1)
    recs = [_record("a", 0.2, 0.04, chat, "t1"), _record("b", 0.5, 0.04, chat, "t1"),
            _record("c", 0.2, 0.09, chat, "t2"), _record("d", 9.0, 1.0, batch, "t2"),
            _record("e", 0, 0, batch, "t2", outcome="shed")]
    out = slo_attainment(recs, makespan_s=2.0)
    assert out["all"] == {"requests": 5, "met": 2, "attainment": 0.4, "goodput_rps": 1.0}
    assert out["by_priority"]["1"]["met"] == 1 and out["by_priority"]["1"]["attainment"] == pytest.approx(1 / 3)
    assert out["by_priority"]["-1"] == {"requests": 2, "met": 1, "attainment": 0.5, "goodput_rps": 0.5}
    assert out["by_tenant"]["t1"]["met"] == 1 and out["by_tenant"]["t2"]["met"] == 1


def test_a_trace_row_carries_its_objective_and_tenant_columns(tmp_path):
    rows = [{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]},
            {"timestamp": 10, "input_length": 600, "output_length": 4, "hash_ids": [1, 3], "slo_ttft_ms": 200,
             "slo_tpot_ms": 40, "priority": 1, "tenant": "acme"},
            {"timestamp": 20, "input_length": 600, "output_length": 4, "hash_ids": [4], "priority": -1}]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reqs = mooncake(path)
    assert reqs[0].objective is NO_OBJECTIVE and reqs[0].tenant is None
    assert (reqs[1].objective.ttft_s, reqs[1].objective.tpot_s, reqs[1].objective.priority) == (0.2, 0.04, 1)
    assert reqs[1].tenant == "acme" and reqs[2].objective.sheddable
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({**rows[1], "slo_ttft_ms": "soon"}) + "\n")
    with pytest.raises(ObjectiveError, match=r"bad.jsonl:1: slo_ttft_ms"):
        mooncake(bad)


def test_the_simulator_reports_attainment_that_a_tighter_target_lowers():
    engine = EngineConfig(block_size=16, num_gpu_blocks=512)
    rng = np.random.default_rng(3)

    def run(target_s: float) -> dict:
        reqs = [SimRequest(f"r{i}", i * 0.05, rng.integers(0, 1000, 300).astype(np.uint32), 8,
                           objective=ServiceObjective(target_s, None, 0), tenant=f"t{i % 2}") for i in range(40)]
        return summarise(Simulation(reqs, SimConfig(workers=2, policy="least_loaded", engine=engine)).run())

    loose, tight = run(1000.0), run(1e-6)
    assert loose["slo_attainment"] == 1.0 and loose["goodput_rps"] > 0
    assert tight["slo_attainment"] == 0.0 and tight["goodput_rps"] == 0.0
    assert set(loose["slo_by_tenant"]) == {"t0", "t1"} and loose["slo_by_priority"]["0"]["requests"] == 40
    without = summarise(SimResult("x", [], 1.0, {"w0": 0}, [], 0))
    assert without["slo_attainment"] == 1.0 and without["goodput_rps"] == 0.0


def test_the_router_config_reads_the_slo_section_and_names_a_bad_key(tmp_path):
    from router.config import ConfigError, load_config

    good = tmp_path / "good.yaml"
    good.write_text("slo:\n  objectives:\n    interactive: {priority: 1, ttft_ms: 300}\n  default: interactive\n")
    cfg = load_config(str(good), environ={})
    assert objective_for({}, cfg.slo) == ServiceObjective(0.3, None, 1, "interactive")
    bad = tmp_path / "bad.yaml"
    bad.write_text("slo:\n  objectives:\n    interactive: {priority: 1}\n  models: {m: gone}\n")
    with pytest.raises(ConfigError, match=r"slo\.models\.m"):
        load_config(str(bad), environ={})


# ---- routing to the objective (router/scheduling/plugins/pickers/meets_objective.py) ------------------------

def _fleet_with_a_cached_but_busy_worker():
    """w0 holds an 8K-token prompt's prefix and decodes six requests; w1 is idle and cold. Without targets the
    objective prefers w1 (the cold prefill costs this request 0.17 s, the hit on w0 would slow six decodes)."""
    from sim.workload import tokens_for_block
    from tests.test_routing_core import core_with, feed_prefix, request

    core = core_with(2)
    prompt = tokens_for_block(5, 8192).tolist()
    feed_prefix(core, "w0", prompt, 0.0)
    for i in range(6):
        r = request(tokens_for_block(100 + i, 512).tolist(), f"busy{i}", max_tokens=200)
        core.dispatch(r, core.decide(r, 0.0), "w0", 0.0)
        core.first_token(f"busy{i}", 0.1)
    return core, lambda objective: request(prompt, "x", max_tokens=100, objective=objective)


def test_without_targets_the_objective_picker_ranks_as_min_score_does():
    core, req = _fleet_with_a_cached_but_busy_worker()
    d = core.decide(req(NO_OBJECTIVE), 0.2)
    assert d.outcome == "routed" and list(d.ranked) == ["w1", "w0"]
    r0, r1 = d.report("w0"), d.report("w1")
    assert r1.score < r0.score and r0.ttft_s < r1.ttft_s  # the trade issue 43 is about: w1 costs it TTFT


def test_a_ttft_target_only_one_worker_meets_sends_it_there():
    core, req = _fleet_with_a_cached_but_busy_worker()
    loose = core.decide(req(ServiceObjective(10.0, None)), 0.2)
    assert list(loose.ranked) == ["w1", "w0"]  # both meet it: the one that costs the others least
    tight = core.decide(req(ServiceObjective(0.1, None)), 0.2)
    assert list(tight.ranked) == ["w0", "w1"]
    assert tight.report("w0").ttft_s <= 0.9 * 0.1 < tight.report("w1").ttft_s
    assert tight.predicted_ttft_s == tight.report("w0").ttft_s and tight.predicted_tpot_s == tight.report("w0").step_s
    assert "targets TTFT 100 ms" in tight.reason


def test_the_margin_keeps_a_barely_met_target_from_counting_as_met():
    core, req = _fleet_with_a_cached_but_busy_worker()
    w1_ttft = core.decide(req(NO_OBJECTIVE), 0.2).report("w1").ttft_s
    # w1 is predicted just under the target, but not by the 10% margin: w0 (well within it) is chosen
    d = core.decide(req(ServiceObjective(w1_ttft * 1.05, None)), 0.2)
    assert d.ranked[0] == "w0"


def test_nobody_meeting_the_target_sheds_a_sheddable_request_and_routes_others_to_the_least_violation():
    core, req = _fleet_with_a_cached_but_busy_worker()
    shed = core.decide(req(ServiceObjective(1e-4, None, -1)), 0.2)
    assert shed.outcome == "shed" and not shed.ranked and "no worker meets its objective" in shed.reason
    assert {c.worker_id for c in shed.candidates} == {"w0", "w1"}  # the debug view still explains it
    kept = core.decide(req(ServiceObjective(1e-4, None, 0)), 0.2)
    assert kept.outcome == "routed" and list(kept.ranked) == ["w0", "w1"]  # w0's predicted TTFT is the nearest
    tpot = core.decide(req(ServiceObjective(None, 1e-6, 0)), 0.2)
    assert tpot.outcome == "routed"


def test_a_profile_without_predictions_ignores_targets_as_the_peers_do():
    from sim.workload import tokens_for_block
    from tests.test_routing_core import core_with, request

    core = core_with(3, policy="least_loaded")
    prompt = tokens_for_block(9, 256).tolist()
    d = core.decide(request(prompt, "x", objective=ServiceObjective(1e-6, 1e-6, -1)), 0.0)
    assert d.outcome == "routed"


@pytest.mark.parametrize("seed", range(5))
def test_meets_objective_without_targets_is_min_score_over_random_fleets(seed):
    """The same decisions, ranking and draws as the min-score picker, whatever the fleet (a request without an
    objective keeps today's behaviour exactly)."""
    from router.scheduling import Endpoint, RoutingConfig, RoutingCore
    from sim.workload import tokens_for_block
    from tests.test_routing_core import request

    rng = np.random.default_rng(seed)
    sched = {"profiles": [{"name": "old", "plugins": [{"ref": "healthy"}, {"ref": "latency-cost"},
                                                      {"ref": "min-score"}]},
                          {"name": "new", "plugins": [{"ref": "healthy"}, {"ref": "latency-cost"},
                                                      {"ref": "meets-objective"}]}]}
    cores = {p: RoutingCore(RoutingConfig(policy=p, seed=seed, scheduling=sched)) for p in ("old", "new")}
    n = int(rng.integers(2, 40))
    for core in cores.values():
        for i in range(n):
            core.upsert_endpoint(Endpoint(f"w{i}", f"10.0.0.{i}:8000"))
    for k in range(30):
        prompt = tokens_for_block(int(rng.integers(0, 6)), int(rng.integers(16, 3000))).tolist()
        max_tokens = int(rng.integers(1, 300))
        out = []
        for core in cores.values():
            r = request(prompt, f"r{k}", max_tokens=max_tokens)
            d = core.decide(r, k * 0.01)
            core.dispatch(r, d, d.chosen, k * 0.01)
            out.append(list(d.ranked))
        assert out[0] == out[1]


def test_llm_ds_newer_header_names_are_read_first_and_the_older_still_work():
    from router.scheduling.slo import flow_id

    o = objective_for({"x-llm-d-slo-ttft-ms": "200", "x-slo-ttft-ms": "900", "x-llm-d-inference-objective": "batch"},
                      CONFIG)
    assert (o.ttft_s, o.priority) == (0.2, -1)
    with pytest.raises(ObjectiveError, match="x-llm-d-slo-tpot-ms"):
        objective_for({"x-llm-d-slo-tpot-ms": "fast"}, CONFIG)
    with pytest.raises(ObjectiveError, match="x-llm-d-inference-objective"):
        objective_for({"x-llm-d-inference-objective": "platinum"}, CONFIG)
    # the flow a held request waits in: the trusted tenant, else the fairness id it names
    fair = {"x-gateway-inference-fairness-id": "team-a"}
    assert flow_id(fair, None) == "team-a" and flow_id(fair, "acme") == "acme" and flow_id({}, None) is None
    assert flow_id({"x-llm-d-inference-fairness-id": "b", **fair}, None) == "b"


def test_llm_ds_headroom_rule_on_the_same_predictions():
    """llmd_predicted: the lowest blended latency without targets; with them the positive-headroom candidate
    nearest the boundary (llm-d's default ``least``), else the smallest deficit, and a shed for priority < 0."""
    from router.scheduling import RoutingConfig, RoutingCore
    from router.scheduling.types import Endpoint

    core, req = _fleet_with_a_cached_but_busy_worker()
    peer = RoutingCore(RoutingConfig(policy="llmd_predicted", block_size=16, seed=1))
    peer.state, peer.dispatches = core.state, core.dispatches  # the same fleet, in flight and all
    assert isinstance(peer.endpoints["w0"], Endpoint)
    assert list(peer.decide(req(NO_OBJECTIVE), 0.2).ranked) == ["w0", "w1"]  # w0's TTFT is the lower
    assert peer.decide(req(ServiceObjective(10.0, None)), 0.2).ranked[0] == "w1"  # least headroom: bin-packing
    assert peer.decide(req(ServiceObjective(0.1, None)), 0.2).ranked[0] == "w0"  # the only one with headroom
    assert peer.decide(req(ServiceObjective(1e-4, None)), 0.2).ranked[0] == "w0"  # the smaller deficit
    assert peer.decide(req(ServiceObjective(1e-4, None, -1)), 0.2).outcome == "shed"
