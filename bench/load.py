"""Shared pieces of the HTTP benchmarks: start servers as processes, drive load, summarise latencies."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp


def build_extensions(tree: str | os.PathLike[str]) -> None:
    """Compile a baseline tree's C extensions in place (its ``setup.py``), as ``pip install -e`` did for this
    one: a tree without them runs the pure-Python reference loops, and a comparison against it would time those
    loops, not the commit."""
    if os.path.exists(os.path.join(tree, "setup.py")):
        subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tree, check=True,
                       capture_output=True)


def p99(xs: Sequence[float]) -> float:
    """Nearest-rank 99th percentile (the sample at index 0.99 n of the sorted ones)."""
    s = sorted(xs)
    return s[min(len(s) - 1, int(0.99 * len(s)))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pinned(cmd: list[str], core: int | None) -> list[str]:
    """Pin a server to one core (when taskset exists) so 'one core' figures mean one core."""
    if core is None or not shutil.which("taskset") or (os.cpu_count() or 1) <= core:
        return cmd
    return ["taskset", "-c", str(core), *cmd]


def http_ok(url: str, body: bytes | None = None) -> Callable[[], bool]:
    """A readiness check: ``url`` answers 200 (a POST of ``body`` when given)."""

    def check() -> bool:
        req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    return check


def port_open(port: int) -> Callable[[], bool]:
    def check() -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
        except OSError:
            return False

    return check


@contextlib.contextmanager
def running(cmd: Sequence[str], ready: Callable[[], bool], timeout: float = 30.0, what: str = "",
            **popen: Any) -> Iterator[subprocess.Popen[bytes]]:
    """Start ``cmd``, wait until ``ready()`` (or fail if it exits or times out), always stop it after."""
    popen.setdefault("stdout", subprocess.DEVNULL)
    proc = subprocess.Popen(list(cmd), **popen)
    try:
        deadline = time.monotonic() + timeout
        while not ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{what or cmd[0]} did not become ready (exit {proc.poll()})")
            time.sleep(0.05)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextlib.contextmanager
def server_process(args: Sequence[str], port: int, core: int | None = None,
                   timeout: float = 30.0) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``python ARGS`` (pinned to ``core``) until its ``port`` accepts connections; stop it afterwards."""
    with running(pinned([sys.executable, *args], core), port_open(port), timeout, " ".join(args[:4])) as proc:
        yield proc


@dataclass(frozen=True)
class SimWorkerProcess:
    """A simulated worker started by ``sim_workers``: where it listens and how the router names it."""

    url: str
    address: str
    spec: str  # for --worker / parse_worker_arg: URL,id=..,events=..[,replay=..]


def sim_workers(stack: contextlib.ExitStack, n: int, *args: str, replay: bool = False) -> list[SimWorkerProcess]:
    """Start ``n`` ``kvrouter worker sim`` processes with KV events on loopback, stopped with ``stack``."""
    out = []
    for i in range(n):
        port, ev, rp = free_port(), free_port(), free_port()
        cmd = ["-m", "router.cli", "worker", "sim", "--port", str(port),
               "--events-endpoint", f"tcp://[::ffff:127.0.0.1]:{ev}", *args]  # '::' binds, loopback only
        spec = f"http://127.0.0.1:{port},id=w{i},events=tcp://127.0.0.1:{ev}"
        if replay:
            cmd += ["--replay-endpoint", f"tcp://[::ffff:127.0.0.1]:{rp}"]
            spec += f",replay=tcp://127.0.0.1:{rp}"
        stack.enter_context(server_process(cmd, port))
        out.append(SimWorkerProcess(f"http://127.0.0.1:{port}", f"127.0.0.1:{port}", spec))
    return out


@dataclass
class LoadResult:
    latencies_ms: list[float]
    elapsed_s: float
    errors: int
    responses: list[dict[str, Any]]

    @property
    def rps(self) -> float:
        return len(self.latencies_ms) / self.elapsed_s if self.elapsed_s else 0.0

    def pct(self, q: float) -> float:
        xs = sorted(self.latencies_ms)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

    @property
    def p50(self) -> float:
        return statistics.median(self.latencies_ms) if self.latencies_ms else float("nan")


async def drive(url: str, bodies: Sequence[dict[str, Any]], concurrency: int,
                headers: dict[str, str] | None = None, keep: bool = False) -> LoadResult:
    """POST every body once, ``concurrency`` at a time; latency is to the full response."""
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for b in bodies:
        queue.put_nowait(b)
    lat: list[float] = []
    out: list[dict[str, Any]] = []
    errors = 0
    conn = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    async with aiohttp.ClientSession(connector=conn, headers=headers) as session:

        async def worker() -> None:
            nonlocal errors
            while not queue.empty():
                body = queue.get_nowait()
                t0 = time.perf_counter()
                try:
                    async with session.post(url, json=body) as r:
                        data = await r.json(content_type=None)
                        if r.status != 200:
                            errors += 1
                            continue
                except (TimeoutError, aiohttp.ClientError):
                    errors += 1
                    continue
                lat.append((time.perf_counter() - t0) * 1e3)
                if keep:
                    out.append(data)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    return LoadResult(lat, elapsed, errors, out)
