"""The index against a brute-force model, plus eviction and per-tier matching."""

from array import array
from collections import defaultdict
from contextlib import contextmanager, nullcontext

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.index import MEDIA, CompactKvIndex, KvIndex, Medium, PrefixMatch, compact, residency, speculative

KEYS = 12  # a small key space so different hashes share keys and prefixes overlap
WORKERS = ["a", "b", "c"]
# every test runs on both layouts: one API, one behaviour
LAYOUTS = pytest.mark.parametrize("Index", [KvIndex, CompactKvIndex], ids=["dicts", "compact"])


def key_of(h: int) -> int:
    return h % KEYS


class ModelIndex:
    """Obvious and slow: per worker and medium, a refcount per engine hash."""

    def __init__(self):
        self.refs = defaultdict(lambda: defaultdict(int))  # (worker, medium) -> hash -> count

    def store(self, w, hashes, m):
        for h in hashes:
            self.refs[w, m][h] += 1

    def remove(self, w, hashes, m):
        for h in hashes:
            if self.refs[w, m].get(h):
                self.refs[w, m][h] -= 1
                if not self.refs[w, m][h]:
                    del self.refs[w, m][h]

    def clear(self, w):
        for m in MEDIA:
            self.refs[w, m].clear()

    def held(self, w, m):
        return {key_of(h) for h, c in self.refs[w, m].items() if c > 0}

    def match(self, keys):
        out = {}
        for w in WORKERS:
            sets = [self.held(w, m) for m in MEDIA]
            tiers = [sets[0], sets[0] | sets[1], sets[0] | sets[1] | sets[2]]
            lens = []
            for s in tiers:
                n = 0
                while n < len(keys) and keys[n] in s:
                    n += 1
                lens.append(n)
            if lens[2]:
                out[w] = PrefixMatch(lens[0], lens[1] - lens[0], lens[2] - lens[1])
        return out


worker = st.sampled_from(WORKERS)
medium = st.sampled_from(list(Medium))
hashes = st.lists(st.integers(0, 40), min_size=1, max_size=6)
op = st.one_of(
    st.tuples(st.just("store"), worker, hashes, medium),
    st.tuples(st.just("store"), worker, hashes, st.just(Medium.GPU)),
    st.tuples(st.just("remove"), worker, hashes, medium),
    st.tuples(st.just("clear"), worker, st.just([]), st.just(Medium.GPU)),
    st.tuples(st.just("drop_worker"), worker, st.just([]), st.just(Medium.GPU)),
)


@LAYOUTS
@settings(max_examples=300, deadline=None)
@given(st.lists(op, max_size=40), st.lists(st.lists(st.integers(0, KEYS - 1), max_size=8), min_size=1, max_size=4))
def test_random_interleavings_agree_with_brute_force(Index, ops, queries):
    check_against_model(Index(), ops, queries)


@LAYOUTS
@settings(max_examples=300, deadline=None)
@given(st.lists(op, max_size=40), st.lists(st.lists(st.integers(0, KEYS - 1), max_size=8), min_size=1, max_size=4))
def test_the_index_without_its_compiled_loops_agrees_too(Index, ops, queries):
    """The Python loops (the reference, and what runs where the package was built without a C compiler) against
    the model, and the compiled ones against them: the same entries, copies and LRU order (``export_worker``)."""
    assert None not in compiled_loops(), "router.index._fastdicts or _fastcompact not built"
    fast = Index()
    check_against_model(fast, ops, queries)
    with python_loops():
        python = Index()
        check_against_model(python, ops, queries)
    for w in WORKERS:
        assert fast.export_worker(w) == python.export_worker(w)


def compiled_loops():
    return (residency._store_new, residency._store_chain, residency._remove_plain, residency._gpu_prefix,
            residency._keys_of, compact._store_plain, compact._remove_plain, compact._latest_keys,
            compact._rebuild_slots, compact._compact_rows, compact._store_chain)


