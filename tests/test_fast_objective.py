"""The compiled objective (router/scheduling/_fastobjective.c) against the formula it follows (``_inputs``,
``_objective_columns``, ``CostModel.terms`` on numpy arrays) on random columns, edge values included: NaN and
missing metrics, no capacity, no output, CPU and storage hits, engine counts above and below the router's own.
Every row must come out the same to the last bit; and its inputs are checked, not trusted."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from router.scheduling import columns as fleet_columns
from router.scheduling.cost import CostModel, CostParams, Estimates, prompt_blocks_to_admit
from router.scheduling.engine_profile import StepTiming
from router.scheduling.plugins.scorers import latency_cost
from router.scheduling.plugins.scorers.latency_cost import OBJECTIVE_ROWS, _inputs, _objective_columns

price = latency_cost.compiled_price


def test_the_objective_is_compiled():
    assert price is not None, "router.scheduling._fastobjective was not built: is a C compiler installed?"


def random_columns(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    """A fleet's columns as the scorer reads them, with the edge values the live router meets."""
    def pick(*choices: float) -> np.ndarray:
        return rng.choice(np.array(choices, dtype=float), n)

    requests = rng.integers(0, 12, n).astype(float)
    return {
        "has_load": rng.random(n) < 0.8, "requests": requests,
        "decoding": np.minimum(requests, rng.integers(0, 12, n)).astype(float),
        "active": rng.integers(0, 300, n).astype(float), "pending": pick(0.0, 0.0, 512.0, 9000.0, 70_000.0),
        "capacity": pick(0.0, 0.0, 100.0, 4096.0, 8000.0, 131072.0, 1000.5, -32.0), "fresh": rng.random(n) < 0.7,
        "waiting": pick(np.nan, 0.0, 1.0, 3.0, 40.0), "running": pick(np.nan, 0.0, 2.0, 9.5, 64.0),
        "kv": pick(np.nan, 0.0, 0.2, 0.97, 1.3), "gpu": rng.integers(0, 80, n), "cpu": rng.choice([0, 0, 5, 30], n),
        "storage": rng.choice([0, 0, 0, 12], n), "output_tokens": pick(0.0, 10.0, 3000.0),
        "ttft_slope": pick(1.0, 0.4, 2.7), "decode_slope": pick(1.0, 0.8, 3.1),
        "batch_limit": pick(0.0, 0.0, 1.0, 4.0, 256.0),
    }


def reference_rows(c: SimpleNamespace, shared: np.ndarray, resident: np.ndarray, request: SimpleNamespace,
                   tail: int, costs: CostModel, reuse: float, w: float, held: float = 0.0) -> np.ndarray:
    """The rows by the formula in Python, on arrays: what ``score_slots`` computed before it was compiled."""
    c.shared = shared
    n_keys, bs = len(request.keys), request.block_size
    partial = prompt_blocks_to_admit(request.prompt_tokens, n_keys, bs)
    pending, running, kv, cap, used, new, need, over = _inputs(np, c, n_keys, tail, bs, costs.params, partial)
    snap = SimpleNamespace(request=request, costs=costs)
    known = c.capacity > 0
    arrays = _objective_columns(np, snap, c, pending, running, kv, cap, used, new, np.where(known, resident, 0.0),
                                np.zeros(len(shared)), held)
    est = Estimates(*costs.terms(np, arrays, reuse))
    reports = {"queue_s": est.queue_s, "prefill_s": est.prefill_s, "decode_s": est.decode_s,
               "ttft_s": est.queue_s + est.prefill_s, "stall_s": est.stall_s,
               "interference_s": est.stall_s + est.slowdown_s, "eviction_s": est.eviction_s, "step_s": est.step_s,
               "model_ttft_s": est.model_ttft_s, "model_step_s": est.model_step_s, "score": est.scores(w),
               "behind_s": est.behind_s, "preempt_s": est.preempt_s,
               "need": need.astype(float), "over": over, "slowdown_s": est.slowdown_s,
               "batch_wait_s": est.batch_wait_s}
    return np.array([reports[name] for name in OBJECTIVE_ROWS])


def compiled_rows(columns: dict[str, np.ndarray], selection: np.ndarray | None, shared: np.ndarray,
                  resident: np.ndarray, request: SimpleNamespace, tail: int, p: CostParams, reuse: float,
                  w: float, held: float = 0.0) -> np.ndarray:
    t = p.timing
    out = np.full((len(OBJECTIVE_ROWS), len(shared)), -1.0)
    price(tuple(columns.values()), selection, shared, resident,
          (len(request.keys), tail, request.block_size, request.prompt_tokens, request.max_tokens),
          (p.waiting_prompt_tokens, p.remaining_fraction, p.step_token_budget, p.storage_ms_per_token, t.prefill_a,
           t.prefill_b, t.prefill_c, t.decode_a, t.decode_b, t.decode_c, t.load_back_ms_per_token, p.kv_watermark,
           reuse, w, held),
          out, None, 0)
    return out


