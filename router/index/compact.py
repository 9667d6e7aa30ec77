"""Which block keys each worker holds, per medium, in flat arrays: ``KvIndex``'s API for fleets too big for its
dicts (``routing.index: compact``). Pure: no I/O, no clocks.

The trade, measured (docs/benchmarks.md, "Compact index"): 38 bytes per resident block against the dict
index's 242 (20M blocks over 1,000 workers fit in 0.7 GB, not 4.8), for about 2.5x its per-block ingest cost
(a 16-block event is too small for numpy, so events run scalar code over memoryviews) and a fixed numpy cost
per match that small fleets feel (8K-token decisions at 8-64 workers 1.7-1.9x) and wide ones win back (0.85-0.91x
at 256). Below a few hundred workers the dict index is faster and its memory is no concern.

Flat arrays, no Python object per block (numpy only: the package must install on a clean Python with no
compiler, so no C extension). About 36 bytes per resident (worker, medium, engine hash) entry:

- **entries** (struct of arrays, one row each): engine hash and our key (int64 each), list (worker slot x 3 +
  medium) and refcount (int16, widened to int32 only if a fleet or a count ever needs it). Rows are appended;
  a removed row leaves a hole that a compaction squeezes out, so row order *is* the index's LRU order (a hash
  stored again moves to a new row at the end) and eviction takes the first rows of a list.
- **hash table** (int32 slots, open addressing): (list, engine hash) -> row, for ``BlockRemoved`` and parents.
- **key tables**, one per medium (int32 slots): key -> its holders. A key one worker holds points at that
  entry's row (the row knows the worker); a key several hold points at a shared row with a bitmask of worker
  slots. A match looks up the request's keys at once (numpy), AND-accumulates their holder masks and reads
  each worker's prefix off where its bit drops out.

The tables store only row numbers: what a slot's key is, the rows say. Single-entry mutations (events carry a
few blocks each) run as scalar code on memoryviews of the arrays; queries over many keys or rows are numpy.

Memory is bounded by ``capacity`` (worker, medium, engine-hash) entries: beyond it the worker holding the most
entries loses its oldest ones, the ones its engine is likeliest to have evicted already.

Engine hashes: vLLM sends uint64 (default) or digest bytes, SGLang signed int64. Ints are kept as int64 (a
uint64 above 2^63 wraps, and comes back unsigned for the worker that sent it); anything else (bytes) is mapped
to int64 by Python's hash, and the original is kept in a side table so that it comes back as it was sent
(a Python object per block again, for digest-sending engines only). Each (worker, medium, hash) entry keeps
its own key: a hash stored on two media with two different keys keeps both (the dict index this replaced kept
the last one for the hash, and could leave the other's holder bit behind).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from router.index.residency import MEDIA, BlockEntry, EngineHash, Medium, PrefixMatch, store_chained
from router.keys import ROOT_KEY

try:  # the store and remove loops' common blocks in C (router/index/_fastcompact.c); the Python loops
    # (_store_blocks, _remove_blocks) do them without it
    from router.index._fastcompact import compact_rows as _compact_rows
    from router.index._fastcompact import forget as _forget_buffers
    from router.index._fastcompact import latest_keys as _latest_keys
    from router.index._fastcompact import rebuild_slots as _rebuild_slots
    from router.index._fastcompact import remove_plain as _remove_plain
    from router.index._fastcompact import store_chain as _store_chain
    from router.index._fastcompact import store_plain as _store_plain
except ImportError:
    _store_plain = _store_chain = _remove_plain = _latest_keys = _rebuild_slots = _compact_rows = None

    def _forget_buffers() -> None:
        return None

_M64 = (1 << 64) - 1
_I64_MIN, _I64_END, _U64_END = -(1 << 63), 1 << 63, 1 << 64
_M32, _MULT32 = (1 << 32) - 1, 0x9E3779B1  # Fibonacci hashing: the slot is the high bits of x * MULT
_LIST_MULT = 0x632BE59BD9B4E019  # spreads the list id over the engine hash
_EMPTY = -1  # an empty table slot; a shared holder row r is stored as -3 - r
_MAX_LOAD = 0.7  # live entries, as a fraction of the slots, before a table is rebuilt larger
_REBUILT_LOAD = 0.55  # (a table grows 1.27x a rebuild; deletions leave no tombstones, so churn rebuilds none)
# the entry rows grow by this when full with fewer than an eighth holes (more: compacted in place), so that under
# steady eviction they stay within 1.13-1.29x the live entries (with 1.25x growth and compaction from a quarter
# holes they settled at 1.6x: 48 B a block against 36 B insert-only)
_ROW_GROWTH = 1.125
_MIN_SLOTS = 64
_PAD = 64  # slots past the home range (see _Table)
_NO_LIST = -1  # an entry row's list when the row is a hole
_U64 = np.uint64
# A store of this many blocks or more goes through numpy (below, scalar code is faster): measured crossover
# about 400-500 blocks for lists of Python ints (what the event feed hands over; a numpy call costs about a
# microsecond or more here, and converting the lists costs too), far lower for arrays and ranges.
_BULK = 512
_BULK_ARRAYS = 32
_INT_ONLY = frozenset({int})
_WINDOW = np.arange(8)  # slots a vectorised probe reads per key and round


def _home(x: int, size: int) -> int:
    """The home slot of int64 ``x`` in a table of ``size`` home slots: the two halves folded, then Fibonacci
    hashing in 32 bits (small ints all the way; ``_homes`` is the same for arrays)."""
    return ((((x ^ (x >> 32)) & _M32) * _MULT32) & _M32) * size >> 32


def _homes(x: np.ndarray, size: int) -> np.ndarray:
    u = x.view(_U64)
    folded = (u ^ (u >> _U64(32))) & _U64(_M32)
    return (((folded * _U64(_MULT32)) & _U64(_M32)) * _U64(size) >> _U64(32)).astype(np.int64)


def _ehash_probe(lst: int, v: int) -> int:
    return v ^ _wrap64(lst * _LIST_MULT)


def _wrap64(x: int) -> int:
    """``x`` modulo 2^64, as a signed int64."""
    return ((x + _I64_END) & _M64) - _I64_END


def _int64(value: int) -> int | None:
    """An int in int64 or uint64 range as int64 (a uint64 above 2^63 wraps); None when neither."""
    if _I64_MIN <= value < _I64_END:
        return value
    if _I64_END <= value < _U64_END:
        return value - _U64_END
    return None


def _array64(values: Sequence[int]) -> tuple[np.ndarray, bool]:
    """Python ints (int64 or uint64 range) as an int64 array (uint64 wrapped), and whether any was a uint64
    above 2^63. Raises OverflowError (an int beyond both) or TypeError (not ints)."""
    if isinstance(values, np.ndarray):  # (numpy casts arrays without range checks: by dtype, then)
        if values.dtype == np.uint64:
            arr = values.view(np.int64)
            return arr, bool((arr < 0).any())
        if values.dtype.kind not in "iu":
            raise TypeError(f"{values.dtype} is not an integer dtype")
        return values.astype(np.int64), False
    try:  # block keys are uint64
        arr = np.asarray(values, dtype=np.uint64).view(np.int64)
        return arr, bool(len(arr)) and bool((arr < 0).any())
    except OverflowError:
        pass
    return np.asarray(values, dtype=np.int64), False  # engine hashes may be signed (SGLang)


class _Table:
    """Open addressing with linear probing over int32 slots holding row numbers (the owner knows each row's
    probe key). A deletion leaves no tombstone (``vacate``): under steady eviction a table keeps its size and
    load, and is rebuilt only to grow. Keys hash into the first ``homes`` slots; a few more follow them, so
    that a rebuild can place every run of keys without wrapping."""

    __slots__ = ("homes", "limit", "mv", "slots", "used")

    def __init__(self, homes: int = _MIN_SLOTS) -> None:
        self.homes = homes
        self.slots = np.full(homes + _PAD, _EMPTY, np.int32)
        self.mv = memoryview(self.slots)
        self.used = 0  # live entries
        self.limit = int(homes * _MAX_LOAD)

    def needs_room(self, extra: int) -> bool:
        return self.used + extra > self.limit

    def vacate(self, pos: int, home_of: Callable[[int], int]) -> None:
        """Empty slot ``pos`` without a tombstone (deletion for linear probing, Knuth's Algorithm R): each later
        entry of the run, up to the next empty slot, moves back into the hole unless its home lies cyclically
        after the hole, so every entry stays reachable from its home with no empty slot on the way.
        ``home_of``: an entry's home slot, from its value. The reference of ``_fastcompact.c``'s ``vacate``."""
        mv, size = self.mv, len(self.mv)
        hole = j = pos
        while True:
            j += 1
            if j == size:
                j = 0
            val = mv[j]
            if val == _EMPTY:
                break
            if (j - home_of(val)) % size >= (j - hole) % size:  # its home is at or before the hole
                mv[hole] = val
                hole = j
        mv[hole] = _EMPTY
        self.used -= 1

    def rebuild(self, live: int, extra: int, probes: np.ndarray, values: np.ndarray) -> None:
        """Reinsert ``values`` (their probe keys ``probes``) into a table sized for ``live + extra``."""
        homes = max(_MIN_SLOTS, int((live + extra) / _REBUILT_LOAD) + 1)
        _forget_buffers()  # (the compiled loops' open buffers of the slots this replaces: freed with them)
        self.homes, self.slots = homes, np.full(homes + _PAD, _EMPTY, np.int32)
        self.mv, self.used, self.limit = memoryview(self.slots), 0, int(homes * _MAX_LOAD)
        if _rebuild_slots is not None and _rebuild_slots(self.slots, np.ascontiguousarray(probes, np.int64),
                                                         np.ascontiguousarray(values, np.int32), homes):
            self.used = len(values)  # (router/index/_fastcompact.c: the placement below, a radix sort in C)
            return
        home = _homes(probes, homes)
        order = np.argsort(home, kind="stable")
        home = home[order]
        # inserted in home order, each key takes the slot after the previous one's or its home, the later
        step = np.arange(len(home))
        pos = np.maximum.accumulate(home - step) + step if len(home) else home
        if len(pos) and pos[-1] >= len(self.slots):  # a run past the padding (never seen): probe in rounds
            self.insert(home, values[order])
            return
        self.slots[pos] = values[order]
        self.used = len(values)

    def insert(self, pos: np.ndarray, values: np.ndarray) -> None:
        """Put ``values`` (absent, each in its own first empty slot from ``pos`` on) in: the first claimant
        of an empty slot takes it, the others move on."""
        slots, size = self.slots, len(self.slots)
        pos = pos.copy()
        todo = np.arange(len(values))
        while todo.size:
            p = pos[todo]
            free = slots[p] == _EMPTY
            p_free = p[free]
            _, first = np.unique(p_free, return_index=True)
            slots[p_free[first]] = values[todo[free][first]]
            placed = np.zeros(todo.size, bool)
            placed[np.flatnonzero(free)[first]] = True
            todo = todo[~placed]
            nxt = pos[todo] + 1
            nxt[nxt == size] = 0
            pos[todo] = nxt
        self.used += len(values)


class CompactKvIndex:
    """Residency of KV blocks across workers, fed by engine events, queried by prefix."""

    def __init__(self, capacity: int = 8_000_000) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self.evicted_entries = 0
        self._entries = 0
        # entry rows
        self._rows = 0  # rows in use, holes included
        self._holes = 0
        self._alloc_rows(256)
        self._ehash = _Table()
        # key -> holders, per medium; shared holder rows: key and a bitmask of worker slots
        self._ktab = [_Table() for _ in MEDIA]
        self._words = 1  # 64-bit words per holder mask
        self._s_key = [np.zeros(16, np.int64) for _ in MEDIA]
        self._s_mask = [np.zeros((16, 1), _U64) for _ in MEDIA]
        self._shared_views()
        self._s_rows = [0, 0, 0]
        self._s_free: list[list[int]] = [[], [], []]
        # (slot, medium, key) -> extra entries of that worker and medium holding the same key (rare: only if
        # two engine hashes share our key); lets removal of one keep the key resident.
        self._dup_keys: dict[tuple[int, int, int], int] = {}
        # workers
        self._slot: dict[str, int] = {}  # insertion order: the order ties in eviction go by
        self._owner: dict[int, str] = {}
        self._free_slots: list[int] = []
        self.slot_epoch = 0  # +1 whenever a worker takes or gives up a slot (callers cache slot maps by it)
        self._list_len: list[int] = [0, 0, 0]  # entries per list (slot x 3 + medium)
        self._unsigned: set[int] = set()  # slots that sent uint64 hashes above 2^63 (they come back unsigned)
        self._unsigned_keys = False  # keys above 2^63 seen: keys come back unsigned
        # non-int engine hashes: int64 value -> [original, entries holding it]
        self._originals: dict[int, list] = {}

    # ---- storage -------------------------------------------------------------------------
    def _alloc_rows(self, cap: int) -> None:
        self._e_hash = np.zeros(cap, np.int64)
        self._e_key = np.zeros(cap, np.int64)
        self._e_list = np.full(cap, _NO_LIST, np.int16)
        self._e_count = np.zeros(cap, np.int16)
        self._views()

    def _shared_views(self) -> None:
        """Memoryviews of the shared rows (keys; masks flat, ``words`` per row) for the scalar paths."""
        _forget_buffers()  # (arrays replaced: the compiled loops' open buffers of the old ones go)
        self._s_kv = [memoryview(a) for a in self._s_key]
        self._s_mv = [memoryview(a).cast("B").cast("Q") for a in self._s_mask]

    def _views(self) -> None:
        _forget_buffers()
        self._mh, self._mk = memoryview(self._e_hash), memoryview(self._e_key)
        self._ml, self._mc = memoryview(self._e_list), memoryview(self._e_count)

    def _reserve(self, n: int) -> None:
        """Room for ``n`` more rows and table slots, so that nothing moves while a batch is applied."""
        if self._rows + n > len(self._e_hash):
            live = self._rows - self._holes
            if self._holes * 8 >= self._rows and live + n <= len(self._e_hash):
                self._compact()  # an eighth or more are holes: their room is reused
            else:
                self._grow_rows(max(self._rows + n, int(len(self._e_hash) * _ROW_GROWTH) + 16))
        if self._ehash.needs_room(n):
            rows = self._live_rows()
            lists = self._e_list[rows].astype(np.int64)
            self._ehash.rebuild(len(rows), n, self._e_hash[rows] ^ (lists * np.int64(_LIST_MULT)),
                                rows.astype(np.int32))
        for m in MEDIA:
            if self._ktab[m].needs_room(n):
                self._rebuild_keys(m, n)

    def _live_rows(self) -> np.ndarray:
        return np.flatnonzero(self._e_list[: self._rows] >= 0)

    def _grow_rows(self, cap: int) -> None:
        """Room for ``cap`` rows, every row (holes too) where it was: the tables stay as they are. Growth keeps
        the holes (fewer than an eighth): a copy of the rows costs a few ns each, a compaction also renumbers
        every table slot, so growing by small steps stays cheap and the rows stay close to the live entries."""
        for name in ("_e_hash", "_e_key", "_e_list", "_e_count"):
            old = getattr(self, name)
            new = np.full(cap, _NO_LIST, old.dtype) if name == "_e_list" else np.zeros(cap, old.dtype)
            new[: self._rows] = old[: self._rows]
            setattr(self, name, new)
        self._views()

    def _compact(self) -> None:
        """Squeeze out the holes in place (row order, hence LRU order, kept)."""
        if _compact_rows is not None:  # in place, in C (router/index/_fastcompact.c): the same
            self._rows = _compact_rows(self._e_hash, self._e_key, self._e_list, self._e_count, self._rows,
                                       [t.slots for t in (self._ehash, *self._ktab)])
            self._holes = 0
            return
        rows = self._live_rows()
        remap = np.full(self._rows, -1, np.int64)
        remap[rows] = np.arange(len(rows))
        arrays = (self._e_hash, self._e_key, self._e_list, self._e_count)
        size = len(self._e_hash)
        new = []
        for a in arrays:
            b = np.zeros(size, a.dtype) if a is not self._e_list else np.full(size, _NO_LIST, a.dtype)
            b[: len(rows)] = a[rows]
            new.append(b)
        self._e_hash, self._e_key, self._e_list, self._e_count = new
        self._views()
        self._rows, self._holes = len(rows), 0
        for t in (self._ehash, *self._ktab):
            live = t.slots >= 0
            t.slots[live] = remap[t.slots[live]]

    def _rebuild_keys(self, m: int, extra: int) -> None:
        t = self._ktab[m]
        vals = t.slots[t.slots >= 0]
        shared = t.slots[t.slots <= -3]
        singles = vals.astype(np.int64)
        probes = np.concatenate([self._e_key[singles], self._s_key[m][-3 - shared.astype(np.int64)]])
        t.rebuild(len(probes), extra, probes, np.concatenate([vals, shared]))

    def _widen(self, name: str) -> None:
        """A list id or refcount past int16: that column goes int32 (fleets past 10,922 workers, or counts)."""
        setattr(self, name, getattr(self, name).astype(np.int32))
        self._views()

    # ---- scalar lookups --------------------------------------------------------------------
    def _efind(self, lst: int, v: int) -> tuple[int, int]:
        """(slot, row) of (list, engine hash); row -1 when absent, slot then the first empty one."""
        mv = self._ehash.mv
        size = len(mv)
        pos = _home(_ehash_probe(lst, v), self._ehash.homes)
        mh, ml = self._mh, self._ml
        while True:
            row = mv[pos]
            if row == _EMPTY:
                return pos, -1
            if row >= 0 and mh[row] == v and ml[row] == lst:
                return pos, row
            pos += 1
            if pos == size:
                pos = 0

    def _kfind(self, m: int, k: int) -> tuple[int, int]:
        """(slot, value) of key ``k`` on medium ``m``: a row (one holder), -3 - shared row, or EMPTY."""
        mv = self._ktab[m].mv
        size = len(mv)
        pos = _home(k, self._ktab[m].homes)
        mk, sk = self._mk, self._s_kv[m]
        while True:
            val = mv[pos]
            if val == _EMPTY:
                return pos, val
            if (val >= 0 and mk[val] == k) or (val <= -3 and sk[-3 - val] == k):
                return pos, val
            pos += 1
            if pos == size:
                pos = 0

    def _entry_home(self, row: int) -> int:
        """The hash-table home of entry ``row`` (what ``vacate`` asks of the entries it may move)."""
        return _home(_ehash_probe(self._ml[row], self._mh[row]), self._ehash.homes)

    def _key_homes(self, m: int) -> Callable[[int], int]:
        """The home of a value of medium ``m``'s key table: an entry row's key's, or a shared row's (made for
        each deletion, not kept: a function held by the index that refers to it would keep it from being
        freed until the cyclic collector runs)."""
        mk, sk, homes = self._mk, self._s_kv[m], self._ktab[m].homes

        def home_of(val: int) -> int:
            return _home(mk[val] if val >= 0 else sk[-3 - val], homes)
        return home_of

    # ---- value mapping ---------------------------------------------------------------------
    def _hash_value(self, h: EngineHash, slot: int | None) -> tuple[int, bool]:
        """The int64 an engine hash is kept as, and whether it is not an int (its original must be kept).
        ``slot``: the sending worker, marked unsigned when the hash is a uint64 above 2^63."""
        if type(h) is not int:
            try:
                h = operator.index(h)  # type: ignore[arg-type]
            except TypeError:
                return hash(("kvindex", h)), True
        if _I64_MIN <= h < _I64_END:
            return h, False
        if _I64_END <= h < _U64_END:
            if slot is not None:
                self._unsigned.add(slot)
            return h - _U64_END, False
        return hash(("kvindex", h)), True

    def _key_value(self, key: int) -> int:
        k = _int64(operator.index(key))
        if k is None:
            raise OverflowError(f"block key {key} is not a 64-bit integer")
        if k != key:
            self._unsigned_keys = True
        return k

    def _out_key(self, k: int) -> int:
        return k + _U64_END if k < 0 and self._unsigned_keys else k

    def _out_hash(self, v: int, slot: int) -> EngineHash:
        orig = self._originals.get(v)
        if orig is not None:
            return orig[0]
        return v + _U64_END if v < 0 and slot in self._unsigned else v

    # ---- workers -------------------------------------------------------------------------
    def _worker(self, worker_id: str) -> int:
        slot = self._slot.get(worker_id)
        if slot is None:
            slot = self._free_slots.pop() if self._free_slots else len(self._slot)
            self._slot[worker_id] = slot
            self._owner[slot] = worker_id
            self.slot_epoch += 1
            while len(self._list_len) < 3 * slot + 3:
                self._list_len.append(0)
            if 3 * slot + 2 > np.iinfo(self._e_list.dtype).max:
                self._widen("_e_list")
            if slot >= 64 * self._words:
                words = slot // 64 + 1
                for m in MEDIA:
                    grown = np.zeros((len(self._s_mask[m]), words), _U64)
                    grown[:, : self._words] = self._s_mask[m]
                    self._s_mask[m] = grown
                self._words = words
                self._shared_views()
        return slot

    def workers(self) -> list[str]:
        return list(self._slot)

    def slot_of(self, worker_id: str) -> int | None:
        """The worker's column in ``match_lengths`` and ``blocks_by_slot`` (None: it holds nothing, never did)."""
        return self._slot.get(worker_id)

    def clear_worker(self, worker_id: str) -> int:
        """Forget every block of one worker (AllBlocksCleared, restart, unrecoverable gap)."""
        slot = self._slot.get(worker_id)
        if slot is None:
            return 0
        lists = self._e_list[: self._rows]
        rows = np.flatnonzero((lists >= 3 * slot) & (lists < 3 * slot + 3))
        for row in rows.tolist():
            self._drop_row(row)
        for k in [k for k in self._dup_keys if k[0] == slot]:
            del self._dup_keys[k]
        self._unsigned.discard(slot)
        return len(rows)

    def remove_worker(self, worker_id: str) -> None:
        self.clear_worker(worker_id)
        slot = self._slot.pop(worker_id, None)
        if slot is not None:
            del self._owner[slot]
            self._free_slots.append(slot)
            self.slot_epoch += 1

    # ---- events --------------------------------------------------------------------------
    def key_of(self, worker_id: str, engine_hash: EngineHash) -> int | None:
        """Our key for an engine hash the worker holds (on any medium; the most recently stored if several)."""
        slot = self._slot.get(worker_id)
        if slot is None:
            return None
        found = self.keys_of(worker_id, (engine_hash,))
        return found[0] if found else None

    def keys_of(self, worker_id: str, engine_hashes: Sequence[EngineHash]) -> list[int]:
        """``key_of`` of each hash, the ones the worker holds on no medium left out (the feed asks it for the
        parent of every stored event and the blocks of every GPU removal: the probes in C)."""
        slot = self._slot.get(worker_id)
        if slot is None:
            return []
        if _latest_keys is not None:  # (the hashes as sent, or, where one is not an int64, as kept)
            keys: list[int] | None = _latest_keys(*self._tables(Medium.GPU, 3 * slot), self._list_len, engine_hashes,
                                                  self._unsigned_keys)
            if keys is not None:
                return keys
        lo, hi = _I64_MIN, _I64_END
        values = [h if type(h) is int and lo <= h < hi else self._hash_value(h, None)[0] for h in engine_hashes]
        if _latest_keys is not None:
            return _latest_keys(*self._tables(Medium.GPU, 3 * slot), self._list_len, values,  # type: ignore[no-any-return]
                                self._unsigned_keys)
        lists = tuple(lst for lst in range(3 * slot, 3 * slot + 3) if self._list_len[lst])
        if not lists:
            return []
        found = []
        for v in values:
            best = max(self._efind(lst, v)[1] for lst in lists)
            if best >= 0:
                found.append(self._out_key(self._mk[best]))
        return found

    def store(
        self, worker_id: str, engine_hashes: Sequence[EngineHash], keys: Sequence[int], medium: Medium
    ) -> None:
        """Record blocks stored by a worker (one BlockStored event)."""
        if len(engine_hashes) != len(keys):
            raise ValueError("engine_hashes and keys differ in length")
        slot = self._worker(worker_id)
        bulk = _BULK if type(keys) is list else _BULK_ARRAYS
        if len(keys) >= bulk and self._store_many(slot, engine_hashes, keys, int(medium)):
            if self._entries > self.capacity:
                self._evict()
            return
        m = int(medium)
        self._make_room(len(keys), m)
        if _store_plain is None:
            added = self._store_blocks(slot, m, engine_hashes, keys)
        else:  # the common blocks in C; the first that needs more here, then C again from the next
            added = self._stored_plain(slot, m, engine_hashes, keys, 0)
        self._stored(3 * slot + m, added)

    def store_chain(self, worker_id: str, engine_hashes: Sequence[EngineHash], token_ids: Sequence[int],
                    block_size: int, parent_hash: EngineHash | None, medium: Medium) -> bool:
        """One BlockStored event from its tokens (``KvIndex.store_chain``): the parent's key, the chained keys,
        the store; False, storing nothing, for an orphan. The feed's common event in one compiled call
        (router/index/_fastcompact.c: ``store_chain``); token ids that are not uint32 raise as ``chain_keys``."""
        slot = self._slot.get(worker_id)
        n = len(engine_hashes)
        if _store_chain is not None and slot is not None and n < _BULK:  # (a long event: the numpy store)
            m = int(medium)
            self._make_room(n, m)
            lst = 3 * slot + m
            done = _store_chain(*self._tables(m, lst), self._list_len, engine_hashes, token_ids, block_size,
                                parent_hash, ROOT_KEY, self._rows, self._unsigned_keys)
            if done is not None:
                stop, self._rows, added, wide, keys = done
                if keys is None:
                    return False
                self._took_plain(m, added, wide)
                if stop < n:
                    added += self._stored_plain(slot, m, engine_hashes, keys, stop, handed_back=True)
                self._stored(lst, added)
                return True
        return store_chained(self, worker_id, engine_hashes, token_ids, block_size, parent_hash, medium)

    def _make_room(self, n: int, m: int) -> None:
        ehash, ktab = self._ehash, self._ktab[m]
        if self._rows + n > len(self._e_hash) or ehash.used + n > ehash.limit or ktab.used + n > ktab.limit:
            self._reserve(n)  # (the common event has room: checked here without the calls)

    def _took_plain(self, m: int, added: int, wide: bool) -> None:
        """What a compiled store loop's ``added`` new entries changed (each took a slot in both tables)."""
        self._ktab[m].used += added
        self._ehash.used += added
        if wide:
            self._unsigned_keys = True

    def _stored_plain(self, slot: int, m: int, engine_hashes: Sequence[EngineHash], keys: Sequence[int], start: int,
                      handed_back: bool = False) -> int:
        """The blocks from ``start`` on, the common ones in C, each one it hands back in Python, then C again from
        the next (``handed_back``: block ``start`` itself was handed back already). Returns the new entries."""
        n, lst, added = len(keys), 3 * slot + m, 0
        while True:
            if handed_back:
                added += self._store_blocks(slot, m, engine_hashes[start : start + 1], keys[start : start + 1])
                start += 1
            stop, self._rows, plain, wide = _store_plain(*self._tables(m, lst), engine_hashes, keys, start,
                                                         self._rows)
            self._took_plain(m, plain, wide)
            added += plain
            if stop < 0:  # a key that is not a uint64: all of the rest in Python (it raises or maps them)
                return added + self._store_blocks(slot, m, engine_hashes[start:], keys[start:])
            if stop >= n:
                return added
            start, handed_back = stop, True

    def _stored(self, lst: int, added: int) -> None:
        self._list_len[lst] += added
        self._entries += added
        if self._entries > self.capacity:
            self._evict()

    def _tables(self, m: int, lst: int) -> tuple:
        """What the compiled loops work on, in place (router/index/_fastcompact.c: ``Tables``): the hash table and
        medium ``m``'s key table, the entry rows, ``m``'s shared keys, the tables' homes, list ``lst``'s probe
        spread and ``lst`` itself. Read afresh for each call: the arrays are replaced when they grow or widen."""
        ktab, ehash = self._ktab[m], self._ehash
        return (ehash.slots, ktab.slots, self._e_hash, self._e_key, self._e_list, self._e_count, self._s_key[m],
                ehash.homes, ktab.homes, ((lst * _LIST_MULT + _I64_END) & _M64) - _I64_END, lst)  # (_wrap64)

    def _store_blocks(self, slot: int, m: int, engine_hashes: Sequence[EngineHash], keys: Sequence[int]) -> int:
        """The store loop in Python (room reserved by the caller): every case, and the reference of the C loop
        (router/index/_fastcompact.c), which hands it the blocks it does not take. Returns the new entries."""
        lo, hi = _I64_MIN, _I64_END
        mapped = [(h, False) if type(h) is int and lo <= h < hi else self._hash_value(h, slot) for h in engine_hashes]
        top = _U64_END
        ks = [(k if k < hi else k - top) if type(k) is int and 0 <= k < top else self._key_value(k) for k in keys]
        if not self._unsigned_keys and any(k < 0 for k in ks):  # (a negative key passed as such sets nothing)
            self._unsigned_keys = any(type(k) is int and k >= hi for k in keys)
        n = len(ks)
        lst = 3 * slot + m
        # the loop below is _efind, _append and _hold inlined (one function call per block costs more than
        # the rest of the block's work)
        mh, mk, ml, mc = self._mh, self._mk, self._ml, self._mc
        et, kt = self._ehash.mv, self._ktab[m].mv
        esize, ksize = len(et), len(kt)
        ehome, khome = self._ehash.homes, self._ktab[m].homes
        spread = _wrap64(lst * _LIST_MULT)
        m32, mult, empty = _M32, _MULT32, _EMPTY  # (locals: the loop runs once per block)
        ktab, sk = self._ktab[m], self._s_kv[m]
        rows = self._rows  # (written back before any call that reads it)
        added = keys_added = 0
        for i in range(n):
            v, other = mapped[i]
            x = v ^ spread
            pos = ((((x ^ (x >> 32)) & m32) * mult) & m32) * ehome >> 32
            while True:
                row = et[pos]
                if row == empty or (row >= 0 and mh[row] == v and ml[row] == lst):
                    break
                pos += 1
                if pos == esize:
                    pos = 0
            if row >= 0:  # stored again: one more copy, moved to the end (most recently stored)
                self._rows = rows
                self._store_again(row, pos, m)
                rows = self._rows
                mh, mk, ml, mc = self._mh, self._mk, self._ml, self._mc  # (a count may have widened)
                continue
            k = ks[i]
            new = rows
            mh[new], mk[new], ml[new], mc[new] = v, k, lst, 1
            rows = new + 1
            et[pos] = new
            added += 1
            kpos = ((((k ^ (k >> 32)) & m32) * mult) & m32) * khome >> 32
            while True:
                val = kt[kpos]
                if val == empty:
                    kt[kpos] = new
                    keys_added += 1
                    break
                if (val >= 0 and mk[val] == k) or (val <= -3 and sk[-3 - val] == k):
                    self._rows = rows
                    self._hold(m, slot, k, new)  # others hold it too: a shared row
                    sk = self._s_kv[m]  # (the shared rows may have grown)
                    break
                kpos += 1
                if kpos == ksize:
                    kpos = 0
            if other:
                orig = self._originals.get(v)
                if orig is None:
                    self._originals[v] = [engine_hashes[i], 1]
                else:
                    orig[1] += 1
        self._rows = rows
        ktab.used += keys_added
        self._ehash.used += added
        return added

    def _store_again(self, row: int, pos: int, m: int) -> None:
        """A hash the list holds stored again (hash-table slot ``pos``): one more copy, moved to the end."""
        count = self._mc[row] + 1
        if count > np.iinfo(self._e_count.dtype).max:
            self._widen("_e_count")
        k, lst = self._mk[row], self._ml[row]
        new = self._append(self._mh[row], k, lst, count)
        self._ehash.mv[pos] = new
        kpos, val = self._kfind(m, k)
        if val == row:
            self._ktab[m].mv[kpos] = new
        self._ml[row] = _NO_LIST
        self._holes += 1

    def _store_many(self, slot: int, engine_hashes: Sequence[EngineHash], keys: Sequence[int], m: int) -> bool:
        """``store`` in numpy, for a batch of int hashes none of which the list holds yet (a worker's bulk
        load, a snapshot, a long prompt); False, with nothing changed, when the batch is not such a batch."""
        for seq in (engine_hashes, keys):  # (the types of a list's items gathered in C: no bytecode per block)
            if not (isinstance(seq, range | np.ndarray) or set(map(type, seq)) <= _INT_ONLY):
                return False
        try:
            v, wrapped = _array64(engine_hashes)
            k, keys_wrapped = _array64(keys)
        except (OverflowError, TypeError, ValueError):
            return False
        n = len(v)
        if v.ndim != 1 or k.shape != v.shape:
            return False
        if len(np.unique(v)) != n:
            return False
        lst = 3 * slot + m
        self._reserve(n)
        found, epos = self._efind_many(lst, v)
        if (found != _EMPTY).any():
            return False
        if wrapped:
            self._unsigned.add(slot)
        if keys_wrapped:
            self._unsigned_keys = True
        r0 = self._rows
        rows = np.arange(r0, r0 + n, dtype=np.int32)
        self._e_hash[r0 : r0 + n] = v
        self._e_key[r0 : r0 + n] = k
        self._e_list[r0 : r0 + n] = lst
        self._e_count[r0 : r0 + n] = 1
        self._rows = r0 + n
        self._ehash.insert(epos, rows)
        vals, kpos = self._kfind_many(m, k)
        absent = np.flatnonzero(vals == _EMPTY)
        _, first = np.unique(k[absent], return_index=True)  # a key twice in the batch: its first row holds it
        new = absent[first]
        self._ktab[m].insert(kpos[new], rows[new])
        rest = np.ones(n, bool)
        rest[new] = False
        for i in np.flatnonzero(rest).tolist():  # keys others hold already: shared rows
            self._hold(m, slot, int(k[i]), r0 + i)
        self._list_len[lst] += n
        self._entries += n
        return True

    def _append(self, v: int, k: int, lst: int, count: int) -> int:
        row = self._rows
        self._mh[row], self._mk[row], self._ml[row], self._mc[row] = v, k, lst, count
        self._rows = row + 1
        return row

    def _hold(self, m: int, slot: int, k: int, row: int) -> None:
        """Entry ``row`` (worker ``slot``) holds key ``k`` on medium ``m``."""
        t = self._ktab[m]
        pos, val = self._kfind(m, k)
        if val == _EMPTY:
            t.mv[pos] = row
            t.used += 1
            return
        if val >= 0:  # a second holder: the key moves to a shared row
            r = self._alloc_shared(m, k)
            first = self._ml[val] // 3
            self._set_bit(m, r, first)
            t.mv[pos] = -3 - r
        else:
            r = -3 - val
        i, bit = r * self._words + (slot >> 6), 1 << (slot & 63)
        masks = self._s_mv[m]
        if masks[i] & bit:
            dup = (slot, m, k)
            self._dup_keys[dup] = self._dup_keys.get(dup, 0) + 1
        else:
            masks[i] |= bit

    def _set_bit(self, m: int, r: int, slot: int) -> None:
        self._s_mv[m][r * self._words + (slot >> 6)] |= 1 << (slot & 63)

    def _alloc_shared(self, m: int, k: int) -> int:
        free = self._s_free[m]
        if free:
            r = free.pop()
        else:
            r = self._s_rows[m]
            if r == len(self._s_key[m]):
                grow = max(16, r // 2)
                self._s_key[m] = np.concatenate([self._s_key[m], np.zeros(grow, np.int64)])
                self._s_mask[m] = np.concatenate([self._s_mask[m], np.zeros((grow, self._words), _U64)])
                self._shared_views()
            self._s_rows[m] = r + 1
        self._s_key[m][r] = k
        self._s_mask[m][r] = 0
        return r

    def remove(self, worker_id: str, engine_hashes: Iterable[EngineHash], medium: Medium) -> int:
        """Apply a BlockRemoved; returns how many hashes were unknown to the index."""
        slot = self._slot.get(worker_id)
        if slot is None:
            return sum(1 for _ in engine_hashes)
        if _remove_plain is None:
            return self._remove_blocks(slot, medium, engine_hashes)
        hashes = (engine_hashes if type(engine_hashes) is list or isinstance(engine_hashes, Sequence)
                  else list(engine_hashes))  # (a list first: an ABC's isinstance costs as much as a block)
        m, n = int(medium), len(hashes)
        lst = 3 * slot + m
        unknown = start = 0
        while True:  # the common blocks in C; the first that needs more here, then C again from the next
            stop, missing, dropped = _remove_plain(*self._tables(m, lst), hashes, start, bool(self._originals))
            unknown += missing
            if dropped:
                self._holes += dropped
                self._list_len[lst] -= dropped
                self._entries -= dropped
                self._ehash.used -= dropped
                self._ktab[m].used -= dropped
            if stop >= n:
                return unknown
            unknown += self._remove_blocks(slot, medium, hashes[stop : stop + 1])
            start = stop + 1

    def _remove_blocks(self, slot: int, medium: Medium, engine_hashes: Iterable[EngineHash]) -> int:
        """The remove loop in Python: every case, and the reference of the C loop (router/index/_fastcompact.c),
        which hands it the blocks it does not take. Returns how many hashes were unknown."""
        lst = 3 * slot + int(medium)
        unknown = 0
        lo, hi = _I64_MIN, _I64_END
        et, mh, mk, ml, mc = self._ehash.mv, self._mh, self._mk, self._ml, self._mc
        esize, ehome, spread = len(et), self._ehash.homes, _wrap64(lst * _LIST_MULT)
        m = int(medium)
        kt, sk = self._ktab[m].mv, self._s_kv[m]
        ksize, khome = len(kt), self._ktab[m].homes
        m32, mult, empty, no_list = _M32, _MULT32, _EMPTY, _NO_LIST
        key_home = self._key_homes(m)  # (no removal here replaces the arrays it reads)
        dropped = 0
        for h in engine_hashes:  # _efind inlined, as in ``store``
            v = h if type(h) is int and lo <= h < hi else self._hash_value(h, None)[0]
            x = v ^ spread
            pos = ((((x ^ (x >> 32)) & m32) * mult) & m32) * ehome >> 32
            while True:
                row = et[pos]
                if row == empty or (row >= 0 and mh[row] == v and ml[row] == lst):
                    break
                pos += 1
                if pos == esize:
                    pos = 0
            if row < 0:
                unknown += 1
                continue
            if mc[row] > 1:
                mc[row] -= 1
                continue
            # _drop_row inlined for its common case, a key this entry alone holds (the call costs as much)
            k = mk[row]
            kpos = ((((k ^ (k >> 32)) & m32) * mult) & m32) * khome >> 32
            while True:
                val = kt[kpos]
                if val == empty or (val >= 0 and mk[val] == k) or (val <= -3 and sk[-3 - val] == k):
                    break
                kpos += 1
                if kpos == ksize:
                    kpos = 0
            if val >= 0 and not self._originals:
                self._ehash.vacate(pos, self._entry_home)
                self._ktab[m].vacate(kpos, key_home)
                ml[row] = no_list
                dropped += 1
            else:
                self._drop_row(row, pos)
        if dropped:
            self._holes += dropped
            self._list_len[lst] -= dropped
            self._entries -= dropped
        return unknown

    def _drop_row(self, row: int, pos: int | None = None) -> None:
        """Forget entry ``row`` whatever its count (its table slot ``pos``, when the caller found it)."""
        lst, v, k = self._ml[row], self._mh[row], self._mk[row]
        if pos is None:
            pos = self._efind(lst, v)[0]
        self._ehash.vacate(pos, self._entry_home)
        self._ml[row] = _NO_LIST
        self._holes += 1
        self._list_len[lst] -= 1
        self._entries -= 1
        if self._originals:
            orig = self._originals.get(v)
            if orig is not None:
                orig[1] -= 1
                if not orig[1]:
                    del self._originals[v]
        slot, m = divmod(lst, 3)
        kpos, val = self._kfind(m, k)
        t = self._ktab[m]
        if val >= 0:
            t.vacate(kpos, self._key_homes(m))
            return
        dup = (slot, m, k)
        extra = self._dup_keys.get(dup)
        if extra:
            if extra == 1:
                del self._dup_keys[dup]
            else:
                self._dup_keys[dup] = extra - 1
            return
        r, words = -3 - val, self._words
        masks, base = self._s_mv[m], (-3 - val) * words
        masks[base + (slot >> 6)] &= ~(1 << (slot & 63))
        if not any(masks[base + j] for j in range(words)):
            t.vacate(kpos, self._key_homes(m))
            self._s_free[m].append(r)

    def _evict(self) -> None:
        """Shed the oldest entries of the biggest workers until 1% below capacity (amortised)."""
        target = self.capacity - max(1, self.capacity // 100)
        lens = self._list_len
        while self._entries > target:
            slot = max(self._slot.values(), key=lambda s: lens[3 * s] + lens[3 * s + 1] + lens[3 * s + 2])
            medium = max(MEDIA, key=lambda m: lens[3 * slot + m])
            lst = 3 * slot + medium
            excess = min(lens[lst], self._entries - target)
            rows = np.flatnonzero(self._e_list[: self._rows] == lst)[:excess]
            for row in rows.tolist():
                self._drop_row(row)
            self.evicted_entries += len(rows)

    # ---- snapshots -----------------------------------------------------------------------
    def export_worker(self, worker_id: str) -> list[BlockEntry]:
        """One worker's whole residency, per medium in the index's own LRU order (oldest first): what a
        snapshot must carry so that ``import_worker`` rebuilds the same state (refcounts and order included)."""
        slot = self._slot.get(worker_id)
        if slot is None:
            return []
        out = []
        for m in MEDIA:
            rows = self._rows_of(3 * slot + m)
            for v, k, c in zip(self._e_hash[rows].tolist(), self._e_key[rows].tolist(),
                               self._e_count[rows].tolist(), strict=True):
                out.append(BlockEntry(m, self._out_hash(v, slot), self._out_key(k), c))
        return out

    def import_worker(self, worker_id: str, entries: Iterable[BlockEntry]) -> None:
        """Replace one worker's residency with ``entries`` (as ``export_worker`` gave them)."""
        self.clear_worker(worker_id)
        for e in entries:
            for _ in range(e.count):
                self.store(worker_id, (e.engine_hash,), (e.key,), e.medium)

    def _rows_of(self, lst: int) -> np.ndarray:
        if not self._list_len[lst]:
            return np.zeros(0, np.int64)
        return np.flatnonzero(self._e_list[: self._rows] == lst)

    # ---- queries -------------------------------------------------------------------------
    def __len__(self) -> int:
        """Resident (worker, medium, engine hash) entries."""
        return self._entries

    @property
    def nbytes(self) -> int:
        """Bytes held in the index's arrays (its Python dicts of workers and rare cases aside)."""
        arrays = [self._e_hash, self._e_key, self._e_list, self._e_count, self._ehash.slots,
                  *(t.slots for t in self._ktab), *self._s_key, *self._s_mask]
        return sum(a.nbytes for a in arrays)

    def blocks_held(self, worker_id: str) -> dict[Medium, int]:
        slot = self._slot.get(worker_id)
        if slot is None:
            return {m: 0 for m in MEDIA}
        return {m: self._list_len[3 * slot + m] for m in MEDIA}

    def blocks_held_on(self, worker_id: str, medium: Medium) -> int:
        slot = self._slot.get(worker_id)
        return 0 if slot is None else self._list_len[3 * slot + medium]

    def blocks_by_slot(self, medium: Medium) -> np.ndarray:
        """``blocks_held_on`` of every worker at once, by slot (``slot_of``)."""
        return np.array(self._list_len[medium::3], dtype=np.int64)

    def resident_keys(self, worker_id: str) -> dict[Medium, set[int]]:
        """Every key a worker holds, per medium (for tests and debugging; O(blocks))."""
        slot = self._slot.get(worker_id)
        if slot is None:
            return {m: set() for m in MEDIA}
        return {m: {self._out_key(k) for k in self._e_key[self._rows_of(3 * slot + m)].tolist()} for m in MEDIA}

    def engine_hashes(self, worker_id: str) -> dict[Medium, set[EngineHash]]:
        """Every engine hash a worker holds, per medium (for tests and debugging)."""
        slot = self._slot.get(worker_id)
        if slot is None:
            return {m: set() for m in MEDIA}
        return {m: {self._out_hash(v, slot) for v in self._e_hash[self._rows_of(3 * slot + m)].tolist()}
                for m in MEDIA}

    def holds(self, worker_id: str, key: int, medium: Medium = Medium.GPU) -> bool:
        slot = self._slot.get(worker_id)
        k = _int64(key)
        if slot is None or k is None:
            return False
        _, val = self._kfind(int(medium), k)
        if val >= 0:
            return self._ml[val] // 3 == slot
        if val <= -3:
            return bool(self._s_mask[medium][-3 - val, slot >> 6] >> _U64(slot & 63) & _U64(1))
        return False

    def match(self, keys: Sequence[int]) -> dict[str, PrefixMatch]:
        """Each worker's longest consecutive prefix of ``keys`` (from block 0), by tier.

        Workers with no matched block are absent from the result.
        """
        slots, gpu, cpu, storage = self.match_lengths(keys)
        owner = self._owner
        return {owner[s]: PrefixMatch(g, c, st)
                for s, g, c, st in zip(slots.tolist(), gpu.tolist(), cpu.tolist(), storage.tolist(), strict=True)}

    def match_lengths(self, keys: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``match`` as arrays: the slots (``slot_of``) of the workers with a matched block, and their
        GPU / CPU / storage blocks (a decision over a thousand workers reads them without a dict of them)."""
        none = np.zeros(0, np.int64)
        n = len(keys)
        if not n or not self._entries:
            return none, none, none, none
        tiered = any(self._ktab[m].used for m in (Medium.CPU, Medium.STORAGE))
        tiers = 3 if tiered else 1
        first = _int64(operator.index(keys[0]))
        if first is None or all(self._kfind(m, first)[1] == _EMPTY for m in range(tiers)):
            return none, none, none, none  # nobody holds block 0 (a cold prompt): no numpy at all
        words = self._words
        carry = np.full((tiers, words), _M64, _U64)  # every slot alive before block 0
        lengths = np.zeros((tiers, 64 * words), np.int64)
        karr = _array64(keys)[0]
        start, chunk = 0, 256
        while start < n:
            stop = min(n, start + chunk)
            masks = self._holder_masks(karr[start:stop], tiers)
            alive = np.bitwise_and.accumulate(np.concatenate([carry[:, None, :], masks], axis=1), axis=1)
            for tier in range(tiers):  # a slot's bit drops out at the first block it misses: that is its length
                cum = alive[tier]
                dropped = cum[:-1] & ~cum[1:]
                rows, cols = np.nonzero(dropped)
                if rows.size:
                    bits = np.unpackbits(dropped[rows, cols].view(np.uint8).reshape(-1, 8), axis=1,
                                         bitorder="little")
                    which, bit = np.nonzero(bits)
                    lengths[tier, cols[which] * 64 + bit] = start + rows[which]
            carry = alive[:, -1, :]
            start = stop
            if not carry[tiers - 1].any():
                break
            chunk = n  # (most requests end inside the first chunk)
        else:  # still alive after the last block: the whole request
            for tier in range(tiers):
                bits = np.unpackbits(carry[tier].view(np.uint8), bitorder="little")
                lengths[tier, np.flatnonzero(bits)] = n
        total = lengths[tiers - 1]
        slots = np.flatnonzero(total)
        if not tiered:
            return slots, total[slots], np.zeros(len(slots), np.int64), np.zeros(len(slots), np.int64)
        g, c = lengths[0, slots], lengths[1, slots]
        return slots, g, c - g, total[slots] - c

    def _holder_masks(self, karr: np.ndarray, tiers: int) -> np.ndarray:
        """(tiers, keys, words) holder bitmasks: GPU; GPU or CPU; any medium (cumulative over the media)."""
        out = np.zeros((tiers, len(karr), self._words), _U64)
        for m in range(tiers):
            vals = self._kfind_many(m, karr)[0]
            held = out[m]
            one = np.flatnonzero(vals >= 0)
            if one.size:
                slots = (self._e_list[vals[one]] // 3).astype(np.int64)
                held[one, slots >> 6] = _U64(1) << (slots & 63).astype(_U64)
            many = np.flatnonzero(vals <= -3)
            if many.size:
                held[many] = self._s_mask[m][-3 - vals[many]]
            if m:
                held |= out[m - 1]
        return out

    def _kfind_many(self, m: int, karr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``_kfind`` for every key at once: (values, slots)."""
        e_key, s_key = self._e_key, self._s_key[m]

        def same(vals: np.ndarray, idx: np.ndarray) -> np.ndarray:
            probe_key = np.where(vals >= 0, e_key.take(np.maximum(vals, 0)), s_key.take(np.maximum(-3 - vals, 0)))
            return ((vals >= 0) | (vals <= -3)) & (probe_key == karr[idx])

        return _probe(self._ktab[m], karr, same)

    def _efind_many(self, lst: int, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``_efind`` for every hash of one list at once: (rows or EMPTY, slots)."""
        e_hash, e_list = self._e_hash, self._e_list

        def same(vals: np.ndarray, idx: np.ndarray) -> np.ndarray:
            rows = np.maximum(vals, 0)
            return (vals >= 0) & (e_hash.take(rows) == v[idx]) & (e_list.take(rows) == lst)

        return _probe(self._ehash, v ^ np.int64(_wrap64(lst * _LIST_MULT)), same)


def _probe(t: _Table, probes: np.ndarray, same) -> tuple[np.ndarray, np.ndarray]:  # type: ignore[no-untyped-def]
    """Vectorised linear probing: per probe key, the value of the slot ``same`` accepts (EMPTY: none) and that
    slot (else the first empty one). Home slots first (most probes end there), then a window of slots per
    probe and round for the rest."""
    slots, size = t.slots, len(t.slots)
    pos = _homes(probes, t.homes)
    val = slots.take(pos)
    if not t.used:
        return val, pos
    todo = np.flatnonzero((val != _EMPTY) & ~same(val, np.arange(len(probes))))
    while todo.size:  # the first accepted or empty slot in a window ends a probe
        win = pos[todo, None] + _WINDOW
        win[win >= size] -= size
        w = slots.take(win)
        hit = same(w, todo[:, None])
        stop = hit | (w == _EMPTY)
        ended = stop.any(axis=1)
        first = stop.argmax(axis=1)
        done, r, f = todo[ended], np.flatnonzero(ended), first[ended]
        val[done] = np.where(hit[r, f], w[r, f], _EMPTY)
        pos[done] = win[r, f]
        todo = todo[~ended]
        pos[todo] = (pos[todo] + len(_WINDOW)) % size
    return val, pos
