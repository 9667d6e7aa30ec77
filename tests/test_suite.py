"""The scenario suite (``kvrouter sim --suite standard``) and the oracle policy (issue 15, items 3 and 5)."""

import argparse
import json
from collections import Counter

import numpy as np
import pytest

from router.index import Medium
from router.scheduling import CostParams, RoutingConfig, profiles
from sim import cli
from sim.oracle import ORACLE, oracle_routing
from sim.runner import EventFaults, RequestRecord, SimConfig, SimResult, Simulation, summarise
from sim.suite import SCENARIOS, SUMMARY_KEYS, TRACE, TRACE_SPEEDUPS, half_compute
from sim.workload import SimRequest, engine_answer, tokens_for_block, working_set_tokens
from tests.conftest import need_shared
from workers.engine import EngineConfig, EngineModel, EngineRequest, TimingModel

BS = 16


def _cli(argv):
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return cli.run(p.parse_args(argv))


@pytest.fixture(scope="module")
def quick_suite():
    """The quick suite, once, through the CLI's JSON."""
    need_shared(TRACE)
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert _cli(["--suite", "standard", "--quick", "--json"]) == 0
    return json.loads(out.getvalue())


# ---- the suite's output ----------------------------------------------------------------------------------

def test_quick_suite_has_every_scenario_and_every_profile_plus_the_oracle(quick_suite):
    expected = {*profiles.BUILTIN_PROFILES, ORACLE}
    assert set(quick_suite["scenarios"]) == set(SCENARIOS)
    assert set(quick_suite["profiles"]) == expected
    for name, sc in quick_suite["scenarios"].items():
        assert set(sc["policies"]) == expected, name
        assert 0.0 < sc["bound_hit_rate"] <= 1.0
        for policy, s in sc["policies"].items():
            assert set(SUMMARY_KEYS) <= set(s), (name, policy)
            assert isinstance(s["rejected"], int) and isinstance(s["failed"], int)
            assert s["completed"] + s["rejected"] + s["failed"] + s["shed"] + s["no_endpoint"] == s["requests"]
            assert s["requests"] == sc["requests"]
            # nobody beats one infinite cache shared by all (it also holds every answer)
            assert s["hit_rate"] <= sc["bound_hit_rate"] + 1e-9, (name, policy)
            assert s["ttft_p50_s"] <= s["ttft_p90_s"] <= s["ttft_p99_s"] and s["ttft_mean_s"] <= s["e2e_mean_s"]
            if policy == "precise":  # the default profile predicts what it routes on: its errors are reported
                pred = s["prediction"]
                assert pred is not None and pred["ttft_n"] > 0, name
                assert pred["ttft_median_rel_error"] <= pred["ttft_p90_rel_error"], name
            assert s["tpot_mean_s"] > 0
    st = quick_suite["standings"]
    assert set(st) == set(SCENARIOS)
    for row in st.values():
        assert row["ttft_mean_s"]["winner"] in expected and "precise_vs_oracle_pct" in row["e2e_mean_s"]


def test_scenarios_that_should_differ_do(quick_suite):
    sc = quick_suite["scenarios"]
    # the CPU tier serves hits the GPU cache alone has evicted (same workload, same fleet otherwise)
    assert sc["cpu_offload"]["policies"]["precise"]["hit_rate"] > sc["eviction"]["policies"]["precise"]["hit_rate"]
    # a restart loses what the restarted worker held, under some policy at least; none other fails requests
    assert any(p["failed"] for p in sc["restart"]["policies"].values())
    assert all(p["failed"] == 0 for n, s in sc.items() if n != "restart" for p in s["policies"].values())
    # prefix-aware routing hits more than random where prefixes are shared
    for name in ("shared_prefix", "hot_prefix", "zipf_prefixes", "multi_turn"):
        assert sc[name]["policies"]["precise"]["hit_rate"] > sc[name]["policies"]["random"]["hit_rate"], name


