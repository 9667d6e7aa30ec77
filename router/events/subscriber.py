"""ZeroMQ adapter: receive engines' KV-event messages and hand them to the feed in order.

Two topologies (vLLM binds its PUB socket when the endpoint has ``*``/``::`` or is ipc/inproc):
- **dial**: one SUB socket per engine, connected to its PUB endpoint; the worker is known per socket.
- **bind**: one SUB socket bound by the router that every engine connects to; the worker is named by
  ``identity(topic, data_parallel_rank)`` (default: the topic, plus ``@dp<rank>`` for ranks > 0).

A gap is filled from the worker's replay socket (DEALER, ``[b"", start_seq]``) before later messages of
that worker are taken; the feed decides what an unfilled gap means. Bad frames are counted, never fatal.
Batches are applied in slices with the event loop free between them (``drive``): a huge one costs the
requests being routed meanwhile a few milliseconds at a time, not a second at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from router.aio import cancel_and_wait
from router.events.codec import (
    SEQ_BYTES,
    EventBatch,
    MalformedFrame,
    decode_message,
    decode_replay_frames,
)
from router.events.feed import IndexFeeder, Steps, T

log = logging.getLogger(__name__)

Identity = Callable[[str, int | None], str]
MAX_SOCKETS = 16384


def default_identity(topic: str, dp_rank: int | None) -> str:
    base = topic or "default"
    return f"{base}@dp{dp_rank}" if dp_rank else base


@dataclass(frozen=True, slots=True)
class EventSource:
    """One engine (one data-parallel rank) whose PUB socket the router dials."""

    worker_id: str
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


async def fetch_replay(
    ctx: zmq.asyncio.Context, endpoint: str, start_seq: int, stop_before: int | None, timeout_s: float
) -> list[tuple[int, EventBatch]]:
    """Ask an engine's replay socket for batches ``start_seq..stop_before-1`` (None: all it has). Best effort."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    out: list[tuple[int, EventBatch]] = []
    try:
        sock.connect(endpoint)
        await sock.send_multipart([b"", start_seq.to_bytes(SEQ_BYTES, "big")])
        while True:
            frames = await asyncio.wait_for(sock.recv_multipart(), timeout_s)
            try:
                msg = decode_replay_frames(frames, raw_tokens=True)
            except MalformedFrame as e:
                log.warning("bad replay frame from %s: %s", endpoint, e)
                continue
            if msg is None:
                break
            out.append((msg.seq, msg.batch))
            if stop_before is not None and msg.seq >= stop_before - 1:
                break
    except (TimeoutError, zmq.ZMQError) as e:
        log.warning("replay from %s failed after %d batches: %r", endpoint, len(out), e)
    finally:
        sock.close()
    return out


