"""SGLang's KV events (page size 1 by default, or any page size dividing the router's block) re-chunked into
the router's blocks (router/events/rechunk.py), through the real decoder and feed.

Where the frames come from: the ``sglang`` package cannot be imported here (its ``sglang/__init__`` pulls in
torch and its kernels, and its event recorder ``sglang/srt/mem_cache/events.py`` imports the native hash and
kernel modules), and it is not a dependency. So ``MiniSGLang`` below publishes what SGLang 0.5.23's radix
cache publishes, read from its code (``sglang/srt/mem_cache/events.py``: ``KVCacheEventRecorder.record_store``
sends one ``BlockStored`` per page, parent = the previous page, the node's parent's last page, or none at the
root; ``enqueue`` coalesces a chain's pages into one event, older releases did not; ``record_remove`` one
``BlockRemoved`` per radix node; ``cache_salt`` and ``lora_name`` on every event of a salted or adapter node;
``radix_cache.py``: a split node publishes nothing, so a request diverging inside a cached node is stored
with its parent in the middle of the earlier chain), and frames it as SGLang's msgspec structs in
``sglang/srt/disaggregation/kv_events.py`` do (tagged maps, ``omit_defaults``: ``lora_id`` always, ``medium``,
``cache_salt``, ``session_id``, ``lora_name`` only when set; batch ``[ts, events, attn_dp_rank]``).
``GOLDEN_*`` are payloads encoded by those real SGLang 0.5.23 structs (the module loaded from the wheel with
``sglang.srt.runtime_context`` stubbed): the builder here must produce the same bytes. Page hashes follow
SGLang's shape (sha256 chained page by page, salt as the chain's seed, first 8 bytes as a signed int64);
the router never needs to reproduce them.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.events.codec import BlockStored, EventBatch, decode_message, decode_payload
from router.events.feed import IndexFeeder
from router.index import KvIndex
from router.keys import request_keys

B = 16  # the router's block size

# Encoded by sglang 0.5.23's own structs (sglang/srt/disaggregation/kv_events.py):
# KVEventBatch(ts=1.5, events=[BlockStored(block_hashes=[-5, 7], parent_block_hash=None, token_ids=[1, 2],
#   block_size=1, lora_id=None, medium=StorageMedium.GPU, cache_salt="t1"), BlockRemoved(block_hashes=[7],
#   medium="GPU"), AllBlocksCleared()])
GOLDEN_SALTED = bytes.fromhex(
    "93cb3ff80000000000009388a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392fb07b1706172656e74"
    "5f626c6f636b5f68617368c0a9746f6b656e5f696473920102aa626c6f636b5f73697a6501a76c6f72615f6964c0a66d656469"
    "756da3475055aa63616368655f73616c74a2743183a474797065ac426c6f636b52656d6f766564ac626c6f636b5f686173686573"
    "9107a66d656469756da347505581a474797065b0416c6c426c6f636b73436c6561726564c0"
)
# KVEventBatch(ts=2.0, events=[BlockStored(block_hashes=[-2**60, 42], parent_block_hash=9, token_ids=[5, 6, 7, 8],
#   block_size=2, lora_id=None, medium=StorageMedium.CPU, session_id="s", lora_name="ad1")], attn_dp_rank=0)
GOLDEN_LORA = bytes.fromhex(
    "93cb40000000000000009189a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392d3f00000000000000"
    "02ab1706172656e745f626c6f636b5f6861736809a9746f6b656e5f6964739405060708aa626c6f636b5f73697a6502a76c6f72"
    "615f6964c0a66d656469756daa4350555f50494e4e4544aa73657373696f6e5f6964a173a96c6f72615f6e616d65a361643100"
)


# ---- SGLang's frames ---------------------------------------------------------------------------------------

def sg_stored(hashes: list[int], parent: int | None, tokens: list[int], page: int, medium: str | None = "GPU",
              salt: str | None = None, session: str | None = None, lora: str | None = None) -> dict[str, Any]:
    """A ``BlockStored`` map as SGLang's struct encodes it (field order, ``omit_defaults``)."""
    ev: dict[str, Any] = {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": parent,
                          "token_ids": list(tokens), "block_size": page, "lora_id": None}
    for name, value in (("medium", medium), ("cache_salt", salt), ("session_id", session), ("lora_name", lora)):
        if value is not None:
            ev[name] = value
    return ev


