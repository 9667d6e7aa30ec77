"""Ordered application of event batches to the index, per worker. Pure: the caller passes ``now``.

The feed owns the sequence rules so the live subscriber, the recorded-file replay and the simulator
share them:
- in order (``seq == last + 1``): apply.
- ahead (``seq > last + 1``, or a first contact with ``seq > 0``): report a ``Gap``; the caller fetches the
  missing range from the worker's replay socket and calls ``fill_gap``. If the range cannot be filled,
  the worker's entries are cleared and it is **unsynced** until fresh events have flowed for
  ``resync_after_s`` (or an ``AllBlocksCleared`` makes its state exact again).
- behind (``seq <= last``): the engine restarted (its seq restarts at 0, its cache is empty and it sends
  no AllBlocksCleared): clear, then treat the batch as a first contact.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from msgspec import Raw

from router.events.codec import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEvent,
    MalformedFrame,
    RawBlockStored,
    medium_of,
    token_ids_of,
)
from router.events.rechunk import DEFAULT_MAX_PAGES, Rechunker, can_rechunk
from router.index import BlockEntry, KvIndex, Medium
from router.keys import ROOT_KEY, chain_keys, request_extras

T = TypeVar("T")
# what applying an event raises when the event is malformed: counted, and the event skipped (RecursionError: extra
# keys nested past what hashing them can walk)
MALFORMED_EVENT = (MalformedFrame, ValueError, OverflowError, TypeError, RecursionError)
# A feed operation in steps: each ``next`` applies up to SLICE_BLOCKS blocks, so an adapter with an event
# loop can yield between steps (one BlockStored of a million hashes must not stall every request).
Steps = Generator[None, None, T]
SLICE_BLOCKS = 4096


def run_steps(steps: Steps[T]) -> T:
    """Run a stepped feed operation to its end, at once (callers without an event loop to share)."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


@dataclass(frozen=True, slots=True)
class Gap:
    worker_id: str
    first_missing: int
    next_seq: int  # the held batch's seq; the gap is [first_missing, next_seq)


@dataclass(slots=True)
class WorkerFeed:
    worker_id: str
    last_seq: int | None = None
    last_event_at: float | None = None
    synced: bool = False
    unsynced_since: float | None = None
    events: Counter[str] = field(default_factory=Counter)
    batches: int = 0
    malformed: int = 0
    gaps: int = 0
    gaps_filled: int = 0
    resets: int = 0
    orphan_blocks: int = 0  # stored blocks whose parent hash we did not know
    unknown_removals: int = 0
    block_size_mismatch: int = 0
    superseded_batches: int = 0  # replayed batches skipped because a later AllBlocksCleared undid them
    duplicates: int = 0  # live batches already applied from the connect-time replay
    suspect_since: float | None = None  # the worker failed to answer: no credit until a batch proves its state
    bootstrap_ts: dict[int, float] = field(default_factory=dict)  # seq -> batch time, of the connect-time replay
    rechunk: Rechunker | None = None  # pages smaller than the router's block (SGLang: 1 token), re-chunked
    applying: bool = False  # a batch is half applied (between slices): no snapshot of this worker now
    relay_trusted: bool = True  # fed from a relay (event bus): its synced flag holds unless we missed messages


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    worker_id: str
    state: str  # "synced" | "unsynced" | "stale"
    last_event_age_s: float | None
    last_seq: int | None
    blocks: dict[Medium, int]


class FeedJournal(Protocol):
    """Told every change the feed makes to a worker's index, in order, once it is whole: what a relay
    publishes on the event bus so that a consumer applying the same records reproduces this index exactly."""

    def applied(self, worker_id: str, seq: int, batch: EventBatch, synced: bool) -> None:
        """A batch was applied (whatever its seq: the feed's order rules already ran)."""

    def reset(self, worker_id: str) -> None:
        """The worker's entries were cleared because the engine restarted (its seq went back)."""

    def desynced(self, worker_id: str) -> None:
        """The worker's entries were cleared and it is unsynced (a gap no replay could fill)."""