@contextmanager
def python_loops():
    """Both layouts' Python loops instead of their compiled ones (router/index/_fastdicts.c, _fastcompact.c)."""
    saved = compiled_loops()
    residency._store_new = residency._store_chain = residency._remove_plain = residency._gpu_prefix = None
    residency._keys_of = None
    compact._store_plain = compact._remove_plain = compact._latest_keys = compact._rebuild_slots = None
    compact._compact_rows = compact._store_chain = None
    try:
        yield
    finally:
        (residency._store_new, residency._store_chain, residency._remove_plain, residency._gpu_prefix,
         residency._keys_of, compact._store_plain, compact._remove_plain, compact._latest_keys,
         compact._rebuild_slots, compact._compact_rows, compact._store_chain) = saved


def check_against_model(index, ops, queries) -> None:
    """Apply ``ops`` to ``index`` and to the brute-force model; every query matches the same, every worker
    holds the same engine hashes."""
    model = ModelIndex()
    for kind, w, hs, m in ops:
        if kind == "store":
            index.store(w, hs, [key_of(h) for h in hs], m)
            model.store(w, hs, m)
        elif kind == "remove":
            index.remove(w, hs, m)
            model.remove(w, hs, m)
        elif kind == "clear":
            index.clear_worker(w)
            model.clear(w)
        else:
            index.remove_worker(w)
            model.clear(w)
        for q in queries:
            want = model.match(q)
            assert index.match(q) == want
            # the array form: by the index's slots, the same matches
            slots, g, c, s = index.match_lengths(q)
            owner = {index.slot_of(x): x for x in index.workers()}
            assert {owner[i]: PrefixMatch(a, b, d) for i, a, b, d in
                    zip(slots.tolist(), g.tolist(), c.tolist(), s.tolist(), strict=True)} == want
    by_slot = {m: index.blocks_by_slot(m) for m in MEDIA}
    for w in WORKERS:
        assert index.blocks_held(w) == {m: len(model.refs[w, m]) for m in MEDIA}
        slot = index.slot_of(w)
        if slot is not None:
            assert {m: int(by_slot[m][slot]) for m in MEDIA} == index.blocks_held(w)
        assert index.engine_hashes(w) == {m: set(model.refs[w, m]) for m in MEDIA}
    assert len(index) == sum(len(r) for r in model.refs.values())


@LAYOUTS
def test_removal_resolves_through_engine_hash_and_counts_unknown(Index):
    index = Index()
    index.store("a", [101, 102], [1, 2], Medium.GPU)
    assert index.remove("a", [999], Medium.GPU) == 1
    assert index.remove("a", [102], Medium.GPU) == 0
    assert index.match([1, 2]) == {"a": PrefixMatch(gpu=1)}
    assert index.key_of("a", 101) == 1 and index.key_of("a", 102) is None


@LAYOUTS
def test_same_hash_stored_twice_needs_two_removals(Index):
    index = Index()
    index.store("a", [7], [70], Medium.GPU)
    index.store("a", [7], [70], Medium.GPU)
    index.remove("a", [7], Medium.GPU)
    assert index.holds("a", 70)
    index.remove("a", [7], Medium.GPU)
    assert not index.holds("a", 70)


@LAYOUTS
def test_a_hash_on_two_media_under_two_keys_releases_each_mediums_own_key(Index):
    """Each (medium, engine hash) entry keeps the key it was stored with: removing it from one medium drops that
    medium's holder bit and no other (one shared hash -> key map per worker dropped the wrong one)."""
    index = Index()
    index.store("a", [5], [1], Medium.GPU)
    index.store("a", [5], [2], Medium.CPU)
    assert index.resident_keys("a") == {Medium.GPU: {1}, Medium.CPU: {2}, Medium.STORAGE: set()}
    assert index.remove("a", [5], Medium.GPU) == 0
    assert not index.holds("a", 1, Medium.GPU) and index.holds("a", 2, Medium.CPU)
    assert index.match([1]) == {} and index.match([2]) == {"a": PrefixMatch(gpu=0, cpu=1)}
    assert index.key_of("a", 5) == 2


