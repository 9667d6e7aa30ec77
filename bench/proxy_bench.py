"""``kvrouter bench proxy``: what the proxy adds, side by side with direct access and the SGLang gateway.

Two simulated workers at time-scale 0 (no modelled GPU time: what remains is HTTP and routing), each in
its own process. Targets, measured in the same run and interleaved round by round so machine noise hits
them alike: direct (client alternates the workers), ``kvrouter serve`` (precise policy, events on) in one
process and with ``--processes 2`` (one port, shared load), and ``smg`` (cache_aware), none pinned: each may
use every core. Concurrency 1: latency p50/p99 of short non-streamed completions; concurrency 32:
requests/s. The router's CPU time per request (all its processes) is read from /proc. ``ratios`` compares
``kvrouter --processes 2`` with smg in the same run: requests/s at 32 and added p50 at 1.
``python -m bench.proxy_bench --baseline REV [--processes N] [--smg]`` puts this tree's proxy against git REV's in
one run (interleaved rounds), smg beside them when asked.
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
    """CPU seconds of ``pid`` and its descendants alive now (``--processes N``: the parent and its children)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    total = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            children = [int(c) for c in fh.read().split()]
    except OSError:
        return total
    for child in children:
        with contextlib.suppress(OSError):
            total += _cpu_s(child)
    return total


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
        targets: dict[str, list[str]] = {"direct": worker_urls}
        routers = {}
        for name, processes in (("kvrouter", 1), ("kvrouter-2p", 2)):
            kv_port, admin_port = free_port(), free_port()
            kv_args = ["-m", "router.cli", "serve", "--host", "127.0.0.1", "--port", str(kv_port), "--admin-port",
                       str(admin_port), "--policy", "precise", "--processes", str(processes)]
            for s in specs:
                kv_args += ["--worker", s]
            routers[name] = stack.enter_context(server_process(kv_args, kv_port))
            if processes > 1:  # the port opens with the first child: wait for them all
                _wait_processes(f"http://127.0.0.1:{admin_port}", processes)
            targets[name] = [f"http://127.0.0.1:{kv_port}"]
        pids = {name: proc.pid for name, proc in routers.items()}
        try:
            targets["smg"] = [stack.enter_context(smg(worker_urls))]
            pids["smg"] = _listening_pid(int(targets["smg"][0].rsplit(":", 1)[1]))
        except PeerUnavailable as e:
            out["smg"] = {"skipped": str(e)}
        c1: dict[str, list[float]] = {name: [] for name in targets}
        for r in range(rounds):
            for name, urls in targets.items():
                c1[name] += asyncio.run(_c1(urls, n_c1, r * n_c1))
        rps: dict[str, list[float]] = {name: [] for name in targets}
        cpu_ms: dict[str, list[float]] = {name: [] for name in pids}
        busy: dict[str, list[float]] = {name: [] for name in targets}
        for r in range(max(2, rounds // 2)):
            for name, urls in targets.items():
                before = _cpu_s(pids[name]) if name in pids else 0.0
                box = _box_cpu()
                if name == "direct":  # split the load over both workers, as a router would
                    res = asyncio.run(_split(urls, n_c32))
                else:
                    res = asyncio.run(drive(urls[0] + "/v1/completions", _bodies(n_c32, r), 32))
                if res.errors:
                    raise RuntimeError(f"{name}: {res.errors} failed requests at concurrency 32")
                rps[name].append(res.rps)
                busy[name].append(_box_busy(box))
                if name in pids:
                    cpu_ms[name].append((_cpu_s(pids[name]) - before) * 1e3 / n_c32)
    direct_p50 = statistics.median(c1["direct"])
    direct_p99 = p99(c1["direct"])
    out["direct"] = {"p50_ms_c1": round(direct_p50, 3), "p99_ms_c1": round(direct_p99, 3),
                     "rps_c32": round(statistics.median(rps["direct"]), 1),
                     "box_busy_c32": round(statistics.median(busy["direct"]), 3)}
    for name in targets:
        if name == "direct":
            continue
        p50, p99_ms = statistics.median(c1[name]), p99(c1[name])
        out[name] = {"p50_ms_c1": round(p50, 3), "p99_ms_c1": round(p99_ms, 3),
                     "added_p50_ms_c1": round(p50 - direct_p50, 3), "added_p99_ms_c1": round(p99_ms - direct_p99, 3),
                     "rps_c32": round(statistics.median(rps[name]), 1),
                     "box_busy_c32": round(statistics.median(busy[name]), 3)}
    for name, ms in cpu_ms.items():
        out[name]["cpu_ms_per_request"] = round(statistics.median(ms), 3)
    if "rps_c32" in out.get("smg", {}):
        mine, theirs = out["kvrouter-2p"], out["smg"]
        out["ratios"] = {"rps_c32_vs_smg": round(mine["rps_c32"] / theirs["rps_c32"], 3),
                         "added_p50_c1_vs_smg": round(mine["added_p50_ms_c1"] / theirs["added_p50_ms_c1"], 3)
                         if theirs["added_p50_ms_c1"] > 0 else None,
                         "rps_c32_2p_vs_1p": round(mine["rps_c32"] / out["kvrouter"]["rps_c32"], 3)}
    out["requests"] = {"c1_per_target": n_c1 * rounds, "c32_per_round": n_c32}
    return out


def _listening_pid(port: int) -> int:
    """The process listening on ``port`` (smg's, for its CPU time), by its socket's inode in /proc."""
    inode = None
    with open("/proc/net/tcp") as fh:
        for line in fh.readlines()[1:]:
            f = line.split()
            if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                inode = f[9]
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]":
                    return int(pid)
    raise RuntimeError(f"no process listens on port {port}")


def _box_cpu() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    with open("/proc/stat") as fh:
        values = [int(v) for v in fh.readline().split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


def _box_busy(since: tuple[int, int]) -> float:
    """The fraction of every core busy since ``since`` (every process of the machine, this bench's or not)."""
    busy, total = _box_cpu()
    return (busy - since[0]) / max(1, total - since[1])


def _wait_processes(admin_url: str, processes: int, timeout: float = 60.0) -> None:
    """Until process 0 (admin) hears every sibling: all of them are up and sharing load."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(admin_url + "/admin/workers", timeout=2) as r:
                if len(json.loads(r.read())["shared_load"]["peers"]) == processes - 1:
                    return
        except (OSError, KeyError, ValueError):
            pass
        time.sleep(0.1)
    raise RuntimeError(f"the {processes} router processes did not all start within {timeout:.0f} s")


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
    for name in ("direct", "kvrouter", "kvrouter-2p", "smg"):
        r = res.get(name, {})
        if "skipped" in r:
            print(f"{name:<10}  skipped: {r['skipped']}")
            continue
        with contextlib.suppress(KeyError):
            print(f"{name:<10}{r['p50_ms_c1']:>11.3f}{r['p99_ms_c1']:>11.3f}{r.get('added_p50_ms_c1', 0):>11.3f}"
                  f"{r.get('added_p99_ms_c1', 0):>11.3f}{r['rps_c32']:>11.0f}")
    print(f"kvrouter CPU per request (parse, tokenize, decide, relay): {res['kvrouter']['cpu_ms_per_request']:.3f} ms"
          f" (1 process), {res['kvrouter-2p']['cpu_ms_per_request']:.3f} ms (2 processes); smg "
          f"{res.get('smg', {}).get('cpu_ms_per_request', float('nan')):.3f} ms")
    print("machine busy during the c32 runs: " + ", ".join(f"{n} {res[n]['box_busy_c32']:.0%}" for n in
                                                           ("direct", "kvrouter", "kvrouter-2p", "smg") if n in res
                                                           and "box_busy_c32" in res[n]))
    if "ratios" in res:
        q = res["ratios"]
        print(f"kvrouter --processes 2 vs smg, same run: req/s c32 {q['rps_c32_vs_smg']:.2f}x (target >= 1.0), "
              f"added p50 c1 {q['added_p50_c1_vs_smg']}x (target <= 1.5); 2 vs 1 process {q['rps_c32_2p_vs_1p']:.2f}x")
    return 0


def against_revision(revision: str, rounds: int = 6, n: int = 600, processes: int = 1,
                     with_smg: bool = False) -> dict[str, Any]:
    """``kvrouter serve`` of this tree against the same of git ``revision`` (``--processes N`` each), and smg
    when asked, in one run: interleaved rounds of c1 latency, c32 requests/s and CPU per request (the least noisy
    of the three on a shared machine). With smg: each tree's ``ratios`` against it, as ``run`` computes them."""
    import subprocess
    import sys
    import tempfile

    from bench.load import build_extensions, port_open, running

    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                          check=True).stdout.strip()
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="kvrouter-ab-") as old_tree:
        archive = subprocess.run(["git", "-C", root, "archive", revision], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", old_tree], input=archive, check=True)
        build_extensions(old_tree)
        workers = sim_workers(stack, 2, "--time-scale", "0")
        urls, pids = {}, {}
        for name, tree in ((revision, old_tree), ("this tree", root)):
            port, admin = free_port(), free_port()
            cmd = [sys.executable, "-m", "router.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                   "--admin-port", str(admin), "--policy", "precise", "--processes", str(processes)]
            for w in workers:
                cmd += ["--worker", w.spec]
            proc = stack.enter_context(running(cmd, port_open(port), 60, name, cwd=tree,
                                               env={**os.environ, "PYTHONPATH": tree}))
            if processes > 1:
                _wait_processes(f"http://127.0.0.1:{admin}", processes)
            urls[name], pids[name] = f"http://127.0.0.1:{port}", proc.pid
        if with_smg:
            urls["smg"] = stack.enter_context(smg([w.url for w in workers]))
            pids["smg"] = _listening_pid(int(urls["smg"].rsplit(":", 1)[1]))
        direct = [w.url for w in workers]
        lat: dict[str, list[float]] = {k: [] for k in [*urls, "direct"]}
        rps: dict[str, list[float]] = {k: [] for k in urls}
        cpu: dict[str, list[float]] = {k: [] for k in urls}
        for r in range(rounds):
            lat["direct"] += asyncio.run(_c1(direct, n // 4, r * n))
            for name in list(urls) if r % 2 == 0 else list(urls)[::-1]:
                url = urls[name]
                lat[name] += asyncio.run(_c1([url], n // 4, r * n))
                before = _cpu_s(pids[name])
                res = asyncio.run(drive(url + "/v1/completions", _bodies(n, r), 32))
                if res.errors:
                    raise RuntimeError(f"{name}: {res.errors} failed requests")
                cpu[name].append((_cpu_s(pids[name]) - before) * 1e3 / n)
                rps[name].append(res.rps)
    direct_p50 = statistics.median(lat["direct"])
    out: dict[str, Any] = {"direct": {"p50_ms_c1": round(direct_p50, 3)}}
    for name in urls:
        out[name] = {"p50_ms_c1": round(statistics.median(lat[name]), 3),
                     "added_p50_ms_c1": round(statistics.median(lat[name]) - direct_p50, 3),
                     "rps_c32": round(statistics.median(rps[name]), 1),
                     "cpu_ms_per_request": round(statistics.median(cpu[name]), 3)}
    if with_smg:
        theirs = out["smg"]
        for name in (revision, "this tree"):
            mine = out[name]
            mine["ratios"] = {"rps_c32_vs_smg": round(mine["rps_c32"] / theirs["rps_c32"], 3),
                              "added_p50_c1_vs_smg": round(mine["added_p50_ms_c1"] / theirs["added_p50_ms_c1"], 3)
                              if theirs["added_p50_ms_c1"] > 0 else None}
    return out


if __name__ == "__main__":  # python -m bench.proxy_bench --baseline REV
    cli = argparse.ArgumentParser(description="this tree's proxy against a git revision's, in one run")
    cli.add_argument("--baseline", required=True, help="a git revision, e.g. HEAD~3")
    cli.add_argument("--rounds", type=int, default=6)
    cli.add_argument("--processes", type=int, default=1, help="kvrouter serve --processes N, both trees")
    cli.add_argument("--smg", action="store_true", help="smg in the same run, and each tree's ratios against it")
    given = cli.parse_args()
    print(json.dumps(against_revision(given.baseline, given.rounds, processes=given.processes, with_smg=given.smg),
                     indent=2))