class IndexFeeder:
    def __init__(self, index: KvIndex, block_size: int | None = None, resync_after_s: float = 2.0,
                 rechunk: bool = True, rechunk_max_pages: int = DEFAULT_MAX_PAGES) -> None:
        self.index = index
        self.block_size = block_size  # None: accept the engine's block size as is
        self.resync_after_s = resync_after_s
        # Engine pages that tile the router's block (SGLang's default page size 1) are re-chunked into it
        # (router/events/rechunk.py), at most ``rechunk_max_pages`` pages held per worker; otherwise a
        # block size other than ours is counted in ``block_size_mismatch`` and dropped.
        self.rechunk = rechunk
        self.rechunk_max_pages = rechunk_max_pages
        self.feeds: dict[str, WorkerFeed] = {}
        # told the keys each GPU removal evicts (the routing objective's reuse statistics), when set
        self.on_gpu_evicted: Callable[[list[int]], None] | None = None
        self.journal: FeedJournal | None = None  # a relay's publisher, when set
        self._work = 0  # blocks (and events) applied since the last step ended

    def feed(self, worker_id: str) -> WorkerFeed:
        f = self.feeds.get(worker_id)
        if f is None:
            f = self.feeds[worker_id] = WorkerFeed(worker_id)
        return f

    # ---- sequencing ------------------------------------------------------------------------
    def offer(self, worker_id: str, seq: int, batch: EventBatch, now: float) -> Gap | None:
        """Apply a live batch if it is next in order; otherwise say which range is missing."""
        return run_steps(self.offer_steps(worker_id, seq, batch, now))

    def fill_gap(
        self, gap: Gap, replayed: Iterable[tuple[int, EventBatch]], held: EventBatch, now: float
    ) -> bool:
        return run_steps(self.fill_gap_steps(gap, replayed, held, now))

    def bootstrap(self, worker_id: str, replayed: Iterable[tuple[int, EventBatch]], now: float) -> bool:
        return run_steps(self.bootstrap_steps(worker_id, replayed, now))

    def offer_steps(self, worker_id: str, seq: int, batch: EventBatch, now: float) -> Steps[Gap | None]:
        """``offer`` in steps."""
        f = self.feed(worker_id)
        if f.bootstrap_ts:
            if f.bootstrap_ts.get(seq) == batch.ts:  # published while the connect-time replay was read
                f.duplicates += 1
                return None
            f.bootstrap_ts = {}  # past the overlap (a restarted engine's seq 0 has another timestamp)
        if f.last_seq is not None and seq <= f.last_seq:
            self._reset(f)
        expected = 0 if f.last_seq is None else f.last_seq + 1
        if seq != expected:
            f.gaps += 1
            return Gap(worker_id, expected, seq)
        if seq == 0:
            f.synced = True  # we have seen every batch this engine process published
        yield from self._apply(f, seq, batch, now)
        return None

    def fill_gap_steps(
        self, gap: Gap, replayed: Iterable[tuple[int, EventBatch]], held: EventBatch, now: float
    ) -> Steps[bool]:
        """Apply replayed batches covering ``gap`` then the held one; clear the worker if they do not.

        Batches before the last ``AllBlocksCleared`` in the range are skipped (``superseded``): the clear
        wipes whatever they did. For the same reason a replay that does not reach back to the start of the
        gap still fills it if it reaches back to a clear: a router meeting a long-lived engine whose buffer
        (vLLM keeps 10,000 batches) no longer holds seq 0 is exact from its last cache reset on.
        """
        f = self.feed(gap.worker_id)
        exact = _exact_tail({seq: b for seq, b in replayed}, gap.first_missing, gap.next_seq)
        filled = exact is not None
        if exact is not None:
            batches, superseded = exact
            f.superseded_batches += superseded
            if gap.first_missing == 0:
                f.synced = True  # replayed from the engine's first batch, or from a reset: exact either way
            for seq, batch in batches:
                yield from self._apply(f, seq, batch, now)
            f.gaps_filled += 1
        else:  # a partial range is no better than nothing: whatever it did, the clear below undoes
            self._desync(f, now)
        yield from self._apply(f, gap.next_seq, held, now)
        return filled

    def bootstrap_steps(self, worker_id: str, replayed: Iterable[tuple[int, EventBatch]], now: float) -> Steps[bool]:
        """Before any live batch: apply an engine's whole replay buffer, read at connect time, if it makes the
        index exact (it starts at seq 0 or holds a cache reset). A router meeting long-lived engines then knows
        their caches before traffic arrives, instead of replaying up to 10,000 batches mid-request."""
        by_seq = {seq: b for seq, b in replayed}
        known = self.feeds.get(worker_id)
        if (known is not None and known.last_seq is not None) or not by_seq:
            return False  # nothing published yet (a worker not heard from counts as synced and empty)
        exact = _exact_tail(by_seq, 0, max(by_seq) + 1)
        if exact is None:
            return False
        f = self.feed(worker_id)
        batches, superseded = exact
        f.superseded_batches += superseded
        f.synced = True  # decided before applying, so that each journalled batch says so
        for seq, batch in batches:
            yield from self._apply(f, seq, batch, now)
        f.bootstrap_ts = {seq: b.ts for seq, b in by_seq.items()}
        return True

    def _reset(self, f: WorkerFeed) -> None:
        self._clear(f)
        f.resets += 1
        f.last_seq = None
        if self.journal is not None:
            self.journal.reset(f.worker_id)

    def _desync(self, f: WorkerFeed, now: float) -> None:
        self._clear(f)
        self._mark_unsynced(f, now)
        if self.journal is not None:
            self.journal.desynced(f.worker_id)

    def desync(self, worker_id: str, now: float) -> None:
        """Clear a worker and mark it unsynced from outside the sequence rules: a relay that had to drop
        records (the bus was down too long), a consumer that missed some (retention, a relay's drops)."""
        f = self.feed(worker_id)
        f.relay_trusted = False
        self._desync(f, now)

    # ---- fed from a relay (the event bus) ----------------------------------------------------
    def restore(self, worker_id: str, entries: Iterable[BlockEntry], last_seq: int | None, synced: bool,
                now: float) -> None:
        """Start a worker from a relay's index snapshot: its entries as ``KvIndex.export_worker`` gave
        them and the feed state they are exact at; what the relay published after it follows."""
        f = self.feed(worker_id)
        self._clear(f)
        self.index.import_worker(worker_id, entries)
        f.last_seq, f.synced, f.relay_trusted = last_seq, synced, True
        f.unsynced_since = None if synced else now
        f.last_event_at, f.suspect_since, f.bootstrap_ts = now, None, {}

    def apply_relayed_steps(self, worker_id: str, seq: int, batch: EventBatch, synced: bool,
                            now: float) -> Steps[None]:
        """Apply a batch a relay applied (its feed already ran the order rules), taking the relay's synced
        flag, unless this consumer itself missed records: then its own resync rule decides."""
        f = self.feed(worker_id)
        yield from self._apply(f, seq, batch, now)
        if f.relay_trusted:
            f.synced = synced
        elif f.synced:
            f.relay_trusted = True  # resynced on our own (a clear, or fresh events for resync_after_s)

    def desync_relayed(self, worker_id: str, now: float) -> None:
        """A relay's unsynced record: it cleared the worker (a gap its replay could not fill); its synced
        flag on the following batches says when it is exact again."""
        f = self.feed(worker_id)
        self._desync(f, now)
        f.relay_trusted = True

    def reset_relayed(self, worker_id: str) -> None:
        """A relay's reset record: the engine (or the relay) restarted; what follows rebuilds the worker. Until
        then it is empty and exact, as a worker not heard from is on the direct path (the relay's own feed
        holds it so: record 0 of a relay that has not heard from an idle engine is this reset alone)."""
        f = self.feed(worker_id)
        self._reset(f)
        f.synced, f.unsynced_since = True, None
        f.relay_trusted = True

    def _clear(self, f: WorkerFeed) -> None:
        """Forget a worker's blocks, and the pages being re-chunked with them (their index entries go too)."""
        self.index.clear_worker(f.worker_id)
        if f.rechunk is not None:
            f.rechunk.clear()

    def _mark_unsynced(self, f: WorkerFeed, now: float) -> None:
        f.synced = False
        f.unsynced_since = now

    def suspend(self, worker_id: str, now: float) -> None:
        """The worker stopped answering: it may come back as a new process with an empty cache, publishing
        nothing until it serves a request. Until its next batch shows which (the old sequence going on, or a
        restart's seq 0, which clears), its index must not be trusted."""
        f = self.feeds.get(worker_id)
        if f is not None and f.last_seq is not None and f.suspect_since is None:
            f.suspect_since = now

    def mark_malformed(self, worker_id: str) -> None:
        self.feed(worker_id).malformed += 1

    def remove_worker(self, worker_id: str) -> None:
        self.feeds.pop(worker_id, None)
        self.index.remove_worker(worker_id)

    # ---- application -------------------------------------------------------------------------
    def _apply(self, f: WorkerFeed, seq: int, batch: EventBatch, now: float) -> Steps[None]:
        """Apply one batch, yielding after every ``SLICE_BLOCKS`` blocks (a huge event is applied in slices)."""
        f.last_seq = seq
        f.last_event_at = now
        f.batches += 1
        f.suspect_since = None
        f.applying = True
        try:
            yield from self._apply_events(f, batch)
        finally:
            f.applying = False
        if not f.synced and f.unsynced_since is not None and now - f.unsynced_since >= self.resync_after_s:
            f.synced = True
        if self.journal is not None:
            self.journal.applied(f.worker_id, seq, batch, f.synced)

    def _apply_events(self, f: WorkerFeed, batch: EventBatch) -> Steps[None]:
        stored = removed = 0  # the common events, counted into ``f.events`` once a batch (a Counter's += per
        try:  # event costs as much as a one-block event's own work)
            for event in batch.events:
                cls = type(event)
                if (cls is RawBlockStored or cls is BlockRemoved or cls is BlockStored) and \
                        len(event.block_hashes) <= SLICE_BLOCKS:
                    # the common case, without the generator of slices: its cost per event is felt at the
                    # few blocks a vLLM event carries
                    try:
                        if cls is not BlockRemoved:
                            self._stored(f, event)
                            stored += 1
                        else:
                            self._removed(f, event)
                            removed += 1
                    except MALFORMED_EVENT:
                        f.malformed += 1
                        continue
                    self._work += len(event.block_hashes) + 1
                    if self._work >= SLICE_BLOCKS:  # counted across batches: a long replay yields too
                        self._work = 0
                        yield
                    continue
                yield from self._apply_other(f, event)
        finally:
            if stored:
                f.events["BlockStored"] += stored
            if removed:
                f.events["BlockRemoved"] += removed

    def _apply_other(self, f: WorkerFeed, event: KvEvent) -> Steps[None]:
        """A clear, or a stored or removed event of more than ``SLICE_BLOCKS`` blocks (applied in slices)."""
        cls = type(event)
        try:
            for piece in _slices(event, SLICE_BLOCKS):
                if isinstance(piece, BlockStored):
                    self._stored(f, piece)
                elif isinstance(piece, BlockRemoved):
                    self._removed(f, piece)
                elif isinstance(piece, AllBlocksCleared):
                    self._clear(f)
                    f.synced = True
                self._work += len(getattr(piece, "block_hashes", ())) + 1
                if self._work >= SLICE_BLOCKS:
                    self._work = 0
                    yield
        except MALFORMED_EVENT:
            f.malformed += 1
            return
        f.events[cls.__struct_config__.tag or cls.__name__] += 1  # (a RawBlockStored counts as a BlockStored)

    def _removed(self, f: WorkerFeed, ev: BlockRemoved) -> None:
        medium = medium_of(ev.medium)
        hashes = ev.block_hashes
        if f.rechunk is not None:  # pages first: what they do not hold may be plain blocks
            hashes = f.rechunk.remove(hashes, medium)
        if self.on_gpu_evicted is not None and medium is Medium.GPU:
            self.on_gpu_evicted(self.index.keys_of(f.worker_id, hashes))
        f.unknown_removals += self.index.remove(f.worker_id, hashes, medium)

    def _stored(self, f: WorkerFeed, ev: BlockStored) -> None:
        n = len(ev.block_hashes)
        tokens = ev.token_ids
        if type(tokens) is Raw:  # (the router's own decode: RawBlockStored)
            tokens = token_ids_of(tokens)
        if ev.block_size <= 0 or len(tokens) != n * ev.block_size:
            raise MalformedFrame("token_ids do not fill block_hashes x block_size")
        medium = medium_of(ev.medium)
        if self.block_size is not None and ev.block_size != self.block_size:
            if self.rechunk and can_rechunk(ev.block_size, self.block_size):
                if f.rechunk is None:
                    f.rechunk = Rechunker(self.index, f.worker_id, self.block_size, self.rechunk_max_pages)
                f.orphan_blocks += f.rechunk.store(ev, tokens, medium)
                return
            f.block_size_mismatch += n
            return
        extras = ev.extra_keys
        if (extras is None and not (ev.lora_name or ev.cache_salt)) or (
                extras is not None and len(extras) == n and not any(extras)):  # (vLLM: one None per block)
            # no extra keys: the parent, the keys and the store in one call (compiled for the dict index)
            if not self.index.store_chain(f.worker_id, ev.block_hashes, tokens, ev.block_size,
                                          ev.parent_block_hash, medium):
                f.orphan_blocks += n
            return
        if ev.parent_block_hash is None:
            parent = ROOT_KEY
        else:
            found = self.index.key_of(f.worker_id, ev.parent_block_hash)
            if found is None:
                f.orphan_blocks += n
                return
            parent = found
        if extras is None:  # SGLang: no extra_keys field, a LoRA name or salt of its own
            extras = request_extras(n, ev.lora_name, ev.cache_salt if ev.parent_block_hash is None else None)
        elif len(extras) != n:
            raise MalformedFrame("extra_keys length differs from block_hashes")
        keys = chain_keys(tokens, ev.block_size, parent, extras)
        self.index.store(f.worker_id, ev.block_hashes, keys, medium)

    # ---- status ------------------------------------------------------------------------------
    def status(self, worker_id: str, now: float, stale_after_s: float | None = None) -> WorkerStatus:
        """A query: a worker never heard from reads as a fresh feed would, and nothing is created for it."""
        f = self.feeds.get(worker_id) or WorkerFeed(worker_id)
        age = None if f.last_event_at is None else max(0.0, now - f.last_event_at)
        if not f.synced:
            state = "unsynced"
        elif f.suspect_since is not None:
            state = "unverified"
        elif stale_after_s is not None and (age is None or age > stale_after_s):
            state = "stale"
        else:
            state = "synced"
        return WorkerStatus(worker_id, state, age, f.last_seq, self.index.blocks_held(worker_id))


