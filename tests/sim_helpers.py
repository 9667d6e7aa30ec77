"""Start real simulated workers on loopback ports for the tests."""

from __future__ import annotations

import contextlib
import subprocess
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


@dataclass
class WorkerProcess:
    """A simulated worker in its own process, to be killed for real."""

    proc: subprocess.Popen[bytes]
    port: int
    events: str
    replay: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def spec(self, worker_id: str) -> str:
        return f"{self.url},id={worker_id},events={self.events},replay={self.replay}"

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


def spawn_worker(*args: str) -> WorkerProcess:
    import subprocess
    import sys
    import time
    import urllib.request

    from bench.load import free_port

    port, ev, rp = free_port(), free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "router.cli", "worker", "sim", "--port", str(port),
                             "--events-endpoint", f"tcp://[::ffff:127.0.0.1]:{ev}",
                             "--replay-endpoint", f"tcp://[::ffff:127.0.0.1]:{rp}", *args])
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("simulated worker did not start") from None
            time.sleep(0.1)
    return WorkerProcess(proc, port, f"tcp://127.0.0.1:{ev}", f"tcp://127.0.0.1:{rp}")