@pytest.mark.parametrize("seed", range(200))
def test_compiled_rows_equal_the_formula(seed):
    rng = np.random.default_rng(seed)
    fleet = int(rng.integers(1, 70))
    columns = random_columns(rng, fleet)
    select = rng.random() < 0.5
    slots = rng.integers(0, fleet, int(rng.integers(1, 2 * fleet + 1))) if select else np.arange(fleet)
    n = len(slots)
    bs = int(rng.choice([1, 16, 64]))
    n_keys = int(rng.integers(0, 120))
    request = SimpleNamespace(keys=list(range(n_keys)), block_size=bs,
                              prompt_tokens=n_keys * bs + int(rng.integers(0, bs)),
                              max_tokens=int(rng.choice([0, 1, 64, 4000])))
    tail = int(rng.integers(0, 70))
    shared = rng.integers(0, n_keys + 1, n).astype(float)
    resident = rng.choice([0.0, 1000.0, 9e4, 2e5], n)
    timing = StepTiming(*(rng.uniform(0.5, 1.5, 7) * np.array([4.21e-7, 1.518e-2, 16.5, -25.74, 54.01, 5.74, 1e-3])))
    p = CostParams(step_token_budget=int(rng.choice([1, 512, 8192])), waiting_prompt_tokens=int(rng.choice([0, 2048])),
                   remaining_fraction=float(rng.uniform(0, 1)), storage_ms_per_token=float(rng.uniform(0, 0.01)),
                   kv_watermark=float(rng.choice([0.0, 0.0, 0.01, 0.1])),
                   **{f: getattr(timing, f) for f in ("prefill_a", "prefill_b", "prefill_c", "decode_a", "decode_b",
                                                     "decode_c", "load_back_ms_per_token")})
    costs = CostModel(p)
    reuse, w = float(rng.uniform(0, 1)), float(rng.choice([0.0, 1.0, 0.3]))
    held = float(rng.choice([0.0, 0.0, 0.25, 3.0]))  # the share of the requests flow control holds
    got = compiled_rows(columns, slots if select else None, shared, resident, request, tail, p, reuse, w, held)
    want = reference_rows(SimpleNamespace(**{k: v[slots] for k, v in columns.items()}), shared, resident, request,
                          tail, costs, reuse, w, held)
    for name, g, e in zip(OBJECTIVE_ROWS, got, want, strict=True):
        np.testing.assert_array_equal(g, e, err_msg=name)


def test_bad_inputs_are_refused_not_read():
    rng = np.random.default_rng(0)
    columns = random_columns(rng, 4)
    request = SimpleNamespace(keys=[1, 2], block_size=16, prompt_tokens=40, max_tokens=8)
    p = CostParams()
    ok = (columns, None, np.zeros(4), np.zeros(4), request, 0, p, 0.5, 1.0)
    assert compiled_rows(*ok).shape == (len(OBJECTIVE_ROWS), 4)
    with pytest.raises(IndexError):  # a slot beyond the fleet
        compiled_rows(columns, np.array([0, 4]), np.zeros(2), np.zeros(2), request, 0, p, 0.5, 1.0)
    with pytest.raises(ValueError):  # a candidate count the selection does not have
        compiled_rows(columns, np.array([0, 1]), np.zeros(3), np.zeros(3), request, 0, p, 0.5, 1.0)
    with pytest.raises(ValueError):  # columns of different lengths
        compiled_rows({**columns, "kv": np.zeros(3)}, None, np.zeros(4), np.zeros(4), request, 0, p, 0.5, 1.0)
    with pytest.raises(TypeError):  # a column of another type
        compiled_rows({**columns, "kv": np.zeros(4, dtype=np.float32)}, None, np.zeros(4), np.zeros(4), request, 0,
                      p, 0.5, 1.0)
    with pytest.raises(ValueError):
        price(tuple(columns.values())[:3], None, np.zeros(4), np.zeros(4), (2, 0, 16, 40, 8), (0.0,) * 15,
              np.zeros((len(OBJECTIVE_ROWS), 4)), None, 0)
    with pytest.raises(ValueError):  # an output of the wrong shape
        price(tuple(columns.values()), None, np.zeros(4), np.zeros(4), (2, 0, 16, 40, 8), (0.0,) * 15,
              np.zeros((3, 4)), None, 0)


