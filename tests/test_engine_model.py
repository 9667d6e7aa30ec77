"""The engine model's events, through the real codec, feed and index, reproduce its own block table."""

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.events.codec import EventBatch, decode_payload, encode_payload
from router.events.feed import IndexFeeder
from router.index import KvIndex, Medium
from router.keys import request_keys
from workers.engine import EngineConfig, EngineModel, EngineRequest, TimingModel


def drive(engine: EngineModel, feeder: IndexFeeder, t: float, seq: int, steps: int) -> tuple[float, int]:
    for _ in range(steps):
        if not engine.has_work:
            break
        r = engine.step(t)
        t += r.duration_s
        if r.events:  # through the wire format, as a subscriber would receive it
            batch = decode_payload(encode_payload(EventBatch(t, r.events, 0)))
            assert feeder.offer("w", seq, batch, t) is None
            seq += 1
    return t, seq


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    gpu_blocks=st.integers(24, 80),
    cpu_blocks=st.sampled_from([0, 16, 64]),
    n_requests=st.integers(1, 25),
)
def test_event_stream_reproduces_the_engine_block_table(seed, gpu_blocks, cpu_blocks, n_requests):
    rng = random.Random(seed)
    bs = 8
    engine = EngineModel(EngineConfig(num_gpu_blocks=gpu_blocks, block_size=bs, cpu_blocks=cpu_blocks,
                                      max_num_batched_tokens=rng.choice([32, 128, 1024])))
    feeder = IndexFeeder(KvIndex(), block_size=bs)
    prefixes = [[rng.randrange(500) for _ in range(rng.randrange(0, 60))] for _ in range(3)]
    t, seq = 0.0, 0
    reqs = []
    for i in range(n_requests):
        prompt = rng.choice(prefixes) + [rng.randrange(500) for _ in range(rng.randrange(1, 40))]
        salt = rng.choice([None, None, "tenant-a"])
        req = EngineRequest(str(i), prompt, rng.randrange(1, 20), cache_salt=salt)
        engine.add_request(req)
        reqs.append(req)
        t, seq = drive(engine, feeder, t, seq, rng.randrange(0, 12))
        if rng.random() < 0.05 and not engine.running and engine.reset_prefix_cache():
            feeder.offer("w", seq, EventBatch(t, engine.take_events(), 0), t)
            seq += 1
    t, seq = drive(engine, feeder, t, seq, 10_000)
    assert not engine.has_work
    held = feeder.index.engine_hashes("w")
    assert held[Medium.GPU] == set(engine.pool.cached)
    assert held[Medium.CPU] == set(engine.pool.cpu)
    f = feeder.feed("w")
    assert f.malformed == 0 and f.unknown_removals == 0
    # the router's keys for each prompt find exactly the prefix the engine would hit
    for req in reqs:
        keys = request_keys(req.prompt, bs, cache_salt=req.cache_salt)
        hashes = engine._hashes_upto(EngineRequest("probe", req.prompt, 1, cache_salt=req.cache_salt), len(keys))
        gpu_hits, cpu_hits = engine.pool.lookup(hashes)
        m = feeder.index.match(keys).get("w")
        got = (m.gpu, m.cpu) if m else (0, 0)
        if f.orphan_blocks == 0:
            assert got == (len(gpu_hits), cpu_hits)


def test_repeated_prompt_hits_all_but_the_last_token_like_vllm():
    engine = EngineModel(EngineConfig(num_gpu_blocks=64, block_size=32))
    prompt = list(range(100))
    for rid in ("a", "b"):
        req = EngineRequest(rid, prompt, 3)
        engine.add_request(req)
        while engine.has_work:
            engine.step(0.0)
    assert req.num_cached_tokens == (len(prompt) - 1) // 32 * 32 == 96
    assert engine.stats.prefix_hits_tokens == 96 and engine.stats.prefix_queries_tokens == 200


def test_outputs_are_identical_cached_or_not():
    outs = []
    engine = EngineModel(EngineConfig(num_gpu_blocks=64, block_size=16))
    for rid in ("cold", "warm"):
        req = EngineRequest(rid, list(range(80)), 5)
        engine.add_request(req)
        while engine.has_work:
            engine.step(0.0)
        outs.append((req.output, req.num_cached_tokens))
    assert outs[0][0] == outs[1][0] and outs[0][1] == 0 and outs[1][1] == 64