async def drive(steps: Steps[T]) -> T:
    """Run a stepped feed operation, letting the event loop run between its slices."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        await asyncio.sleep(0)


class KvEventSubscriber:
    def __init__(
        self,
        feeder: IndexFeeder,
        *,
        bind: str | None = None,
        identity: Identity = default_identity,
        replay_endpoints: dict[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        replay_timeout_s: float = 1.0,
        rcvhwm: int = 100_000,
        ctx: zmq.asyncio.Context | None = None,
    ) -> None:
        self.feeder = feeder
        self.bind = bind
        self.identity = identity
        self.replay_endpoints = dict(replay_endpoints or {})
        self.clock = clock
        self.replay_timeout_s = replay_timeout_s
        self.rcvhwm = rcvhwm
        self.ctx = ctx or zmq.asyncio.Context.instance()
        if ctx is None and self.ctx.get(zmq.MAX_SOCKETS) < MAX_SOCKETS:
            # libzmq's default (1023) is passed at about 500 engines (a SUB each, a DEALER per replay); the
            # setting counts only until the context's first socket, as here in a router or relay process
            self.ctx.set(zmq.MAX_SOCKETS, MAX_SOCKETS)
        self.unattributed_malformed = 0  # bind mode: frames too broken to name their worker
        self.messages = 0
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.ready: set[str] = set()  # dialled workers past their connect-time replay (read, tried or none)
        self.bound_endpoint: str | None = None

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        if self.bind is not None:
            sock = self._sub_socket()
            sock.bind(self.bind)
            self.bound_endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self._tasks["<bind>"] = asyncio.create_task(self._run(sock, None))

    def add_source(self, source: EventSource) -> None:
        """Dial one engine (also usable alongside a bound socket)."""
        self.remove_source(source.worker_id)
        if source.replay_endpoint:
            self.replay_endpoints[source.worker_id] = source.replay_endpoint
        sock = self._sub_socket(source.topic)
        sock.connect(source.endpoint)
        self._tasks[source.worker_id] = asyncio.create_task(self._run(sock, source.worker_id))

    def remove_source(self, worker_id: str) -> None:
        task = self._tasks.pop(worker_id, None)
        if task is not None:
            task.cancel()
        self.ready.discard(worker_id)  # a re-added source reads its replay buffer again before it is ready

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        await cancel_and_wait(tasks)

    def _sub_socket(self, topic: str = "") -> zmq.asyncio.Socket:
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, self.rcvhwm)
        sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        return sock

    # ---- receive loop ------------------------------------------------------------------------
    async def _run(self, sock: zmq.asyncio.Socket, worker_id: str | None) -> None:
        try:
            if worker_id is not None:
                if worker_id in self.replay_endpoints:
                    try:
                        await self._bootstrap(worker_id)
                    except Exception:  # a broken replay must not end the subscription: live events go on
                        log.exception("connect-time replay of %s failed", worker_id)
                self.ready.add(worker_id)
            while True:
                frames = await sock.recv_multipart()
                self.messages += 1
                try:
                    await self._handle(frames, worker_id)
                except Exception:  # never let one bad message end the subscription
                    log.exception("error handling KV event message")
        finally:
            sock.close()

    async def _handle(self, frames: list[bytes], worker_id: str | None) -> None:
        try:
            msg = decode_message(frames, raw_tokens=True)
        except MalformedFrame as e:
            named = worker_id or self._identity_of_broken(frames)
            if named is None:
                self.unattributed_malformed += 1
            else:
                self.feeder.mark_malformed(named)
            log.debug("malformed KV event frame: %s", e)
            return
        worker = worker_id or self.identity(msg.topic, msg.batch.data_parallel_rank)
        gap = await drive(self.feeder.offer_steps(worker, msg.seq, msg.batch, self.clock()))
        if gap is None:
            return
        endpoint = self.replay_endpoints.get(worker)
        replayed: list[tuple[int, EventBatch]] = []
        if endpoint:
            replayed = await fetch_replay(
                self.ctx, endpoint, gap.first_missing, gap.next_seq, self.replay_timeout_s
            )
        filled = await drive(self.feeder.fill_gap_steps(gap, replayed, msg.batch, self.clock()))
        log.info(
            "worker %s: gap %d..%d %s", worker, gap.first_missing, gap.next_seq - 1,
            "filled from replay" if filled else "not recoverable, index cleared (unsynced)",
        )

    async def _bootstrap(self, worker_id: str) -> None:
        """Read the engine's replay buffer once at connect time (the SUB socket is already connected, so
        nothing published meanwhile is lost; what both deliver is skipped as a duplicate)."""
        replayed = await fetch_replay(self.ctx, self.replay_endpoints[worker_id], 0, None, self.replay_timeout_s)
        if await drive(self.feeder.bootstrap_steps(worker_id, replayed, self.clock())):
            log.info("worker %s: %d batches replayed at connect, index synced", worker_id, len(replayed))

    def _identity_of_broken(self, frames: list[bytes]) -> str | None:
        if len(frames) < 1:
            return None
        try:
            return self.identity(bytes(frames[0]).decode(), None)
        except UnicodeDecodeError:
            return None