def sg_removed(hashes: list[int], medium: str | None = "GPU") -> dict[str, Any]:
    ev: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": list(hashes)}
    if medium is not None:
        ev["medium"] = medium
    return ev


def sg_cleared() -> dict[str, Any]:
    return {"type": "AllBlocksCleared"}


def sg_payload(ts: float, events: list[dict[str, Any]], dp_rank: int | None = 0) -> bytes:
    return msgspec.msgpack.encode([ts, events, dp_rank])


def _int64(hex_digest: str) -> int:
    """SGLang's ``hash_str_to_int64``: the digest's first 8 bytes as a signed int64."""
    u = int(hex_digest[:16], 16)
    return u - (1 << 64) if u >= 1 << 63 else u


class MiniSGLang:
    """The events SGLang's radix cache publishes, page size ``page``: a request's new pages are one chain
    from the last cached page (coalesced into one event, or one event per page as older releases sent)."""

    def __init__(self, page: int = 1, per_page: bool = False) -> None:
        self.page = page
        self.per_page = per_page
        self.parent: dict[int, int | None] = {}  # cached page hash -> its parent page hash
        self.kids: Counter[int | None] = Counter()
        self.events: list[dict[str, Any]] = []  # of the current scheduler step

    def hashes(self, tokens: list[int], salt: str | None = None, lora: str | None = None) -> list[int]:
        prior = ""
        if salt is not None or lora is not None:
            prior = hashlib.sha256(f"sglang-cache-salt-v1\0{salt}\0{lora}".encode()).hexdigest()
        out = []
        for i in range(len(tokens) // self.page):
            page = tokens[i * self.page : (i + 1) * self.page]
            prior = hashlib.sha256(bytes.fromhex(prior) + array("i", page).tobytes()).hexdigest()
            out.append(_int64(prior))
        return out

    def insert(self, tokens: list[int], salt: str | None = None, lora: str | None = None) -> None:
        hs = self.hashes(tokens, salt, lora)
        first = 0
        while first < len(hs) and hs[first] in self.parent:
            first += 1
        parent = hs[first - 1] if first else None
        new, p = hs[first:], self.page
        for h in new:
            self.parent[h] = parent
            self.kids[parent] += 1
            parent = h
        if not new:
            return
        parent = hs[first - 1] if first else None
        toks = tokens[first * p : (first + len(new)) * p]
        if self.per_page:
            for i, h in enumerate(new):
                self.events.append(sg_stored([h], parent, toks[i * p : (i + 1) * p], p, salt=salt, lora=lora))
                parent = h
        else:
            self.events.append(sg_stored(new, parent, toks, p, salt=salt, lora=lora))

    def evict(self, tokens: list[int], pages: int, salt: str | None = None, lora: str | None = None) -> int:
        """Evict up to ``pages`` pages from this request's cached tail, leaves only (as the radix tree does)."""
        hs = self.hashes(tokens, salt, lora)
        held = 0
        while held < len(hs) and hs[held] in self.parent:
            held += 1
        gone: list[int] = []
        while len(gone) < pages and held and not self.kids[hs[held - 1]]:
            held -= 1
            h = hs[held]
            self.kids[self.parent.pop(h)] -= 1
            gone.append(h)
        if gone:
            self.events.append(sg_removed(gone[::-1]))  # a node's pages, in order
        return len(gone)

    def remove_pages(self, hashes: list[int]) -> None:
        """Remove pages whatever their place (not what the radix tree does: for the removal rule)."""
        for h in hashes:
            self.kids[self.parent.pop(h)] -= 1
        self.events.append(sg_removed(hashes))

    def clear(self) -> None:
        self.parent.clear()
        self.kids.clear()
        self.events.append(sg_cleared())

    def cached_blocks(self, tokens: list[int], salt: str | None = None, lora: str | None = None) -> int:
        """Full router blocks of this request the engine holds (its leading cached pages)."""
        held = 0
        for h in self.hashes(tokens, salt, lora):
            if h not in self.parent:
                break
            held += 1
        return held * self.page // B

    def take(self) -> list[dict[str, Any]]:
        events, self.events = self.events, []
        return events


class Router:
    """The feed and index, reached through the wire: each step's events framed, decoded, offered in order."""

    def __init__(self, worker: str = "sg", **feeder_args: Any) -> None:
        self.feeder = IndexFeeder(KvIndex(), block_size=B, **feeder_args)
        self.worker = worker
        self.seq = 0

    def publish(self, events: list[dict[str, Any]], seq: int | None = None) -> None:
        seq = self.seq if seq is None else seq
        frames = [b"", seq.to_bytes(8, "big"), sg_payload(1000.0 + seq, events)]
        msg = decode_message(frames)
        assert self.feeder.offer(self.worker, msg.seq, msg.batch, now=float(seq)) is None
        self.seq = seq + 1

    def step(self, engine: MiniSGLang) -> None:
        self.publish(engine.take())

    def match(self, tokens: list[int], salt: str | None = None, lora: str | None = None) -> int:
        m = self.feeder.index.match(request_keys(tokens, B, lora_name=lora, cache_salt=salt)).get(self.worker)
        return 0 if m is None else m.total

    @property
    def feed(self):
        return self.feeder.feeds[self.worker]


PREFIX = [1000 + i for i in range(40)]  # shared by three requests: 2 full router blocks and 8 tokens of a third
REQUESTS = [PREFIX + [2000 + i for i in range(16)],  # 56 tokens: 3 blocks
            PREFIX + [3000 + i for i in range(20)],  # 60: 3
            PREFIX + [4000 + i for i in range(35)]]  # 75: 4


# ---- the frames are SGLang's --------------------------------------------------------------------------------

def test_the_frame_builder_matches_payloads_encoded_by_sglang_itself():
    salted = [sg_stored([-5, 7], None, [1, 2], 1, salt="t1"), sg_removed([7]), sg_cleared()]
    assert sg_payload(1.5, salted, None) == GOLDEN_SALTED
    lora = [sg_stored([-(2**60), 42], 9, [5, 6, 7, 8], 2, medium="CPU_PINNED", session="s", lora="ad1")]
    assert sg_payload(2.0, lora, 0) == GOLDEN_LORA
    batch = decode_payload(GOLDEN_LORA)
    ev = batch.events[0]
    assert isinstance(ev, BlockStored) and (ev.block_size, ev.lora_name, ev.medium) == (2, "ad1", "CPU_PINNED")
    assert [type(e).__name__ for e in decode_payload(GOLDEN_SALTED).events] == [
        "BlockStored", "BlockRemoved", "AllBlocksCleared"]


# ---- re-chunking --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("per_page", [False, True], ids=["coalesced", "one-event-per-page"])
def test_requests_sharing_a_prefix_match_their_full_router_blocks(page, per_page):
    engine, router = MiniSGLang(page, per_page), Router()
    for req in REQUESTS:
        engine.insert(req)
        router.step(engine)
    assert [router.match(r) for r in REQUESTS] == [3, 3, 4]
    assert [engine.cached_blocks(r) for r in REQUESTS] == [3, 3, 4]
    f = router.feed
    assert f.block_size_mismatch == 0 and f.orphan_blocks == 0 and f.malformed == 0
    # the second and third requests diverge at token 40, inside block 2: SGLang stores them from the middle of
    # the first chain, and their block 2 is built from the 8 shared tokens and their own 8
    assert f.rechunk is not None and f.rechunk.pages == (56 + 20 + 35) // page
    assert f.rechunk.partial == 3  # each request's last 8, 12 and 11 tokens: held, not indexed
    # a request diverging inside a block matches up to the previous full block
    assert router.match(PREFIX + [9] * 8) == 2
    assert router.match(PREFIX[:20] + [7] * 30) == 1
    assert router.match([5] * 48) == 0


def test_a_chain_continued_in_a_later_event_fills_its_partial_block():
    engine, router = MiniSGLang(), Router()
    turn1 = list(range(100, 120))  # 20 tokens: one block and a partial one
    engine.insert(turn1)
    router.step(engine)
    assert router.match(turn1) == 1 and router.feed.rechunk.partial == 1
    turn2 = [*turn1, *range(500, 512)]  # the conversation goes on from its last token: 32 tokens
    engine.insert(turn2)
    router.step(engine)
    assert router.match(turn2) == 2 and router.feed.rechunk.partial == 0


@pytest.mark.parametrize("page", [1, 4])
def test_removing_one_page_inside_a_router_block_removes_that_block(page):
    engine, router = MiniSGLang(page), Router()
    for req in REQUESTS:
        engine.insert(req)
    router.step(engine)
    a, b, c = REQUESTS
    # the first request's last page of block 2 (token 47): only its own block 2 goes
    engine.remove_pages([engine.hashes(a)[47 // page]])
    router.step(engine)
    assert [router.match(r) for r in REQUESTS] == [2, 3, 4]
    # a page of the shared tokens of block 2 (token 36): every block 2 built on it goes
    engine.remove_pages([engine.hashes(a)[36 // page]])
    router.step(engine)
    assert [router.match(r) for r in REQUESTS] == [2, 2, 2]
    assert router.feed.unknown_removals == 0
    # a branch from a later page of that block (token 43) copies the hole: its block 2 is not whole either
    own = [-(i + 1) for i in range(4 // page)]
    router.publish([sg_stored(own, engine.hashes(a)[44 // page - 1], [8] * 4, page)])
    assert router.match(a[:44] + [8] * 4) == 2
    router.publish([sg_removed(own)])
    # what the radix tree would send first: the tails, then the shared pages; stored again, from token 32 on
    engine.remove_pages([h for r in (b, c) for h in engine.hashes(r)[40 // page :]])
    engine.remove_pages([h for h in engine.hashes(a)[32 // page : 47 // page] if h in engine.parent])
    router.step(engine)
    for req in REQUESTS:
        engine.insert(req)
    router.step(engine)
    assert [router.match(r) for r in REQUESTS] == [3, 3, 4]
    assert router.feed.rechunk.pages == len(engine.parent) and router.feed.unknown_removals == 0


def test_leaf_first_eviction_and_reinsertion_as_the_radix_tree_does_it():
    engine, router = MiniSGLang(), Router()
    for req in REQUESTS:
        engine.insert(req)
    router.step(engine)
    a = REQUESTS[0]
    assert engine.evict(a, 100) == 16  # its own node: tokens 40..55 (the shared prefix has other children)
    router.step(engine)
    assert [router.match(r) for r in REQUESTS] == [2, 3, 4]
    engine.insert(a)
    router.step(engine)
    assert [router.match(r) for r in REQUESTS] == [3, 3, 4]
    for req in REQUESTS:
        engine.evict(req, 1000)
    router.step(engine)
    assert [router.match(r) for r in REQUESTS] == [0, 0, 0]
    rc = router.feed.rechunk
    assert rc.pages == 0 and rc.partial == 0 and len(router.feeder.index) == 0


def test_all_blocks_cleared_clears_the_pages_too():
    engine, router = MiniSGLang(), Router()
    for req in REQUESTS:
        engine.insert(req)
    router.step(engine)
    engine.clear()
    engine.insert(REQUESTS[2])  # stored after the clear in the same step: applied in order
    router.step(engine)
    assert [router.match(r) for r in REQUESTS] == [2, 2, 4]
    assert router.feed.rechunk.pages == 75
    engine.clear()
    router.step(engine)
    assert [router.match(r) for r in REQUESTS] == [0, 0, 0]
    assert router.feed.rechunk.pages == 0 and len(router.feeder.index) == 0


def test_a_restart_or_an_unfillable_gap_forgets_the_pages():
    engine, router = MiniSGLang(), Router()
    engine.insert(REQUESTS[0])
    router.step(engine)
    restarted = MiniSGLang()  # seq back to 0: a new engine process, its cache empty
    restarted.insert(REQUESTS[1])
    router.publish(restarted.take(), seq=0)
    assert router.feed.resets == 1 and router.feed.rechunk.pages == 60
    assert [router.match(r) for r in REQUESTS[:2]] == [2, 3]
    restarted.insert([9] * 32)
    gap = router.feeder.offer("sg", 5, decode_payload(sg_payload(0.0, restarted.take())), now=1.0)
    assert gap is not None
    router.feeder.fill_gap(gap, [], decode_payload(sg_payload(0.0, [])), now=1.0)
    assert router.feed.rechunk.pages == 0 and router.match(REQUESTS[1]) == 0


def test_a_salted_request_matches_only_with_the_same_salt():
    engine, router = MiniSGLang(), Router()
    engine.insert(REQUESTS[0], salt="tenant-a")
    router.step(engine)
    a = REQUESTS[0]
    assert router.match(a, salt="tenant-a") == 3
    assert router.match(a) == 0 and router.match(a, salt="tenant-b") == 0
    # a second salted request stored from the middle of the first chain (its events carry the salt too):
    # the salt keys block 0 only, so its block 2 continues the salted chain
    engine.insert(REQUESTS[2], salt="tenant-a")
    router.step(engine)
    assert router.match(REQUESTS[2], salt="tenant-a") == 4 and router.match(REQUESTS[2]) == 0
    engine.insert(REQUESTS[1])  # unsalted: its own chain from the root
    router.step(engine)
    assert router.match(REQUESTS[1]) == 3 and router.match(REQUESTS[1], salt="tenant-a") == 2


def test_a_lora_adapters_blocks_match_requests_for_that_adapter():
    engine, router = MiniSGLang(), Router()
    engine.insert(REQUESTS[2], lora="ad1")
    router.step(engine)
    assert router.match(REQUESTS[2], lora="ad1") == 4
    assert router.match(REQUESTS[2]) == 0 and router.match(REQUESTS[2], lora="ad2") == 0


@pytest.mark.parametrize("page", [3, 5, 32])
def test_a_page_size_that_does_not_tile_the_block_is_a_mismatch_as_before(page):
    engine, router = MiniSGLang(page), Router()
    engine.insert(REQUESTS[2][:64])
    router.step(engine)
    f = router.feed
    assert f.block_size_mismatch == 64 // page and f.rechunk is None
    assert sum(router.feeder.index.blocks_held("sg").values()) == 0


def test_re_chunking_can_be_turned_off():
    engine, router = MiniSGLang(), Router(rechunk=False)
    engine.insert(REQUESTS[0])
    router.step(engine)
    assert router.feed.block_size_mismatch == 56 and router.match(REQUESTS[0]) == 0


def test_memory_is_bounded_leaves_first_and_counted():
    engine, router = MiniSGLang(), Router(rechunk_max_pages=64)
    shared = list(range(32))  # two blocks every request continues from
    reqs = [shared + [1000 * (k + 1) + i for i in range(16)] for k in range(8)]
    for req in reqs:
        engine.insert(req)
        router.step(engine)
    rc = router.feed.rechunk
    assert rc.pages <= 64 and rc.dropped_pages == 32 + 8 * 16 - rc.pages
    assert router.match(reqs[-1]) == 3 and router.match(reqs[-2]) == 3
    assert router.match(reqs[0]) == 2  # its own block forgotten (and out of the index), the shared prefix kept
    engine.insert([*reqs[0], *range(7000, 7016)])  # continues from a forgotten page: an orphan, as in the feed
    router.step(engine)
    assert router.feed.orphan_blocks == 16


def test_a_malformed_page_event_changes_nothing():
    router = Router()
    router.publish([sg_stored([1, 2], None, [5, 2**32], 1)])  # a token id past uint32
    f = router.feed
    assert f.malformed == 1 and f.rechunk.pages == 0 and f.rechunk.partial == 0
    router.publish([sg_stored([3], 404, [5], 1)])  # parent unknown: an orphan
    assert f.orphan_blocks == 1


def test_vllm_blocks_smaller_than_the_routers_use_their_extra_keys():
    """vLLM 16-token blocks into 32-token router blocks: the salt in block 0's extra keys keys router block 0."""
    feeder = IndexFeeder(KvIndex(), block_size=32)
    tokens = list(range(64))
    ev = BlockStored([11, 12, 13, 14], None, tokens, 16, None, "GPU", None, [["t"], None, None, None])
    feeder.offer("v", 0, EventBatch(0.0, [ev], 0), 0.0)
    dup = BlockStored([11], None, tokens[:16], 16, None, "GPU", None, [["t"]])  # a second physical copy
    feeder.offer("v", 1, EventBatch(0.0, [dup], 0), 0.0)
    index = feeder.index
    assert index.match(request_keys(tokens, 32, cache_salt="t"))["v"].gpu == 2
    assert "v" not in index.match(request_keys(tokens, 32))
    from router.events.codec import BlockRemoved

    feeder.offer("v", 2, EventBatch(0.0, [BlockRemoved([11], "GPU")], 0), 0.0)  # one copy of two goes
    assert index.match(request_keys(tokens, 32, cache_salt="t"))["v"].gpu == 2
    feeder.offer("v", 3, EventBatch(0.0, [BlockRemoved([11], "GPU")], 0), 0.0)
    assert "v" not in index.match(request_keys(tokens, 32, cache_salt="t"))


def test_a_page_copied_to_host_memory_is_its_own_tier():
    engine, router = MiniSGLang(), Router()
    a = REQUESTS[0]
    engine.insert(a)
    router.step(engine)
    hs = engine.hashes(a)
    # HiCache backs the pages up to host memory (same hashes, medium CPU_PINNED), then GPU evicts the tail
    router.publish([sg_stored(hs, None, a, 1, medium="CPU_PINNED")])
    router.publish([sg_removed(hs[32:], medium="GPU")])
    m = router.feeder.index.match(request_keys(a, B))["sg"]
    assert (m.gpu, m.cpu) == (2, 1)


# ---- property: the index holds exactly the engine's full blocks ------------------------------------------------

BASE = [50_000 + i for i in range(64)]
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.integers(0, 64), st.lists(st.integers(0, 3), max_size=40),
                  st.sampled_from([None, None, "s"])),
        st.tuples(st.just("evict"), st.integers(0, 30), st.integers(1, 40), st.none()),
        st.tuples(st.just("clear"), st.just(0), st.just([]), st.none()),
    ),
    min_size=1, max_size=25,
)


def apply_op(engine: MiniSGLang, seen: list[tuple[list[int], str | None]], op: str, a: int, toks: list[int],
             salt: str | None) -> None:
    """One generated operation on the engine; ``seen`` keeps every prompt inserted (and its salt)."""
    if op == "insert":
        req = BASE[:a] + toks
        engine.insert(req, salt=salt)
        seen.append((req, salt))
    elif op == "evict" and seen:
        req, salt = seen[a % len(seen)]
        engine.evict(req, toks, salt=salt)
    elif op == "clear":
        engine.clear()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([1, 2, 4, 8]), st.booleans(), OPS)
def test_the_index_matches_exactly_the_full_blocks_the_engine_holds(page, per_page, ops):
    engine, router = MiniSGLang(page, per_page), Router()
    seen: list[tuple[list[int], str | None]] = []
    for op, a, toks, salt in ops:
        apply_op(engine, seen, op, a, toks, salt)
        router.step(engine)
        for req, salt in seen:
            assert router.match(req, salt=salt) == engine.cached_blocks(req, salt), (req, salt)
        rc = router.feed.rechunk
        if rc is not None:
            assert rc.pages == len(engine.parent)  # no page leaks, none lost
    assert router.feed.orphan_blocks == 0 and router.feed.malformed == 0


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([1, 2, 4]), st.booleans(), st.integers(8, 80), OPS)
def test_within_the_memory_bound_the_index_never_claims_a_block_the_engine_lacks(page, per_page, cap, ops):
    engine, router = MiniSGLang(page, per_page), Router(rechunk_max_pages=cap)
    seen: list[tuple[list[int], str | None]] = []
    for op, a, toks, salt in ops:
        apply_op(engine, seen, op, a, toks, salt)
        router.step(engine)
        rc = router.feed.rechunk
        assert rc is None or rc.pages <= cap
        for req, salt in seen:
            assert router.match(req, salt=salt) <= engine.cached_blocks(req, salt), (req, salt)
    assert router.feed.malformed == 0


def test_a_long_prompt_in_one_event_is_applied_in_slices():
    """A 10,000-token prompt at page size 1 is one event of 10,000 hashes; the feed cuts it in slices, each
    continuing from the last page of the one before."""
    engine, router = MiniSGLang(), Router()
    prompt = [7 + i % 5000 for i in range(10_000)]
    engine.insert(prompt)
    router.step(engine)
    assert router.match(prompt) == 625 and router.feed.rechunk.pages == 10_000
