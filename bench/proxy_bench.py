"""``kvrouter bench proxy``: what the proxy adds, side by side with direct access and the SGLang gateway.

Two simulated workers at time-scale 0 (no modelled GPU time: what remains is HTTP and routing), each in
its own process. Targets, measured in the same run and interleaved round by round so machine noise hits
them alike: direct (client alternates the workers), ``kvrouter serve`` (precise policy, events on) and
``smg`` (cache_aware), each its own process. Concurrency 1: latency p50/p99 of short non-streamed
completions; concurrency 32: requests/s. The router's CPU time per request is read from /proc.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import time
from contextlib import ExitStack
from typing import Any

import aiohttp

from bench.load import drive, free_port, p99, server_process, sim_workers
from bench.peers import PeerUnavailable, smg


def _bodies(n: int, offset: int = 0) -> list[dict[str, Any]]:
    return [{"model": "sim-model", "prompt": f"a short prompt, number {(i + offset) % 64}, for the proxy benchmark",
             "max_tokens": 4} for i in range(n)]


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _c1(urls: list[str], n: int, offset: int) -> list[float]:
    """Sequential requests over kept-alive connections; direct access alternates the workers."""
    lat: list[float] = []
    async with aiohttp.ClientSession() as session:
        for i, body in enumerate(_bodies(n, offset)):
            url = urls[i % len(urls)] + "/v1/completions"
            t0 = time.perf_counter()
            async with session.post(url, json=body) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"request to {url} failed with {r.status}")
            lat.append((time.perf_counter() - t0) * 1e3)
    return lat


def run(quick: bool = False) -> dict[str, Any]:
    n_c1, rounds, n_c32 = (60, 2, 300) if quick else (200, 5, 3000)
    out: dict[str, Any] = {}
    with ExitStack() as stack:
        workers = sim_workers(stack, 2, "--time-scale", "0")
        worker_urls, specs = [w.url for w in workers], [w.spec for w in workers]
        kv_port, admin_port = free_port(), free_port()
        kv_args = ["-m", "router.cli", "serve", "--host", "127.0.0.1", "--port", str(kv_port), "--admin-port",
                   str(admin_port), "--policy", "precise"]
        for s in specs:
            kv_args += ["--worker", s]
        kv = stack.enter_context(server_process(kv_args, kv_port))
        targets: dict[str, list[str]] = {"direct": worker_urls, "kvrouter": [f"http://127.0.0.1:{kv_port}"]}
        try:
            targets["smg"] = [stack.enter_context(smg(worker_urls))]
        except PeerUnavailable as e:
            out["smg"] = {"skipped": str(e)}
        c1: dict[str, list[float]] = {name: [] for name in targets}
        for r in range(rounds):
            for name, urls in targets.items():
                c1[name] += asyncio.run(_c1(urls, n_c1, r * n_c1))
        rps: dict[str, list[float]] = {name: [] for name in targets}
        cpu_ms = []
        for r in range(max(2, rounds // 2)):
            for name, urls in targets.items():
                before = _cpu_s(kv.pid) if name == "kvrouter" else 0.0
                if name == "direct":  # split the load over both workers, as a router would
                    res = asyncio.run(_split(urls, n_c32))
                else:
                    res = asyncio.run(drive(urls[0] + "/v1/completions", _bodies(n_c32, r), 32))
                if res.errors:
                    raise RuntimeError(f"{name}: {res.errors} failed requests at concurrency 32")
                rps[name].append(res.rps)
                if name == "kvrouter":
                    cpu_ms.append((_cpu_s(kv.pid) - before) * 1e3 / n_c32)
    direct_p50 = statistics.median(c1["direct"])
    direct_p99 = p99(c1["direct"])
    out["direct"] = {"p50_ms_c1": round(direct_p50, 3), "p99_ms_c1": round(direct_p99, 3),
                     "rps_c32": round(statistics.median(rps["direct"]), 1)}
    for name in targets:
        if name == "direct":
            continue
        p50, p99_ms = statistics.median(c1[name]), p99(c1[name])
        out[name] = {"p50_ms_c1": round(p50, 3), "p99_ms_c1": round(p99_ms, 3),
                     "added_p50_ms_c1": round(p50 - direct_p50, 3), "added_p99_ms_c1": round(p99_ms - direct_p99, 3),
                     "rps_c32": round(statistics.median(rps[name]), 1)}
    out["kvrouter"]["cpu_ms_per_request"] = round(statistics.median(cpu_ms), 3)
    out["requests"] = {"c1_per_target": n_c1 * rounds, "c32_per_round": n_c32}
    return out


async def _split(urls: list[str], n: int):  # type: ignore[no-untyped-def]
    halves = await asyncio.gather(*(drive(u + "/v1/completions", _bodies(n // len(urls), i), 32 // len(urls))
                                    for i, u in enumerate(urls)))
    merged = halves[0]
    for h in halves[1:]:
        merged.latencies_ms += h.latencies_ms
        merged.errors += h.errors
        merged.elapsed_s = max(merged.elapsed_s, h.elapsed_s)
    return merged


def main(args: argparse.Namespace) -> int:
    res = run(quick=args.quick)
    if args.json:
        print(json.dumps(res, indent=2, sort_keys=True))
        return 0
    print(f"{'target':<10}{'p50 ms c1':>11}{'p99 ms c1':>11}{'added p50':>11}{'added p99':>11}{'req/s c32':>11}")
    for name in ("direct", "kvrouter", "smg"):
        r = res.get(name, {})
        if "skipped" in r:
            print(f"{name:<10}  skipped: {r['skipped']}")
            continue
        with contextlib.suppress(KeyError):
            print(f"{name:<10}{r['p50_ms_c1']:>11.3f}{r['p99_ms_c1']:>11.3f}{r.get('added_p50_ms_c1', 0):>11.3f}"
                  f"{r.get('added_p99_ms_c1', 0):>11.3f}{r['rps_c32']:>11.0f}")
    print(f"kvrouter CPU per request (parse, tokenize, decide, relay): {res['kvrouter']['cpu_ms_per_request']:.3f} ms")
    return 0
