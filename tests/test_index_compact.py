"""The compact index's own paths: the numpy bulk store against the brute-force model, the hash kinds engines
send (uint64 above 2^63, signed int64, bytes digests), table growth and compaction, wide fleets, and the
array form of a match."""

import random
from contextlib import nullcontext

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.index import CompactKvIndex as KvIndex
from router.index import Medium, PrefixMatch, compact
from tests.test_index import check_against_model, op, python_loops


@settings(max_examples=200, deadline=None)
@given(st.lists(op, max_size=40), st.lists(st.lists(st.integers(0, 11), max_size=8), min_size=1, max_size=4))
def test_bulk_store_agrees_with_brute_force(ops, queries):
    """Every store of two blocks or more takes the numpy path (normally only long batches do)."""
    saved = compact._BULK
    compact._BULK = 2
    try:
        check_against_model(KvIndex(), ops, queries)
    finally:
        compact._BULK = saved


@pytest.mark.parametrize("bulk", [False, True])
def test_engine_hashes_come_back_as_sent(bulk, monkeypatch):
    if bulk:
        monkeypatch.setattr(compact, "_BULK", 2)
    index = KvIndex()
    vllm = [(1 << 64) - 1, (1 << 63) + 5, 7]  # uint64, two above 2^63
    sglang = [-(1 << 63), -5, 9]  # signed int64
    digests = [b"\x01" * 32, b"\x02" * 32, b"short"]
    index.store("vllm", vllm, [(1 << 64) - 10, 11, 12], Medium.GPU)
    index.store("sglang", sglang, [20, 21, 22], Medium.GPU)
    index.store("digest", digests, [30, 31, 32], Medium.CPU)
    assert index.engine_hashes("vllm")[Medium.GPU] == set(vllm)
    assert index.engine_hashes("sglang")[Medium.GPU] == set(sglang)
    assert index.engine_hashes("digest")[Medium.CPU] == set(digests)
    assert index.resident_keys("vllm")[Medium.GPU] == {(1 << 64) - 10, 11, 12}
    assert index.key_of("vllm", (1 << 63) + 5) == 11 and index.key_of("sglang", -5) == 21
    assert index.key_of("digest", b"short") == 32 and index.key_of("digest", b"other") is None
    assert index.match([(1 << 64) - 10, 11]) == {"vllm": PrefixMatch(gpu=2)}
    exported = index.export_worker("digest")
    assert [e.engine_hash for e in exported] == digests
    assert index.remove("digest", digests[:2], Medium.CPU) == 0
    assert index.engine_hashes("digest")[Medium.CPU] == {b"short"}
    assert index.remove("sglang", [-5, -6], Medium.GPU) == 1


def test_growth_and_compaction_keep_lru_order_and_lookups():
    """Far past the first table and row sizes, with holes from removals and hashes stored again."""
    index = KvIndex()
    n = 20_000
    index.store("a", range(n), range(10_000, 10_000 + n), Medium.GPU)  # bulk
    for h in range(0, n, 3):  # holes
        index.remove("a", [h], Medium.GPU)
    for h in range(1, 200, 3):  # stored again: moves to the end
        index.store("a", [h], [10_000 + h], Medium.GPU)
    index.store("b", range(n, 2 * n), range(10_000, 10_000 + n), Medium.GPU)  # all shared with a
    kept = [h for h in range(n) if h % 3]
    order = [e.engine_hash for e in index.export_worker("a")]
    again = [h for h in range(1, 200, 3)]
    assert order == [h for h in kept if h not in set(again)] + again
    assert index.blocks_held("a")[Medium.GPU] == len(kept)
    assert index.key_of("a", 4) == 10_004 and index.key_of("a", 3) is None
    assert index.match(list(range(10_000, 10_010))) == {"b": PrefixMatch(gpu=10)}  # a lost block 0
    assert index.match(list(range(10_001, 10_003))) == {"a": PrefixMatch(gpu=2), "b": PrefixMatch(gpu=2)}
    index.clear_worker("b")
    assert index.match([10_001, 10_002]) == {"a": PrefixMatch(gpu=2)}
    assert len(index) == len(kept)


