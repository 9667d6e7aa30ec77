"""Short-lived guesses of what a worker is about to cache. Pure: callers pass ``now``.

When the router sends a request to a worker, that worker will hold the request's blocks a prefill later,
but the events only arrive then. Recording the routed keys for a short TTL lets a burst of identical
prefixes follow the first one instead of all landing on cold workers before the first events arrive.

Each key remembers only the worker it was most recently sent to. Keys are prefix-closed (a key names its
whole prefix), so a worker owning key i was sent keys 0..i too: its speculative prefix is i + 1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

try:  # the walk and the claims' loops in C (router/index/_fastdicts.c), built where a compiler was
    from router.index._fastdicts import claim_keys as _compiled_claim
    from router.index._fastdicts import release_claims as _compiled_release
    from router.index._fastdicts import speculative_prefixes as _compiled_walk
except ImportError:  # pragma: no cover - a build without the extension
    _compiled_walk = _compiled_claim = _compiled_release = None


def py_claim_keys(owner: dict, keys: Sequence[int], entry: tuple[str, float]) -> list:
    """Each key's entry before (None where it had none), then ``owner[k] = entry`` for each: the reference of
    the compiled ``claim_keys``."""
    previous = [owner.get(k) for k in keys]
    for k in keys:
        owner[k] = entry
    return previous


def py_release_claims(owner: dict, keys: Sequence[int], previous: list, entry: tuple[str, float]) -> None:
    """``claim_keys`` taken back: each key ``entry`` still owns (not claimed again since) returns to its previous
    entry, or leaves ``owner`` where it had none: the reference of the compiled ``release_claims``."""
    for k, prev in zip(keys, previous, strict=True):
        if owner.get(k) is entry:
            if prev is None:
                del owner[k]
            else:
                owner[k] = prev


claim_keys = _compiled_claim or py_claim_keys
release_claims = _compiled_release or py_release_claims


class SpeculativePrefixes:
    def __init__(self, ttl_s: float = 2.0, max_entries: int = 1_000_000) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._owner: dict[int, tuple[str, float]] = {}  # key -> (worker, expiry)

    def __len__(self) -> int:
        return len(self._owner)

    def record(self, worker_id: str, keys: Sequence[int], now: float) -> Callable[[], None] | None:
        """Remember ``keys`` as on their way to ``worker_id``; returns how to take that back (the request went
        elsewhere after all): the keys this record still owns return to their previous owners."""
        if self.ttl_s <= 0 or not keys:
            return None
        if len(self._owner) + len(keys) > self.max_entries:
            self._purge(now)
        entry = (worker_id, now + self.ttl_s)
        previous = claim_keys(self._owner, keys, entry)

        def undo() -> None:
            release_claims(self._owner, keys, previous, entry)  # (a purge may have replaced the dict)

        return undo

    def match(self, keys: Sequence[int], now: float) -> dict[str, int]:
        """Each worker's longest prefix of ``keys`` routed to it within the TTL (a decision walks the whole
        prompt here while a burst of it is in flight: compiled where it could be built, the loop below the
        reference)."""
        if _compiled_walk is not None:
            found = _compiled_walk(self._owner, keys, now)
            if found is not None:
                return found  # type: ignore[no-any-return]
        out: dict[str, int] = {}
        owner = self._owner
        for i, k in enumerate(keys):
            entry = owner.get(k)
            if entry is None or entry[1] <= now:
                break
            out[entry[0]] = i + 1
        return out

    def forget_worker(self, worker_id: str) -> None:
        self._owner = {k: v for k, v in self._owner.items() if v[0] != worker_id}

    def _purge(self, now: float) -> None:
        self._owner = {k: v for k, v in self._owner.items() if v[1] > now}
        if len(self._owner) > self.max_entries // 2:  # all still live: keep the newest half
            live = sorted(self._owner.items(), key=lambda kv: kv[1][1])
            self._owner = dict(live[len(live) // 2 :])
