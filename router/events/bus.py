"""The event bus (NATS JetStream) between relays and routers: subjects, records, snapshots, the consumer.

A relay (router/events/relay.py) runs the feed rules on an engine's ZeroMQ events and publishes, per worker,
what its own feed did, in order, as ``BusRecord``s on ``kvrouter.events.<worker token>``: ``batch`` (an
engine batch it applied, with its synced flag after it), ``reset`` (the engine restarted, or a relay
started: the worker's entries go) and ``unsynced`` (a gap neither the replay nor the bus could fill: the
entries go and the worker is unsynced). Records carry the relay's ``epoch`` (one per relay process) and
``n`` (per worker, 0, 1, 2, ... within the epoch; every epoch starts with a ``reset`` at 0), so a
consumer knows when it missed one (retention, a relay's counted drops) and then says unsynced instead of
being silently wrong. An ``IndexSnapshot`` per worker (object store ``kvrouter-snapshots``) holds the
relay's ``KvIndex.export_worker`` rows and the (epoch, n, stream sequence) it is exact at.

``BusFollower`` applies records to a feeder. This module is pure (no I/O); its NATS adapter, with
``BusSubscriber``, is router/events/bus_nats.py. docs/event-bus.md has the design and the failure modes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import msgspec

from router.events.codec import EventBatch
from router.events.feed import IndexFeeder, Steps
from router.index import BlockEntry, Medium

log = logging.getLogger(__name__)

STREAM = "KVROUTER_EVENTS"
SUBJECT_PREFIX = "kvrouter.events"
SNAPSHOT_BUCKET = "kvrouter-snapshots"
SNAPSHOT_REQUEST_SUBJECT = "kvrouter.relay.snapshot"  # a request: every relay snapshots its workers, replies
SNAPSHOT_VERSION = 1

BATCH, RESET, UNSYNCED = "batch", "reset", "unsynced"


# ---- names -----------------------------------------------------------------------------------
_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-")


def worker_token(worker_id: str) -> str:
    """A worker id as one NATS subject token and object name: ``[A-Za-z0-9-]`` kept, every other byte
    (``.``, ``:``, ``*``, ``>``, ``_`` itself, non-ASCII) as ``_XX`` hex, so distinct ids stay distinct."""
    if not worker_id:
        return "_"
    return "".join(c if c in _SAFE else "".join(f"_{b:02X}" for b in c.encode()) for c in worker_id)


def subject_of(worker_id: str, prefix: str = SUBJECT_PREFIX) -> str:
    return f"{prefix}.{worker_token(worker_id)}"


# ---- records and snapshots -------------------------------------------------------------------
class BusRecord(msgspec.Struct, array_like=True, gc=False):
    """One change a relay's feed made to a worker: the unit on the bus (one JetStream message)."""

    kind: str  # BATCH | RESET | UNSYNCED
    worker_id: str
    epoch: str  # the publishing relay process
    n: int  # per worker within the epoch: 0 (always a RESET), 1, 2, ...
    seq: int = -1  # BATCH: the engine's seq
    synced: bool = False  # BATCH: the relay's synced flag once the batch was applied
    batch: EventBatch | None = None

    @property
    def msg_id(self) -> str:
        """``Nats-Msg-Id``: a retried publish of the same record is stored once (ids are per stream, so the
        worker is part of it)."""
        return f"{worker_token(self.worker_id)}.{self.epoch}.{self.n}"


class SnapshotRow(msgspec.Struct, array_like=True, gc=False):
    medium: int
    engine_hash: int | bytes
    key: int
    count: int


class IndexSnapshot(msgspec.Struct, gc=False):
    """A relay's index of one worker, exact after record (``epoch``, ``n``), stored at ``stream_seq``."""

    worker_id: str
    epoch: str
    n: int
    stream_seq: int
    last_seq: int | None
    synced: bool
    block_size: int | None
    rows: list[SnapshotRow]
    taken_at: float = 0.0  # wall clock, for operators
    version: int = SNAPSHOT_VERSION

    def entries(self) -> Iterator[BlockEntry]:
        return (BlockEntry(Medium(r.medium), r.engine_hash, r.key, r.count) for r in self.rows)


def snapshot_rows(entries: list[BlockEntry]) -> list[SnapshotRow]:
    return [SnapshotRow(int(e.medium), e.engine_hash, e.key, e.count) for e in entries]  # type: ignore[arg-type]


_record_encoder = msgspec.msgpack.Encoder()
_record_decoder = msgspec.msgpack.Decoder(BusRecord)
_snapshot_decoder = msgspec.msgpack.Decoder(IndexSnapshot)


def encode_record(record: BusRecord) -> bytes:
    return _record_encoder.encode(record)


def decode_record(data: bytes) -> BusRecord:
    return _record_decoder.decode(data)


def encode_snapshot(snapshot: IndexSnapshot) -> bytes:
    return _record_encoder.encode(snapshot)


def decode_snapshot(data: bytes) -> IndexSnapshot:
    return _snapshot_decoder.decode(data)


