"""KV-event publisher in vLLM's exact wire format: PUB stream plus a ROUTER replay socket.

As vLLM's ``ZmqEventPublisher``: the PUB socket binds when the endpoint contains ``*`` or ``::`` or is
ipc/inproc, and connects otherwise; seq starts at 0 and rises by one per batch; the replay socket answers
``[b"", start_seq]`` with every buffered batch ``>= start_seq`` as ``[b"", topic, seq, payload]`` and then
the end marker. Data-parallel rank r publishes ``dp_rank = r`` in each batch.

Fault switches for tests and demos: ``paused`` (events are discarded: the worker keeps serving but the
router's view goes stale), ``drop_every`` (every Nth batch is buffered for replay but not sent: a gap),
``restart()`` (seq back to 0, buffer cleared, as a restarted engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque

import zmq
import zmq.asyncio

from router.events.codec import END_OF_REPLAY, SEQ_BYTES, EventBatch, KvEvent, encode_message

log = logging.getLogger(__name__)


def vllm_binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KvEventPublisher:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        dp_rank: int = 0,
        buffer_steps: int = 10_000,
        ctx: zmq.asyncio.Context | None = None,
    ) -> None:
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.topic = topic
        self.dp_rank = dp_rank
        self.seq = 0
        self.buffer: deque[tuple[int, list[bytes]]] = deque(maxlen=buffer_steps)
        self.paused = False
        self.drop_every = 0
        self.sent = self.dropped = self.discarded = 0
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        if vllm_binds(endpoint):
            if "[" in endpoint:  # tcp://[::ffff:127.0.0.1]:P binds loopback only, as with vLLM
                self.pub.setsockopt(zmq.IPV6, 1)
            self.pub.bind(endpoint)
        else:
            self.pub.connect(endpoint)
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
        self.replay_endpoint: str | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self._router: zmq.asyncio.Socket | None = None
        if replay_endpoint:
            self._router = self.ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            if "[" in replay_endpoint:
                self._router.setsockopt(zmq.IPV6, 1)
            self._router.bind(replay_endpoint)
            self.replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)

    def start(self) -> None:
        if self._router is not None and self._replay_task is None:
            self._replay_task = asyncio.create_task(self._serve_replay())

    async def _serve_replay(self) -> None:
        assert self._router is not None
        while True:
            try:
                frames = await self._router.recv_multipart()
                ident, start = frames[0], frames[-1]
                first = int.from_bytes(start, "big") if len(start) == SEQ_BYTES else 0
                for seq, msg in list(self.buffer):
                    if seq >= first:
                        await self._router.send_multipart([ident, b"", *msg])
                await self._router.send_multipart([ident, b"", b"", END_OF_REPLAY, b""])
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("replay request failed")

    async def publish(self, events: list[KvEvent], ts: float) -> int | None:
        """Publish one batch; returns its seq (None when paused and the batch was discarded)."""
        if not events:
            return None
        if self.paused:
            self.discarded += 1
            return None
        seq = self.seq
        self.seq += 1
        msg = encode_message(self.topic, seq, EventBatch(ts, events, self.dp_rank))
        self.buffer.append((seq, msg))
        if self.drop_every and (seq + 1) % self.drop_every == 0:
            self.dropped += 1
            return seq
        await self.pub.send_multipart(msg)
        self.sent += 1
        return seq

    def restart(self) -> None:
        self.seq = 0
        self.buffer.clear()

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
        if self._router is not None:
            self._router.close()
        self.pub.close()