def test_a_wide_fleet_matches_across_mask_words():
    """More than 64 workers: holder masks span several words, and ranks beyond the first word match."""
    index = KvIndex()
    keys = list(range(100, 140))
    for j in range(150):
        held = keys[: j % 41]
        index.store(f"w{j}", range(1000 * j, 1000 * j + len(held)), held, Medium.GPU if j % 2 else Medium.CPU)
    got = index.match(keys)
    want = {}
    for j in range(150):
        held = j % 41
        if held:
            want[f"w{j}"] = PrefixMatch(gpu=held) if j % 2 else PrefixMatch(gpu=0, cpu=held)
    assert got == want
    slots, gpu, cpu, storage = index.match_lengths(keys)
    assert {index.workers()[s]: (g, c) for s, g, c in zip(slots, gpu, cpu, strict=True)} == {
        w: (p.gpu, p.cpu) for w, p in want.items()}
    assert not storage.any()


def test_eviction_on_bulk_stores_takes_the_biggest_workers_oldest():
    index = KvIndex(capacity=1000)
    index.store("small", range(100), range(5000, 5100), Medium.GPU)
    index.store("big", range(100, 1100), range(1000), Medium.GPU)
    assert len(index) <= 1000 and index.blocks_held("small")[Medium.GPU] == 100
    assert not index.holds("big", 0) and index.holds("big", 999)


def test_memory_per_block_is_flat_arrays():
    index = KvIndex(capacity=1 << 30)
    rng = np.random.default_rng(1)
    for j in range(64):
        keys = rng.integers(0, 1 << 63, 2000).tolist()
        index.store(f"w{j}", range(2000 * j, 2000 * (j + 1)), keys, Medium.GPU)
    assert index.nbytes / len(index) <= 40


@pytest.mark.parametrize("loops", ["compiled", "python"])
def test_steady_eviction_keeps_memory_flat_and_rebuilds_no_table(loops):
    """Engines evicting as fast as they store (16 workers, 16-block events in, each worker's oldest 16 out): the
    tables are never rebuilt (deletions leave no tombstones) and the rows stay within the holes' budget, so a
    resident block costs what it cost when the index filled, and still under 40 B."""
    rng = random.Random(5)
    with python_loops() if loops == "python" else nullcontext():
        index = KvIndex(capacity=1 << 30)
        held: dict[str, list[list[int]]] = {f"w{j}": [] for j in range(16)}
        h = 0

        def store(w: str) -> None:
            nonlocal h
            hashes = list(range(h, h + 16))
            h += 16
            index.store(w, hashes, [rng.getrandbits(64) for _ in hashes], Medium.GPU)
            held[w].append(hashes)

        for w in held:
            for _ in range(125):  # 2,000 blocks each
                store(w)
        filled = index.nbytes / len(index)
        tables = [t.slots for t in (index._ehash, *index._ktab)]
        worst = 0.0
        for _ in range(3):  # every block replaced three times over
            for _ in range(125):
                for w in held:
                    store(w)
                    index.remove(w, held[w].pop(0), Medium.GPU)
                    worst = max(worst, index.nbytes / len(index))
        assert all(t.slots is s for t, s in zip((index._ehash, *index._ktab), tables, strict=True))
        assert len(index) == 16 * 2000 and index._rows <= len(index._e_hash) <= 1.29 * len(index)
        assert worst <= 40.0 and worst <= filled * 1.15, (filled, worst)
        assert index.match(index.keys_of("w3", held["w3"][0])) == {"w3": PrefixMatch(gpu=16)}


def test_numpy_arrays_store_as_their_python_ints_would():
    """A batched caller (the simulator) may hand arrays: uint64 above 2^63 comes back unsigned, int64 signed."""
    a, b = KvIndex(), KvIndex()
    hashes = np.array([(1 << 63) + i for i in range(40)], dtype=np.uint64)
    keys = np.arange(40, dtype=np.uint64) + np.uint64(1 << 63)
    a.store("w", hashes, keys, Medium.GPU)
    b.store("w", [int(h) for h in hashes], [int(k) for k in keys], Medium.GPU)
    assert a.export_worker("w") == b.export_worker("w")
    a.store("s", np.arange(-40, 0, dtype=np.int64), np.arange(40, dtype=np.int64), Medium.GPU)
    assert a.engine_hashes("s")[Medium.GPU] == set(range(-40, 0))
    assert a.match([int(k) for k in keys[:3]]) == {"w": PrefixMatch(gpu=3)}


@pytest.mark.parametrize("bad", [2**64, -1, "7"])
def test_a_store_with_a_key_that_is_not_a_uint64_fails_whole(bad):
    """A key past 64 bits fails the event before any of its blocks is stored (the compiled loop leaves the whole
    event to the Python one when a key is not a plain uint64); a negative int64 key is stored as such."""
    index = KvIndex()
    index.store("w", [1], [10], Medium.GPU)
    if bad == -1:
        index.store("w", [2, 3], [11, bad], Medium.GPU)
        assert index.match([10]) == {"w": PrefixMatch(1)} and len(index) == 3
        return
    with pytest.raises((OverflowError, TypeError)):
        index.store("w", [2, 3], [11, bad], Medium.GPU)
    assert len(index) == 1 and index.engine_hashes("w")[Medium.GPU] == {1}


