"""``kvrouter bench worker``: simulated-worker throughput at time-scale 0 on one core.

The worker process is pinned to core 0, the load generator runs here (core 1 on a 2-core box).
Baseline in the same run: a trivial aiohttp server answering the same requests with a canned body,
i.e. the HTTP floor of this machine and client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics

from bench.load import drive, free_port, server_process


def _bodies(n: int) -> list[dict]:
    return [{"prompt": f"short prompt number {i % 50} for the worker", "max_tokens": 4} for i in range(n)]


def measure(args: list[str], port: int, n: int, rounds: int) -> list[float]:
    rates = []
    with server_process(args, port, core=0):
        asyncio.run(drive(f"http://127.0.0.1:{port}/v1/completions", _bodies(200), 32))  # warm-up
        for _ in range(rounds):
            res = asyncio.run(drive(f"http://127.0.0.1:{port}/v1/completions", _bodies(n), 32))
            if res.errors:
                raise RuntimeError(f"{res.errors} failed requests")
            rates.append(res.rps)
    return rates


def run(quick: bool = False) -> dict:
    n, rounds = (300, 2) if quick else (3000, 5)
    p1, p2 = free_port(), free_port()
    sim = measure(["-m", "router.cli", "worker", "sim", "--port", str(p1), "--time-scale", "0"], p1, n, rounds)
    floor = measure(["-m", "bench.trivial_server", str(p2)], p2, n, rounds)
    return {"sim_worker_rps": round(statistics.median(sim), 1), "trivial_http_rps": round(statistics.median(floor), 1),
            "requests_per_round": n, "rounds": rounds, "concurrency": 32, "max_tokens": 4}


def main(args: argparse.Namespace) -> int:
    res = run(quick=args.quick)
    if args.json:
        print(json.dumps(res, indent=2, sort_keys=True))
        return 0
    print(f"{'simulated worker, time-scale 0, 1 core (req/s, median)':<58} {res['sim_worker_rps']:>10,.0f}")
    print(f"{'  baseline: trivial aiohttp server, same client (req/s)':<58} {res['trivial_http_rps']:>10,.0f}"
          f"   (worker = {res['sim_worker_rps'] / res['trivial_http_rps']:.2f}x of it)")
    return 0
