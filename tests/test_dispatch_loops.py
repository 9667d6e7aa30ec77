"""The per-key loops of a request's dispatch and end in C (router/index/_fastdicts.c: ``count_keys``,
``claim_keys``, ``release_claims``) against their Python references: the same dicts, in the same order, the
same errors, through random sequences of dispatches, retries and ends."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.index import speculative
from router.load import LoadTracker, accounting

_fastdicts = pytest.importorskip("router.index._fastdicts", reason="the compiled loops did not build here")

# request i's keys: a shared "system prompt" of the first few keys, then its own (chained keys never repeat)
_SHARED = [7_000_000_000_000_000_000 + i for i in range(6)]


def _keys(request: int, shared: int, own: int) -> list[int]:
    return _SHARED[:shared] + [(request + 1) * 1_000_003 + j for j in range(own)]


_ops = st.lists(st.tuples(st.sampled_from(["dispatch", "complete"]), st.integers(0, 7), st.integers(0, 6),
                          st.integers(0, 9), st.sampled_from(["w0", "w1"])), max_size=40)


@given(_ops)
@settings(max_examples=200, deadline=None)
def test_compiled_counts_equal_the_python_loop_through_dispatches_and_ends(ops):
    """Two load trackers, one counting keys in C, one in Python, through the same dispatches (a request id
    dispatched again is a retry) and ends: every worker's counts are the same dict, key for key, in order."""
    trackers = []
    for count in (_fastdicts.count_keys, accounting.py_count_keys):
        saved, accounting.count_keys = accounting.count_keys, count
        try:
            tracker = LoadTracker()
            for op, rid, shared, own, worker in ops:
                if op == "dispatch":
                    tracker.dispatch(f"r{rid}", worker, 16 * (shared + own) + 5, 10, 8, 0.0,
                                     keys=_keys(rid, shared, own))
                else:
                    tracker.complete(f"r{rid}", 1.0)
            trackers.append(tracker)
        finally:
            accounting.count_keys = saved
    compiled, python = trackers
    assert sorted(compiled.workers) == sorted(python.workers)
    for wid, w in compiled.workers.items():
        assert list(w.active_keys.items()) == list(python.workers[wid].active_keys.items())
        assert w.active_blocks == python.workers[wid].active_blocks


@pytest.mark.parametrize("count", [_fastdicts.count_keys, accounting.py_count_keys])
def test_a_count_taken_below_zero_is_a_key_error_and_a_bad_delta_refused(count):
    counts = {1: 2, 2: 1}
    count(counts, [1, 2], -1)
    assert counts == {1: 1}
    with pytest.raises(KeyError):
        count(counts, [1, 3], -1)
    assert counts == {}  # what came before the missing key was applied, as the loop applies it
    with pytest.raises(ValueError):
        count(counts, [1], 2)
    count(counts, (5, 5, 6), 1)  # any sequence; a key twice counts twice
    assert list(counts.items()) == [(5, 2), (6, 1)]


_claims = st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 8), st.integers(0, 8),
                             st.integers(-1, 30)), max_size=20)


@given(_claims)
@settings(max_examples=200, deadline=None)
def test_compiled_claims_equal_the_python_loops(claims):
    """Claims of overlapping key ranges for workers, some taken back later in any order (``undo_at``: after
    which claim, -1 never): the owner dict the compiled loops leave is the Python loops', item for item in
    order, with the same entry objects."""
    results = []
    for claim, release in ((_fastdicts.claim_keys, _fastdicts.release_claims),
                           (speculative.py_claim_keys, speculative.py_release_claims)):
        saved = speculative.claim_keys, speculative.release_claims
        speculative.claim_keys, speculative.release_claims = claim, release
        try:
            prefixes = speculative.SpeculativePrefixes(ttl_s=2.0)
            undos: list[tuple[int, object]] = []
            for i, (worker, start, length, undo_at) in enumerate(claims):
                undo = prefixes.record(worker, list(range(start, start + length)), float(i))
                if undo is not None and undo_at >= 0:
                    undos.append((i + undo_at, undo))
                for due, pending in [u for u in undos if u[0] <= i]:
                    pending()  # type: ignore[operator]
                    undos.remove((due, pending))
            results.append(list(prefixes._owner.items()))
        finally:
            speculative.claim_keys, speculative.release_claims = saved
    assert results[0] == results[1]


def test_release_claims_refuses_mismatched_lengths_and_leaves_other_claims_alone():
    owner: dict[int, tuple[str, float]] = {}
    first, second = ("a", 1.0), ("b", 2.0)
    was = _fastdicts.claim_keys(owner, [1, 2, 3], first)
    assert was == [None, None, None]
    was_b = _fastdicts.claim_keys(owner, [2], second)
    assert was_b == [first]
    with pytest.raises(ValueError):
        _fastdicts.release_claims(owner, [1, 2, 3], [None], first)
    _fastdicts.release_claims(owner, [1, 2, 3], was, first)  # key 2 is b's now: it stays b's
    assert owner == {2: second}
    _fastdicts.release_claims(owner, [2], was_b, second)
    assert owner == {2: first}  # back to what b's claim found there


@given(st.lists(st.integers(0, 3), max_size=40), st.integers(0, 40))
@settings(max_examples=300, deadline=None)
def test_the_compiled_searches_of_keys_in_flight_step_as_the_python_ones(counts, length):
    """``held_prefix`` and ``shared_len`` on counts that need not be prefix-closed (a search that took other
    steps would answer otherwise there): the compiled answers are the Python searches'."""
    keys = [50_000 + i for i in range(length)]
    active = {k: c for k, c in zip(keys, counts, strict=False) if c}
    assert _fastdicts.held_prefix(active, keys) == accounting.py_held_prefix(active, keys)
    full = {k: active.get(k, 1) for k in keys}  # shared_len's keys are a request's in flight: all counted
    assert _fastdicts.shared_len(keys, full) == accounting.py_shared_len(keys, full)
    # prefix-closed counts (as chained keys make them): the answers are the prefix lengths
    closed = {k: 2 for k in keys[: length // 2]} | {k: 1 for k in keys[length // 2:]}
    assert _fastdicts.held_prefix(closed, keys) == length
    assert _fastdicts.shared_len(keys, closed) == length // 2


def test_a_key_in_flight_missing_from_the_counts_is_a_key_error():
    with pytest.raises(KeyError):
        _fastdicts.shared_len([1, 2, 3], {1: 2, 3: 1})
    assert _fastdicts.held_prefix({}, []) == 0