def test_the_compiled_loops_never_write_through_arrays_the_index_replaced(monkeypatch):
    """The compiled loops keep their arrays' buffers open between calls, found again by the arrays' identity:
    with the index's releases of them turned off, events that grow, compact and rebuild every array still leave
    exactly the index the Python loops leave, to the tables' slots."""
    monkeypatch.setattr(compact, "_forget_buffers", lambda: None)
    rng = random.Random(3)
    ops, live = [], {w: [] for w in ("a", "b", "c")}
    for n in range(600):
        w = rng.choice("abc")
        m = rng.choice([Medium.GPU, Medium.GPU, Medium.CPU])
        if live[w] and rng.random() < 0.4:
            for _ in range(min(len(live[w]), rng.randint(1, 8))):
                h, stored_on = live[w].pop(rng.randrange(len(live[w])))
                ops.append(("remove", w, [h], None, stored_on))
        else:
            hashes = [n * 100 + i for i in range(rng.randint(1, 16))]
            live[w] += [(h, m) for h in hashes]
            ops.append(("store", w, hashes, [rng.getrandbits(64) if rng.random() < 0.8 else h % 50 for h in hashes], m))

    def run():
        index = KvIndex()
        for kind, w, hashes, keys, m in ops:
            if kind == "store":
                index.store(w, hashes, keys, m)
            else:
                index.remove(w, hashes, m)
        tables = [t.slots.tolist() for t in (index._ehash, *index._ktab)]  # (deletions move entries: alike)
        return {w: index.export_worker(w) for w in "abc"}, len(index), tables

    fast = run()
    with python_loops():
        assert run() == fast


@pytest.mark.parametrize("loops", ["compiled", "python"])
def test_a_hash_stored_and_removed_over_and_over_leaves_the_tables_as_they_were(loops):
    """A hot block evicted and recomputed again and again: a deletion leaves no tombstone, so the tables come
    back to the very slots they had (no rebuild, no longer probes, their use counting live entries only)."""
    with python_loops() if loops == "python" else nullcontext():
        index = KvIndex()
        index.store("a", list(range(100)), list(range(1000, 1100)), Medium.GPU)
        tables = (index._ehash.slots, index._ktab[Medium.GPU].slots)
        before = (tables[0].copy(), tables[1].copy())
        for _ in range(3 * len(tables[0])):
            index.store("a", [7777], [5555], Medium.GPU)
            index.remove("a", [7777], Medium.GPU)
        assert index._ehash.slots is tables[0] and index._ktab[Medium.GPU].slots is tables[1]  # (no rebuild)
        assert np.array_equal(tables[0], before[0]) and np.array_equal(tables[1], before[1])
        assert (index._ehash.used, index._ktab[Medium.GPU].used) == (100, 100)
        assert index.match(list(range(1000, 1100))) == {"a": PrefixMatch(gpu=100)} and len(index) == 100


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32), st.integers(1, 300), st.sampled_from([3, 17, 64, 1000]))
def test_a_deletion_keeps_every_other_entry_reachable_from_its_home(seed, n, spread):
    """``_Table.vacate`` (deletion without tombstones) on crowded tables, runs wrapping past the end included:
    after any sequence of deletions every remaining value is found by probing from its home with no empty slot
    on the way, the deleted ones are gone, and ``used`` counts what is left."""
    rng = np.random.default_rng(seed)
    t = compact._Table(homes=max(8, int(n / 0.7) + 1))
    size = len(t.slots)
    home = {v: int(rng.integers(0, spread)) % t.homes if spread < 1000 else int(rng.integers(0, t.homes))
            for v in range(n)}
    if rng.random() < 0.5:  # some runs that wrap: homes at the table's end
        home = {v: (t.homes - 1 - h % 3) if v % 2 else h for v, h in home.items()}
    for v in range(n):  # insert by linear probing from each home
        p = home[v]
        while t.slots[p] != compact._EMPTY:
            p = (p + 1) % size
        t.slots[p] = v
        t.used += 1
    live = set(range(n))
    for v in rng.permutation(n)[: int(rng.integers(0, n + 1))].tolist():
        t.vacate(int(np.flatnonzero(t.slots == v)[0]), home.__getitem__)
        live.discard(v)
        assert t.used == len(live)
    assert set(t.slots[t.slots >= 0].tolist()) == live
    for v in live:
        p = home[v]
        while t.slots[p] != v:
            assert t.slots[p] != compact._EMPTY, f"{v} unreachable from its home {home[v]}"
            p = (p + 1) % size


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 3000), st.integers(0, 2**16), st.sampled_from([0, 1, 8, 2**20]), st.integers(0, 40))
def test_the_compiled_rebuild_places_every_value_as_the_numpy_one_does(n, seed, spread, crowd):
    """``_Table.rebuild`` with its placement in C (router/index/_fastcompact.c: ``rebuild_slots``) and with the
    numpy reference: the same slots, also for probe keys crowded onto few homes (``spread`` 0: all on one, so
    the run passes the padding and both insert in rounds) and for tables past 65,536 homes (two radix passes)."""
    rng = np.random.default_rng(seed)
    probes = (rng.integers(-2**63, 2**63 - 1, n, dtype=np.int64) if spread == 2**20
              else rng.integers(0, spread + 1, n, dtype=np.int64) * np.int64(crowd + 1))
    values = rng.permutation(max(n, 1))[:n].astype(np.int32)
    extra = int(rng.integers(0, 2**17)) if seed % 3 == 0 else 5  # some tables of more than 65,536 homes
    built = compact._Table()
    built.rebuild(n, extra, probes, values)
    saved, compact._rebuild_slots = compact._rebuild_slots, None
    try:
        reference = compact._Table()
        reference.rebuild(n, extra, probes, values)
    finally:
        compact._rebuild_slots = saved
    assert saved is not None, "router.index._fastcompact not built"
    assert built.homes == reference.homes and built.used == reference.used == n
    assert np.array_equal(built.slots, reference.slots)


