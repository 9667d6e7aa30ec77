"""The trace-replay simulator: conservation, determinism, the independent bound, CLI output."""

import gc
import json
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

from router.keys import chain_keys
from router.scheduling import RouteRequest, RoutingConfig
from sim import workload
from sim.runner import EventFaults, SimConfig, Simulation, summarise
from sim.workload import (
    SimRequest,
    infinite_cache_bound,
    mooncake,
    multi_turn,
    shared_prefix,
    tokens_for_block,
    tokens_for_blocks,
    tokens_for_hash_ids,
)
from tests.conftest import TRACE, need_shared
from workers.engine import EngineConfig

SMALL = EngineConfig(num_gpu_blocks=600, block_size=16, max_num_seqs=8)


def test_every_request_completes_or_is_shed_exactly_once():
    reqs = shared_prefix(groups=8, per_group=20, system_tokens=512, question_tokens=64, output_tokens=40, rate=400)
    routing = RoutingConfig(policy="precise", block_size=16, max_inflight_requests=6, seed=0)
    res = Simulation(reqs, SimConfig(workers=3, engine=SMALL, routing=routing)).run()
    ids = Counter(r.request_id for r in res.records)
    assert set(ids) == {r.request_id for r in reqs} and set(ids.values()) == {1}
    outcomes = Counter(r.outcome for r in res.records)
    assert outcomes["shed"] > 0  # the admission limit did bite
    for r in res.records:
        if r.outcome == "routed":
            assert r.finished_at is not None and r.output_tokens == 40 and r.first_token_at <= r.finished_at
        else:
            assert r.first_token_at is None and r.worker is None
    s = summarise(res)
    assert s["completed"] + s["shed"] == len(reqs)


