"""Thin adapters that carry ``LoadExchange`` envelopes (router/load/exchange.py) between replicas.

- ``NatsLoadBus``: router replicas on any hosts, over NATS core subjects ``kvrouter.load.<replica>`` (no
  JetStream: a load delta is worth nothing a few seconds later, so nothing is stored or replayed; what a
  replica misses its peers' heartbeats and expiry repair).
- ``IpcLoadBus``: the processes of one router (``--processes N``) in one pod, over ZeroMQ PUB/SUB on
  ``ipc://`` sockets in a directory the parent made: each process binds its own PUB and connects a SUB to
  every sibling's. No broker and no server to run, a restarted process rebinds its path and its siblings'
  SUBs reconnect on their own; a Unix socket costs tens of microseconds per envelope. Shared memory was the
  other candidate: it would need a fixed-layout table, cross-process locks and an allocator for the block
  keys, and it would be a second fold beside the one the replicas need anyway; the same deltas and the same
  fold serve both here.

``LoadSync`` drives one exchange over one bus: the outbox flushed once per event-loop pass (however many
requests moved in it), a heartbeat and an expiry pass every ``heartbeat_s``, a farewell on stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import zmq
import zmq.asyncio

from router.load.exchange import LoadExchange

log = logging.getLogger(__name__)

SUBJECT_PREFIX = "kvrouter.load"

OnMessage = Callable[[bytes], None]


class LoadBus(Protocol):
    async def start(self, on_message: OnMessage) -> None: ...

    def publish(self, data: bytes) -> None: ...

    async def stop(self) -> None: ...


class NatsLoadBus:
    """Publishes on ``kvrouter.load.<replica>``, subscribes to ``kvrouter.load.*``. A bus that is down at start
    or later is retried in the background; meanwhile the replica routes on its own load only."""

    def __init__(self, url: str, replica_id: str, subject_prefix: str = SUBJECT_PREFIX) -> None:
        self.url = url
        self.subject = f"{subject_prefix}.{replica_id}"
        self.pattern = f"{subject_prefix}.*"
        self.replica_id = replica_id
        self._nc = None  # nats.aio.client.Client once connected
        self._connecting: asyncio.Task[None] | None = None
        self._sends: set[asyncio.Task[None]] = set()

    @property
    def connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    async def start(self, on_message: OnMessage) -> None:
        self._connecting = asyncio.create_task(self._connect(on_message))
        with contextlib.suppress(TimeoutError):  # a bus that is up is used from the first request
            await asyncio.wait_for(asyncio.shield(self._connecting), 2.0)

    async def _connect(self, on_message: OnMessage) -> None:
        import nats
        from nats.errors import NoServersError

        async def deliver(msg) -> None:  # type: ignore[no-untyped-def]
            on_message(msg.data)

        while True:
            try:
                nc = await nats.connect(self.url, name=f"kvrouter-load-{self.replica_id}", no_echo=True,
                                        max_reconnect_attempts=-1, reconnect_time_wait=0.5, connect_timeout=2)
                await nc.subscribe(self.pattern, cb=deliver)
                self._nc = nc
                log.info("shared load on %s as replica %s", self.url, self.replica_id)
                return
            except (NoServersError, OSError, TimeoutError) as e:
                log.warning("load bus %s unreachable (%r): routing on this replica's own load; retrying", self.url, e)
                await asyncio.sleep(1.0)

    def publish(self, data: bytes) -> None:
        if self._nc is None:
            return
        task = asyncio.ensure_future(self._nc.publish(self.subject, data))
        self._sends.add(task)
        task.add_done_callback(self._sent)

    def _sent(self, task: asyncio.Task[None]) -> None:
        self._sends.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("load publish failed: %r", task.exception())

    async def stop(self) -> None:
        if self._connecting is not None and not self._connecting.done():
            self._connecting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._connecting
        if self._nc is not None:
            with contextlib.suppress(Exception):  # a bus already gone: nothing to flush
                await asyncio.wait_for(self._nc.drain(), 2.0)
            self._nc = None


def ipc_endpoint(directory: str | Path, index: int) -> str:
    return f"ipc://{Path(directory) / f'load-{index}.sock'}"


class IpcLoadBus:
    """Process ``index`` of ``count``: binds ``load-<index>.sock`` in ``directory``, hears every sibling's."""

    def __init__(self, directory: str | Path, index: int, count: int) -> None:
        self.directory = Path(directory)
        self.index = index
        self.count = count
        self._ctx = zmq.asyncio.Context.instance()
        self._pub: zmq.asyncio.Socket | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self, on_message: OnMessage) -> None:
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, 100_000)
        pub.bind(ipc_endpoint(self.directory, self.index))
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        for i in range(self.count):
            if i != self.index:
                sub.connect(ipc_endpoint(self.directory, i))  # before the sibling binds is fine: zmq retries
        self._pub, self._sub = pub, sub
        self._task = asyncio.create_task(self._receive(sub, on_message))

    async def _receive(self, sub: zmq.asyncio.Socket, on_message: OnMessage) -> None:
        while True:
            data = await sub.recv()
            on_message(data)
            while True:  # everything already queued, without a trip through the loop each
                try:
                    data = sub.recv(zmq.NOBLOCK).result()
                except zmq.Again:
                    break
                on_message(data)

    def publish(self, data: bytes) -> None:
        if self._pub is not None:
            self._pub.send(data, zmq.NOBLOCK)  # PUB never blocks: at the high-water mark it drops

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._pub is not None:
            self._pub.close(linger=200)  # time for the farewell to leave
        if self._sub is not None:
            self._sub.close(linger=0)
        self._pub = self._sub = None


class LoadSync:
    """Keeps ``exchange`` flowing over ``bus``."""

    def __init__(self, exchange: LoadExchange, bus: LoadBus, *, heartbeat_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.exchange = exchange
        self.bus = bus
        self.heartbeat_s = heartbeat_s
        self.clock = clock
        self._flush_scheduled = False
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.exchange.wake = self._wake
        await self.bus.start(self._received)
        self._task = asyncio.create_task(self._beat())

    def _received(self, data: bytes) -> None:
        self.exchange.receive(data, self.clock())

    def _wake(self) -> None:
        if not self._flush_scheduled and self._loop is not None:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        data = self.exchange.take_batch()
        if data is not None:
            self.bus.publish(data)

    async def _beat(self) -> None:
        while True:
            self.bus.publish(self.exchange.heartbeat())
            self.exchange.expire(self.clock())
            await asyncio.sleep(self.heartbeat_s)

    async def stop(self) -> None:
        self.exchange.wake = None
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._flush()
        self.bus.publish(self.exchange.farewell())
        await self.bus.stop()


__all__ = ["IpcLoadBus", "LoadBus", "LoadSync", "NatsLoadBus", "ipc_endpoint"]