def _slices(event: BlockStored | BlockRemoved | AllBlocksCleared, size: int) -> Iterator[KvEvent]:
    """An event as consecutive pieces of at most ``size`` blocks, with the same effect applied in order: a
    stored chain continues from the previous piece's last hash. Pieces are cut as they are applied (a copy of
    all of them at once would be one long stall again). A malformed event is left whole (it fails as one),
    and so is a small one."""
    if isinstance(event, AllBlocksCleared) or len(event.block_hashes) <= size:
        yield event
        return
    n = len(event.block_hashes)
    hashes = event.block_hashes
    if isinstance(event, BlockRemoved):
        for i in range(0, n, size):
            yield BlockRemoved(hashes[i : i + size], event.medium, event.group_idx)
        return
    bs = event.block_size
    extras = event.extra_keys
    tokens = token_ids_of(event.token_ids)
    if bs <= 0 or len(tokens) != n * bs or (extras is not None and len(extras) != n):
        yield event
        return
    for i in range(0, n, size):
        j = min(n, i + size)
        yield BlockStored(
            hashes[i:j], event.parent_block_hash if i == 0 else hashes[i - 1], tokens[i * bs : j * bs],
            bs, event.lora_id, event.medium, event.lora_name, None if extras is None else extras[i:j],
            event.group_idx, event.kv_cache_spec_kind, event.cache_salt if i == 0 else None)


def _exact_tail(by_seq: dict[int, EventBatch], first: int, end: int) -> tuple[list[tuple[int, EventBatch]], int] | None:
    """Of the replayed batches, those in ``[first, end)`` that make a worker's state exact, and how many were
    skipped: the contiguous run ending at ``end - 1``, whole if it reaches ``first``, else from its last
    ``AllBlocksCleared`` on (a clear wipes what came before it). None when neither holds."""
    run: list[tuple[int, EventBatch]] = []
    seq = end - 1
    while seq >= first and seq in by_seq:
        run.append((seq, by_seq[seq]))
        seq -= 1
    run.reverse()
    clears = [i for i, (_, batch) in enumerate(run) if any(isinstance(e, AllBlocksCleared) for e in batch.events)]
    if seq >= first and not clears:
        return None
    start = clears[-1] if clears else 0
    return run[start:], start
