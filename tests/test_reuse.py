"""The reuse statistics' ghost list: the compiled one (router/scheduling/_fastghosts.c) against the reference
(``PyGhostList``) on random operations, and what P(reuse) learns from them."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.scheduling import reuse
from router.scheduling.reuse import PyGhostList, ReuseTracker

KEYS = st.one_of(st.integers(0, 40), st.integers(0, 2**63 - 1))  # few keys (repeats) and wide ones
FRESH = 2**63  # keys from here on: never drawn
OPS = st.lists(st.one_of(st.tuples(st.just("evicted"), st.lists(KEYS, max_size=40)),
                         st.tuples(st.just("requested"), st.lists(KEYS, max_size=40)),
                         st.tuples(st.just("set_window"), st.integers(-2, 60))), max_size=60)


def test_the_compiled_list_is_built():
    assert reuse.GhostList is not PyGhostList, "router.scheduling._fastghosts was not built: is a C compiler installed?"


def _both(window: int, ops: list) -> tuple:
    """The compiled list and the reference after ``ops``, their counts checked equal after each."""
    fast, ref = reuse.GhostList(window), PyGhostList(window)
    for name, arg in ops:
        getattr(fast, name)(arg)
        getattr(ref, name)(arg)
        assert len(fast) == len(ref)
        assert (fast.reused, fast.expired, fast.window_blocks) == (ref.reused, ref.expired, ref.window_blocks)
    return fast, ref


@settings(max_examples=300, deadline=None)
@given(window=st.integers(1, 50), ops=OPS)
def test_compiled_and_reference_lists_agree(window, ops):
    fast, ref = _both(window, ops)
    # the same ghosts: asking for each of the reference's removes one from the compiled list
    for i, k in enumerate(ref.oldest_first()):
        fast.requested([k])
        assert len(fast) == len(ref) - i - 1, k


@settings(max_examples=100, deadline=None)
@given(window=st.integers(1, 30), ops=OPS)
def test_compiled_list_ages_ghosts_out_in_the_reference_order(window, ops):
    fast, ref = _both(window, ops)
    expected = ref.oldest_first()
    fast.set_window(1)
    ref.set_window(1)
    for i, k in enumerate(expected[:-1]):  # a fresh key each time ages the oldest ghost out of both
        fresh = [FRESH + i]
        fast.evicted(fresh)
        ref.evicted(fresh)
        assert k not in ref.oldest_first()
        assert len(fast) == len(ref)
        fast.requested([k])  # already aged out: no reuse counted
        assert fast.reused == ref.reused
    assert (fast.reused, fast.expired) == (ref.reused, ref.expired)


def test_a_large_run_agrees_through_many_compactions():
    fast, ref = reuse.GhostList(1000), PyGhostList(1000)
    for i in range(20_000):
        batch = [(i * 7919 + j * 104729) % 3000 for j in range(8)]
        fast.evicted(batch)
        ref.evicted(batch)
        if i % 3 == 0:
            fast.requested(batch[:2])
            ref.requested(batch[:2])
        if i % 5000 == 0:
            fast.set_window(500 + i // 10)
            ref.set_window(500 + i // 10)
    assert len(fast) == len(ref)
    assert (fast.reused, fast.expired) == (ref.reused, ref.expired)


def test_keys_that_are_not_64_bit_ints_raise():
    g = reuse.GhostList(4)
    with pytest.raises(OverflowError):
        g.evicted([2**64])
    with pytest.raises(OverflowError):
        g.evicted([-1])
    with pytest.raises(TypeError):
        g.evicted(["k"])


@pytest.mark.parametrize("ghosts", [PyGhostList, reuse.GhostList])
def test_probability_learns_the_reused_fraction(ghosts):
    t = ReuseTracker(window_blocks=100, prior=0.5, prior_samples=4.0, ghosts=ghosts)
    assert t.probability == pytest.approx(0.5)
    t.evicted(range(100))
    t.requested(range(50))  # a third of what will have been evicted asked for again ...
    t.evicted(range(1000, 1150))  # ... and 100 ghosts age out unasked: the 50 left and the 50 oldest new ones
    assert len(t) == 100
    aged = t.probability
    assert aged < 0.5
    t.requested(range(1050, 1150))  # every ghost left asked for again
    assert len(t) == 0
    assert t.probability > 0.5 > aged