@LAYOUTS
def test_copies_and_shared_keys_survive_a_removal_of_one(Index):
    """The rare cases the removal loop leaves to its slow path: a hash with two copies, two hashes under one key."""
    index = Index()
    index.store("a", [1, 2, 3], [10, 20, 20], Medium.GPU)  # hashes 2 and 3 share key 20
    index.store("a", [1], [10], Medium.GPU)  # a second copy of hash 1
    assert index.remove("a", [1, 2, 9], Medium.GPU) == 1
    assert index.holds("a", 10) and index.holds("a", 20)
    assert index.export_worker("a")[0].count == 1
    assert index.remove("a", [1, 3], Medium.GPU) == 0
    assert not index.holds("a", 10) and not index.holds("a", 20) and len(index) == 0


@LAYOUTS
def test_tiers_split_the_prefix_by_cheapest_medium(Index):
    index = Index()
    index.store("a", [1, 2], [10, 11], Medium.GPU)
    index.store("a", [3], [12], Medium.CPU)
    index.store("a", [4], [13], Medium.STORAGE)
    index.store("b", [5, 6, 7, 8], [10, 11, 12, 13], Medium.CPU)
    m = index.match([10, 11, 12, 13, 14])
    assert m["a"] == PrefixMatch(gpu=2, cpu=1, storage=1)
    assert m["b"] == PrefixMatch(gpu=0, cpu=4, storage=0)
    assert m["a"].total == 4


@LAYOUTS
def test_capacity_bounds_memory_by_evicting_oldest_of_the_biggest_worker(Index):
    index = Index(capacity=100)
    index.store("small", range(10), range(1000, 1010), Medium.GPU)
    index.store("big", range(100, 200), range(100), Medium.GPU)  # pushes past capacity
    assert len(index) <= 100
    assert index.blocks_held("small")[Medium.GPU] == 10  # the small worker keeps everything
    assert index.evicted_entries >= 10
    assert not index.holds("big", 0)  # oldest gone ...
    assert index.holds("big", 99)  # ... newest kept
    assert index.match(list(range(1000, 1010)))["small"].gpu == 10


@LAYOUTS
def test_worker_slots_are_reused_without_leaking_old_residency(Index):
    index = Index()
    index.store("a", [1], [5], Medium.GPU)
    index.remove_worker("a")
    index.store("b", [2], [6], Medium.GPU)  # takes a's slot
    assert index.match([5]) == {}
    assert index.match([6]) == {"b": PrefixMatch(gpu=1)}


@LAYOUTS
def test_export_import_worker_rebuilds_refcounts_and_lru_order(Index):
    src = Index()
    src.store("w", [1, 2, 3], [11, 12, 13], Medium.GPU)
    src.store("w", [2], [12], Medium.GPU)  # stored twice: count 2, and now the most recent
    src.store("w", [9], [19], Medium.CPU)
    src.store("other", [1], [11], Medium.GPU)
    exported = src.export_worker("w")
    assert [(e.medium, e.engine_hash, e.key, e.count) for e in exported] == [
        (Medium.GPU, 1, 11, 1), (Medium.GPU, 3, 13, 1), (Medium.GPU, 2, 12, 2), (Medium.CPU, 9, 19, 1)]
    dst = Index()
    dst.store("w", [7], [17], Medium.GPU)  # replaced, not merged
    dst.import_worker("w", exported)
    assert dst.export_worker("w") == exported
    assert dst.resident_keys("w") == src.resident_keys("w")
    dst.remove("w", [2], Medium.GPU)  # one of its two copies: still held
    assert dst.holds("w", 12)
    assert src.export_worker("nobody") == []


