"""``min-score``: lowest total cost first; equal totals (to 1e-9) in seeded random order, so identical
workers share the load."""

from __future__ import annotations

import random
from collections.abc import Sequence
from itertools import repeat

import numpy as np

from router.scheduling.plugins.base import Picker
from router.scheduling.snapshot import Candidate, Snapshot

# up to this many candidates ``rank`` sorts them as ``pick`` does; more: ``min_score_order`` (the same order)
SORTED_UP_TO = 32


class MinScore(Picker):
    type_name = "min-score"

    def pick(self, snap: Snapshot, cands: Sequence[Candidate], scores: Sequence[float]) -> list[str]:
        rng = self.rng
        order = sorted(zip(cands, scores, strict=True), key=lambda cs: (round(cs[1], 9), rng.random()))
        return [c.worker_id for c, _ in order]

    def rank(self, snap: Snapshot, slots: np.ndarray, scores: Sequence[float]) -> list[str]:
        if len(slots) <= SORTED_UP_TO:  # a few: Python's sort, as ``pick``, costs less than the arrays
            ids = list(map(snap.ids.__getitem__, slots.tolist()))
            rng = self.rng
            order = sorted(zip(ids, scores, strict=True), key=lambda cs: (round(cs[1], 9), rng.random()))
            return [w for w, _ in order]
        return snap.cols.id_array[slots[min_score_order(scores, self.rng)]].tolist()


_DRAWS_BY_BITS = 256  # from this many draws, one getrandbits call costs less than a random() call each


def draws_of(rng: random.Random, n: int) -> np.ndarray:
    """``[rng.random() for _ in range(n)]`` as an array, the generator left where those calls leave it.

    Exact either way: ``random()`` takes two 32-bit outputs of the generator (a = first >> 5, b = second >> 6,
    (a * 2^26 + b) / 2^53), and ``getrandbits(64 n)`` takes the same 2n outputs in the same order, the i-th in
    bits 32 i to 32 i + 31; so a thousand-worker ranking reads its draws from one big int."""
    if n < _DRAWS_BY_BITS:
        return np.fromiter(map(random.Random.random, repeat(rng, n)), dtype=float, count=n)
    words = np.frombuffer(rng.getrandbits(64 * n).to_bytes(8 * n, "little"), dtype="<u4").reshape(n, 2)
    high = (words[:, 0] >> 5).astype(np.float64)
    low = (words[:, 1] >> 6).astype(np.float64)
    return (high * 67108864.0 + low) * (1.0 / 9007199254740992.0)


def min_score_order(scores: Sequence[float], rng: random.Random) -> np.ndarray:
    """``pick``'s order as positions: by ``round(score, 9)``, ties by one ``rng.random()`` each, drawn in the
    candidates' order (so the generator moves exactly as ``pick`` moves it). Sorted by score, then draw, first:
    that is the order wherever scores that round alike are equal. Python's ``round`` is asked only of
    neighbours within 1e-8, the only ones it could merge, and only if there are some are the groups it makes
    sorted again."""
    n = len(scores)
    draws = draws_of(rng, n)
    s = scores if isinstance(scores, np.ndarray) else np.fromiter(scores, dtype=float, count=n)
    # by score, then draw, then position (``sorted`` is stable): a stable sort by score of the candidates in draw
    # order, which costs half a ``lexsort((draws, s))`` (a quicksort of the draws, then a sort of scores that
    # are mostly tied or in runs); draws that are equal (about one decision in 10^10 at a thousand
    # candidates) are put in draw order stably, so that they keep the candidates' order
    by_draw = np.argsort(draws)
    if n > 1 and not (np.diff(draws[by_draw]) > 0).all():
        by_draw = np.argsort(draws, kind="stable")
    order = by_draw[np.argsort(s[by_draw], kind="stable")]
    ss = s[order]
    with np.errstate(invalid="ignore"):  # inf - inf: equal, as they round
        gap = np.diff(ss)
    boundary = gap > 1e-8  # apart by more than 1e-8: they round apart; equal: they round alike
    near = np.flatnonzero(~boundary & (gap != 0))
    if not len(near):
        return order
    for k in near.tolist():
        boundary[k] = round(float(ss[k]), 9) != round(float(ss[k + 1]), 9)
    group = np.concatenate(([0], np.cumsum(boundary)))
    return order[np.lexsort((draws[order], group))]
