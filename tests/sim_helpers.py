"""Start real simulated workers on loopback ports for the tests."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiohttp import web

from router.tokenizer import load_tokenizer
from workers.engine import EngineConfig, EngineModel
from workers.sim.publisher import KvEventPublisher
from workers.sim.server import SimWorker


@dataclass
class RunningWorker:
    worker: SimWorker
    runner: web.AppRunner
    url: str
    port: int

    @property
    def publisher(self) -> KvEventPublisher | None:
        return self.worker.publisher

    async def stop(self) -> None:
        await self.runner.cleanup()


async def start_worker(
    *, time_scale: float = 0.0, events: bool = True, replay: bool = True, topic: str = "",
    block_size: int = 16, num_gpu_blocks: int = 2048, cpu_blocks: int = 0, model: str = "sim-model",
    max_model_len: int = 32768, events_endpoint: str = "tcp://127.0.0.1:*", **engine_kw,
) -> RunningWorker:
    tok = load_tokenizer()
    engine = EngineModel(EngineConfig(num_gpu_blocks=num_gpu_blocks, block_size=block_size, cpu_blocks=cpu_blocks,
                                      max_model_len=max_model_len, vocab_size=tok.vocab_size, **engine_kw))
    pub = None
    if events:
        # tcp://127.0.0.1:* has '*', so it binds, as vLLM's publisher would
        pub = KvEventPublisher(events_endpoint, "tcp://127.0.0.1:*" if replay else None, topic)
    worker = SimWorker(engine, tok, model, pub, time_scale)
    runner = web.AppRunner(worker.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return RunningWorker(worker, runner, f"http://127.0.0.1:{port}", port)


@contextlib.asynccontextmanager
async def workers(n: int, **kw) -> AsyncIterator[list[RunningWorker]]:
    started = [await start_worker(**kw) for _ in range(n)]
    try:
        yield started
    finally:
        for w in started:
            await w.stop()
