"""``kvrouter bench bus``: N synthetic engine streams through a relay and NATS JetStream into 2 replicas.

Processes, all real: a generator binding N engine sockets (an XPUB per stream as vLLM's PUB, plus a ROUTER
replay socket) and publishing realistic batches (index_bench's: chained 8-block BlockStored events with token
ids, BlockRemoved of the oldest once 128 blocks are live) round-robin across the streams as fast as it can;
``kvrouter relay`` serving every stream; a nats-server; two replica processes, each following every worker
on the bus with ``BusSubscriber``. Sustained rate = block events generated / (first publish -> both replicas
applied every stream's last batch). Both replicas' indexes are checked against the generated truth (each
content family fed through a plain ``IndexFeeder``), by a digest of ``export_worker``.

Baseline, same run, same generator: today's topology, both replicas dialling all N engines over ZeroMQ.
``python -m bench.bus_bench generate|replica ...`` are the child processes' entry points.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from bench.index_bench import make_batches
from bench.nats import nats_server
from router.events.bus import snapshot_rows
from router.events.codec import SEQ_BYTES, decode_payload
from router.events.feed import IndexFeeder
from router.index import KvIndex

BLOCK = 16
FAMILIES = 16  # distinct contents (stream i carries family i % FAMILIES): truth is computed once per family
EVENTS_PER_BATCH, BLOCKS_PER_EVENT, CAPACITY = 2, 8, 128


def worker_id(i: int) -> str:
    return f"engine-{i:04d}"


def family_payloads(batches: int) -> list[tuple[list[bytes], int]]:
    return [make_batches(batches, EVENTS_PER_BATCH, BLOCKS_PER_EVENT, seed=f + 1, capacity=CAPACITY)
            for f in range(FAMILIES)]


def digest(feeder: IndexFeeder, wid: str) -> str:
    rows = snapshot_rows(feeder.index.export_worker(wid))
    return hashlib.blake2b(msgspec.msgpack.encode(rows), digest_size=12).hexdigest()


def truth_digests(families: list[tuple[list[bytes], int]]) -> list[str]:
    out = []
    for payloads, _ in families:
        feeder = IndexFeeder(KvIndex(), block_size=BLOCK)
        for seq, p in enumerate(payloads):
            feeder.offer("w", seq, decode_payload(p), 0.0)
        out.append(digest(feeder, "w"))
    return out


# ---- child: the generator ----------------------------------------------------------------------------
async def generate(streams: int, batches: int, subscribers: int) -> None:
    """Bind the sockets, print their endpoints, wait until ``subscribers`` have subscribed to each, wait for
    ``go`` on stdin, publish everything, print when it started and ended."""
    import zmq
    import zmq.asyncio

    from router.events.codec import END_OF_REPLAY

    ctx = zmq.asyncio.Context()
    ctx.set(zmq.MAX_SOCKETS, 2 * streams + 64)  # a PUB and a replay ROUTER per engine
    families = family_payloads(batches)
    pubs, routers, endpoints = [], [], []
    for i in range(streams):
        pub = ctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's subscription, not only the first
        pub.setsockopt(zmq.SNDHWM, 0)  # an engine's queue: this bench measures the consumers, not drops
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind("tcp://127.0.0.1:*")
        rt = ctx.socket(zmq.ROUTER)
        rt.setsockopt(zmq.LINGER, 0)
        rt.bind("tcp://127.0.0.1:*")
        pubs.append(pub)
        routers.append(rt)
        endpoints.append([worker_id(i), pub.getsockopt_string(zmq.LAST_ENDPOINT),
                          rt.getsockopt_string(zmq.LAST_ENDPOINT)])
    print(json.dumps({"endpoints": endpoints}), flush=True)

    async def serve_replay(i: int) -> None:
        payloads = families[i % FAMILIES][0]
        while True:
            ident, _, start = await routers[i].recv_multipart()
            first = int.from_bytes(start, "big")
            for seq in range(first, published[i]):
                await routers[i].send_multipart([ident, b"", b"", seq.to_bytes(SEQ_BYTES, "big"), payloads[seq]])
            await routers[i].send_multipart([ident, b"", b"", END_OF_REPLAY, b""])

    async def subscribed(i: int) -> None:
        for _ in range(subscribers):
            while (await pubs[i].recv())[:1] != b"\x01":
                pass

    published = [0] * streams
    replay_tasks = [asyncio.create_task(serve_replay(i)) for i in range(streams)]
    await asyncio.gather(*(subscribed(i) for i in range(streams)))
    print(json.dumps({"subscribed": True}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    started = time.time()
    for seq in range(batches):
        for i in range(streams):
            payload = families[i % FAMILIES][0][seq]
            await pubs[i].send_multipart([b"", seq.to_bytes(SEQ_BYTES, "big"), payload])
            published[i] = seq + 1
        await asyncio.sleep(0)
    print(json.dumps({"started": started, "ended": time.time()}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # serve replays until told
    for t in replay_tasks:
        t.cancel()
    ctx.destroy(linger=0)


# ---- child: a replica ----------------------------------------------------------------------------------
async def replica(streams: int, batches: int, bus: str | None, endpoints: list[list[str]] | None,
                  timeout_s: float) -> None:
    """Follow every worker (on the bus, or dialling the engines), print ``ready``, then, once every worker's
    last batch is applied, the time it happened and each worker's index digest."""
    from router.events.bus_nats import BusSubscriber
    from router.events.subscriber import EventSource, KvEventSubscriber

    began = time.monotonic()
    feeder = IndexFeeder(KvIndex(), block_size=BLOCK)
    sub: Any
    if bus is not None:
        sub = BusSubscriber(feeder, bus)
        sources = [EventSource(worker_id(i), "") for i in range(streams)]
    else:
        sub = KvEventSubscriber(feeder)
        sources = [EventSource(w, ev, rp) for w, ev, rp in endpoints or []]
    await sub.start()
    for s in sources:
        sub.add_source(s)
    wids = [s.worker_id for s in sources]
    deadline = time.monotonic() + timeout_s
    while not set(wids) <= sub.ready and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    print(json.dumps({"ready": len(sub.ready), "startup_s": round(time.monotonic() - began, 2)}), flush=True)

    def done() -> bool:
        return all((f := feeder.feeds.get(w)) is not None and f.last_seq == batches - 1 for w in wids)

    while not done() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    finished = time.time()
    stats = sub.stats() if isinstance(sub, BusSubscriber) else {"messages": sub.messages}
    print(json.dumps({"finished": finished, "complete": done(), "digests": {w: digest(feeder, w) for w in wids},
                      "unsynced": sum(not feeder.feeds[w].synced for w in wids if w in feeder.feeds),
                      "stats": stats}), flush=True)
    await sub.stop()


