"""A KV-event publisher written for the tests: vLLM's wire format, live PUB plus a ROUTER replay socket."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from router.events.codec import END_OF_REPLAY, SEQ_BYTES, EventBatch, encode_message


class TestPublisher:
    __test__ = False

    def __init__(self, ctx: zmq.asyncio.Context, topic: str = "kv", replay: bool = True,
                 connect: str | None = None) -> None:
        self.ctx, self.topic = ctx, topic
        # XPUB sends exactly as PUB does, and also tells us when a subscriber has joined.
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        # every subscription, not only a topic's first: a subscriber that joins while the one before it is
        # still leaving (a relay restarted) would otherwise be folded into it and never announced
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        if connect:
            self.pub.connect(connect)
            self.endpoint = connect
        else:
            self.pub.bind("tcp://127.0.0.1:*")
            self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.seq = 0
        self.buffer: list[tuple[int, list[bytes]]] = []
        self.replay_endpoint: str | None = None
        self._replay_task: asyncio.Task | None = None
        if replay:
            self.router = ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.bind("tcp://127.0.0.1:*")
            self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._replay_task = asyncio.create_task(self._serve_replay())

    async def _serve_replay(self) -> None:
        while True:
            ident, _, start = await self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq, frames in list(self.buffer):
                if seq >= first:
                    await self.router.send_multipart([ident, b"", *frames])
            await self.router.send_multipart([ident, b"", b"", END_OF_REPLAY, b""])

    async def wait_subscribed(self, timeout: float = 5.0) -> None:
        msg = await asyncio.wait_for(self.pub.recv(), timeout)
        assert msg[:1] == b"\x01"

    async def publish(self, batch: EventBatch, send: bool = True) -> int:
        """Publish the next batch; ``send=False`` drops it on the wire but keeps it for replay."""
        seq = self.seq
        frames = encode_message(self.topic, seq, batch)
        self.buffer.append((seq, frames))
        self.seq += 1
        if send:
            await self.pub.send_multipart(frames)
        return seq

    def restart(self) -> None:
        """As an engine restart: seq back to 0, replay buffer empty."""
        self.seq = 0
        self.buffer.clear()

    async def send_raw(self, frames: list[bytes]) -> None:
        await self.pub.send_multipart(frames)

    async def close(self) -> None:
        if self._replay_task:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
            self.router.close()
        self.pub.close()


async def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


SEQ = SEQ_BYTES
