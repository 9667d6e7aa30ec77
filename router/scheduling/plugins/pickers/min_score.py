"""``min-score``: lowest total cost first; equal totals (to 1e-9) in seeded random order, so identical
workers share the load.

A wide fleet's ranking is mostly unread: the router reads its first few (the pick and the fallbacks a proxy
retries or Envoy is handed), so ``rank`` orders those exactly and the rest only when something reads them."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from itertools import repeat
from typing import overload

import numpy as np

from router.scheduling.plugins.base import Picker
from router.scheduling.snapshot import Candidate, Snapshot

# up to this many candidates ``rank`` sorts them as ``pick`` does; more: ``ordered`` (the same order)
SORTED_UP_TO = 32
# a wide ranking's first this many are ordered when it is made, the rest when read (past a proxy's three attempts
# and Envoy's pick and two fallbacks by default); up to HEAD_FROM candidates the whole order costs less (measured:
# 64 candidates 20 against 24 us, 160 alike, 1,000 119 against 49)
HEAD = 8
HEAD_FROM = 160


class MinScore(Picker):
    type_name = "min-score"

    def pick(self, snap: Snapshot, cands: Sequence[Candidate], scores: Sequence[float]) -> list[str]:
        rng = self.rng
        order = sorted(zip(cands, scores, strict=True), key=lambda cs: (round(cs[1], 9), rng.random()))
        return [c.worker_id for c, _ in order]

    def rank(self, snap: Snapshot, slots: np.ndarray, scores: Sequence[float]) -> Sequence[str]:
        if len(slots) <= SORTED_UP_TO:  # a few: Python's sort, as ``pick``, costs less than the arrays
            ids = list(map(snap.ids.__getitem__, slots.tolist()))
            rng = self.rng
            order = sorted(zip(ids, scores, strict=True), key=lambda cs: (round(cs[1], 9), rng.random()))
            return [w for w, _ in order]
        s = scores if isinstance(scores, np.ndarray) else np.fromiter(scores, dtype=float, count=len(scores))
        draws = draws_of(self.rng, len(s))  # all of them now: the generator moves as ``pick`` moves it
        ids = snap.cols.id_array[slots]
        head = head_order(s, draws, HEAD)
        if head is None:
            return ids[ordered(s, draws)].tolist()
        return Ranking(ids[head].tolist(), len(s), lambda: ids[ordered(s, draws)].tolist())


class Ranking(Sequence[str]):
    """A ranking whose head is known and whose rest is ordered on first read: ``head`` are its first worker ids,
    ``complete()`` gives all ``size`` of them in the same order (the head first). Equal to the list it reads as."""

    __slots__ = ("_complete", "_full", "_head", "_size")

    def __init__(self, head: list[str], size: int, complete: Callable[[], list[str]]) -> None:
        self._head, self._size, self._complete, self._full = head, size, complete, None

    def _all(self) -> list[str]:
        if self._full is None:
            self._full = self._complete()
        return self._full

    def __len__(self) -> int:
        return self._size

    @overload
    def __getitem__(self, i: int) -> str: ...

    @overload
    def __getitem__(self, i: slice) -> list[str]: ...

    def __getitem__(self, i: int | slice) -> str | list[str]:
        head = self._head
        if isinstance(i, slice):
            if i.step in (None, 1) and (i.start or 0) >= 0 and i.stop is not None and 0 <= i.stop <= len(head):
                return head[i]
            return self._all()[i]
        if 0 <= i < len(head):
            return head[i]
        return self._all()[i]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Ranking):
            other = other._all()
        return isinstance(other, list) and self._all() == other

    __hash__ = None  # type: ignore[assignment]  # (a list's equal: unhashable as a list is)

    def __repr__(self) -> str:
        return repr(self._all())


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


def head_order(s: np.ndarray, draws: np.ndarray, k: int) -> np.ndarray | None:
    """The first ``k`` positions of ``ordered(s, draws)``, from the candidates that could be among them: those
    within rounding of the k-th lowest score (a superset of every one whose rounded score is at most its
    rounded one, which is where the first k are). None where that saves nothing (up to ``HEAD_FROM`` or ``4 k``
    candidates, or as many near the k-th as to be most of them) or where a score is NaN or -inf."""
    n = len(s)
    if n <= max(HEAD_FROM, 4 * k) or not (s > -np.inf).all():  # NaN or -inf: no threshold to select by
        return None
    kth = float(np.partition(s, k - 1)[k - 1])
    near = np.flatnonzero(s <= kth + max(1e-8, abs(kth) * 1e-12))  # kth inf: every one
    if 4 * len(near) > n:
        return None
    if len(near) <= SORTED_UP_TO:  # a few (the usual case): Python's sort of ``pick``'s keys costs less
        sn, dn = s[near].tolist(), draws[near].tolist()
        return near[sorted(range(len(near)), key=lambda j: (round(sn[j], 9), dn[j]))[:k]]
    return near[ordered(s[near], draws[near])[:k]]


def ordered(s: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """Positions by ``round(score, 9)``, then draw, then position (Python's ``sorted`` of ``pick``). Sorted by
    score, then draw, first: that is the order wherever scores that round alike are equal. Python's ``round``
    is asked only of neighbours within 1e-8, the only ones it could merge, and only if there are some are the
    groups it makes sorted again."""
    n = len(s)
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
    return order[np.lexsort((order, draws[order], group))]  # (equal draws: the candidates' order)