def test_suite_table_and_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert _cli(["--suite", "standard", "--quick", "--scenarios", "hot_prefix", "--policies", "round_robin,oracle",
                 "--plots", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "== hot_prefix" in out and "standings" in out and "rejected" in out
    assert [p.name for p in tmp_path.iterdir()] == ["hot_prefix.png"]
    assert _cli(["--suite", "standard", "--scenarios", "nope"]) == 2


def test_cost_overrides_apply_to_every_profile(capsys):
    """``--cost kv_load_weight=0`` makes precise the precise_ttft profile (the same objective, TTFT first)."""
    base = ["--suite", "standard", "--quick", "--scenarios", "hot_prefix", "--json"]
    assert _cli([*base, "--policies", "precise_ttft,precise"]) == 0
    plain = json.loads(capsys.readouterr().out)["scenarios"]["hot_prefix"]["policies"]
    assert _cli([*base, "--policies", "precise", "--cost", "kv_load_weight=0"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["cost"]["kv_load_weight"] == 0
    def figures(r):
        return {k: v for k, v in r.items() if k != "wall_s"}

    assert figures(got["scenarios"]["hot_prefix"]["policies"]["precise"]) == figures(plain["precise_ttft"])
    assert figures(plain["precise"]) != figures(plain["precise_ttft"])
    assert _cli([*base, "--cost", "nope=1"]) == 2
    assert _cli([*base, "--policies", "oracle", "--cost", "kv_load_weight=0"]) == 0  # the oracle takes it too
    assert json.loads(capsys.readouterr().out)["scenarios"]["hot_prefix"]["policies"]["oracle"]["completed"] > 0


# ---- the oracle ------------------------------------------------------------------------------------------

def _warm(engine: EngineModel, tokens: np.ndarray, out: int = 4) -> None:
    """Serve one request on the engine directly: its blocks are cached, and no event reaches any router."""
    engine.add_request(EngineRequest("warm", tokens, out))
    t = 0.0
    while engine.has_work:
        t += engine.step(t).duration_s
    engine.take_events()


@pytest.mark.parametrize("fault", [EventFaults(stop_at=0.0), EventFaults(delay_s=1e6)])
def test_the_oracle_sees_the_engines_true_hit_that_the_router_cannot(fault):
    prefix = tokens_for_block(1, 40 * BS)
    probe = SimRequest("probe", 10.0, np.concatenate([prefix, tokens_for_block(2, 5 * BS)]), 8)
    engine = EngineConfig(num_gpu_blocks=400, block_size=BS)
    seen = {}
    for policy in ("precise", ORACLE):
        sim = Simulation([probe], SimConfig(workers=3, policy=policy, engine=engine,
                                            faults={i: fault for i in range(3)}))
        _warm(sim.engines["w1"], prefix)
        _, d = sim.decide(probe, 10.0)
        seen[policy] = (d, {c.worker_id: c.matched_gpu for c in d.candidates})
        if policy == ORACLE:
            # what the oracle credited is what the engine then finds: its own lookup, no side effects before
            real = sim.engines["w1"]
            real.add_request(EngineRequest("probe", probe.tokens, 8))
            real.step(10.0)
            assert real.running[0].num_cached_tokens == seen[ORACLE][1]["w1"] * BS == 40 * BS
    assert seen["precise"][1] == {"w0": 0, "w1": 0, "w2": 0}  # no event ever told the router
    assert seen[ORACLE][1] == {"w0": 0, "w1": 40, "w2": 0}
    assert seen[ORACLE][0].chosen == "w1"


def test_the_oracle_in_a_run_follows_the_cache_through_delayed_events():
    prefix = tokens_for_block(3, 64 * BS)
    reqs = [SimRequest(f"r{i}", i * 5.0, np.concatenate([prefix, tokens_for_block(100 + i, 2 * BS)]), 4)
            for i in range(6)]  # 5 s apart: past the speculative prefixes' 2 s, long before any event arrives
    faults = {i: EventFaults(delay_s=1000.0) for i in range(4)}
    engine = EngineConfig(num_gpu_blocks=1000, block_size=BS)
    # learning off: precise's choice among workers it has no news of is then a fair draw, not the one worker whose
    # first TTFT happened to come in under the model (what this test compares is information, not learning)
    base = RoutingConfig(policy="precise", block_size=BS, seed=0, cost=CostParams(learn=False))
    runs = {"precise": Simulation(reqs, SimConfig(workers=4, engine=engine, faults=faults, routing=base)).run(),
            ORACLE: Simulation(reqs, SimConfig(workers=4, engine=engine, faults=faults,
                                               routing=oracle_routing(BS, 0, base))).run()}
    oracle = runs[ORACLE].records
    assert len({r.worker for r in oracle}) == 1  # every request on the first one's worker: it holds the prefix
    assert all(r.cached_tokens == 64 * BS for r in oracle[1:])
    assert summarise(runs[ORACLE])["hit_rate"] > summarise(runs["precise"])["hit_rate"]


def test_the_oracle_knows_a_slow_worker():
    setup = SCENARIOS["heterogeneous"].build(True, TRACE)
    slow, fast = EngineModel(setup.engines[0]), EngineModel(setup.engine)
    assert slow.timing.prefill_ms(2048) == pytest.approx(2 * fast.timing.prefill_ms(2048))
    assert slow.timing.decode_ms(0.5) == pytest.approx(2 * fast.timing.decode_ms(0.5))
    res = Simulation(setup.requests, SimConfig(workers=setup.workers, policy=ORACLE, engine=setup.engine,
                                               engines=setup.engines)).run()
    per = Counter(r.worker for r in res.records)
    assert per["w0"] < len(setup.requests) / setup.workers


# ---- each scenario is what it says -----------------------------------------------------------------------

def test_hot_prefix_every_request_shares_the_8k_prefix():
    for quick in (True, False):
        reqs = SCENARIOS["hot_prefix"].build(quick, TRACE).requests
        prefix = reqs[0].tokens[:8192]
        assert all(np.array_equal(r.tokens[:8192], prefix) for r in reqs)
        assert {r.num_tokens - 8192 for r in reqs} == {BS, 2 * BS}  # 1-2 blocks of their own
        assert len({r.tokens[8192:].tobytes() for r in reqs}) == len(reqs)
        rate = len(reqs) / reqs[-1].arrival
        assert 8 < rate < 16  # Poisson ~12/s


def test_eviction_working_set_is_two_to_three_times_the_fleet_cache():
    for quick in (True, False):
        for name in ("eviction", "cpu_offload"):
            s = SCENARIOS[name].build(quick, TRACE)
            ratio = working_set_tokens(s.requests, s.engine.block_size) / s.fleet_cache_tokens
            assert 2.0 <= ratio <= 3.0, (name, quick, ratio)
        off = SCENARIOS["cpu_offload"].build(quick, TRACE)
        assert off.engine.cpu_blocks == 4 * off.engine.num_gpu_blocks
        assert (off.engine.cpu_blocks + off.engine.num_gpu_blocks) * off.workers * BS >= working_set_tokens(
            off.requests, BS)  # the two tiers together could hold it all


def test_zipf_prefixes_are_unequally_popular():
    reqs = SCENARIOS["zipf_prefixes"].build(False, TRACE).requests
    counts = Counter(r.session for r in reqs)
    ranked = [counts.get(f"prefix-{k}", 0) for k in range(24)]
    assert ranked[0] > 2 * ranked[5] > 0 and ranked[0] > 4 * ranked[-1]


def test_multi_turn_prompts_repeat_the_engines_answer_and_hit_it():
    reqs = SCENARIOS["multi_turn"].build(True, TRACE).requests
    turns = sorted((r for r in reqs if r.session == "conv-0"), key=lambda r: r.arrival)
    assert len(turns) >= 2
    first, second = turns[0], turns[1]
    answer = engine_answer(first.tokens, first.output_len)
    assert np.array_equal(second.tokens[: first.num_tokens + len(answer)], np.concatenate([first.tokens, answer]))
    engine = EngineModel(EngineConfig(num_gpu_blocks=1000, block_size=BS))
    _warm(engine, first.tokens, first.output_len)
    engine.add_request(EngineRequest("t1", second.tokens, 4))
    engine.step(0.0)
    # the answer's blocks were cached while it was generated (all but the last token's KV)
    assert engine.running[0].num_cached_tokens == (first.num_tokens + first.output_len - 1) // BS * BS


def test_shared_prefix_and_event_delay_shapes():
    sp = SCENARIOS["shared_prefix"].build(False, TRACE)
    assert len(sp.requests) == 64 * 16
    ed = SCENARIOS["event_delay"].build(True, TRACE)
    assert ed.faults and all(f.delay_s == 0.2 for f in ed.faults.values()) and len(ed.faults) == ed.workers
    order = [r.session for r in sorted(ed.requests, key=lambda r: r.arrival)]
    runs = [g for i, g in enumerate(order) if i == 0 or order[i - 1] != g]
    assert len(runs) == len(set(order))  # each group's prompts back to back: one burst per prefix


def test_restart_clears_the_worker_and_the_router_learns_it_from_the_events_alone():
    s = SCENARIOS["restart"].build(True, TRACE)
    cfg = SimConfig(workers=s.workers, policy="round_robin", engine=s.engine, restart_busiest_at=s.restart_busiest_at)
    sim = Simulation(s.requests, cfg)
    res = sim.run()
    assert len(sim.restarts) == 1 and sim.restarts[0][0] == s.restart_busiest_at
    w = sim.restarts[0][1]
    feed = sim.core.feeder.feeds[w]
    assert feed.resets >= 1  # seq went back to 0, with no AllBlocksCleared: the feed started again
    for wid, engine in sim.engines.items():  # and the index is exact again everywhere
        assert sim.core.index.blocks_held_on(wid, Medium.GPU) == len(engine.pool.cached)
    recs = {r.request_id: r for r in res.records}
    failed = [r for r in recs.values() if r.outcome == "failed"]
    assert all(r.worker == w and r.arrival <= s.restart_busiest_at and r.error == "worker restarted" for r in failed)
    assert summarise(res)["failed"] == len(failed)
    assert not sim.core.load.inflight  # nothing left in the router's accounting


def test_trace_scenarios_read_the_shared_trace_at_two_loads():
    need_shared(TRACE)
    light = SCENARIOS["trace_light"].build(True, TRACE)
    heavy = SCENARIOS["trace_heavy"].build(True, TRACE)
    assert len(light.requests) == len(heavy.requests) > 0
    assert TRACE_SPEEDUPS["trace_heavy"] > TRACE_SPEEDUPS["trace_light"]
    span = light.requests[-1].arrival / heavy.requests[-1].arrival
    assert span == pytest.approx(TRACE_SPEEDUPS["trace_heavy"] / TRACE_SPEEDUPS["trace_light"], rel=0.05)


def test_tpot_is_time_after_the_first_token_per_further_token():
    recs = [RequestRecord("a", 0.0, "w0", 10, output_tokens=5, first_token_at=1.0, finished_at=3.0),
            RequestRecord("b", 0.0, "w0", 10, output_tokens=1, first_token_at=1.0, finished_at=1.0)]
    s = summarise(SimResult("x", recs, 3.0, {"w0": 20}, [], 2))
    assert s["tpot_mean_s"] == pytest.approx(0.5)  # (3 - 1) / (5 - 1); a one-token answer has none


def test_half_compute_doubles_every_step():
    from workers.engine import TimingModel

    t = TimingModel()
    h = half_compute(t)
    assert h.step_ms(3000, 5, 0.4, 100) == pytest.approx(2 * t.step_ms(3000, 5, 0.4, 100))


def test_the_router_learns_engines_that_run_slower_than_its_default_timing():
    """Engines 1.5x slower than the router's default timing at everything: the routing core, told nothing, fits
    each worker's TTFT and inter-token time from what it observes, and its predictions come to match."""
    slow = TimingModel(**{k: 1.5 * v for k, v in TimingModel().as_dict().items()})
    engine = EngineConfig(num_gpu_blocks=4096, block_size=BS, timing=slow)
    rng = np.random.default_rng(5)
    reqs, t = [], 0.0
    for i in range(240):
        t += float(rng.exponential(0.25))  # light load: most requests find nothing queued ahead
        reqs.append(SimRequest(f"r{i}", t, tokens_for_block(1000 + i, int(rng.integers(16, 200)) * BS), 24))
    sim = Simulation(reqs, SimConfig(workers=2, policy="precise", engine=engine))
    sim.run()
    for w in ("w0", "w1"):
        prof = sim.core.cost.profile(w)
        assert len(prof.ttft) >= 30 and len(prof.decode) >= 30
        assert prof.ttft.slope == pytest.approx(1.5, rel=0.05)
        assert prof.decode.slope == pytest.approx(1.5, rel=0.05)