@LAYOUTS
def test_residency_digest_is_order_independent_and_sees_counts_and_media(Index):
    from router.index.digest import residency_digest

    a, b = Index(), Index()
    a.store("w", [1, 2], [11, 12], Medium.GPU)
    b.store("w", [2], [12], Medium.GPU)
    b.store("w", [1], [11], Medium.GPU)
    assert residency_digest(a, "w") == residency_digest(b, "w")
    b.store("w", [1], [11], Medium.GPU)  # a second copy
    assert residency_digest(a, "w") != residency_digest(b, "w")
    c = Index()
    c.store("w", [1, 2], [11, 12], Medium.CPU)
    assert residency_digest(a, "w") != residency_digest(c, "w")


@settings(max_examples=200, deadline=None)
@given(st.integers(65, 1500), st.data())
def test_wide_fleets_read_drop_masks_as_words_as_bit_by_bit(width, data):
    """A match over more than 64 workers reads the walk's drop masks as 64-bit words (numpy); the bit-by-bit
    reading narrow fleets use says the same slots, lengths and order."""
    slots = data.draw(st.permutations(range(width)))[: data.draw(st.integers(0, width))]
    cuts = sorted(data.draw(st.lists(st.integers(0, len(slots)), max_size=12)))
    events = []
    for n, (a, b) in enumerate(zip([0, *cuts], [*cuts, len(slots)], strict=True)):
        if b > a:
            events.append((sum(1 << s for s in slots[a:b]), n + 1))
    wide = residency._drop_lengths(events, width)
    bits = residency._drop_lengths_by_bit(events)
    assert wide[0].tolist() == bits[0].tolist() and wide[1].tolist() == bits[1].tolist()


@pytest.mark.skipif(residency._gpu_prefix is None, reason="the compiled loops did not build here")
@settings(max_examples=300, deadline=None)
@given(st.sampled_from([1, 5, 63, 64, 65, 130, 1000]), st.data())
def test_the_compiled_gpu_walk_equals_the_python_walk(width, data):
    """The compiled match walk (holder masks read as 64-bit words) against the Python walk and its reading of
    the drop masks, on any holders: masks with holes (a worker holding a block without the one before), empty
    masks, blocks nobody holds."""
    n = data.draw(st.integers(0, 30))
    keys = list(range(1000, 1000 + n))
    holders = {}
    for k in keys:
        kind = data.draw(st.sampled_from(["absent", "empty", "dense", "sparse"]))
        if kind == "empty":
            holders[k] = 0
        elif kind != "absent":
            draw = st.integers(0, (1 << width) - 1)
            holders[k] = data.draw(draw) | (((1 << width) - 1) if kind == "dense" else 0) & data.draw(draw)
    slots, lengths = residency._gpu_prefix(holders, keys, width)
    want = residency._drop_lengths(KvIndex()._walk_gpu_only(keys, holders), width)
    assert np.frombuffer(slots, dtype=np.int64).tolist() == want[0].tolist()
    assert np.frombuffer(lengths, dtype=np.int64).tolist() == want[1].tolist()


@pytest.mark.skipif(speculative._compiled_walk is None, reason="the compiled loops did not build here")
@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 12), st.floats(0, 5), st.booleans()),
                max_size=12), st.integers(0, 12), st.floats(0, 8))
def test_the_compiled_speculative_walk_equals_the_python_walk(records, length, now):
    """Records of prefixes to workers at various times (some taken back, some expired by ``now``): the compiled
    walk answers each worker's prefix exactly as the Python loop does."""
    keys = [10_000 + i for i in range(12)]
    prefixes = speculative.SpeculativePrefixes(ttl_s=2.0)
    for worker, n, at, undone in records:
        undo = prefixes.record(worker, keys[:n], at)
        if undone and undo is not None:
            undo()
    compiled = prefixes.match(keys[:length], now)
    saved, speculative._compiled_walk = speculative._compiled_walk, None
    try:
        assert compiled == prefixes.match(keys[:length], now)
    finally:
        speculative._compiled_walk = saved


