"""Thin adapters that carry ``LoadExchange`` envelopes (router/load/exchange.py) between replicas.

- ``NatsLoadBus``: router replicas on any hosts, over NATS core subjects ``kvrouter.load.<replica>`` (no
  JetStream: a load delta is worth nothing a few seconds later, so nothing is stored or replayed; what a
  replica misses its peers' heartbeats and expiry repair).
- ``IpcLoadBus``: the processes of one router (``--processes N``) in one pod, over Unix datagram sockets in a
  directory the parent made: each process binds one, and an envelope is one ``sendto`` per sibling from the
  event loop; the receiver's event loop is woken by epoll directly. No broker, no server, no connection to
  keep or re-establish (a restarted process rebinds its path), and no I/O threads: ZeroMQ PUB/SUB over
  ``ipc://`` was tried first, and its two I/O-thread hand-offs per message added 0.9 ms to the proxy's p50 at
  concurrency 1 on a busy 2-core box (each is a wake-up competing for the cores the request needs). Shared
  memory was the other candidate: it would need a fixed-layout table, cross-process locks and an allocator
  for the block keys, and it would be a second fold beside the one the replicas need anyway; the same deltas
  and the same fold serve both here.

``LoadSync`` drives one exchange over one bus: the outbox flushed ``flush_s`` (2 ms) after its first delta, so
the deltas of every request that moved meanwhile share one envelope (a dispatch, its first token and its end
are often one message, not three: on a busy box each message costs a wake-up of every other process), a
heartbeat and an expiry pass every ``heartbeat_s``, a farewell on stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from router.load.exchange import LoadExchange
from router.nats_connection import connect_nats

log = logging.getLogger(__name__)

SUBJECT_PREFIX = "kvrouter.load"

OnMessage = Callable[[bytes], None]


class LoadBus(Protocol):
    max_message_bytes: int | None  # the largest envelope it carries (None: no limit known)

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
        self.max_message_bytes: int | None = None  # the server's max_payload, once connected
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
        async def deliver(msg) -> None:  # type: ignore[no-untyped-def]
            on_message(msg.data)

        nc = await connect_nats(self.url, f"kvrouter-load-{self.replica_id}", no_echo=True,
                                while_down="routing on this replica's own load; retrying")
        await nc.subscribe(self.pattern, cb=deliver)
        self.max_message_bytes = nc.max_payload
        self._nc = nc
        log.info("shared load on %s as replica %s", self.url, self.replica_id)

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


def socket_path(directory: str | Path, index: int) -> Path:
    return Path(directory) / f"load-{index}.sock"


class IpcLoadBus:
    """Process ``index`` of ``count``: a Unix datagram socket bound at ``load-<index>.sock`` in ``directory``;
    an envelope is one datagram sent to every sibling's path. Nothing blocks: a sibling not bound yet (starting,
    restarting) or with a full buffer misses that envelope (``dropped``), which its next heartbeat repairs."""

    def __init__(self, directory: str | Path, index: int, count: int) -> None:
        self.path = socket_path(directory, index)
        self.siblings = [str(socket_path(directory, i)) for i in range(count) if i != index]
        self.dropped = 0
        self.max_message_bytes: int | None = None
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self, on_message: OnMessage) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setblocking(False)
        with contextlib.suppress(OSError):  # as large as the host allows: a burst must not be dropped
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        # a datagram must fit the send buffer (the kernel reports twice what it grants)
        self.max_message_bytes = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) // 2 - 4096
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # a previous process of this index left it
        sock.bind(str(self.path))
        self._sock = sock
        self._loop = asyncio.get_running_loop()

        def readable() -> None:
            while True:
                try:
                    data = sock.recv(1 << 22)
                except (BlockingIOError, InterruptedError):
                    return
                on_message(data)

        self._loop.add_reader(sock.fileno(), readable)

    def publish(self, data: bytes) -> None:
        sock = self._sock
        if sock is None:
            return
        for path in self.siblings:
            try:
                sock.sendto(data, path)
            except OSError:  # not bound yet, gone, or its buffer full: repaired by the next heartbeat
                self.dropped += 1

    async def stop(self) -> None:
        if self._sock is not None:
            if self._loop is not None:
                self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


class LoadSync:
    """Keeps ``exchange`` flowing over ``bus``."""

    def __init__(self, exchange: LoadExchange, bus: LoadBus, *, heartbeat_s: float = 0.5, flush_s: float = 0.002,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``flush_s``: how long deltas wait to share an envelope (0: flushed at the next event-loop pass)."""
        self.exchange = exchange
        self.bus = bus
        self.heartbeat_s = heartbeat_s
        self.flush_s = flush_s
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
            if self.flush_s > 0:
                self._loop.call_later(self.flush_s, self._flush)
            else:
                self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        while (data := self.exchange.take_batch(self.bus.max_message_bytes)) is not None:
            self.bus.publish(data)

    async def _beat(self) -> None:
        while True:
            self._flush()
            self.bus.publish(self.exchange.heartbeat(self.bus.max_message_bytes))
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


__all__ = ["IpcLoadBus", "LoadBus", "LoadSync", "NatsLoadBus", "socket_path"]
