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

``BusFollower`` applies records to a feeder (pure, no I/O); ``BusSubscriber`` is its NATS adapter, with
the ZeroMQ subscriber's shape (add_source / remove_source / ready / start / stop) so the fleet, /ready
and the diagnosis work unchanged. docs/event-bus.md has the design and the failure modes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from router.aio import cancel_and_wait
from router.events.codec import EventBatch
from router.events.feed import IndexFeeder, Steps
from router.events.subscriber import EventSource, drive
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
@dataclass(slots=True)
class FollowState:
    """Where one worker's consumer stands: the last record applied and what it cost to get there."""

    epoch: str | None = None
    n: int = -1
    stream_seq: int = 0  # the last JetStream sequence applied (or the snapshot's)
    batches: int = 0
    missed: int = 0  # times records were missing (retention, a relay's drops): the worker went unsynced
    duplicates: int = 0
    snapshot_loaded: bool = False


@dataclass
class BusFollower:
    """Applies a relay's records to a feeder in order, checking that none is missing. Pure: ``now`` given."""

    feeder: IndexFeeder
    states: dict[str, FollowState] = field(default_factory=dict)

    def state(self, worker_id: str) -> FollowState:
        st = self.states.get(worker_id)
        if st is None:
            st = self.states[worker_id] = FollowState()
        return st

    def restore(self, snapshot: IndexSnapshot, now: float) -> None:
        """Start from a snapshot: the worker's index as the relay had it after record ``snapshot.n``."""
        self.feeder.restore(snapshot.worker_id, snapshot.entries(), snapshot.last_seq, snapshot.synced, now)
        st = self.state(snapshot.worker_id)
        st.epoch, st.n, st.stream_seq, st.snapshot_loaded = snapshot.epoch, snapshot.n, snapshot.stream_seq, True

    def apply_steps(self, record: BusRecord, stream_seq: int, now: float) -> Steps[None]:
        wid = record.worker_id
        st = self.state(wid)
        if record.epoch == st.epoch and record.n <= st.n:
            st.duplicates += 1  # delivered again (a consumer recreated after an outage): applied already
            return
        continuous = (record.epoch == st.epoch and record.n == st.n + 1) or (record.kind == RESET and record.n == 0)
        st.epoch, st.n, st.stream_seq = record.epoch, record.n, stream_seq
        if not continuous:
            st.missed += 1
            log.warning("worker %s: bus records missing before %s.%d: index cleared (unsynced)",
                        wid, record.epoch, record.n)
            self.feeder.desync(wid, now)
        if record.kind == BATCH and record.batch is not None:
            st.batches += 1
            yield from self.feeder.apply_relayed_steps(wid, record.seq, record.batch, record.synced, now)
        elif record.kind == RESET:
            self.feeder.reset_relayed(wid)
        elif record.kind == UNSYNCED:
            self.feeder.desync_relayed(wid, now)

    def forget(self, worker_id: str) -> None:
        self.states.pop(worker_id, None)


# ---- NATS adapters -----------------------------------------------------------------------------
async def connect_bus(url: str, name: str, retry_s: float = 0.5) -> Any:
    """A NATS connection that reconnects forever; the first connect is retried too (the bus may start
    after us)."""
    import nats

    async def _error(e: Exception) -> None:
        log.debug("nats %s: %r", name, e)

    while True:
        try:
            return await nats.connect(url, name=name, max_reconnect_attempts=-1, reconnect_time_wait=retry_s,
                                      connect_timeout=2, allow_reconnect=True, error_cb=_error)
        except Exception as e:  # no servers yet: keep trying, as a reconnect would
            log.info("event bus %s not reachable (%r); retrying", url, e)
            await asyncio.sleep(retry_s)