# ---- the pure consumer -----------------------------------------------------------------------
# Why a record read from the bus was dropped, unapplied (``kvrouter_bus_records_dropped_total{reason}``): a fixed
# set, so the label's values are bounded whatever arrives.
MALFORMED = "malformed"  # not a BusRecord (undecodable), or one no relay writes (unknown kind, n < 0, ...)
WORKER_MISMATCH = "worker_mismatch"  # names a worker the router follows, but another one than its subject's
UNKNOWN_WORKER = "unknown_worker"  # names a worker the router does not follow (not discovered)
DROP_REASONS = (MALFORMED, WORKER_MISMATCH, UNKNOWN_WORKER)
_KINDS = frozenset({BATCH, RESET, UNSYNCED})


def record_problem(record: BusRecord) -> str | None:
    """Why a decoded record is not one a relay publishes, or None."""
    if record.kind not in _KINDS:
        return f"unknown kind {record.kind[:40]!r}"
    if record.n < 0:
        return f"n = {record.n}"
    if record.kind == BATCH and record.batch is None:
        return "a batch record without its batch"
    return None


@dataclass(slots=True)
class FollowState:
    """Where one worker's consumer stands: the last record applied and what it cost to get there."""

    epoch: str | None = None
    n: int = -1
    stream_seq: int = 0  # the last JetStream sequence read (applied, the snapshot's, or dropped)
    batches: int = 0
    missed: int = 0  # times records were missing (retention, a relay's drops): the worker went unsynced
    duplicates: int = 0
    snapshot_loaded: bool = False


@dataclass
class BusFollower:
    """Applies a relay's records to a feeder in order, checking that none is missing. Pure: ``now`` given.

    A record is applied to the worker whose subject it was read from, never to the one its payload names: the
    subject is what the bus's permissions guard (docs/event-bus.md) and what this router chose to follow. A
    record whose payload names another worker, or one this router does not follow (``follow``), is dropped and
    counted by reason (``dropped``), creating no state: the state held is one ``FollowState`` per followed
    worker, however many names arrive."""

    feeder: IndexFeeder
    states: dict[str, FollowState] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DROP_REASONS, 0))

    def follow(self, worker_id: str) -> FollowState:
        """Start following a worker (the fleet discovered it); its state, kept if it already had one."""
        return self.state(worker_id)

    def state(self, worker_id: str) -> FollowState:
        st = self.states.get(worker_id)
        if st is None:
            st = self.states[worker_id] = FollowState()
        return st

    def restore(self, snapshot: IndexSnapshot, now: float) -> None:
        """Start from a snapshot: the worker's index as the relay had it after record ``snapshot.n``."""
        if snapshot.worker_id not in self.states:
            self.drop(UNKNOWN_WORKER)
            return
        self.feeder.restore(snapshot.worker_id, snapshot.entries(), snapshot.last_seq, snapshot.synced, now)
        st = self.state(snapshot.worker_id)
        st.epoch, st.n, st.stream_seq, st.snapshot_loaded = snapshot.epoch, snapshot.n, snapshot.stream_seq, True

    def drop(self, reason: str, worker_id: str | None = None, stream_seq: int = 0) -> None:
        """Count a record not applied; read past it on ``worker_id``'s subject (a resubscription starts after)."""
        self.dropped[reason] += 1
        st = self.states.get(worker_id) if worker_id is not None else None
        if st is not None:
            st.stream_seq = max(st.stream_seq, stream_seq)

    def check(self, worker_id: str, record: BusRecord) -> str | None:
        """The drop reason for ``record`` read on ``worker_id``'s subject, or None: apply it."""
        if record_problem(record) is not None:
            return MALFORMED
        if worker_id not in self.states or record.worker_id not in self.states:
            return UNKNOWN_WORKER
        if record.worker_id != worker_id:
            return WORKER_MISMATCH
        return None

    def apply_steps(self, worker_id: str, record: BusRecord, stream_seq: int, now: float) -> Steps[None]:
        """Apply ``record``, read on ``worker_id``'s subject at ``stream_seq`` (or drop it: ``check``)."""
        reason = self.check(worker_id, record)
        if reason is not None:
            if reason == MALFORMED:
                log.debug("worker %s: malformed bus record at %d: %s", worker_id, stream_seq, record_problem(record))
            self.drop(reason, worker_id, stream_seq)
            return
        st = self.states[worker_id]
        if record.epoch == st.epoch and record.n <= st.n:
            st.duplicates += 1  # delivered again (a consumer recreated after an outage): applied already
            st.stream_seq = max(st.stream_seq, stream_seq)
            return
        continuous = (record.epoch == st.epoch and record.n == st.n + 1) or (record.kind == RESET and record.n == 0)
        st.epoch, st.n, st.stream_seq = record.epoch, record.n, stream_seq
        if not continuous:
            st.missed += 1
            log.warning("worker %s: bus records missing before %s.%d: index cleared (unsynced)",
                        worker_id, record.epoch[:40], record.n)
            self.feeder.desync(worker_id, now)
        if record.kind == BATCH and record.batch is not None:
            st.batches += 1
            yield from self.feeder.apply_relayed_steps(worker_id, record.seq, record.batch, record.synced, now)
        elif record.kind == RESET:
            self.feeder.reset_relayed(worker_id)
        elif record.kind == UNSYNCED:
            self.feeder.desync_relayed(worker_id, now)

    def forget(self, worker_id: str) -> None:
        self.states.pop(worker_id, None)