def test_waits_added_as_the_formula_adds_them():
    """``add_waits`` (the memory waits of many candidates, found by one search over their schedules) gives the
    rows the formula gives with those waits in its ``memory_wait`` column."""
    rng = np.random.default_rng(7)
    columns = random_columns(rng, 50)
    request = SimpleNamespace(keys=list(range(30)), block_size=16, prompt_tokens=490, max_tokens=64)
    p, reuse, w = CostParams(), 0.4, 0.7
    shared, resident = rng.integers(0, 31, 50).astype(float), rng.choice([0.0, 9e4], 50)
    out = compiled_rows(columns, None, shared, resident, request, 5, p, reuse, w)
    at = np.flatnonzero(rng.random(50) < 0.5)
    waits = rng.uniform(0, 3, len(at))
    latency_cost.compiled_add_waits(out, at, waits, w)
    c = SimpleNamespace(**columns, shared=shared)
    pending, running, kv, cap, used, new, _, _ = _inputs(np, c, 30, 5, 16, p, 1)
    wait = np.zeros(50)
    wait[at] = waits
    arrays = _objective_columns(np, SimpleNamespace(request=request, costs=CostModel(p)), c, pending, running, kv,
                                cap, used, new, np.where(c.capacity > 0, resident, 0.0), wait)
    est = Estimates(*CostModel(p).terms(np, arrays, reuse))
    np.testing.assert_array_equal(out[OBJECTIVE_ROWS.index("queue_s")], est.queue_s)
    np.testing.assert_array_equal(out[OBJECTIVE_ROWS.index("ttft_s")], est.queue_s + est.prefill_s)
    np.testing.assert_array_equal(out[OBJECTIVE_ROWS.index("score")], est.scores(w))
    with pytest.raises(IndexError):
        latency_cost.compiled_add_waits(out, np.array([50]), np.zeros(1), w)
    with pytest.raises(ValueError):
        latency_cost.compiled_add_waits(out, np.array([1, 2]), np.zeros(1), w)


def test_release_waits_search_as_the_numpy_search_does():
    """``release_waits`` (each worker's release schedule searched in C) answers what the numpy search over the
    padded rows answers, and what ``bisect`` on each row does: edge values included (nothing lacking, more
    than everything frees, ties on a row's steps, rows of one entry and of many); a NaN reads the last entry."""
    compiled = fleet_columns.compiled_release_waits
    assert compiled is not None, "router.scheduling._fastobjective was not built: is a C compiler installed?"
    rng = np.random.default_rng(11)
    for width in (1, 2, 3, 8, 17):
        n = 40
        ends = np.sort(rng.uniform(90.0, 130.0, (n, width)), axis=1)
        freed = np.sort(rng.integers(1, 200, (n, width)), axis=1).astype(float)
        freed[:, -1] = np.inf  # (every row ends in +inf, as the columns keep them)
        slots = rng.integers(0, n, 300)
        blocks = rng.choice(np.array([0.0, 1.0, 50.0, 120.0, 199.0, 500.0, 1e300]), 300)
        blocks[::7] = freed[slots[::7], rng.integers(0, width, len(slots[::7]))]  # exact ties
        got = np.empty(300)
        compiled(freed, ends, slots, blocks, 100.0, got)
        np.testing.assert_array_equal(got, fleet_columns.search_release_rows(freed, ends, slots, blocks, 100.0))
        for j in range(300):
            i = min(int(np.searchsorted(freed[slots[j]], blocks[j], side="left")), width - 1)
            assert got[j] == max(0.0, ends[slots[j], i] - 100.0)
        compiled(freed, ends, slots[:3], np.full(3, np.nan), 100.0, got[:3])
        np.testing.assert_array_equal(got[:3], np.maximum(0.0, ends[slots[:3], -1] - 100.0))
    one = np.zeros((3, 2))
    with pytest.raises(IndexError):
        compiled(one, one, np.array([3]), np.zeros(1), 0.0, np.empty(1))
    with pytest.raises(ValueError):  # schedules of different shapes
        compiled(one, np.zeros((3, 4)), np.array([0]), np.zeros(1), 0.0, np.empty(1))
    with pytest.raises(ValueError):  # an output of the wrong length
        compiled(one, one, np.array([0, 1]), np.zeros(2), 0.0, np.empty(1))
    with pytest.raises(ValueError):  # slots that are not integers
        compiled(one, one, np.array([0.0]), np.zeros(1), 0.0, np.empty(1))
