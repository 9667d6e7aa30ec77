"""The engine's array batch against the one-request-at-a-time reference scheduler it replaced.

``EngineModel(vectorised=False)`` runs every step on the requests themselves (the scheduler as it was); the
default holds the running batch in arrays and visits a request in Python only when something happens to it.
Both must give the same step durations, KV events, outputs and counters on any workload: preemption, the CPU
tier, received KV, fast-forwarded decode runs and aborts included.
"""

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from router.events.codec import EventBatch, encode_payload
from workers.engine import EngineConfig, EngineModel, EngineRequest


def _outputs(result):
    return [(o.request.request_id, o.token, o.first, o.finished, o.count) for o in result.outputs]


def _state(engine):
    reqs = list(engine.running) + list(engine.waiting)
    return ([(r.request_id, r.num_computed, r.n_out, list(r.block_ids), r.status, r.first_token_at,
              r.num_cached_tokens) for r in reqs],
            vars(engine.stats), engine.pool.num_free, sorted(engine.pool.cached), list(engine.pool.free))


def _workload(seed):
    rng = random.Random(seed)
    shared = [rng.randrange(1000) for _ in range(rng.randrange(0, 120))]
    plan = []
    for i in range(rng.randint(1, 40)):
        prompt = shared[: rng.randrange(0, len(shared) + 1)] + [rng.randrange(1000) for _ in range(rng.randint(1, 90))]
        plan.append(dict(rid=f"r{i}", prompt=prompt, max_tokens=rng.randint(1, 60),
                         salt=rng.choice([None, None, None, "t"]),
                         remote=rng.choice([0, 0, 0, len(prompt) // 8 * 8]),
                         steps=rng.randrange(0, 6), until=rng.choice([None, None, 0.05, 1.0, 50.0]),
                         abort=rng.random() < 0.05))
    return plan


def _drive(engine, plan):
    trace, t, live = [], 0.0, {}
    for item in plan:
        req = EngineRequest(item["rid"], item["prompt"], item["max_tokens"], cache_salt=item["salt"],
                            remote_kv_tokens=item["remote"])
        try:
            engine.add_request(req)
        except ValueError as e:
            trace.append(("rejected", str(e)))
            continue
        live[item["rid"]] = req
        for _ in range(item["steps"]):
            if not engine.has_work:
                break
            until = None if item["until"] is None else t + item["until"]
            r = engine.step(t, until)
            trace.append((r.duration_s, encode_payload(EventBatch(t, r.events, 0)), _outputs(r),
                          [(o.request.request_id, o.first, o.finished) for o in r.notable],
                          r.prefill_tokens, r.decode_reqs, _state(engine)))
            t += r.duration_s
        if item["abort"]:
            victim = live[sorted(live)[len(item["rid"]) % len(live)]]
            engine.abort(victim)
            trace.append(("abort", victim.request_id, _state(engine)))
    while engine.has_work:
        r = engine.step(t, t + 0.3)
        trace.append((r.duration_s, encode_payload(EventBatch(t, r.events, 0)), _outputs(r), r.prefill_tokens,
                      r.decode_reqs, _state(engine)))
        t += r.duration_s
    trace.append([(r.request_id, r.output, r.first_token_at, r.finished_at, r.status) for r in live.values()])
    return trace


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 100_000), gpu_blocks=st.integers(20, 90), cpu_blocks=st.sampled_from([0, 8, 40]),
       budget=st.sampled_from([16, 40, 128, 2048]), max_seqs=st.sampled_from([2, 5, 256]),
       block_size=st.sampled_from([4, 8, 16]))
def test_the_array_batch_steps_exactly_as_the_reference_scheduler(seed, gpu_blocks, cpu_blocks, budget, max_seqs,
                                                                   block_size):
    config = EngineConfig(num_gpu_blocks=gpu_blocks, block_size=block_size, cpu_blocks=cpu_blocks,
                          max_num_batched_tokens=budget, max_num_seqs=max_seqs, vocab_size=997)
    plan = _workload(seed)
    assert _drive(EngineModel(config), plan) == _drive(EngineModel(config, vectorised=False), plan)


def test_preemption_under_memory_pressure_is_taken_by_the_reference_path_and_matches():
    """A pool too small for the batch: requests are preempted and recomputed; the array batch hands those steps
    to the reference scheduler and picks the batch up again after."""
    config = EngineConfig(num_gpu_blocks=12, block_size=4, max_num_batched_tokens=64, vocab_size=500)
    plan = [dict(rid=f"p{i}", prompt=list(range(i, i + 10)), max_tokens=14, salt=None, remote=0, steps=1,
                 until=None, abort=False) for i in range(6)]
    fast, ref = EngineModel(config), EngineModel(config, vectorised=False)
    assert _drive(fast, plan) == _drive(ref, plan)
    assert fast.stats.preemptions == ref.stats.preemptions > 0


def test_output_tokens_are_the_samplers_and_counters_read_through_the_batch():
    engine = EngineModel(EngineConfig(num_gpu_blocks=64, block_size=8, vocab_size=1000))
    req = EngineRequest("a", np.arange(20), 12)
    engine.add_request(req)
    t = 0.0
    for _ in range(4):
        t += engine.step(t).duration_s
    assert req._batch is engine and req.n_out == 4 and req.num_computed == 23  # read from the arrays
    fresh = EngineRequest("b", np.arange(20), 12)
    assert req.output == fresh.next_tokens(4, 1000)
    while engine.has_work:
        engine.step(t, t + 10.0)
    assert req._batch is None and req.n_out == 12 and req.output == fresh.next_tokens(12, 1000)