# ---- the orchestration ---------------------------------------------------------------------------------
@dataclass
class Child:
    """A child process whose JSON stdout lines are read by a thread (a pipe's buffered reader and select
    do not mix)."""

    proc: subprocess.Popen[str]
    lines: queue.Queue[str] = field(default_factory=queue.Queue)

    def __post_init__(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for text in self.proc.stdout:
            if text.startswith("{"):
                self.lines.put(text)

    def line(self, timeout_s: float) -> dict[str, Any]:
        """The next JSON line it prints."""
        try:
            return json.loads(self.lines.get(timeout=timeout_s))  # type: ignore[no-any-return]
        except queue.Empty:
            raise RuntimeError(f"{self.proc.args[2:5]} said nothing in time (exit {self.proc.poll()})") from None

    def tell(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()


@contextlib.contextmanager
def _child(*args: str) -> Iterator[Child]:
    proc = subprocess.Popen([sys.executable, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        yield Child(proc)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def run_phase(streams: int, batches: int, bus_url: str | None, truth: list[str], timeout_s: float,
              workdir: Path) -> dict[str, Any]:
    """One generator, its consumers (a relay plus 2 bus replicas, or 2 direct replicas), one measurement."""
    me = ["-m", "bench.bus_bench"]
    size = ["--streams", str(streams), "--batches", str(batches), "--timeout", str(timeout_s)]
    with contextlib.ExitStack() as stack:
        gen = stack.enter_context(_child(*me, "generate", *size, "--subscribers", "1" if bus_url else "2"))
        endpoints = gen.line(120)["endpoints"]
        if bus_url is not None:
            workers = [arg for w, ev, rp in endpoints for arg in ("--worker", f"{w},events={ev},replay={rp}")]
            stack.enter_context(_child("-m", "router.cli", "relay", "--bus", bus_url, "--block-size", str(BLOCK),
                                       "--log-level", "warning", *workers))
            consumer_args = ["--bus", bus_url]
        else:
            path = workdir / "endpoints.json"
            path.write_text(json.dumps(endpoints))
            consumer_args = ["--endpoints", str(path)]
        replicas = [stack.enter_context(_child(*me, "replica", *size, *consumer_args)) for _ in range(2)]
        gen.line(timeout_s)  # every engine socket has its subscribers
        ready = [r.line(timeout_s) for r in replicas]
        gen.tell()
        times = gen.line(timeout_s)
        results = [r.line(timeout_s) for r in replicas]
        gen.tell()
    families = family_payloads_count(batches)
    block_events = sum(families[i % FAMILIES] for i in range(streams))
    seconds = max(r["finished"] for r in results) - times["started"]
    exact = [r["complete"] and all(d == truth[int(w.rsplit("-", 1)[1]) % FAMILIES] for w, d in r["digests"].items())
             for r in results]
    return {
        "block_events": block_events, "seconds": round(seconds, 3),
        "block_events_per_s": round(block_events / seconds),
        "publish_seconds": round(times["ended"] - times["started"], 3),
        "exact": exact, "ready": [r["ready"] for r in ready], "startup_s": [r["startup_s"] for r in ready],
        "unsynced": [r["unsynced"] for r in results],
        "stats": [r["stats"] for r in results],
    }


def family_payloads_count(batches: int) -> list[int]:
    return [n for _, n in family_payloads(batches)]


def run(streams: int, batches: int, timeout_s: float = 600.0) -> dict[str, Any]:
    import tempfile

    truth = truth_digests(family_payloads(batches))
    with tempfile.TemporaryDirectory(prefix="kvrouter-bus-bench-") as d:
        direct = run_phase(streams, batches, None, truth, timeout_s, Path(d))
        with nats_server() as server:
            bus = run_phase(streams, batches, server.url, truth, timeout_s, Path(d))
    return {"streams": streams, "batches_per_stream": batches, "replicas": 2, "bus": bus, "direct": direct,
            "bus_vs_direct": round(bus["block_events_per_s"] / direct["block_events_per_s"], 3),
            "exact": all(bus["exact"]) and all(direct["exact"])}


def main(args: argparse.Namespace) -> int:
    streams = args.streams or (20 if args.quick else 1000)
    res = run(streams, 30 if args.quick else 40)
    if args.json:
        print(json.dumps(res, indent=2, sort_keys=True))
    else:
        for name in ("direct", "bus"):
            p = res[name]
            print(f"{name:<7} {streams} streams -> 2 replicas: {p['block_events_per_s']:>10,} block-events/s "
                  f"({p['block_events']:,} in {p['seconds']:.1f} s), exact {p['exact']}")
        print(f"bus / direct (same run): {res['bus_vs_direct']:.2f}x")
    return 0 if res["exact"] else 1


def _child_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="bench.bus_bench")
    p.add_argument("role", choices=["generate", "replica"])
    p.add_argument("--streams", type=int, required=True)
    p.add_argument("--batches", type=int, required=True)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--subscribers", type=int, default=1)
    p.add_argument("--bus")
    p.add_argument("--endpoints")
    a = p.parse_args(argv)
    if a.role == "generate":
        asyncio.run(generate(a.streams, a.batches, a.subscribers))
    else:
        endpoints = json.loads(Path(a.endpoints).read_text()) if a.endpoints else None
        asyncio.run(replica(a.streams, a.batches, a.bus, endpoints, a.timeout))


if __name__ == "__main__":
    _child_main(sys.argv[1:])
