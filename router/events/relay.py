"""``kvrouter relay``: engines' ZeroMQ KV events onto the event bus (NATS JetStream), exact and in order.

One relay per engine (a sidecar) or per node (several workers). It reads each engine's PUB and replay
sockets with the router's own feed rules (``KvEventSubscriber`` into an ``IndexFeeder`` over a ``KvIndex``
of its own: gaps filled from replay, restarts, resets, unrecoverable gaps) and publishes what that feed did
(router/events/bus.py's ``BusRecord``s, told by the feeder's journal hook) on one subject per worker, each
record once (``Nats-Msg-Id``), in order (one publish in flight per worker, retried until acknowledged).
While the bus is down records wait in a bounded outbox per worker; when one overflows its records are
dropped (counted), the relay's own entries for that worker are cleared and an ``unsynced`` record follows,
so consumers learn they are unsynced and are never silently wrong. Every ``snapshot_interval_s`` (and on
request, ``kvrouter.relay.snapshot``) it writes each changed worker's index snapshot to the object store.
It presents ``auth`` (router/nats_connection.py's ``NatsAuth``) to the bus; a server that refuses it is logged
as an error and the relay holds its records as while the bus is down.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq.asyncio

from router.aio import cancel_and_wait
from router.events.bus import (
    BATCH,
    RESET,
    SNAPSHOT_BUCKET,
    SNAPSHOT_REQUEST_SUBJECT,
    STREAM,
    SUBJECT_PREFIX,
    UNSYNCED,
    BusRecord,
    IndexSnapshot,
    encode_record,
    encode_snapshot,
    snapshot_rows,
    subject_of,
    worker_token,
)
from router.events.codec import EventBatch
from router.events.feed import IndexFeeder
from router.events.subscriber import EventSource, KvEventSubscriber
from router.index import KvIndex
from router.nats_connection import NatsAuth, connect_nats

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Retention:
    """How long the bus keeps a worker's records: a consumer whose snapshot is older misses records (and
    says unsynced), so snapshots must come well within ``max_age_s``."""

    max_age_s: float = 3600.0
    max_bytes: int = 1 << 30
    duplicate_window_s: float = 120.0  # a publish retried within this is stored once
    # every replica holds one ordered consumer per worker; nats-server 2.15 caps a stream without its own
    # limit at 1,000 consumers (and reads -1 as that default), so the limit is always set
    max_consumers: int = 65_536


@dataclass(slots=True)
class Outbox:
    """One worker's records on their way to the bus, oldest first; ``inflight`` is being published."""

    worker_id: str
    subject: str
    next_n: int = 0
    pending: deque[BusRecord] = field(default_factory=deque)
    inflight: BusRecord | None = None
    acked_n: int = -1
    acked_stream_seq: int = 0
    published: int = 0
    dropped: int = 0  # records dropped because the bus was down longer than the outbox holds
    retries: int = 0
    snapshot_n: int = -1  # the record the last snapshot written is exact after
    waiters: dict[int, asyncio.Future[int]] = field(default_factory=dict)  # record n -> its stream seq
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def empty(self) -> bool:
        return self.inflight is None and not self.pending


async def ensure_stream(js: Any, retention: Retention, prefix: str = SUBJECT_PREFIX) -> None:
    """Create the events stream, or bring an existing one to this retention (the last relay started wins)."""
    from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
    from nats.js.errors import BadRequestError

    config = StreamConfig(name=STREAM, subjects=[f"{prefix}.>"], max_age=retention.max_age_s,
                          max_bytes=retention.max_bytes, duplicate_window=retention.duplicate_window_s,
                          max_consumers=retention.max_consumers,
                          storage=StorageType.FILE, retention=RetentionPolicy.LIMITS, discard=DiscardPolicy.OLD)
    try:
        await js.add_stream(config)
    except BadRequestError:  # exists with another configuration
        await js.update_stream(config)


async def ensure_snapshot_store(js: Any) -> Any:
    from nats.js.api import ObjectStoreConfig, StorageType
    from nats.js.errors import BucketNotFoundError

    try:
        return await js.object_store(SNAPSHOT_BUCKET)
    except BucketNotFoundError:
        return await js.create_object_store(SNAPSHOT_BUCKET, config=ObjectStoreConfig(storage=StorageType.FILE))