async def load_snapshot(store: Any, worker_id: str) -> IndexSnapshot | None:
    """The latest snapshot of a worker in the object ``store``, or None (none, or one we cannot read)."""
    from nats.js.errors import NotFoundError, ObjectNotFoundError

    try:
        result = await store.get(worker_token(worker_id))
    except (ObjectNotFoundError, NotFoundError):
        return None
    try:
        snap = decode_snapshot(result.data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        log.warning("snapshot of %s unreadable (%s): replaying its stream instead", worker_id, e)
        return None
    return snap if snap.version == SNAPSHOT_VERSION and snap.worker_id == worker_id else None


class BusSubscriber:
    """A router's events from the bus: per worker, its latest snapshot, then its subject from the record
    after it, through an ordered (ephemeral, flow-controlled, self-resetting) JetStream consumer."""

    bind: str | None = None  # the ZeroMQ subscriber's bind-mode fields, never used here (diagnosis reads them)
    bound_endpoint: str | None = None

    def __init__(self, feeder: IndexFeeder, url: str, *, clock: Callable[[], float] = time.monotonic,
                 heartbeat_s: float = 1.0, retry_s: float = 0.5, use_snapshots: bool = True,
                 subject_prefix: str = SUBJECT_PREFIX, setup_concurrency: int = 32,
                 request_timeout_s: float = 10.0) -> None:
        """``setup_concurrency``: workers whose snapshot and consumer are being set up at once (a thousand
        workers at start would otherwise be a thousand JetStream API requests at once, timing out)."""
        self.feeder = feeder
        self.url = url
        self.clock = clock
        self.heartbeat_s = heartbeat_s
        self.retry_s = retry_s
        self.use_snapshots = use_snapshots
        self.subject_prefix = subject_prefix
        self.follower = BusFollower(feeder)
        self.replay_endpoints: dict[str, str] = {}  # unused on the bus (the relay asks the engine)
        self.ready: set[str] = set()  # workers caught up with their stream as it was when we subscribed
        self.snapshot_loads = 0
        self.messages = 0
        self.malformed = 0
        self.lag_msgs: dict[str, int] = {}  # records still pending behind the last one applied
        self.lag_s: dict[str, float] = {}  # age of the last record applied when it was applied
        self.request_timeout_s = request_timeout_s
        self.setup_retries = 0
        self._setup = asyncio.Semaphore(setup_concurrency)
        self._nc: Any = None
        self._js: Any = None
        self._store: Any = None  # the snapshot bucket, once it exists
        self._connected = asyncio.Event()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._connect_task: asyncio.Task[None] | None = None

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        self._connect_task = asyncio.create_task(self._connect())

    async def _connect(self) -> None:
        self._nc = await connect_bus(self.url, "kvrouter-router", self.retry_s)
        self._js = self._nc.jetstream(timeout=self.request_timeout_s)
        self._connected.set()

    def add_source(self, source: EventSource) -> None:
        """Follow one worker (its ZeroMQ endpoints are the relay's business; only the id counts here)."""
        self.remove_source(source.worker_id)
        self._tasks[source.worker_id] = asyncio.create_task(self._follow(source.worker_id))

    def remove_source(self, worker_id: str) -> None:
        task = self._tasks.pop(worker_id, None)
        if task is not None:
            task.cancel()
        self.ready.discard(worker_id)
        self.follower.forget(worker_id)
        self.lag_msgs.pop(worker_id, None)
        self.lag_s.pop(worker_id, None)

    async def stop(self) -> None:
        tasks = [*self._tasks.values(), *([self._connect_task] if self._connect_task else [])]
        self._tasks.clear()
        await cancel_and_wait(tasks)
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.close()

    # ---- one worker ----------------------------------------------------------------------------
    async def _follow(self, worker_id: str) -> None:
        from nats.js.api import ConsumerConfig, DeliverPolicy

        await self._connected.wait()
        js = self._js
        subject = subject_of(worker_id, self.subject_prefix)
        st = self.follower.state(worker_id)
        while True:  # the bus or the stream may not be there yet; a subscription that ends is made again
            try:
                async with self._setup:
                    if self.use_snapshots and not st.snapshot_loaded and st.epoch is None:
                        await self._load_snapshot(js, worker_id)
                    head = await self._head_seq(js, subject)
                    config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                                            opt_start_seq=st.stream_seq + 1)
                    sub = await js.subscribe(subject, stream=STREAM, ordered_consumer=True, config=config,
                                             idle_heartbeat=self.heartbeat_s)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.setup_retries += 1
                log.info("worker %s: event bus not ready (%r %s); retrying", worker_id, e,
                         getattr(e, "description", ""))
                await asyncio.sleep(self.retry_s)
                continue
            try:
                if head <= st.stream_seq:
                    self.ready.add(worker_id)
                await self._consume(worker_id, sub, head)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("worker %s: event bus subscription ended (%r); subscribing again", worker_id, e)
                await asyncio.sleep(self.retry_s)
            finally:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    async def _load_snapshot(self, js: Any, worker_id: str) -> None:
        from nats.js.errors import BucketNotFoundError

        if self._store is None:
            try:
                self._store = await js.object_store(SNAPSHOT_BUCKET)
            except BucketNotFoundError:
                return  # no relay has written one yet: the stream from its start
        snap = await load_snapshot(self._store, worker_id)
        if snap is None:
            return
        if snap.block_size != self.feeder.block_size:
            log.warning("worker %s: snapshot made for block size %s, routing uses %s: replaying its stream",
                        worker_id, snap.block_size, self.feeder.block_size)
            return
        self.follower.restore(snap, self.clock())
        self.snapshot_loads += 1
        log.info("worker %s: snapshot at %s.%d (%d rows) loaded", worker_id, snap.epoch, snap.n, len(snap.rows))

    async def _consume(self, worker_id: str, sub: Any, head: int) -> None:
        async for msg in sub.messages:
            self.messages += 1
            try:
                record = decode_record(msg.data)
            except (msgspec.DecodeError, msgspec.ValidationError):
                self.malformed += 1
                continue
            meta = msg.metadata
            seq = meta.sequence.stream
            await drive(self.follower.apply_steps(record, seq, self.clock()))
            self.lag_msgs[worker_id] = meta.num_pending
            self.lag_s[worker_id] = max(0.0, time.time() - meta.timestamp.timestamp())
            if seq >= head:
                self.ready.add(worker_id)

    async def _head_seq(self, js: Any, subject: str) -> int:
        """The stream sequence of the worker's latest record now (0: none): caught up once past it."""
        from nats.js.errors import NotFoundError

        try:
            return int((await js.get_last_msg(STREAM, subject)).seq)
        except NotFoundError:
            return 0

    # ---- metrics -----------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        states = self.follower.states.values()
        return {
            "batches": sum(s.batches for s in states), "snapshot_loads": self.snapshot_loads,
            "missed": sum(s.missed for s in states), "messages": self.messages, "malformed": self.malformed,
            "lag_msgs_max": max(self.lag_msgs.values(), default=0),
            "lag_s_max": max(self.lag_s.values(), default=0.0), "ready": len(self.ready),
            "setup_retries": self.setup_retries,
        }

    def metric_families(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.stats()
        yield CounterMetricFamily("kvrouter_bus_batches", "Event batches applied from the event bus.",
                                  value=s["batches"])
        yield CounterMetricFamily("kvrouter_bus_snapshot_loads", "Index snapshots loaded from the bus.",
                                  value=s["snapshot_loads"])
        yield CounterMetricFamily("kvrouter_bus_missed", "Times a worker's bus records were missing (unsynced).",
                                  value=s["missed"])
        yield GaugeMetricFamily("kvrouter_bus_lag_records", "Most records any worker's consumer is behind.",
                                value=s["lag_msgs_max"])
        yield GaugeMetricFamily("kvrouter_bus_lag_seconds", "Largest age of a record when it was applied.",
                                value=s["lag_s_max"])