@pytest.mark.skipif(residency._gpu_prefix is None, reason="the compiled loops did not build here")
@pytest.mark.parametrize("width", [64, 130, 1000])
def test_the_compiled_gpu_walk_refuses_a_mask_wider_than_the_slots(width):
    """A holder mask with a bit past the slots' words is an error, not a silently truncated mask (the in-place
    reading of an int's digits checks each digit, including one whose bits straddle the last word)."""
    words = (width + 63) // 64
    for bit in (64 * words, 64 * words + 40):
        with pytest.raises(OverflowError):
            residency._gpu_prefix({1: 1 << bit}, [1, 2], width)
    slots, lengths = residency._gpu_prefix({1: 1 << (64 * words - 1)}, [1], width)  # the last bit of the words
    assert np.frombuffer(slots, dtype=np.int64).tolist() == [64 * words - 1]
    assert np.frombuffer(lengths, dtype=np.int64).tolist() == [1]


@pytest.mark.parametrize("Index, loops", [(KvIndex, nullcontext), (KvIndex, python_loops),
                                          (CompactKvIndex, nullcontext), (CompactKvIndex, python_loops)],
                         ids=["dicts", "dicts-python-loops", "compact", "compact-python-loops"])
@pytest.mark.parametrize("tiered", [False, True])
def test_a_wide_fleet_matches_as_a_narrow_one(Index, loops, tiered):
    """Past 64 workers (the dict layout's numpy reading of masks or its compiled walk, the compact layout's extra
    mask words): the same matches as the model's, GPU only and over all three tiers."""
    with loops():
        check_wide_fleet(Index(), tiered)


def check_wide_fleet(index, tiered: bool) -> None:
    keys = list(range(100, 140))
    want = {}
    for j in range(150):
        g, c = j % 7, j % 11
        index.store(f"w{j}", range(1000 * j, 1000 * j + g), keys[:g], Medium.GPU)
        if not tiered:
            if g:
                want[f"w{j}"] = PrefixMatch(g)
            continue
        index.store(f"w{j}", range(1000 * j + 100, 1000 * j + 100 + c), keys[g:g + c], Medium.CPU)
        index.store(f"w{j}", [1000 * j + 200], keys[g + c:g + c + 1], Medium.STORAGE)
        want[f"w{j}"] = PrefixMatch(g, c, 1)
    assert index.match(keys) == want
    assert index.match(keys[:3]) == {w: PrefixMatch(min(m.gpu, 3), min(m.cpu, 3 - min(m.gpu, 3)),
                                                    min(m.storage, 3 - min(m.gpu + m.cpu, 3))) for w, m in want.items()}


any_hash = st.one_of(st.integers(0, 40), st.integers(2**63 - 2, 2**63 + 2), st.integers(-(2**63), -(2**63) + 2),
                     st.integers(-5, -1), st.binary(min_size=1, max_size=2), st.booleans())
any_key = st.one_of(st.integers(0, KEYS - 1), st.integers(2**64 - 3, 2**64 - 1), st.integers(2**63 - 1, 2**63 + 1))


@LAYOUTS
@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["store", "remove"]), worker, st.lists(st.tuples(any_hash, any_key),
                                                                                    min_size=1, max_size=6), medium),
                max_size=25))
def test_the_compiled_loops_hand_back_every_kind_of_hash_and_key(Index, ops):
    """Hashes the compiled loops do not take (uint64 above 2^63, negative, digest bytes, bools) and keys above
    2^63, mixed with plain ones in one event: the compiled and the Python loops leave the same index."""
    def run(index):
        for kind, w, blocks, m in ops:
            hashes = [h for h, _ in blocks]
            if kind == "store":
                index.store(w, hashes, [k for _, k in blocks], m)
            else:
                index.remove(w, hashes, m)
        queries = [[k for _, k in blocks] for _, _, blocks, _ in ops]
        every = [h for _, _, blocks, _ in ops for h, _ in blocks]
        for w in WORKERS:  # keys_of is key_of of each, the ones held nowhere left out
            assert index.keys_of(w, every) == [k for h in every if (k := index.key_of(w, h)) is not None]
        return ({w: index.export_worker(w) for w in WORKERS}, [index.match(q) for q in queries],
                {w: index.engine_hashes(w) for w in WORKERS},
                [index.key_of(w, h) for h in every for w in WORKERS], [index.keys_of(w, every) for w in WORKERS])

    fast = run(Index())
    with python_loops():
        python = run(Index())
    assert fast == python