def test_same_seed_same_result_and_other_seed_differs():
    reqs = multi_turn(conversations=30, turns=3, system_tokens=256, user_tokens=64, output_tokens=20, rate=20)
    runs = [summarise(Simulation(reqs, SimConfig(workers=4, policy="random", engine=SMALL, seed=s)).run())
            for s in (7, 7, 8)]
    for s in runs:
        s.pop("wall_s")
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_bound_is_computed_from_the_trace_alone(tmp_path):
    rows = [
        {"timestamp": 0, "input_length": 1024, "output_length": 5, "hash_ids": [1, 2]},
        {"timestamp": 10, "input_length": 1500, "output_length": 5, "hash_ids": [1, 2, 3]},
        {"timestamp": 20, "input_length": 600, "output_length": 5, "hash_ids": [1, 4]},
        {"timestamp": 30, "input_length": 1024, "output_length": 5, "hash_ids": [1, 2]},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reqs = mooncake(path)
    # hits: 0; 2 blocks (1024); 1 block (512); a full repeat hits all but the last token (1023)
    assert infinite_cache_bound(reqs, 16) == pytest.approx((0 + 1024 + 512 + 1023) / (1024 + 1500 + 600 + 1024))
    # token synthesis: shared hash ids mean shared tokens, at any block size
    assert np.array_equal(reqs[1].tokens[:1024], reqs[0].tokens)
    assert not np.array_equal(reqs[2].tokens[512:600], reqs[0].tokens[512:600])
    assert np.array_equal(tokens_for_hash_ids([1, 2], 700), tokens_for_hash_ids([1, 2, 3], 1200)[:700])


def _splitmix_tokens(block_id: int, n: int, salt: int = 0) -> list[int]:
    """The trace's token synthesis in Python integers, one token at a time: what the numpy passes must give."""
    mask, m2 = (1 << 64) - 1, 0xBF58476D1CE4E5B9
    seed = ((block_id * 2 + 1 + salt * 0x1000003) * 0x9E3779B97F4A7C15) & mask
    out = []
    for i in range(n):
        x = seed ^ (i * m2 & mask)
        x ^= x >> 31
        x = x * m2 & mask
        x ^= x >> 29
        out.append(x % 32000)
    return out


def test_a_prompts_tokens_made_in_one_pass_are_each_blocks_own():
    ids = [0, 7, -1, 100_000_003, 2**40]
    rows = tokens_for_blocks(ids)
    assert rows.shape == (5, 512) and rows.dtype == np.uint32
    for block_id, row in zip(ids, rows, strict=True):
        assert row.tolist() == _splitmix_tokens(block_id, 512)
        assert np.array_equal(tokens_for_block(block_id), row)
    assert tokens_for_block(3, 40, salt=7).tolist() == _splitmix_tokens(3, 40, salt=7)
    # a row longer than its blocks: the blocks, then the last id's salted padding
    toks = tokens_for_hash_ids([5, 6], 1100)
    assert toks.tolist() == _splitmix_tokens(5, 512) + _splitmix_tokens(6, 512) + _splitmix_tokens(6, 76, salt=7)


@pytest.mark.skipif(workload._compiled_hash_id_tokens is None, reason="the compiled synthesis did not build here")
@pytest.mark.parametrize(("ids", "length"), [([5, 6], 1100), ([5, 6], 700), ([5, 6], 1024), ([], 40), ([], 0),
                                             ([-1, 2**40, 0], 1536), ([2**63 - 1, -(2**63)], 1030), ([9], 1)])
def test_the_compiled_prompt_synthesis_is_the_numpy_one(ids, length):
    """A trace row's tokens in C, token for token the numpy passes' (and the one-at-a-time Python integers'):
    cut inside a block, padded past the blocks, no blocks at all, ids at the ends of int64."""
    compiled = workload.tokens_for_hash_ids(ids, length)
    reference = workload.py_tokens_for_hash_ids(ids, length)
    assert compiled.dtype == reference.dtype == np.uint32
    assert compiled.tolist() == reference.tolist()
    spelled = [t for i in ids for t in _splitmix_tokens(i, 512)] if ids else _splitmix_tokens(-1, length)
    if len(spelled) < length:
        spelled += _splitmix_tokens(ids[-1], length - len(spelled), salt=7)
    assert compiled.tolist() == spelled[:length]


def test_a_run_leaves_the_garbage_collector_as_it_found_it():
    """The run collects rarely and freezes the heap it starts with: afterwards, the thresholds and the frozen
    generation are the process's own again (the suite runs many simulations in one process)."""
    before = gc.get_threshold(), gc.get_freeze_count()
    reqs = [SimRequest(f"r{i}", i * 0.1, tokens_for_block(i, 64), 4) for i in range(20)]
    result = Simulation(reqs, SimConfig(workers=2, policy="precise", engine=SMALL)).run()
    assert summarise(result)["completed"] == 20
    assert (gc.get_threshold(), gc.get_freeze_count()) == before


def test_the_real_trace_bound_matches_the_published_figure():
    reqs = mooncake(need_shared(TRACE))
    assert len(reqs) == 12_031
    assert infinite_cache_bound(reqs, 64) == pytest.approx(0.374, abs=0.002)  # REFERENCE.md section 7


def test_precise_hit_rate_never_exceeds_the_bound():
    reqs = mooncake(need_shared(TRACE), limit=300, speedup=4)
    bound = infinite_cache_bound(reqs, 128)
    engine = EngineConfig(num_gpu_blocks=100_000, block_size=128)
    s = summarise(Simulation(reqs, SimConfig(workers=4, policy="precise", engine=engine)).run())
    assert s["completed"] == 300
    assert 0 < s["hit_rate"] <= bound


def test_stopped_events_make_a_worker_stale_in_the_simulation():
    system = tokens_for_block(5, 2048)
    reqs = [SimRequest(f"r{i}", i * 0.1, np.concatenate([system, tokens_for_block(1000 + i, 64)]), 60)
            for i in range(200)]
    # an admission limit of 2 in flight makes both workers take requests from the start
    routing = RoutingConfig(policy="precise", block_size=16, stale_after_s=3.0, max_inflight_requests=2, seed=0)
    faults = {0: EventFaults(stop_at=10.0)}  # worker 0 publishes for 10 s, then goes silent
    sim = Simulation(reqs, SimConfig(workers=2, engine=EngineConfig(num_gpu_blocks=4000, block_size=16),
                                     routing=routing, faults=faults))
    res = sim.run()
    assert sim.core.feeder.feeds["w0"].last_event_at <= 10.0
    assert Counter(r.worker for r in res.records if r.arrival > 14)["w0"] > 0  # it kept taking requests
    probe = RouteRequest("probe", chain_keys(reqs[0].tokens, 16), 2112, 16)
    d = sim.core.decide(probe, now=res.makespan_s)
    by = {c.worker_id: c for c in d.candidates}
    assert by["w0"].state == "stale" and not by["w0"].prefix_credit and by["w0"].matched_gpu == 0
    assert by["w1"].state == "synced" and by["w1"].matched_gpu >= 2048 // 16  # the shared prefix


def test_gaps_in_simulated_event_streams_are_replayed():
    reqs = shared_prefix(groups=4, per_group=10, system_tokens=256, question_tokens=32, output_tokens=8, rate=50)
    faults = {0: EventFaults(drop_every=3), 1: EventFaults(drop_every=3, replay=False)}
    sim = Simulation(reqs, SimConfig(workers=2, engine=SMALL, faults=faults))
    sim.run()
    f0, f1 = sim.core.feeder.feeds["w0"], sim.core.feeder.feeds["w1"]
    assert f0.gaps_filled == f0.gaps > 0
    assert f1.gaps > 0 and f1.gaps_filled == 0


def test_cli_json_has_the_stable_keys():
    out = subprocess.run(
        [sys.executable, "-m", "router.cli", "sim", "--workload", "shared_prefix", "--workers", "2",
         "--policies", "round_robin,precise", "--speedup", "4", "--json"],
        check=True, capture_output=True, text=True, timeout=300,
    ).stdout
    data = json.loads(out)
    assert set(data["policies"]) == {"round_robin", "precise"}
    for p in data["policies"].values():
        assert {"ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "hit_rate", "throughput_tok_s", "shed"} <= set(p)
    assert 0 < data["bound_hit_rate"] <= 1
    assert data["policies"]["precise"]["hit_rate"] <= data["bound_hit_rate"]


# ---- prediction quality (issue 51): predicted at the decision against what the engine then gave -----------------

def test_prediction_quality_is_exact_for_exact_predictions_and_reads_order():
    from sim.runner import RequestRecord, prediction_quality, rank_correlation

    recs = []
    for i, (pred, real) in enumerate([(0.1, 0.1), (0.2, 0.2), (0.4, 0.4)]):
        recs.append(RequestRecord(f"r{i}", arrival=0.0, worker="w0", prompt_tokens=10, output_tokens=3,
                                  first_token_at=1.0 + real, finished_at=1.0 + real + 0.02, dispatched_at=1.0,
                                  predicted_ttft_s=pred, predicted_tpot_s=0.01))
    q = prediction_quality(recs)
    assert q is not None
    # TTFT is counted from the dispatch (1.0), not the arrival (0.0): the router's own queue is not the engine's
    assert q["ttft_median_rel_error"] == pytest.approx(0.0, abs=1e-9) and q["ttft_rank_corr"] == pytest.approx(1.0)
    assert q["tpot_median_rel_error"] == pytest.approx(0.0, abs=1e-9) and q["tpot_n"] == 3
    assert q["tpot_rank_corr"] is None  # every prediction the same: no order to compare
    # predictions off by 2x in the reversed order: 100% error... and the opposite rank
    for rec, pred in zip(recs, (0.8, 0.4, 0.2), strict=True):
        rec.predicted_ttft_s = pred
    q = prediction_quality(recs)
    assert q["ttft_rank_corr"] == pytest.approx(-1.0) and q["ttft_p90_rel_error"] > 1.0
    assert rank_correlation(np.array([1.0, 1.0, 2.0]), np.array([3.0, 3.0, 5.0])) == pytest.approx(1.0)


def test_a_predicting_profile_reports_its_prediction_quality_and_a_blind_one_none():
    reqs = [SimRequest(f"r{i}", i * 0.05, np.arange(i % 4 * 64, i % 4 * 64 + 256), 8) for i in range(40)]
    precise = summarise(Simulation(reqs, SimConfig(workers=2, policy="precise", engine=SMALL)).run())
    blind = summarise(Simulation(reqs, SimConfig(workers=2, policy="round_robin", engine=SMALL)).run())
    assert precise["prediction"] is not None and precise["prediction"]["ttft_n"] == 40
    assert precise["prediction"]["ttft_median_rel_error"] >= 0
    assert blind["prediction"] is None
    assert precise["ttft_p50_s"] <= precise["ttft_p90_s"] <= precise["ttft_p99_s"]
