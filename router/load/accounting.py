"""The router's own view of each worker's load. Pure: callers pass ``now``.

Updated on dispatch, first token and completion. Prefill work not yet done (uncached prompt tokens of
requests that have no first token yet) is what makes a new request wait; decodes in flight slow every step.
KV blocks held by requests in flight are what a new request must fit beside: an engine whose cache is full
of running requests admits nothing until some finish. Those are counted as the engine counts them: the
distinct prompt blocks of the requests in flight (a shared prefix once; block keys are prefix-closed) plus
each request's own partial block and output.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import islice

try:  # the per-key loops in C (router/index/_fastdicts.c), built where a compiler was; the loops below the reference
    from router.index._fastdicts import count_keys as _compiled_count_keys
    from router.index._fastdicts import held_prefix as _compiled_held_prefix
    from router.index._fastdicts import shared_len as _compiled_shared_len
except ImportError:  # pragma: no cover - a build without the extension
    _compiled_count_keys = _compiled_held_prefix = _compiled_shared_len = None


def tail_blocks(prompt_tokens: int, full_blocks: int, max_tokens: int, block_size: int) -> int:
    """KV blocks a request needs beyond its full prompt blocks: its partial last block and its output."""
    return -(-(prompt_tokens - full_blocks * block_size + max_tokens) // block_size)


@dataclass(slots=True)
class InFlight:
    worker_id: str
    prompt_tokens: int
    uncached_tokens: int  # the router's estimate of prefill work at dispatch
    max_tokens: int
    dispatched_at: float
    predicted_ttft_s: float | None = None
    first_token_at: float | None = None
    keys: Sequence[int] = ()  # the request's block keys: its full prompt blocks
    tail_blocks: int = 0  # blocks for its partial last prompt block and its output


@dataclass(slots=True)
class WorkerLoad:
    requests: int = 0
    prompt_tokens: int = 0
    pending_prefill_tokens: int = 0  # uncached tokens of requests still waiting for their first token
    decoding: int = 0  # requests past their first token
    output_tokens: int = 0  # max_tokens of the requests in flight: the decode work they still have, at most
    dispatched_total: int = 0
    last_dispatch_at: float | None = None
    active_keys: dict[int, int] = field(default_factory=dict)  # prompt block key -> requests in flight using it
    tail_blocks: int = 0
    request_ids: set[str] = field(default_factory=set)
    release: tuple[float, list[float], list[int]] | None = None  # cached by release_wait_s; None when stale

    @property
    def active_blocks(self) -> int:
        """KV blocks the requests in flight will hold at most (each at its last token)."""
        return len(self.active_keys) + self.tail_blocks

    def shared_prefix_blocks(self, keys: Sequence[int]) -> int:
        """How many leading ``keys`` a request in flight already holds (binary search: keys are prefix-closed)."""
        return held_prefix(self.active_keys, keys)


def py_held_prefix(active: dict[int, int], keys: Sequence[int]) -> int:
    """How many leading ``keys`` are in ``active``, by a binary search (keys are prefix-closed): the reference
    of the compiled ``held_prefix``."""
    if not keys or keys[0] not in active:
        return 0
    lo, hi = 1, len(keys)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if keys[mid - 1] in active:
            lo = mid
        else:
            hi = mid - 1
    return lo


def py_count_keys(counts: dict[int, int], keys: Sequence[int], delta: int) -> None:
    """``counts[k] += delta`` (1 or -1) for each of ``keys``, a count reaching 0 deleted (a decrement of a key
    with no count raises KeyError): the reference of the compiled ``count_keys``."""
    if delta == 1:
        for k in keys:
            counts[k] = counts.get(k, 0) + 1
        return
    if delta != -1:
        raise ValueError("delta must be 1 or -1")
    for k in keys:
        left = counts[k] - 1
        if left:
            counts[k] = left
        else:
            del counts[k]


count_keys = _compiled_count_keys or py_count_keys
held_prefix = _compiled_held_prefix or py_held_prefix


def py_shared_len(keys: Sequence[int], active: dict[int, int]) -> int:
    """How many leading ``keys`` (a request's, in flight) another request in flight holds too: a binary search,
    since a request holding a key holds every key before it (keys are chained). The reference of the compiled
    ``shared_len``."""
    lo, hi = 0, len(keys)
    while lo < hi:
        mid = (lo + hi) // 2
        if active[keys[mid]] > 1:
            lo = mid + 1
        else:
            hi = mid
    return lo


shared_len = _compiled_shared_len or py_shared_len


@dataclass
class LoadTracker:
    workers: dict[str, WorkerLoad] = field(default_factory=dict)
    inflight: dict[str, InFlight] = field(default_factory=dict)
    # workers whose load changed since the fleet's columns last read them (router/scheduling/columns.py): a
    # decision over a thousand workers re-reads the one or two that changed, not all of them
    changed: set[str] = field(default_factory=set)
    # first block key -> how many requests in flight start with it: a decision whose first key none starts with
    # skips every worker's shared-prefix search. First keys only: keys are chained (each one hashes its parent),
    # so a prompt's first key is never another prompt's later key (short of a 64-bit collision, which the index
    # already assumes away), and counting one key per request keeps dispatch at one dict write per block
    first_key_holders: dict[int, int] = field(default_factory=dict)

    def load(self, worker_id: str) -> WorkerLoad:
        self.changed.add(worker_id)  # every write goes through here
        w = self.workers.get(worker_id)
        if w is None:
            w = self.workers[worker_id] = WorkerLoad()
        return w

    def dispatch(self, request_id: str, worker_id: str, prompt_tokens: int, uncached_tokens: int,
                 max_tokens: int, now: float, predicted_ttft_s: float | None = None, keys: Sequence[int] = (),
                 block_size: int = 16, tail: int | None = None) -> None:
        """``tail``: the request's tail blocks as another replica counted them (default: computed here)."""
        if request_id in self.inflight:
            self.complete(request_id, now)  # a retry on another worker replaces the first attempt
        if tail is None:
            tail = tail_blocks(prompt_tokens, len(keys), max_tokens, block_size)
        self.inflight[request_id] = InFlight(worker_id, prompt_tokens, uncached_tokens, max_tokens, now,
                                             predicted_ttft_s, None, keys, tail)
        w = self.load(worker_id)
        count_keys(w.active_keys, keys, 1)
        if keys:
            holders = self.first_key_holders
            holders[keys[0]] = holders.get(keys[0], 0) + 1
        w.tail_blocks += tail
        w.request_ids.add(request_id)
        w.release = None
        w.requests += 1
        w.output_tokens += max_tokens
        w.prompt_tokens += prompt_tokens
        w.pending_prefill_tokens += uncached_tokens
        w.dispatched_total += 1
        w.last_dispatch_at = now

    def first_token(self, request_id: str, now: float) -> InFlight | None:
        r = self.inflight.get(request_id)
        if r is None or r.first_token_at is not None:
            return None
        r.first_token_at = now
        w = self.load(r.worker_id)
        w.release = None
        w.pending_prefill_tokens -= r.uncached_tokens
        w.decoding += 1
        return r

    def complete(self, request_id: str, now: float) -> InFlight | None:
        r = self.inflight.pop(request_id, None)
        if r is None:
            return None
        w = self.load(r.worker_id)
        count_keys(w.active_keys, r.keys, -1)
        if r.keys:
            self._unhold(r.keys[0])
        w.tail_blocks -= r.tail_blocks
        w.request_ids.discard(request_id)
        w.release = None
        w.requests -= 1
        w.output_tokens -= r.max_tokens
        w.prompt_tokens -= r.prompt_tokens
        if r.first_token_at is None:
            w.pending_prefill_tokens -= r.uncached_tokens
        else:
            w.decoding -= 1
        return r

    def release_wait_s(self, worker_id: str, blocks: int, now: float, decode_step_s: float) -> float:
        """How long until requests in flight on the worker finish and free ``blocks`` KV blocks.

        Each is expected to finish ``max_tokens`` decode steps after its first token (or after its predicted
        one). Taken in that order, each frees its own tail and the prompt blocks no request still in flight
        shares (a suffix of its keys: counts along a key chain never rise). If all of them finishing would
        not free enough: the last one's finish. The schedule is kept per worker until its requests change
        (once per routed request), so a decision over many workers costs a binary search on each.
        """
        w = self.workers.get(worker_id)
        if w is None or not w.request_ids or blocks <= 0:
            return 0.0
        ends, freed = self.release_schedule(w, decode_step_s)
        i = bisect.bisect_left(freed, blocks)
        return max(0.0, ends[min(i, len(ends) - 1)] - now)

    def release_schedule(self, w: WorkerLoad, decode_step_s: float) -> tuple[list[float], list[int]]:
        """The worker's expected finish times in order and the KV blocks freed by each (cumulative), at this
        decode step; kept on the worker until its requests or the step change (``release_wait_s``'s schedule)."""
        if w.release is None or w.release[0] != decode_step_s:
            w.release = (decode_step_s, *self._release_schedule(w, decode_step_s))
        return w.release[1], w.release[2]

    def _release_schedule(self, w: WorkerLoad, decode_step_s: float) -> tuple[list[float], list[int]]:
        """Expected finish times in order, and the KV blocks freed by then (cumulative).

        A request taken as finished frees its tail and the keys no request left in flight holds. The keys it
        shares with another request in flight are a prefix of its keys (counts along a key chain never rise:
        ``shared_len``); only those are counted in ``gone``, since a key it alone holds goes with it in any
        order. A busy engine's requests share a system prompt and little else, so this is a few dict
        operations a request rather than one a prompt block."""
        order = []
        for rid in w.request_ids:
            r = self.inflight[rid]
            start = r.first_token_at if r.first_token_at is not None else r.dispatched_at + (r.predicted_ttft_s or 0.0)
            order.append((start + r.max_tokens * decode_step_s, rid))
        order.sort()
        gone: dict[int, int] = {}  # key -> requests holding it that are taken as finished
        active = w.active_keys
        ends, cumulative, freed = [], [], 0
        for end, rid in order:
            r = self.inflight[rid]
            keys = r.keys
            shared = shared_len(keys, active)
            for k in islice(keys, shared):
                gone[k] = gone.get(k, 0) + 1
            lo, hi = 0, shared  # first key no request left in flight holds (from ``shared`` on: none does)
            while lo < hi:
                mid = (lo + hi) // 2
                k = keys[mid]
                if active[k] - gone[k] == 0:
                    hi = mid
                else:
                    lo = mid + 1
            freed += r.tail_blocks + len(keys) - lo
            ends.append(end)
            cumulative.append(freed)
        return ends, cumulative

    def forget_worker(self, worker_id: str) -> None:
        self.changed.add(worker_id)
        for rid in [rid for rid, r in self.inflight.items() if r.worker_id == worker_id]:
            r = self.inflight.pop(rid)
            if r.keys:
                self._unhold(r.keys[0])
        self.workers.pop(worker_id, None)

    def _unhold(self, first_key: int) -> None:
        """One request fewer in flight starts with ``first_key``."""
        left = self.first_key_holders[first_key] - 1
        if left:
            self.first_key_holders[first_key] = left
        else:
            del self.first_key_holders[first_key]