def test_a_run_past_the_padding_is_placed_in_rounds_either_way():
    """Probe keys whose homes are all the last slot: the run passes the padding, ``rebuild_slots`` writes
    nothing and says so, and the table is filled by ``insert`` (wrapping to the start) as without it."""
    n, extra = 200, 5
    homes = max(compact._MIN_SLOTS, int((n + extra) / compact._REBUILT_LOAD) + 1)
    last = next(x for x in range(10**6) if compact._home(x, homes) == homes - 1)
    probes, values = np.full(n, last, np.int64), np.arange(n, dtype=np.int32)
    slots = np.full(homes + compact._PAD, compact._EMPTY, np.int32)
    assert compact._rebuild_slots(slots, probes, values, homes) is False
    assert (slots == compact._EMPTY).all()
    built = compact._Table()
    built.rebuild(n, extra, probes, values)
    assert sorted(built.slots[built.slots >= 0].tolist()) == list(range(n))
    assert built.slots[0] >= 0  # wrapped


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**16), st.integers(1, 400), st.booleans())
def test_the_compiled_compaction_leaves_the_arrays_the_numpy_one_does(seed, events, wide):
    """``CompactKvIndex._compact`` in place in C (router/index/_fastcompact.c: ``compact_rows``) and with the
    numpy reference, on the same churned index (stores, removals, CPU copies, a key two workers share; list ids
    widened to int32 when ``wide``): the same rows, tables and answers after."""
    def churned() -> KvIndex:
        rng = random.Random(seed)
        index, live = KvIndex(capacity=10**6), []
        if wide:
            index._widen("_e_list")
        for e in range(events):
            w, n = f"w{rng.randrange(3)}", rng.randrange(1, 9)
            hashes = list(range(e * 16, e * 16 + n))
            keys = [rng.randrange(2**64) if rng.random() < 0.9 else 7 for _ in hashes]
            index.store(w, hashes, keys, Medium.CPU if rng.random() < 0.2 else Medium.GPU)
            live.append((w, hashes))
            if rng.random() < 0.6 and live:
                w2, h2 = live.pop(rng.randrange(len(live)))
                index.remove(w2, h2, Medium.GPU)
        return index

    built, reference = churned(), churned()
    built._compact()
    saved, compact._compact_rows = compact._compact_rows, None
    try:
        reference._compact()
    finally:
        compact._compact_rows = saved
    assert saved is not None, "router.index._fastcompact not built"
    assert (built._rows, built._holes) == (reference._rows, reference._holes)
    for name in ("_e_hash", "_e_key", "_e_list", "_e_count"):
        assert np.array_equal(getattr(built, name), getattr(reference, name)), name
    for a, b in zip((built._ehash, *built._ktab), (reference._ehash, *reference._ktab), strict=True):
        assert np.array_equal(a.slots, b.slots)
    for w in ("w0", "w1", "w2"):
        assert built.export_worker(w) == reference.export_worker(w)