class Relay:
    def __init__(
        self,
        url: str,
        sources: Sequence[EventSource],
        *,
        block_size: int | None = 16,
        retention: Retention | None = None,
        snapshot_interval_s: float = 30.0,
        outbox_limit: int = 10_000,
        publish_timeout_s: float = 2.0,
        replay_timeout_s: float = 1.0,
        subject_prefix: str = SUBJECT_PREFIX,
        clock: Callable[[], float] = time.monotonic,
        ctx: zmq.asyncio.Context | None = None,
        auth: NatsAuth | None = None,
    ) -> None:
        self.url = url
        self.auth = auth
        self.refused: str | None = None  # the server's last refusal (credentials, permissions, TLS)
        self.sources = list(sources)
        self.block_size = block_size
        self.retention = retention or Retention()
        self.snapshot_interval_s = snapshot_interval_s
        self.outbox_limit = outbox_limit
        self.publish_timeout_s = publish_timeout_s
        self.subject_prefix = subject_prefix
        self.clock = clock
        self.epoch = secrets.token_hex(6)  # this process's records; a restarted relay starts a new epoch
        self.index = KvIndex()
        self.feeder = IndexFeeder(self.index, block_size=block_size)
        self.feeder.journal = self
        self.subscriber = KvEventSubscriber(self.feeder, clock=clock, replay_timeout_s=replay_timeout_s, ctx=ctx)
        self.outboxes: dict[str, Outbox] = {}
        self.snapshots_written = 0
        self._nc: Any = None
        self._js: Any = None
        self._store: Any = None
        self._bus_ready = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    # ---- the feeder's journal (synchronous, in the feed's order) -------------------------------
    def applied(self, worker_id: str, seq: int, batch: EventBatch, synced: bool) -> None:
        self._enqueue(worker_id, BATCH, seq, synced, batch)

    def reset(self, worker_id: str) -> None:
        self._enqueue(worker_id, RESET)

    def desynced(self, worker_id: str) -> None:
        self._enqueue(worker_id, UNSYNCED)

    def outbox(self, worker_id: str) -> Outbox:
        box = self.outboxes.get(worker_id)
        if box is None:
            box = self.outboxes[worker_id] = Outbox(worker_id, subject_of(worker_id, self.subject_prefix))
            self._tasks.append(asyncio.create_task(self._publish_loop(box)))
        return box

    def _enqueue(self, worker_id: str, kind: str, seq: int = -1, synced: bool = False,
                 batch: EventBatch | None = None) -> None:
        box = self.outbox(worker_id)
        if len(box.pending) >= self.outbox_limit:
            self._overflow(box)  # this record's change is undone by the clear there: not sent either
            return
        box.pending.append(BusRecord(kind, worker_id, self.epoch, box.next_n, seq, synced, batch))
        box.next_n += 1
        box.wake.set()

    def _overflow(self, box: Outbox) -> None:
        """The bus has been away longer than the outbox holds: drop what waits, clear our own entries and
        send ``unsynced`` (its n skips the dropped ones, so a consumer also sees records are missing)."""
        box.dropped += len(box.pending)
        log.warning("worker %s: event bus unreachable, %d records dropped: index cleared (unsynced)",
                    box.worker_id, len(box.pending))
        box.pending.clear()
        for fut in box.waiters.values():
            fut.cancel()
        box.waiters.clear()
        self.feeder.desync(box.worker_id, self.clock())  # journals the UNSYNCED record

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Start reading the engines at once; records wait in the outboxes until the bus is reachable."""
        for src in self.sources:
            self.reset(src.worker_id)  # record 0 of every epoch: what consumers held before is void
        await self.subscriber.start()
        for src in self.sources:
            self.subscriber.add_source(src)
        self._tasks.append(asyncio.create_task(self._connect()))
        self._tasks.append(asyncio.create_task(self._snapshot_loop()))

    async def _connect(self) -> None:
        self._nc = await connect_nats(self.url, f"kvrouter-relay-{self.epoch}", auth=self.auth,
                                      on_error=self._on_error, reconnected_cb=self._on_reconnected,
                                      while_down="holding records in the outbox; retrying")
        self.refused = None
        self._js = self._nc.jetstream()
        while True:
            try:
                await ensure_stream(self._js, self.retention, self.subject_prefix)
                self._store = await ensure_snapshot_store(self._js)
                break
            except Exception as e:  # JetStream not ready yet (or the server restarting)
                log.info("event bus %s: stream not ready (%r); retrying", self.url, e)
                await asyncio.sleep(0.5)
        await self._nc.subscribe(SNAPSHOT_REQUEST_SUBJECT, cb=self._on_snapshot_request)
        self._bus_ready.set()

    def _on_error(self, e: BaseException, refusal: str | None) -> None:
        if refusal is not None:
            self.refused = refusal

    async def _on_reconnected(self) -> None:
        self.refused = None  # admitted again: a refusal seen while reconnecting is over

    async def stop(self, flush_timeout_s: float = 5.0) -> None:
        """Stop reading the engines, publish what waits (up to ``flush_timeout_s``), close."""
        await self.subscriber.stop()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.flushed(), flush_timeout_s)
        await cancel_and_wait(self._tasks)
        self._tasks.clear()
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.close()

    async def flushed(self) -> None:
        """Return once every record enqueued so far is acknowledged by the bus."""
        while not all(b.empty for b in self.outboxes.values()):
            await asyncio.sleep(0.01)

    # ---- publishing --------------------------------------------------------------------------
    async def _publish_loop(self, box: Outbox) -> None:
        await self._bus_ready.wait()
        backoff = 0.05
        while True:
            if box.inflight is None:
                if not box.pending:
                    box.wake.clear()
                    await box.wake.wait()
                    continue
                box.inflight = box.pending.popleft()
            record = box.inflight
            try:
                ack = await self._js.publish(box.subject, encode_record(record), timeout=self.publish_timeout_s,
                                             stream=STREAM, headers={"Nats-Msg-Id": record.msg_id})
            except asyncio.CancelledError:
                raise
            except Exception as e:  # bus down or restarting: the same record again (stored once)
                box.retries += 1
                log.debug("publish of %s %s failed (%r); retrying", box.subject, record.msg_id, e)
                await asyncio.sleep(backoff)
                backoff = min(1.0, backoff * 2)
                continue
            backoff = 0.05
            box.inflight = None
            box.published += 1
            box.acked_n, box.acked_stream_seq = record.n, int(ack.seq)
            fut = box.waiters.pop(record.n, None)
            if fut is not None and not fut.done():
                fut.set_result(box.acked_stream_seq)

    # ---- snapshots ---------------------------------------------------------------------------
    async def snapshot(self, worker_id: str, timeout_s: float = 10.0) -> bool:
        """Write one worker's index snapshot if it changed since the last: True if written."""
        box = self.outboxes.get(worker_id)
        if box is None or self._store is None:
            return False
        f = self.feeder.feeds.get(worker_id)
        while f is not None and f.applying:  # between two slices of one batch: not a state any record gives
            await asyncio.sleep(0)
        n = box.next_n - 1
        if n < 0 or n == box.snapshot_n:
            return False
        rows = snapshot_rows(self.index.export_worker(worker_id))
        last_seq, synced = (f.last_seq, f.synced) if f is not None else (None, False)
        if box.acked_n == n:
            stream_seq = box.acked_stream_seq
        else:
            fut = box.waiters.get(n) or asyncio.get_running_loop().create_future()
            box.waiters[n] = fut
            try:
                stream_seq = await asyncio.wait_for(asyncio.shield(fut), timeout_s)
            except (TimeoutError, asyncio.CancelledError):
                return False  # not on the bus in time, or dropped: the next round tries again
        snap = IndexSnapshot(worker_id, self.epoch, n, stream_seq, last_seq, synced, self.block_size, rows,
                             time.time())
        await self._store.put(worker_token(worker_id), encode_snapshot(snap))
        box.snapshot_n = max(box.snapshot_n, n)
        self.snapshots_written += 1
        return True

    async def snapshot_all(self) -> int:
        """Snapshot every changed worker now; how many were written."""
        written = 0
        for wid in list(self.outboxes):
            try:
                written += await self.snapshot(wid)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("snapshot of %s failed", wid)
        return written

    async def _snapshot_loop(self) -> None:
        await self._bus_ready.wait()
        while True:
            await asyncio.sleep(self.snapshot_interval_s)
            await self.snapshot_all()

    async def _on_snapshot_request(self, msg: Any) -> None:
        written = await self.snapshot_all()
        if msg.reply:
            await msg.respond(json.dumps({"relay": self.epoch, "written": written}).encode())

    # ---- status ------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        boxes = self.outboxes.values()
        return {
            "epoch": self.epoch, "workers": len(self.outboxes), "published": sum(b.published for b in boxes),
            "pending": sum(len(b.pending) + (b.inflight is not None) for b in boxes),
            "dropped": sum(b.dropped for b in boxes), "retries": sum(b.retries for b in boxes),
            "snapshots_written": self.snapshots_written, "bus_ready": self._bus_ready.is_set(),
            "connected": self._nc is not None and bool(self._nc.is_connected), "refused": self.refused,
        }


def parse_relay_worker(arg: str) -> EventSource:
    """``--worker``: the router's spec (``URL,events=E[,replay=R][,id=ID][,topic=T]``) or, as a relay needs no
    URL, ``ID,events=E[,replay=R]``; either way the worker id must match the routers'."""
    from router.discovery import DiscoveryError, parse_worker_arg

    head, _, rest = arg.partition(",")
    if not head.startswith(("http://", "https://")):
        arg = f"http://relay.invalid,id={head}" + (f",{rest}" if rest else "")
    spec = parse_worker_arg(arg)
    if not spec.events:
        raise DiscoveryError(f"--worker {arg!r}: a relay needs events=ENDPOINT (the engine's KV-event PUB socket)")
    return EventSource(spec.worker_id, spec.events, spec.replay, spec.topic)


async def run_relay(relay: Relay, stats_every_s: float = 60.0) -> None:
    """Run until cancelled, logging the relay's counters now and then."""
    await relay.start()
    try:
        while True:
            await asyncio.sleep(stats_every_s)
            log.info("relay %s", relay.stats())
    finally:
        await relay.stop()
        log.info("relay stopped: %s", relay.stats())
