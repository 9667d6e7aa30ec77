"""``kvrouter bench quality``: routing quality through the live proxy, pooled over several workloads.

One demo round is 144 requests, and on a shared 2-core machine the same policy on the same arrivals moves
its hit rate by a few points from run to run (event and step timing decide which prefix an LRU cache drops
first). A policy comparison that means something needs more: this replays the demo's workload shape with
several seeds (different prompts, groups and arrival orders), every policy on every seed, in rotated order,
caches reset before each run, and pools all requests per policy. It also counts, seed by seed, in how many
seeds precise beats each other policy (paired: same arrivals). Each policy's SLO attainment and goodput are
measured against the interactive chat's objective (TTFT 300 ms, TPOT 50 ms; ``bench.demo.DEMO_OBJECTIVE``), at the
client, without the requests stating it.

The live peers run on the same fleet, with the same client and workload, in the same rotation: smg (cache_aware) and
vllm-router (kv_aware: it subscribes to the workers' KV events and tokenizes prompts with the bundled tokenizer; the
fleet publishes vLLM's own sha256 block hashes, ``--prefix-caching-hash-algo sha256``, as a real vLLM fleet does).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
from contextlib import ExitStack
from typing import Any

from bench.demo import (
    DEMO_DEFAULTS,
    DemoRequest,
    PolicyRun,
    drive_workload,
    reset_workers,
    run_round,
    shared_prefix_workload,
)
from bench.load import SimWorkerProcess, sim_workers
from bench.peers import vllm_router

POLICIES = ["round_robin", "approx_prefix", "precise", "smg", "vllm-router"]
BLOCK = 16  # the simulated workers' default block size, told to vllm-router


def pooled(runs: list[PolicyRun]) -> PolicyRun:
    """All requests of one policy's runs as one run."""
    out = PolicyRun(runs[0].policy)
    for r in runs:
        out.ttft += r.ttft
        out.e2e += r.e2e
        out.tpot += r.tpot
        out.prompt_tokens += r.prompt_tokens
        out.cached_tokens += r.cached_tokens
        out.output_tokens += r.output_tokens
        out.errors += r.errors
        out.wall_s += r.wall_s
    return out


def run_vllm_router(workers: list[SimWorkerProcess], workload: list[DemoRequest], progress: bool,
                    policy: str = "kv_aware") -> PolicyRun:
    """The vLLM project's router in front of the same workers, subscribed to their KV events, from cold caches."""
    urls = [w.url for w in workers]
    events = [m.group(1) for w in workers if (m := re.search(r"events=([^,]+)", w.spec))]
    asyncio.run(reset_workers(urls))
    with vllm_router(urls, policy, events, block_size=BLOCK) as url:
        asyncio.run(reset_workers(urls))  # its readiness probe request ran on one worker: start cold
        return asyncio.run(drive_workload("vllm-router", url + "/v1/completions", workload, progress))


def rotated_round(seed: int, workers: list[SimWorkerProcess], workload: list[DemoRequest], progress: bool,
                  skipped: dict[str, str]) -> list[PolicyRun]:
    """Every policy and peer once on one workload, the order rotated by ``seed`` (none always goes first); a peer
    that cannot run is named in ``skipped`` with why, and not tried again."""
    return run_round(POLICIES, seed, [w.spec for w in workers], [w.url for w in workers], workload, progress,
                     skipped, peers={"vllm-router": lambda: run_vllm_router(workers, workload, progress)})


def run(seeds: int, progress: bool = True) -> dict[str, Any]:
    d = DEMO_DEFAULTS
    by_policy: dict[str, list[PolicyRun]] = {}
    skipped: dict[str, str] = {}
    with ExitStack() as stack:
        workers = sim_workers(stack, d["workers"], "--time-scale", str(d["time_scale"]),
                              "--num-gpu-blocks", str(d["gpu_blocks"]), "--block-size", str(BLOCK),
                              "--prefix-caching-hash-algo", "sha256", replay=True)
        for seed in range(seeds):
            workload = shared_prefix_workload(d["groups"], d["per_group"], d["rate"], seed)
            for result in rotated_round(seed, workers, workload, progress, skipped):
                by_policy.setdefault(result.policy, []).append(result)
    out: dict[str, Any] = {"seeds": seeds, "requests_per_seed": d["groups"] * d["per_group"], "policies": {}}
    precise = by_policy.get("precise", [])
    for policy in POLICIES:
        if policy in skipped:
            out["policies"][policy] = {"skipped": skipped[policy]}
            continue
        runs = by_policy[policy]
        entry: dict[str, Any] = dict(pooled(runs).summary())
        entry["per_seed"] = [r.summary() for r in runs]
        if policy != "precise" and len(precise) == len(runs):
            pairs = list(zip(precise, runs, strict=True))
            entry["precise_lower_mean_ttft_seeds"] = sum(
                p.summary()["ttft_mean_s"] < r.summary()["ttft_mean_s"] for p, r in pairs)
            entry["precise_higher_hit_rate_seeds"] = sum(
                p.summary()["hit_rate"] > r.summary()["hit_rate"] for p, r in pairs)
        out["policies"][policy] = entry
    return out


def table(res: dict[str, Any]) -> str:
    n = res["seeds"]
    head = (f"{'policy':<14}{'requests':>9}{'TTFT mean ms':>13}{'p50 ms':>8}{'p99 ms':>8}{'hit rate':>9}"
            f"{'hit min-max':>13}{'SLO met':>8}{'goodput/s':>10}{'errors':>7}  precise better in (seeds): TTFT / hit")
    lines = [head, "-" * len(head)]
    for policy, s in res["policies"].items():
        if "skipped" in s:
            lines.append(f"{policy:<14}skipped: {s['skipped']}")
            continue
        hits = [x["hit_rate"] for x in s["per_seed"]]
        wins = (f"{s['precise_lower_mean_ttft_seeds']}/{n} / {s['precise_higher_hit_rate_seeds']}/{n}"
                if "precise_lower_mean_ttft_seeds" in s else "")
        lines.append(f"{policy:<14}{s['requests']:>9}{s['ttft_mean_s'] * 1e3:>13.1f}{s['ttft_p50_s'] * 1e3:>8.1f}"
                     f"{s['ttft_p99_s'] * 1e3:>8.1f}{s['hit_rate']:>9.1%}"
                     f"{f'{min(hits):.1%}-{max(hits):.1%}':>13}{s['slo_attainment']:>8.1%}{s['goodput_rps']:>10.2f}"
                     f"{s['errors']:>7}  {wins}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    seeds = args.seeds or (2 if args.quick else 8)
    res = run(seeds, progress=not args.json)
    if args.json:
        print(json.dumps(res, indent=2, sort_keys=True))
    else:
        print(f"\n{seeds} seeds x {res['requests_per_seed']} requests per policy, pooled "
              f"(median seed hit rate of precise: "
              f"{statistics.median(x['hit_rate'] for x in res['policies']['precise']['per_seed']):.1%})")
        print(table(res))
    errors = sum(s.get("errors", 0) for s in res["policies"].values())
    if errors:
        print(f"{errors} requests failed", file=sys.stderr)
    return 0 if not errors else 1
