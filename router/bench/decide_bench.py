"""``kvrouter bench decide``: latency of one routing decision (precise policy), tokenization excluded.

Index: each worker holds 16K blocks; worker j holds the first j/N of the query prompt, so the match walks
the whole prompt. Load: every worker has requests in flight and fresh engine metrics, and reports a KV
capacity its requests in flight nearly fill, so the cost model runs its full path (duplicate-copy eviction
cost and a memory wait over every request in flight). Timed: ``RoutingCore.decide`` (filters, index match,
speculative match, estimates, ranking, explain), on block keys computed beforehand (their cost is reported
apart). Between decisions the request is dispatched to the chosen worker and completed (untimed), so each
decision also rebuilds that one worker's memory-release schedule, as it would live.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time

from router.bench.load import p99
from router.index import Medium
from router.keys import request_keys
from router.load import EngineMetrics
from router.scheduling import Endpoint, RouteRequest, RoutingConfig, RoutingCore

BLOCK = 16
SIZES = {"8k": 8192, "32k": 32768}


def _core(n_workers: int, keys: list[int], blocks_per_worker: int, rng: random.Random) -> RoutingCore:
    core = RoutingCore(RoutingConfig(policy="precise", block_size=BLOCK, seed=0))
    h = 1
    for j in range(n_workers):
        wid = f"w{j}"
        core.upsert_endpoint(Endpoint(wid, f"10.0.{j // 250}.{j % 250}:8000"))
        share = keys[: len(keys) * j // n_workers]
        filler = [rng.getrandbits(64) for _ in range(max(0, blocks_per_worker - len(share)))]
        core.index.store(wid, range(h, h + len(share) + len(filler)), share + filler, Medium.GPU)
        h += len(share) + len(filler)
        for r in range(3):
            own = [rng.getrandbits(64) for _ in range(125)]  # 2,000 prompt tokens + 100 output: 132 blocks
            core.load.dispatch(f"{wid}-{r}", wid, 2000, 1000, 100, 0.0, keys=own, block_size=BLOCK)
        core.update_metrics(wid, EngineMetrics(1.0, 3.0, 0.5, scraped_at=0.0, cache_tokens=400 * BLOCK))
    return core


def run(quick: bool = False) -> dict:
    rng = random.Random(5)
    workers = (8, 64) if quick else (8, 64, 256)
    iters = 50 if quick else 400
    p50: dict[str, float] = {}
    p99_ms: dict[str, float] = {}
    for size_name, n_tokens in SIZES.items():
        tokens = [rng.randrange(32000) for _ in range(n_tokens)]
        keys = request_keys(tokens, BLOCK)
        for n in workers:
            core = _core(n, keys, 2000 if quick else 16_000, rng)
            samples = []
            gc.collect()
            for i in range(iters):
                req = RouteRequest(f"r{i}", keys, n_tokens, BLOCK, 128)
                t0 = time.perf_counter()
                d = core.decide(req, now=0.5)
                samples.append((time.perf_counter() - t0) * 1e3)
                # as in a live router, the chosen worker's requests change before the next decision
                core.dispatch(req, d, d.chosen, now=0.5)
                core.completed(req.request_id, now=0.5)
            samples.sort()
            label = f"{size_name}@{n}"
            p50[label] = round(statistics.median(samples), 4)
            p99_ms[label] = round(p99(samples), 4)
    return {"p50_ms": p50, "p99_ms": p99_ms, "iterations": iters, "block_size": BLOCK}


def main(args: argparse.Namespace) -> int:
    res = run(quick=args.quick)
    if args.json:
        print(json.dumps(res, indent=2, sort_keys=True))
        return 0
    print(f"{'prompt@workers':<16}{'p50 ms':>10}{'p99 ms':>10}")
    for label in res["p50_ms"]:
        print(f"{label:<16}{res['p50_ms'][label]:>10.3f}{res['p99_ms'][label]:>10.3f}")
    return 0