def test_prefill_time_falls_with_the_cached_prefix_as_the_timing_model_says():
    timing = TimingModel()
    engine = EngineModel(EngineConfig(num_gpu_blocks=512, block_size=16, timing=timing))
    prompt = list(range(4000))
    ttfts = []
    for rid in ("cold", "warm"):
        req = EngineRequest(rid, prompt, 1)
        engine.add_request(req)
        t = 0.0
        while engine.has_work:
            t += engine.step(t).duration_s
        ttfts.append(req.first_token_at)
    assert ttfts[0] == pytest.approx(timing.prefill_ms(4000) / 1000)  # one step: 4000 < token budget
    assert ttfts[1] == pytest.approx(timing.prefill_ms(4000 - 3984) / 1000)  # only the uncached tail
    assert ttfts[1] < ttfts[0] / 4


def test_over_long_and_empty_prompts_are_rejected():
    engine = EngineModel(EngineConfig(num_gpu_blocks=8, block_size=16, max_model_len=100))
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request(EngineRequest("x", list(range(99)), 5))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request(EngineRequest("y", [], 5))


def test_timing_file_overrides_and_rejects_unknown_keys(tmp_path):
    p = tmp_path / "t.yaml"
    p.write_text("prefill_c: 1.0\nload_back_ms_per_token: 0.5\n")
    t = TimingModel.from_file(p)
    assert t.prefill_c == 1.0 and t.load_back_ms_per_token == 0.5 and t.prefill_b == TimingModel().prefill_b
    p.write_text("prefil_c: 1.0\n")
    with pytest.raises(ValueError, match="unknown timing keys"):
        TimingModel.from_file(p)


def test_disagg_a_request_whose_kv_was_sent_is_admitted_with_its_blocks_received_not_computed():
    """Prefill/decode disaggregation on the engine model: the prompt's full blocks arrive from a prefill engine;
    the decode engine stores and publishes them, computes only the rest (the partial block), and generates what an
    aggregated engine generates."""
    from router.events.codec import BlockStored

    prompt = np.arange(1000, 1000 + 16 * 10 + 5, dtype=np.uint32)  # 10 full blocks + 5 tokens
    agg, dec = EngineModel(EngineConfig(num_gpu_blocks=64)), EngineModel(EngineConfig(num_gpu_blocks=64))
    agg.add_request(a := EngineRequest("a", prompt, 4))
    dec.add_request(d := EngineRequest("d", prompt, 4, remote_kv_tokens=160))
    first = dec.step(0.0)
    assert first.prefill_tokens == 5  # the partial block only: the 160 sent tokens are not computed
    stored = [e for e in first.events if isinstance(e, BlockStored)]
    assert sum(len(e.block_hashes) for e in stored) == 10  # received blocks are cached and announced
    assert d.num_cached_tokens == 0 and d.external_tokens == 160 and dec.stats.external_tokens == 160
    t = 0.0
    while agg.has_work:
        t += agg.step(t).duration_s
    while dec.has_work:
        dec.step(0.0)
    assert d.output == a.output
    # a cache hit there first: only what it lacked is received
    again = EngineRequest("again", prompt, 2, remote_kv_tokens=160)
    dec.add_request(again)
    dec.step(1.0)
    assert again.num_cached_tokens == 160 and again.external_tokens == 0


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), steps=st.integers(0, 40), cpu_blocks=st.sampled_from([0, 16]),
       max_loras=st.sampled_from([0, 2]))
def test_the_simulators_scrape_reads_what_the_routers_parser_reads_from_the_metrics_text(seed, steps, cpu_blocks,
                                                                                        max_loras):
    """The simulator hands each engine's metrics to the core without the text; they must be the very values the
    router's parser reads from the ``/metrics`` text the simulated worker serves, at any engine state."""
    from router.load import parse_engine_metrics
    from workers.engine.metrics import engine_metrics_text, engine_scrape

    rng = random.Random(seed)
    engine = EngineModel(EngineConfig(num_gpu_blocks=48, block_size=8, cpu_blocks=cpu_blocks, max_loras=max_loras))
    shared = [rng.randrange(32000) for _ in range(40)]
    t = 0.0
    for i in range(rng.randint(1, 12)):
        prompt = shared[: rng.randint(1, 40)] + [rng.randrange(32000) for _ in range(rng.randint(1, 60))]
        adapter = rng.choice([None, "a", "b", "c"]) if max_loras else None
        engine.add_request(EngineRequest(f"r{i}", prompt, rng.randint(1, 30), lora_name=adapter))
    for _ in range(steps):
        if not engine.has_work:
            break
        t += engine.step(t).duration_s
    assert engine_scrape(engine, t) == parse_engine_metrics(engine_metrics_text(engine), t)
