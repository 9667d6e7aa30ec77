"""``kvrouter bench replicas``: 1, 2 and 4 proxy replicas on one event bus, behind one load generator.

The demo's fleet and workload shape (simulated workers on the wall clock, groups of prompts sharing a long
prefix, Poisson arrivals). One ``kvrouter relay`` reads every worker's ZeroMQ events into a real JetStream
server; each replica is a ``kvrouter serve`` process that reads the bus, not the engines. The load generator
sends request i to replica i mod N, as a Service in front of them would spread it, so every replica count takes
the same total traffic. With shared load on, replicas publish their dispatch / first-token / completion deltas
and fold the others' into their in-flight accounting; with it off, each knows only its own requests, which
is what the second table shows shared load buys. Each configuration starts from cold caches, and every
configuration runs each seed, in an order rotated per seed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.request
from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any

from bench.demo import DEMO_DEFAULTS, PolicyRun, drive_workload, reset_workers, shared_prefix_workload
from bench.load import SimWorkerProcess, free_port, running, server_process, sim_workers
from bench.nats import NatsServer, nats_server
from bench.quality_bench import pooled

REPLICA_COUNTS = (1, 2, 4)


def relay_command(bus: NatsServer, workers: Sequence[SimWorkerProcess]) -> list[str]:
    """One relay for the node: every worker's events and replay sockets onto the bus."""
    return [sys.executable, "-m", "router.cli", "relay", "--bus", bus.url, "--log-level", "warning",
            *(a for w in workers for a in ("--worker", w.spec))]


def replica_args(bus: NatsServer, workers: Sequence[SimWorkerProcess], replica: str, port: int, admin_port: int,
                 shared_load: bool) -> list[str]:
    """A ``kvrouter serve`` that takes KV events from the bus (its workers name no ZeroMQ endpoint)."""
    args = ["-m", "router.cli", "serve", "--host", "127.0.0.1", "--port", str(port), "--admin-port", str(admin_port),
            "--events-bus", bus.url, "--replica-id", replica, "--block-size", "16"]
    if shared_load:
        args += ["--load-bus", bus.url]
    for i, w in enumerate(workers):
        args += ["--worker", f"{w.url},id=w{i}"]
    return args


def admin_workers(admin_port: int, digest: bool = False) -> dict[str, Any]:
    """A replica's ``/admin/workers`` (with ``digest``: each worker's residency fingerprint)."""
    url = f"http://127.0.0.1:{admin_port}/admin/workers" + ("?digest=1" if digest else "")
    with urllib.request.urlopen(url, timeout=2) as r:
        return json.loads(r.read())["workers"]  # type: ignore[no-any-return]


def wait_until(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


def index_empty_and_synced(admin_port: int) -> bool:
    """Every worker synced from the bus and holding nothing: the reset before a run has reached this replica."""
    try:
        ws = admin_workers(admin_port)
    except OSError:
        return False
    return bool(ws) and all(w["index_state"] == "synced" and not any(w["blocks"].values()) for w in ws.values())


def run(seeds: int, progress: bool = True) -> dict[str, Any]:
    d = DEMO_DEFAULTS
    configs = [(n, True) for n in REPLICA_COUNTS] + [(n, False) for n in REPLICA_COUNTS if n > 1]
    runs: dict[tuple[int, bool], list[PolicyRun]] = {c: [] for c in configs}
    with ExitStack() as stack:
        workers = sim_workers(stack, d["workers"], "--time-scale", str(d["time_scale"]),
                              "--num-gpu-blocks", str(d["gpu_blocks"]), replay=True)
        urls = [w.url for w in workers]
        bus = stack.enter_context(nats_server())
        # the relay has no port of its own: it is ready when the replicas have read its first records
        stack.enter_context(running(relay_command(bus, workers), lambda: True, what="kvrouter relay"))
        for seed in range(seeds):
            workload = shared_prefix_workload(d["groups"], d["per_group"], d["rate"], seed)
            order = configs[seed % len(configs):] + configs[: seed % len(configs)]
            for n, shared in order:
                runs[(n, shared)].append(run_config(bus, workers, urls, n, shared, workload, progress))
    out: dict[str, Any] = {"seeds": seeds, "requests_per_seed": d["groups"] * d["per_group"],
                           "replicas": {}, "replicas_without_shared_load": {}}
    for (n, shared), rs in runs.items():
        s = pooled(rs).summary()
        entry = {"ttft_mean_ms": s["ttft_mean_s"] * 1e3, "ttft_p99_ms": s["ttft_p99_s"] * 1e3,
                 "hit_rate": s["hit_rate"], "e2e_mean_ms": s["e2e_mean_s"] * 1e3, "errors": s["errors"],
                 "requests": s["requests"]}
        out["replicas" if shared else "replicas_without_shared_load"][str(n)] = entry
    one = out["replicas"]["1"]
    for table in ("replicas", "replicas_without_shared_load"):
        for entry in out[table].values():
            entry["ttft_vs_one_replica"] = entry["ttft_mean_ms"] / one["ttft_mean_ms"]
            entry["hit_rate_vs_one_replica"] = entry["hit_rate"] / one["hit_rate"] if one["hit_rate"] else 0.0
    return out


def run_config(bus: NatsServer, workers: Sequence[SimWorkerProcess], urls: list[str], n: int, shared: bool,
               workload: Any, progress: bool) -> PolicyRun:
    asyncio.run(reset_workers(urls))
    with ExitStack() as stack:
        fronts, admins = [], []
        for k in range(n):
            port, admin = free_port(), free_port()
            stack.enter_context(server_process(replica_args(bus, workers, f"r{k}", port, admin, shared), port))
            fronts.append(f"http://127.0.0.1:{port}/v1/completions")
            admins.append(admin)
        for admin in admins:  # each replica has read its snapshot and stream past the reset
            wait_until(lambda a=admin: index_empty_and_synced(a), 30.0, f"replica on admin port {admin} synced")
        label = f"{n} replica{'s' if n > 1 else ''}{'' if shared else ', no shared load'}"
        return asyncio.run(drive_workload(label, fronts, workload, progress))


def table(res: dict[str, Any]) -> str:
    head = f"{'replicas':<10}{'shared load':>12}{'TTFT mean ms':>13}{'vs 1':>7}{'p99 ms':>9}{'hit rate':>9}{'vs 1':>7}"
    lines = [head, "-" * len(head)]
    for name, shared in (("replicas", "on"), ("replicas_without_shared_load", "off")):
        for n, e in res[name].items():
            lines.append(f"{n:<10}{shared:>12}{e['ttft_mean_ms']:>13.1f}{e['ttft_vs_one_replica']:>7.2f}"
                         f"{e['ttft_p99_ms']:>9.1f}{e['hit_rate']:>9.1%}{e['hit_rate_vs_one_replica']:>7.2f}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    seeds = args.seeds or (1 if args.quick else 3)
    res = run(seeds, progress=not args.json)
    print(json.dumps(res, indent=2, sort_keys=True) if args.json else table(res))
    errors = sum(e["errors"] for t in ("replicas", "replicas_without_shared_load") for e in res[t].values())
    if errors:
        print(f"{errors} requests failed", file=sys.stderr)
    return 0 if not errors else 1
