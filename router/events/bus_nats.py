"""The event bus's NATS adapter: connecting, reading snapshots, and ``BusSubscriber``, a router's events from
JetStream with the ZeroMQ subscriber's shape (add_source / remove_source / ready / start / stop), so the fleet,
/ready and the diagnosis work unchanged. The records, the snapshot format and ``BusFollower`` (the pure
apply) are router/events/bus.py; docs/event-bus.md has the design, the failure modes and the bus's
authentication (``NatsAuth``: user/password, token, nkey, creds file, TLS) and permissions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec

from router.aio import cancel_and_wait
from router.events.bus import (
    DROP_REASONS,
    MALFORMED,
    SNAPSHOT_BUCKET,
    SNAPSHOT_VERSION,
    STREAM,
    SUBJECT_PREFIX,
    BusFollower,
    IndexSnapshot,
    decode_record,
    decode_snapshot,
    subject_of,
    worker_token,
)
from router.events.feed import IndexFeeder
from router.events.subscriber import EventSource, drive
from router.nats_connection import NatsAuth, connect_nats

log = logging.getLogger(__name__)


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
                 request_timeout_s: float = 10.0, auth: NatsAuth | None = None) -> None:
        """``setup_concurrency``: workers whose snapshot and consumer are being set up at once (a thousand
        workers at start would otherwise be a thousand JetStream API requests at once, timing out).
        ``auth``: the credentials and TLS this router presents to the bus."""
        self.feeder = feeder
        self.url = url
        self.auth = auth
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
        self.refused: str | None = None  # the server's last refusal (credentials, permissions, TLS), for stats
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
        self._nc = await connect_nats(self.url, "kvrouter-router", retry_s=self.retry_s, auth=self.auth,
                                      on_error=self._on_error, reconnected_cb=self._on_reconnected,
                                      while_down="routing on the index held (load-only for workers it lacks); "
                                      "retrying")
        self.refused = None
        self._js = self._nc.jetstream(timeout=self.request_timeout_s)
        self._connected.set()

    def _on_error(self, e: BaseException, refusal: str | None) -> None:
        if refusal is not None:
            self.refused = refusal

    async def _on_reconnected(self) -> None:
        self.refused = None  # admitted again: a refusal seen while reconnecting is over

    @property
    def connected(self) -> bool:
        return self._nc is not None and bool(self._nc.is_connected)

    def add_source(self, source: EventSource) -> None:
        """Follow one worker (its ZeroMQ endpoints are the relay's business; only the id counts here): only
        followed workers' records are applied, and only from their own subjects."""
        self.remove_source(source.worker_id)
        self.follower.follow(source.worker_id)
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
            meta = msg.metadata
            seq = meta.sequence.stream
            try:
                record = decode_record(msg.data)
            except (msgspec.DecodeError, msgspec.ValidationError):
                self.follower.drop(MALFORMED, worker_id, seq)
            else:  # applied to the worker whose subject it came on, if its payload agrees (else dropped)
                await drive(self.follower.apply_steps(worker_id, record, seq, self.clock()))
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
            "missed": sum(s.missed for s in states), "messages": self.messages,
            "malformed": self.follower.dropped[MALFORMED], "dropped": dict(self.follower.dropped),
            "connected": self.connected, "refused": self.refused,
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
        dropped = CounterMetricFamily("kvrouter_bus_records_dropped", "Records read from the event bus and not "
                                      "applied, by reason: malformed, worker_mismatch (the payload names another "
                                      "worker than its subject), unknown_worker (one this router does not follow).",
                                      labels=["reason"])
        for reason in DROP_REASONS:
            dropped.add_metric([reason], s["dropped"][reason])
        yield dropped
        yield GaugeMetricFamily("kvrouter_bus_connected", "1 while connected to the event bus, 0 while it is "
                                "down or refuses this router (load-only routing for the workers it lacks).",
                                value=1.0 if s["connected"] else 0.0)
        yield GaugeMetricFamily("kvrouter_bus_lag_records", "Most records any worker's consumer is behind.",
                                value=s["lag_msgs_max"])
        yield GaugeMetricFamily("kvrouter_bus_lag_seconds", "Largest age of a record when it was applied.",
                                value=s["lag_s_max"])
