"""Engine pages smaller than the router's block, re-chunked into router blocks. Pure: no I/O, no clocks.

Why: SGLang's default page size is 1. Its ``BlockStored`` events carry one token per block hash, each hash
chaining from the previous token's, while the index keys blocks of ``routing.block_size`` tokens exactly as
``request_keys`` computes them for a request. Any engine page size ``p`` that divides the router's block
size ``b`` can be turned into router blocks: per worker, the tokens of each chain are gathered page by page,
and each time a chain reaches a multiple of ``b`` tokens, the router block over those ``b`` tokens is stored
with the key ``chain_keys`` gives it, continuing from the previous router block's key. That key is the one
``request_keys`` computes for a request with those tokens, so the index match works unchanged. (vLLM
with a block smaller than the router's goes the same way.)

The state, per worker:
- a **segment** is one router block being built or built: the key it continues from (``base``), its tokens
  so far, its extra keys (those of its first page: LoRA name on every block, the salt on block 0 only, as
  ``request_extras`` builds them) and, once it has ``b`` tokens, its key.
- ``pos[medium]``: engine page hash -> (segment that stored it, tokens of that segment up to and including
  the page). A ``BlockStored`` with parent ``H`` continues from ``H``'s place: at a segment's end it extends
  that segment in place; at a full segment it opens the next router block; inside a segment it **branches**:
  SGLang's radix tree publishes a request that diverges from a cached one at any token as a new node whose
  parent is the last shared token, so the new segment copies the shared tokens of the block (at most
  ``b``) and goes on with its own.
- removals: a page removed from a router block means the engine no longer holds the whole block: that
  block leaves the index, and so does every branch that copied the page (a branch's first tokens are
  the pages of the segment it branched from). Such a segment keeps a ``hole`` and is never indexed
  again; an engine that stores the page again publishes it with its parent, which branches afresh.
- a partial router block (fewer than ``b`` tokens at a chain's end) is held here, never indexed: the
  engine holds those tokens, but no request's full block matches them until the chain goes on.

Memory is bounded by ``max_pages`` engine pages per worker (those stored in their own segments; a
branch's copied prefix costs at most ``b`` tokens). Beyond it the least recently used **leaf** segments
are forgotten (their pages counted in ``dropped_pages``, their router blocks leave the index): a
segment some other segment continues or branches from is not a leaf, so a shared prefix outlives the
requests that extend it, as in SGLang's own leaf-first radix eviction. A partial tail is always a leaf.
A chain that later continues from a forgotten page is an orphan, as in the plain feed.

Router blocks enter the index under ids of their own (``_RID_BASE - n``, below any engine hash: SGLang
sends signed int64, vLLM uint64 or bytes), one per built block, so the index's refcounts and removals
stay one-to-one with this module's blocks.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from router.events.codec import BlockStored, MalformedFrame
from router.index import KvIndex, Medium
from router.index.residency import EngineHash
from router.keys import ROOT_KEY, Extra, chain_keys, extra_seed, request_extras

DEFAULT_MAX_PAGES = 1 << 20  # per worker: 1M tokens at page size 1, about 150 MB of accumulator state
_RID_BASE = -(1 << 64)


def can_rechunk(page_size: int, block_size: int) -> bool:
    """Whether pages of ``page_size`` tokens tile router blocks of ``block_size`` exactly."""
    return 0 < page_size < block_size and block_size % page_size == 0


class _Seg:
    """One router block of one chain, being built (fewer than ``b`` tokens) or built."""

    __slots__ = ("base", "branches", "extra", "hole", "key", "kids", "live", "medium", "own", "rid", "tokens", "up")

    def __init__(
        self, up: _Seg | None, base: int, tokens: array[int], extra: Extra, medium: Medium, hole: int | None
    ) -> None:
        self.up = up  # the segment this one continues or branches from (None: block 0 from the root)
        self.base = base  # key of the router block before this one (ROOT_KEY for block 0)
        self.tokens = tokens
        self.extra = extra
        self.medium = medium
        self.hole = hole  # smallest fill of a removed page inside this block's tokens (None: whole)
        self.key: int | None = None  # set once the block has b tokens
        self.rid: EngineHash | None = None  # the id it is indexed under, while indexed
        self.own: list[EngineHash] = []  # pages this segment stored itself (a branch's prefix is not its own)
        self.live = 0  # of ``own``, still held (in ``pos``)
        self.kids = 0  # segments continuing or branching from this one
        self.branches: dict[_Seg, int] = {}  # branch -> tokens it copied from this one


class Rechunker:
    """One worker's pages of ``p < b`` tokens (``p`` dividing ``b``) -> router blocks of ``b`` tokens."""

    def __init__(self, index: KvIndex, worker_id: str, block_size: int, max_pages: int = DEFAULT_MAX_PAGES) -> None:
        if block_size <= 0 or max_pages <= 0:
            raise ValueError("block_size and max_pages must be positive")
        self.index = index
        self.worker_id = worker_id
        self.block_size = block_size
        self.max_pages = max_pages
        self._pos: tuple[dict[EngineHash, tuple[_Seg, int]], ...] = ({}, {}, {})
        self._dups: dict[tuple[Medium, EngineHash], int] = {}  # extra stores of a held page (vLLM: 2 copies)
        self._leaves: OrderedDict[_Seg, None] = OrderedDict()  # eviction candidates, least recently used first
        self._rids = 0
        self.pages = 0  # engine pages held (all media)
        self.partial = 0  # segments with fewer than b tokens (partial tails and branches being built)
        self.dropped_pages = 0  # pages forgotten to stay within max_pages

    # ---- events ------------------------------------------------------------------------------
    def store(self, ev: BlockStored, token_ids: Sequence[int], medium: Medium) -> int:
        """Apply one ``BlockStored`` of pages of ``ev.block_size`` tokens, ``token_ids`` its token ids (read by
        the feed: ``codec.token_ids_of``); returns how many were orphans.

        The event is checked whole before anything changes (a malformed one raises and leaves no trace):
        token ids must fit uint32 and extra keys must hash, as ``chain_keys`` needs them when a block fills.
        """
        p, b = ev.block_size, self.block_size
        if not can_rechunk(p, b):
            raise ValueError(f"page size {p} does not tile block size {b}")
        hashes = ev.block_hashes
        n = len(hashes)
        tokens = array("I", token_ids)  # OverflowError / TypeError for ids that cannot be hashed
        if len(tokens) != n * p:
            raise MalformedFrame("token_ids do not fill block_hashes x block_size")
        extras = ev.extra_keys
        if extras is not None:
            if len(extras) != n:
                raise MalformedFrame("extra_keys length differs from block_hashes")
            for e in extras:
                extra_seed(e)
        if ev.parent_block_hash is None:
            cur: tuple[_Seg, int] | None = None
        else:
            cur = self._find(ev.parent_block_hash, medium)
            if cur is None:
                return n  # its parent is unknown: it could never be matched from block 0
            if cur[1] % p:
                raise MalformedFrame("pages do not line up with the parent's")
        pos = self._pos[medium]
        distinct = len(set(hashes)) == n  # else one page at a time (a hash may repeat within the event)
        j = 0
        while j < n:
            h = hashes[j]
            held = pos.get(h)
            if held is not None:  # the same page again (a second physical copy): count it, go on from it
                self._dups[medium, h] = self._dups.get((medium, h), 0) + 1
                self._touch(held[0])
                cur = held
                j += 1
                continue
            seg = self._target(cur, medium, extras[j] if extras is not None else None, ev)
            # The run of new pages that goes into this segment, at once (page size 1: up to b pages).
            start = len(seg.tokens)
            end = min(n, j + (b - start) // p) if distinct else j + 1
            k = j + 1
            while k < end and hashes[k] not in pos:
                k += 1
            run = hashes[j:k]
            seg.tokens.extend(tokens[j * p : k * p])
            seg.own.extend(run)
            seg.live += k - j
            self.pages += k - j
            pos.update(zip(run, [(seg, start + i * p) for i in range(1, k - j + 1)], strict=True))
            cur = (seg, start + (k - j) * p)
            if cur[1] == b:
                self._complete(seg)
            j = k
        self._bound()
        return 0

    def remove(self, hashes: Iterable[EngineHash], medium: Medium) -> list[EngineHash]:
        """Apply a ``BlockRemoved``; returns the hashes that are not pages held here (for the plain index)."""
        pos = self._pos[medium]
        unknown: list[EngineHash] = []
        for h in hashes:
            if h not in pos:
                unknown.append(h)
                continue
            dup = self._dups.get((medium, h))
            if dup:
                if dup == 1:
                    del self._dups[medium, h]
                else:
                    self._dups[medium, h] = dup - 1
                continue
            seg, fill = pos.pop(h)
            self.pages -= 1
            self._cut(seg, fill)
            seg.live -= 1
            if seg.live == 0 and seg.kids == 0:
                self._finalize(seg)
        return unknown

    def clear(self) -> None:
        """Forget every page (the caller clears the worker's index entries: AllBlocksCleared, restart, gap)."""
        self._pos = ({}, {}, {})
        self._dups.clear()
        self._leaves.clear()
        self.pages = 0
        self.partial = 0

    # ---- internals ---------------------------------------------------------------------------
    def _find(self, h: EngineHash, medium: Medium) -> tuple[_Seg, int] | None:
        """Where page ``h`` sits, on this medium first: a chain's position is its content, and an engine may
        copy a block to another tier before (or without) its parent, as vLLM's parent lookup allows too."""
        found = self._pos[medium].get(h)
        if found is None:
            for other in self._pos:
                found = other.get(h)
                if found is not None:
                    break
        return found

    def _target(self, cur: tuple[_Seg, int] | None, medium: Medium, extra: Extra, ev: BlockStored) -> _Seg:
        """The segment the next page goes into, continuing from ``cur`` (None: the root)."""
        if cur is None:
            if ev.extra_keys is None:  # SGLang: lora_name and the salt as fields, the salt on block 0 only
                extra = request_extras(1, ev.lora_name, ev.cache_salt)[0]
            return self._new(None, ROOT_KEY, array("I"), extra, medium, None)
        seg, fill = cur
        if fill == self.block_size:  # at a full block: the next router block begins
            assert seg.key is not None
            if ev.extra_keys is None:
                extra = request_extras(1, ev.lora_name)[0]
            return self._new(seg, seg.key, array("I"), extra, medium, None)
        if fill == len(seg.tokens) and seg.medium == medium:  # at the chain's end: extend it in place
            self._touch(seg)
            return seg
        # Inside a block (or at its end on another medium): a branch sharing the first ``fill`` tokens.
        hole = seg.hole if seg.hole is not None and seg.hole <= fill else None
        branch = self._new(seg, seg.base, seg.tokens[:fill], seg.extra, medium, hole)
        seg.branches[branch] = fill
        return branch

    def _new(self, up: _Seg | None, base: int, tokens: array[int], extra: Extra, medium: Medium,
             hole: int | None) -> _Seg:
        seg = _Seg(up, base, tokens, extra, medium, hole)
        if up is not None:
            up.kids += 1
            self._leaves.pop(up, None)  # a segment others go on from is not evicted before them
        self._leaves[seg] = None
        self.partial += 1
        return seg

    def _touch(self, seg: _Seg) -> None:
        if seg in self._leaves:
            self._leaves.move_to_end(seg)

    def _complete(self, seg: _Seg) -> None:
        """The segment reached b tokens: its key is what ``request_keys`` gives that block; index it if whole."""
        seg.key = chain_keys(seg.tokens, self.block_size, seg.base, [seg.extra] if seg.extra else None)[0]
        self.partial -= 1
        if seg.hole is None:
            self._rids += 1
            seg.rid = _RID_BASE - self._rids
            self.index.store(self.worker_id, [seg.rid], [seg.key], seg.medium)

    def _unindex(self, seg: _Seg) -> None:
        if seg.rid is not None:
            self.index.remove(self.worker_id, [seg.rid], seg.medium)  # 0 or 1 unknown (index capacity): moot
            seg.rid = None

    def _cut(self, seg: _Seg, fill: int) -> None:
        """The page ending at ``fill`` of ``seg`` is gone: that block and every branch that copied it leave."""
        stack = [seg]
        while stack:
            s = stack.pop()
            if s.hole is not None and s.hole <= fill:
                continue  # already cut at or before it, and so were the branches that copied this far
            s.hole = fill
            self._unindex(s)
            stack.extend(t for t, k in s.branches.items() if k >= fill)

    def _finalize(self, seg: _Seg) -> None:
        """Drop a segment that holds no page and has no kids; its parent may become a leaf (or go too)."""
        while True:
            self._leaves.pop(seg, None)
            self._unindex(seg)
            if seg.key is None:
                self.partial -= 1
            up, seg.up = seg.up, None
            if up is None:
                return
            up.branches.pop(seg, None)
            up.kids -= 1
            if up.kids:
                return
            if up.live:
                self._leaves[up] = None  # a leaf again: its last use was before its kids', so evict it first
                self._leaves.move_to_end(up, last=False)
                return
            seg = up

    def _bound(self) -> None:
        """Forget least recently used leaf segments until at most ``max_pages`` pages are held."""
        while self.pages > self.max_pages and self._leaves:
            seg, _ = self._leaves.popitem(last=False)
            pos = self._pos[seg.medium]
            for h in seg.own:
                held = pos.get(h)
                if held is not None and held[0] is seg:
                    del pos[h]
                    self._dups.pop((seg.medium, h), None)
                    self.pages -= 1
                    self.dropped_pages += 1
            seg.live = 0
            self._finalize(seg)