# one BlockStored from its tokens: a chain of hashes per worker, parents that may be known, unknown or on CPU
chain_event = st.tuples(
    st.sampled_from(["store", "remove"]), worker,
    st.lists(st.integers(0, 30), min_size=1, max_size=4),  # engine hashes (repeats: stored again)
    st.one_of(st.none(), st.integers(0, 30)),  # parent hash
    st.sampled_from([Medium.GPU, Medium.GPU, Medium.CPU]),
    st.integers(0, 3),  # token seed: few distinct blocks, so workers share keys
)


@LAYOUTS
@settings(max_examples=300, deadline=None)
@given(st.lists(chain_event, max_size=30), st.sampled_from([4, 16, 64]), st.sampled_from(["list", "I", "q"]))
def test_store_chain_is_key_of_then_chain_keys_then_store(Index, events, block_size, token_kind):
    """``store_chain`` (each layout's one compiled call for a BlockStored, on a list of token ints or a buffer of
    uint32s; block sizes of 4 and 64 tokens and int64 tokens fall outside it) leaves the index that its parts
    leave, composed in Python: the same entries, copies, LRU order and orphans."""
    def run(index, fused):
        orphans = []
        for kind, w, hashes, parent, m, seed in events:
            if kind == "remove":
                index.remove(w, hashes, m)
                continue
            tokens = [(seed * 7919 + i * (h + 1)) % 50_000 for h in hashes for i in range(block_size)]
            if token_kind != "list":  # uint32s as the simulated engine sends them; int64s, which C must not read
                tokens = array(token_kind, tokens)
            if fused:
                orphans.append(index.store_chain(w, hashes, tokens, block_size, parent, m))
            else:
                orphans.append(residency.store_chained(index, w, hashes, tokens, block_size, parent, m))
        return orphans, {w: index.export_worker(w) for w in WORKERS}, len(index)

    fused = run(Index(), True)
    assert fused == run(Index(), False)
    with python_loops():
        assert fused == run(Index(), True)


@LAYOUTS
@pytest.mark.parametrize("loops", ["compiled", "python"])
def test_store_chain_fails_in_the_order_its_parts_do(Index, loops):
    """An orphan is an orphan before its tokens or its length are looked at; bad tokens fail before a length
    that differs from the hashes': as ``key_of``, ``chain_keys`` and ``store`` one after the other."""
    with python_loops() if loops == "python" else nullcontext():
        index = Index()
        index.store_chain("a", [1], [5] * 16, 16, None, Medium.GPU)
        assert index.store_chain("a", [4, 5], list(range(16)), 16, 999, Medium.GPU) is False
        with pytest.raises(OverflowError):
            index.store_chain("a", [4, 5], [1] * 15 + [1 << 32], 16, 1, Medium.GPU)
        with pytest.raises(ValueError):
            index.store_chain("a", [4, 5], list(range(16)), 16, 1, Medium.GPU)
        assert index.engine_hashes("a")[Medium.GPU] == {1} and len(index) == 1


@LAYOUTS
@pytest.mark.parametrize("tokens", [[1] * 15 + [1 << 32], [1] * 15 + [-1], [1] * 15 + ["x"]],
                         ids=["past-uint32", "negative", "not-an-int"])
def test_store_chain_refuses_bad_tokens_before_storing_anything(Index, tokens):
    """As ``chain_keys`` raises on them (the feed counts the event malformed), with nothing stored."""
    index = Index()
    index.store_chain("a", [1], [5] * 16, 16, None, Medium.GPU)
    with pytest.raises((OverflowError, TypeError)):
        index.store_chain("a", [2, 3], [7] * 16 + tokens, 16, 1, Medium.GPU)
    assert index.engine_hashes("a")[Medium.GPU] == {1} and len(index) == 1
