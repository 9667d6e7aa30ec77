"""Which block keys each worker holds, per medium. Pure: no I/O, no clocks.

Layout, chosen for the match loop (the hot path):
- ``_holders[medium]``: block key -> bitmask of worker slots holding it on that medium. A match walks the
  request's keys once, AND-ing a mask of still-matching workers, and stops as soon as it is empty.
- per worker and medium, an insertion-ordered map ``engine hash -> our key`` (so ``BlockRemoved`` and parent
  hashes resolve); insertion order doubles as the index's own LRU order. The same hash can be stored twice,
  in different physical blocks: the copies beyond the first are counted in a side map, ``extra_copies``
  (rare), so that the common block costs one dict entry, and a store or removal as few dict operations as
  there can be (ingest runs them for every block of every event).

Memory is bounded by ``capacity`` (worker, medium, engine-hash) entries: beyond it the worker holding
the most entries loses its oldest ones, the ones its engine is likeliest to have evicted already.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from router.keys import ROOT_KEY, chain_keys

try:  # the common blocks' loops and the GPU-only walk in C (router/index/_fastdicts.c); the Python below does the
    # same without them
    from router.index._fastdicts import gpu_prefix as _gpu_prefix
    from router.index._fastdicts import keys_of as _keys_of
    from router.index._fastdicts import remove_plain as _remove_plain
    from router.index._fastdicts import store_chain as _store_chain
    from router.index._fastdicts import store_new as _store_new
except ImportError:
    _store_new = _store_chain = _remove_plain = _gpu_prefix = _keys_of = None

EngineHash = Hashable  # vLLM sends uint64 (default) or digest bytes; SGLang signed int64


class Medium(IntEnum):
    GPU = 0
    CPU = 1
    STORAGE = 2


MEDIA = tuple(Medium)


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """A worker's longest consecutive prefix of the request, split by the cheapest tier holding it.

    ``gpu`` = blocks of the longest prefix held on GPU; ``cpu`` = further blocks extending it that are held
    on GPU or CPU; ``storage`` = further blocks held on any medium. ``total`` is the any-medium prefix.
    """

    gpu: int
    cpu: int = 0
    storage: int = 0

    @property
    def total(self) -> int:
        return self.gpu + self.cpu + self.storage


@dataclass(frozen=True, slots=True)
class BlockEntry:
    """One (medium, engine hash) a worker holds: our key for it and how many physical blocks store it."""

    medium: Medium
    engine_hash: EngineHash
    key: int
    count: int = 1


@dataclass(slots=True)
class _WorkerBlocks:
    slot: int
    bit: int = 0  # 1 << slot: the worker's bit in the holder masks (set by __post_init__)
    held: tuple[dict[EngineHash, int], ...] = field(default_factory=lambda: ({}, {}, {}))  # per medium
    extra_copies: dict[tuple[int, EngineHash], int] = field(default_factory=dict)  # (medium, hash) -> copies - 1

    @property
    def entries(self) -> int:
        return sum(len(r) for r in self.held)

    def __post_init__(self) -> None:
        self.bit = 1 << self.slot

    def copies(self, medium: int, h: EngineHash) -> int:
        return 1 + self.extra_copies.get((medium, h), 0)


class KvIndex:
    """Residency of KV blocks across workers, fed by engine events, queried by prefix."""

    def __init__(self, capacity: int = 8_000_000) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self._holders: tuple[dict[int, int], ...] = ({}, {}, {})
        self._workers: dict[str, _WorkerBlocks] = {}
        self._slot_owner: dict[int, str] = {}
        self._free_slots: list[int] = []
        # (slot, medium, key) -> extra engine hashes mapping to the same key (rare: only
        # if two engine hashes share our key); lets removal of one keep the key resident.
        self._dup_keys: dict[tuple[int, int, int], int] = {}
        self._entries = 0
        self.evicted_entries = 0
        # entries per (slot, medium), at 3 x slot + medium: ``blocks_by_slot`` (int64s: read by numpy in place)
        self._held_len = array("q")
        self.slot_epoch = 0  # +1 whenever a worker takes or gives up a slot (callers cache slot maps by it)

    # ---- workers -------------------------------------------------------------------------
    def _worker(self, worker_id: str) -> _WorkerBlocks:
        w = self._workers.get(worker_id)
        if w is None:
            slot = self._free_slots.pop() if self._free_slots else len(self._workers)
            w = self._workers[worker_id] = _WorkerBlocks(slot)
            self._slot_owner[slot] = worker_id
            while len(self._held_len) < 3 * slot + 3:
                self._held_len.append(0)
            self.slot_epoch += 1
        return w

    def workers(self) -> list[str]:
        return list(self._workers)

    def clear_worker(self, worker_id: str) -> int:
        """Forget every block of one worker (AllBlocksCleared, restart, unrecoverable gap)."""
        w = self._workers.get(worker_id)
        if w is None:
            return 0
        dropped = 0
        bit = w.bit
        for medium in MEDIA:
            holders = self._holders[medium]
            refs = w.held[medium]
            for key in refs.values():
                mask = holders.get(key, 0) & ~bit
                if mask:
                    holders[key] = mask
                else:
                    holders.pop(key, None)
            dropped += len(refs)
            refs.clear()
            self._held_len[3 * w.slot + medium] = 0
        w.extra_copies.clear()
        for k in [k for k in self._dup_keys if k[0] == w.slot]:
            del self._dup_keys[k]
        self._entries -= dropped
        return dropped

    def remove_worker(self, worker_id: str) -> None:
        self.clear_worker(worker_id)
        w = self._workers.pop(worker_id, None)
        if w is not None:
            del self._slot_owner[w.slot]
            self._free_slots.append(w.slot)
            self.slot_epoch += 1

    # ---- events --------------------------------------------------------------------------
    def key_of(self, worker_id: str, engine_hash: EngineHash) -> int | None:
        w = self._workers.get(worker_id)
        if w is None:
            return None
        for held in w.held:  # (GPU first: where the parent of a new block nearly always is)
            key = held.get(engine_hash)
            if key is not None:
                return key
        return None

    def keys_of(self, worker_id: str, engine_hashes: Sequence[EngineHash]) -> list[int]:
        """``key_of`` of each hash, the ones the worker holds on no medium left out (in C: one call, not one a
        block, for what the feed tells the reuse statistics of every GPU removal)."""
        w = self._workers.get(worker_id)
        if w is None:
            return []
        if _keys_of is not None:
            return _keys_of(w.held, engine_hashes)  # type: ignore[no-any-return]
        return [k for h in engine_hashes if (k := self.key_of(worker_id, h)) is not None]

    def store(
        self, worker_id: str, engine_hashes: Sequence[EngineHash], keys: Sequence[int], medium: Medium
    ) -> None:
        """Record blocks stored by a worker (one BlockStored event); nothing of it when its lengths differ."""
        if len(engine_hashes) != len(keys):
            raise ValueError("engine_hashes and keys differ in length")
        w = self._worker(worker_id)
        held = w.held[medium]
        holders = self._holders[medium]
        bit = w.bit
        if _store_new is None:
            added = 0
            for h, key in zip(engine_hashes, keys, strict=True):
                added += self._store_one(w, held, holders, bit, medium, h, key)
        else:  # the new blocks in C; the first one stored again or sharing a key here, then C again from the next
            added, stop = _store_new(held, holders, engine_hashes, keys, bit, 0)
            added += self._store_rest(w, held, holders, bit, medium, engine_hashes, keys, stop)
        self._stored(w, medium, held, added)

    def _store_rest(self, w: _WorkerBlocks, held: dict[EngineHash, int], holders: dict[int, int], bit: int,
                    medium: Medium, engine_hashes: Sequence[EngineHash], keys: Sequence[int], stop: int) -> int:
        """After the compiled loop stopped at block ``stop``: that block in Python, then C again from the next."""
        added = 0
        while stop < len(keys):
            added += self._store_one(w, held, holders, bit, medium, engine_hashes[stop], keys[stop])
            more, stop = _store_new(held, holders, engine_hashes, keys, bit, stop + 1)
            added += more
        return added

    def store_chain(self, worker_id: str, engine_hashes: Sequence[EngineHash], token_ids: Sequence[int],
                    block_size: int, parent_hash: EngineHash | None, medium: Medium) -> bool:
        """Record one BlockStored event from its tokens: ``key_of`` its parent (the root for None), the chained
        keys of its blocks (``chain_keys`` without extra keys), ``store``; False, storing nothing, when the
        worker does not hold the parent (an orphan). The feed's common event in one compiled call
        (router/index/_fastdicts.c: ``store_chain``); token ids that are not uint32 raise as ``chain_keys``."""
        w = self._workers.get(worker_id)
        if _store_chain is not None and w is not None:  # (a worker's first event: composed, as it makes the worker)
            holders, bit = self._holders[medium], w.bit
            done = _store_chain(w.held, medium, holders, engine_hashes, token_ids, block_size, parent_hash, ROOT_KEY,
                                bit)
            if done is not None:
                added, stop, keys = done
                if keys is None:
                    return False
                held = w.held[medium]
                if stop < len(keys):
                    added += self._store_rest(w, held, holders, bit, medium, engine_hashes, keys, stop)
                self._stored(w, medium, held, added)
                return True
        return store_chained(self, worker_id, engine_hashes, token_ids, block_size, parent_hash, medium)

    def _stored(self, w: _WorkerBlocks, medium: Medium, held: dict[EngineHash, int], added: int) -> None:
        self._entries += added
        self._held_len[3 * w.slot + medium] = len(held)
        if self._entries > self.capacity:
            self._evict()

    def _store_one(self, w: _WorkerBlocks, held: dict[EngineHash, int], holders: dict[int, int], bit: int,
                   medium: Medium, h: EngineHash, key: int) -> int:
        """The store loop's body for one block (what the C loop hands back): 1 if it is a new entry."""
        old = held.pop(h, None)  # pop + reinsert: most recently stored goes last (LRU order)
        if old is not None:  # stored again: one more copy, under the key it has
            held[h] = old
            copy = (medium, h)
            w.extra_copies[copy] = w.extra_copies.get(copy, 0) + 1
            return 0
        held[h] = key
        mask = holders.get(key, 0)
        if mask & bit:
            dup = (w.slot, medium, key)
            self._dup_keys[dup] = self._dup_keys.get(dup, 0) + 1
        else:
            holders[key] = mask | bit
        return 1

    def remove(self, worker_id: str, engine_hashes: Iterable[EngineHash], medium: Medium) -> int:
        """Apply a BlockRemoved; returns how many hashes were unknown to the index."""
        w = self._workers.get(worker_id)
        if w is None:
            return sum(1 for _ in engine_hashes)
        held = w.held[medium]
        # _drop_entry inlined (a call per block costs as much as the block's own work); the rare cases (a
        # hash with more than one copy, a key two hashes share) take the slow path
        extra, holders, dup_keys = w.extra_copies, self._holders[medium], self._dup_keys
        keep = ~w.bit
        if _remove_plain is not None and not extra and not dup_keys and (
                type(engine_hashes) is list or isinstance(engine_hashes, Sequence)):  # (the decoder's: a list)
            unknown, dropped = _remove_plain(held, holders, engine_hashes, keep)
            self._entries -= dropped
            self._held_len[3 * w.slot + medium] = len(held)
            return unknown
        unknown = dropped = 0
        for h in engine_hashes:
            if extra or dup_keys:
                if h not in held:
                    unknown += 1
                elif (copy := (medium, h)) in extra:
                    n = extra[copy] - 1
                    if n:
                        extra[copy] = n
                    else:
                        del extra[copy]
                else:
                    self._drop_entry(w, medium, h)
                continue
            key = held.pop(h, None)
            if key is None:
                unknown += 1
                continue
            dropped += 1
            mask = holders.pop(key, 0) & keep  # one dict operation for a key this worker alone held
            if mask:
                holders[key] = mask
        self._entries -= dropped
        self._held_len[3 * w.slot + medium] = len(held)
        return unknown

    def _drop_entry(self, w: _WorkerBlocks, medium: Medium, h: EngineHash) -> None:
        """Forget one (medium, hash) entry of a worker, whatever its copies."""
        held = w.held[medium]
        key = held.pop(h)
        self._held_len[3 * w.slot + medium] = len(held)
        w.extra_copies.pop((medium, h), None)
        self._entries -= 1
        self._release_key(w, medium, key)

    def _release_key(self, w: _WorkerBlocks, medium: Medium, key: int) -> None:
        dup = (w.slot, medium, key)
        extra = self._dup_keys.get(dup)
        if extra:
            if extra == 1:
                del self._dup_keys[dup]
            else:
                self._dup_keys[dup] = extra - 1
            return
        holders = self._holders[medium]
        mask = holders.get(key, 0) & ~w.bit
        if mask:
            holders[key] = mask
        else:
            holders.pop(key, None)

    def _evict(self) -> None:
        """Shed the oldest entries of the biggest workers until 1% below capacity (amortised)."""
        target = self.capacity - max(1, self.capacity // 100)
        while self._entries > target:
            w = max(self._workers.values(), key=lambda x: x.entries)
            medium = max(MEDIA, key=lambda m: len(w.held[m]))
            refs = w.held[medium]
            excess = min(len(refs), self._entries - target)
            for h in list(refs)[:excess]:
                self._drop_entry(w, medium, h)
                self.evicted_entries += 1

    # ---- snapshots -----------------------------------------------------------------------
    def export_worker(self, worker_id: str) -> list[BlockEntry]:
        """One worker's whole residency, per medium in the index's own LRU order (oldest first): what a
        snapshot must carry so that ``import_worker`` rebuilds the same state (refcounts and order included)."""
        w = self._workers.get(worker_id)
        if w is None:
            return []
        return [BlockEntry(m, h, key, w.copies(m, h)) for m in MEDIA for h, key in w.held[m].items()]

    def import_worker(self, worker_id: str, entries: Iterable[BlockEntry]) -> None:
        """Replace one worker's residency with ``entries`` (as ``export_worker`` gave them)."""
        self.clear_worker(worker_id)
        for e in entries:
            for _ in range(e.count):
                self.store(worker_id, (e.engine_hash,), (e.key,), e.medium)

    # ---- queries -------------------------------------------------------------------------
    def __len__(self) -> int:
        """Resident (worker, medium, engine hash) entries."""
        return self._entries

    def blocks_held(self, worker_id: str) -> dict[Medium, int]:
        w = self._workers.get(worker_id)
        if w is None:
            return {m: 0 for m in MEDIA}
        return {m: len(w.held[m]) for m in MEDIA}

    def blocks_held_on(self, worker_id: str, medium: Medium) -> int:
        w = self._workers.get(worker_id)
        return len(w.held[medium]) if w is not None else 0

    def resident_keys(self, worker_id: str) -> dict[Medium, set[int]]:
        """Every key a worker holds, per medium (for tests and debugging; O(blocks))."""
        w = self._workers.get(worker_id)
        if w is None:
            return {m: set() for m in MEDIA}
        return {m: set(w.held[m].values()) for m in MEDIA}

    def engine_hashes(self, worker_id: str) -> dict[Medium, set[EngineHash]]:
        """Every engine hash a worker holds, per medium (for tests and debugging)."""
        w = self._workers.get(worker_id)
        return {m: set(w.held[m]) if w else set() for m in MEDIA}

    def holds(self, worker_id: str, key: int, medium: Medium = Medium.GPU) -> bool:
        w = self._workers.get(worker_id)
        return w is not None and bool(self._holders[medium].get(key, 0) >> w.slot & 1)

    def slot_of(self, worker_id: str) -> int | None:
        """The worker's column in ``match_lengths`` and ``blocks_by_slot`` (None: it holds nothing, never did)."""
        w = self._workers.get(worker_id)
        return None if w is None else w.slot

    def blocks_by_slot(self, medium: Medium) -> np.ndarray:
        """``blocks_held_on`` of every worker at once, by slot (``slot_of``): a decision over a thousand workers
        reads one array, not a thousand calls."""
        # (a copy: the view would keep the array from growing)
        return np.frombuffer(self._held_len, dtype=np.int64)[medium::3].copy()

    def match(self, keys: Sequence[int]) -> dict[str, PrefixMatch]:
        """Each worker's longest consecutive prefix of ``keys`` (from block 0), by tier.

        Workers with no matched block are absent from the result.
        """
        slots, gpu, cpu, storage = self.match_lengths(keys)
        owner = self._slot_owner
        return {owner[s]: PrefixMatch(g, c, st)
                for s, g, c, st in zip(slots.tolist(), gpu.tolist(), cpu.tolist(), storage.tolist(), strict=True)}

    def match_lengths(self, keys: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``match`` as arrays: the slots (``slot_of``) of the workers with a matched block, and their GPU / CPU /
        storage blocks; no object per worker (a decision over a thousand workers reads them).

        The walk records each block at which some workers drop out (their mask and the length they reached);
        the masks are read into slots once, at the end (``_drop_lengths``)."""
        gpu, cpu, storage = self._holders
        width = len(self._held_len) // 3
        if not cpu and not storage:
            if _gpu_prefix is not None:  # the walk and the reading of its masks in C
                found = _gpu_prefix(gpu, keys, width)
                slots, lengths = np.frombuffer(found[0], dtype=np.int64), np.frombuffer(found[1], dtype=np.int64)
            else:
                slots, lengths = _drop_lengths(self._walk_gpu_only(keys, gpu), width)
            zeros = np.zeros(len(slots), dtype=np.int64)
            return slots, lengths, zeros, zeros.copy()
        events: list[list[tuple[int, int]]] = [[], [], []]  # tier -> (dropped mask, length)
        alive = [-1, -1, -1]  # GPU; GPU|CPU; any
        n = len(keys)
        for i, key in enumerate(keys):
            g = gpu.get(key, 0)
            masks = (g, g | cpu.get(key, 0), 0)
            masks = (masks[0], masks[1], masks[1] | storage.get(key, 0))
            for tier in (0, 1, 2):
                new = alive[tier] & masks[tier]
                if new != alive[tier]:
                    if alive[tier] != -1:  # (the all-ones mask before block 0: those slots matched nothing)
                        events[tier].append((alive[tier] ^ new, i))  # (new is within alive)
                    alive[tier] = new
            if not alive[2]:
                break
        else:
            for tier in (0, 1, 2):
                if alive[tier] and alive[tier] != -1:
                    events[tier].append((alive[tier], n))
        slots, total = _drop_lengths(events[2], width)  # (in the order the walk dropped them out)
        g, c = np.zeros(width, dtype=np.int64), np.zeros(width, dtype=np.int64)
        for tier, full in ((0, g), (1, c)):
            at, length = _drop_lengths(events[tier], width)
            full[at] = length
        g, c = g[slots], c[slots]
        return slots, g, c - g, total - c

    @staticmethod
    def _walk_gpu_only(keys: Sequence[int], gpu: dict[int, int]) -> list[tuple[int, int]]:
        if not keys:
            return []
        alive = gpu.get(keys[0], 0)
        if not alive:
            return []
        events: list[tuple[int, int]] = []
        get = gpu.get
        for i in range(1, len(keys)):
            new = alive & get(keys[i], 0)
            if new != alive:
                events.append((alive ^ new, i))  # the slots that dropped out (new is within alive)
                alive = new
                if not alive:
                    break
        else:
            events.append((alive, len(keys)))
        return events


_NARROW = 64  # slots up to which masks are read bit by bit in Python (one word: cheaper than numpy's calls)


def _drop_lengths(events: list[tuple[int, int]], width: int) -> tuple[np.ndarray, np.ndarray]:
    """(slots, lengths) of a walk's drop events, ``(mask of slots that dropped out, the length they reached)``,
    each slot in one event: in event order, ascending slots within one. A wide fleet's masks are big ints whose
    bit-by-bit reading costs four big-int operations a slot, so they are read as 64-bit words by numpy."""
    if not events:
        none = np.zeros(0, dtype=np.int64)
        return none, none
    if width <= _NARROW:
        return _drop_lengths_by_bit(events)
    words = (width + 63) // 64
    raw = np.frombuffer(b"".join([m.to_bytes(8 * words, "little") for m, _ in events]), dtype="<u8")
    rows, cols = np.nonzero(raw.reshape(len(events), words))  # the few nonzero words
    word = raw[rows * words + cols]
    found_rows, found_slots = [], []
    while len(word):  # one bit of every word still nonzero per round: rounds = the most bits a word has
        low = word & (~word + np.uint64(1))
        found_rows.append(rows)
        found_slots.append(cols * 64 + np.frexp(low.astype(np.float64))[1] - 1)  # (exact: a power of two)
        word = word ^ low
        left = word != 0
        word, rows, cols = word[left], rows[left], cols[left]
    event = np.concatenate(found_rows)
    slots = np.concatenate(found_slots).astype(np.int64)
    order = np.lexsort((slots, event))
    at = np.fromiter((length for _, length in events), dtype=np.int64, count=len(events))
    return slots[order], at[event[order]]


def _drop_lengths_by_bit(events: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """``_drop_lengths`` one bit at a time (narrow fleets; the wide path's reference in the tests)."""
    slots: list[int] = []
    lengths: list[int] = []
    for mask, length in events:
        while mask:
            low = mask & -mask
            slots.append(low.bit_length() - 1)
            lengths.append(length)
            mask ^= low
    return np.array(slots, dtype=np.int64), np.array(lengths, dtype=np.int64)


def store_chained(index: KvIndex, worker_id: str, engine_hashes: Sequence[EngineHash], token_ids: Sequence[int],
                  block_size: int, parent_hash: EngineHash | None, medium: Medium) -> bool:
    """``store_chain`` composed of ``key_of``, ``chain_keys`` and ``store``: the reference, and any index's path
    (the compact layout's; the dict layout's where its compiled call does not cover the event)."""
    if parent_hash is None:
        parent = ROOT_KEY
    else:
        found = index.key_of(worker_id, parent_hash)
        if found is None:
            return False
        parent = found
    index.store(worker_id, engine_hashes, chain_keys(token_ids, block_size, parent), medium)
    return True
