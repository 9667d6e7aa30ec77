"""``kvrouter demo``: simulated workers + the proxy on this machine, one workload per policy, a table and a chart.

Workers run as separate processes (real HTTP + ZeroMQ, the engine model on the wall clock); the proxy runs
here. Before each policy the workers' prefix caches are reset (their ``AllBlocksCleared`` empties the index)
and a fresh routing core is built, so every policy starts cold on the same arrivals. Hit rates come from the
workers' own ``usage.prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from bench.load import p99, sim_workers
from bench.peers import PeerUnavailable
from router.config import load_config
from router.discovery import parse_worker_arg
from router.frontends.proxy import ProxyServer
from router.scheduling.slo import ServiceObjective
from router.tokenizer import load_tokenizer

DEMO_POLICIES = "random,round_robin,least_loaded,session_hash,approx_prefix,precise"
# the demo's fleet and workload; ``kvrouter bench quality`` replays the same shape over several seeds
DEMO_DEFAULTS: dict[str, Any] = {"workers": 3, "time_scale": 1.0, "gpu_blocks": 1024, "groups": 24, "per_group": 6,
                                 "rate": 16.0}


@dataclass
class DemoRequest:
    at: float
    body: dict[str, Any]
    session: str  # sent as x-session-id: what session_hash pins on


# the interactive chat: what the demo's and the quality bench's attainment is measured against
DEMO_OBJECTIVE = ServiceObjective(0.3, 0.05, 0, "interactive")


@dataclass
class PolicyRun:
    policy: str
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    errors: int = 0
    wall_s: float = 0.0
    per_worker: dict[str, int] = field(default_factory=dict)
    tpot: list[float | None] = field(default_factory=list)  # per request: after the first token (None: one token)

    def summary(self, objective: ServiceObjective = DEMO_OBJECTIVE) -> dict[str, float]:
        """The figures, and attainment of ``objective`` (an error missed it) and goodput, measured at the client
        (the requests do not send it: routing is as without one)."""
        ttft = sorted(self.ttft) or [float("nan")]
        met = sum(objective.met(t, p) for t, p in zip(self.ttft, self.tpot, strict=True))
        return {
            "slo_attainment": met / (len(self.ttft) + self.errors) if self.ttft or self.errors else 1.0,
            "goodput_rps": met / self.wall_s if self.wall_s else 0.0,
            "ttft_p50_s": statistics.median(ttft),
            "ttft_p99_s": p99(ttft),
            "ttft_mean_s": statistics.fmean(ttft),
            "e2e_mean_s": statistics.fmean(self.e2e) if self.e2e else float("nan"),
            "e2e_p99_s": p99(sorted(self.e2e)) if self.e2e else float("nan"),
            "throughput_tok_s": self.output_tokens / self.wall_s if self.wall_s else 0.0,
            "hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "errors": self.errors,
            "requests": len(self.ttft),
        }


def shared_prefix_workload(groups: int, per_group: int, rate: float, seed: int = 0) -> list[DemoRequest]:
    """Groups of prompts sharing a long system prompt (a document, tools), Poisson arrivals, groups interleaved."""
    rng = np.random.default_rng(seed)
    tok = load_tokenizer()
    words = [tok.decode([i]).strip() for i in range(200, 1200)]
    words = [w for w in words if w.isalpha()]
    systems = [" ".join(rng.choice(words, 1400)) for _ in range(groups)]
    order = [(g, q) for g in range(groups) for q in range(per_group)]
    rng.shuffle(order)
    t, out = 0.0, []
    for g, q in order:
        t += float(rng.exponential(1.0 / rate))
        question = " ".join(rng.choice(words, 60))
        out.append(DemoRequest(t, {"model": "sim-model", "prompt": f"{systems[g]}\n\nQuestion {q}: {question}",
                                   "max_tokens": 48, "stream": True, "stream_options": {"include_usage": True}},
                               f"group-{g}"))
    return out


async def _one(session: aiohttp.ClientSession, url: str, req: DemoRequest, start: float, run: PolicyRun) -> None:
    await asyncio.sleep(max(0.0, start + req.at - time.monotonic()))
    t0 = time.monotonic()
    first = None
    tail = b""
    try:
        async with session.post(url, json=req.body, headers={"x-session-id": req.session}) as r:
            if r.status != 200:
                run.errors += 1
                await r.read()
                return
            worker = r.headers.get("x-kvrouter-worker") or r.headers.get("x-smg-routed-worker-id", "?")
            async for chunk in r.content.iter_any():
                if first is None:
                    first = time.monotonic()
                tail = (tail + chunk)[-4096:]
    except aiohttp.ClientError:
        run.errors += 1
        return
    end = time.monotonic()
    usage = {}
    for line in reversed(tail.split(b"\n")):
        if line.startswith(b"data: {") and b'"usage"' in line:
            usage = json.loads(line[6:])["usage"]
            break
    run.ttft.append((first or end) - t0)
    run.e2e.append(end - t0)
    n_out = usage.get("completion_tokens", 0)
    run.tpot.append((end - first) / (n_out - 1) if first is not None and n_out > 1 else None)
    run.prompt_tokens += usage.get("prompt_tokens", 0)
    run.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    run.output_tokens += usage.get("completion_tokens", 0)
    run.per_worker[worker] = run.per_worker.get(worker, 0) + 1


async def reset_workers(worker_urls: list[str]) -> None:
    """Empty every worker's prefix cache (POST /reset_prefix_cache): each policy, or each bench row, starts cold."""
    async with aiohttp.ClientSession() as s:
        for u in worker_urls:  # every policy starts from cold caches
            async with s.post(u + "/reset_prefix_cache") as r:
                await r.read()


async def run_policy(policy: str, workers: list[str], worker_urls: list[str], workload: list[DemoRequest],
                     progress: bool, block_size: int = 16, overrides: dict[str, Any] | None = None) -> PolicyRun:
    """One of our policies through ``kvrouter serve`` (in this process); ``overrides``: more config keys."""
    await reset_workers(worker_urls)
    cfg = load_config(None, {"routing.policy": policy, "routing.block_size": block_size, "probe_interval_s": 0.5,
                             **(overrides or {})})
    cfg.workers = [parse_worker_arg(w) for w in workers]
    server = ProxyServer(cfg)
    await server.start()
    api = await server.serve_api("127.0.0.1", 0)
    port = api.sockets[0].getsockname()[1]
    await asyncio.sleep(0.5)  # event subscriptions settle
    try:
        return await drive_workload(policy, f"http://127.0.0.1:{port}/v1/completions", workload, progress)
    finally:
        api.close()
        await server.stop()


def run_smg(worker_urls: list[str], workload: list[DemoRequest], progress: bool) -> PolicyRun:
    """The peer: SGLang's model gateway, cache_aware policy, in front of the same workers."""
    from bench.peers import smg

    asyncio.run(reset_workers(worker_urls))
    with smg(worker_urls) as url:
        asyncio.run(reset_workers(worker_urls))  # smg's readiness probe request warmed a cache: start cold
        return asyncio.run(drive_workload("smg", url + "/v1/completions", workload, progress))


def run_round(policies: list[str], rotate: int, specs: list[str], urls: list[str], workload: list[DemoRequest],
              progress: bool, skipped: dict[str, str],
              peers: dict[str, Callable[[], PolicyRun]] | None = None) -> list[PolicyRun]:
    """Every policy once on one workload, in an order rotated by ``rotate`` (none always goes first).

    A live peer (``smg``, and any runner ``peers`` adds by name) runs where installed; where not, why goes into
    ``skipped`` and it is not tried again."""
    runners: dict[str, Callable[[], PolicyRun]] = {"smg": lambda: run_smg(urls, workload, progress), **(peers or {})}
    order = policies[rotate % len(policies):] + policies[: rotate % len(policies)]
    done: list[PolicyRun] = []
    for policy in order:
        if policy in skipped:
            continue
        peer = runners.get(policy)
        if peer is None:
            done.append(asyncio.run(run_policy(policy, specs, urls, workload, progress)))
            continue
        try:
            done.append(peer())
        except PeerUnavailable as e:
            skipped[policy] = str(e)
            print(f"  {policy} skipped: {e}", file=sys.stderr)
    return done


async def drive_workload(policy: str, url: str | Sequence[str], workload: list[DemoRequest],
                         progress: bool) -> PolicyRun:
    """Send ``workload`` on its arrival times; over several ``url`` (router replicas), request i goes to the i-th
    in turn, as a load balancer in front of them would spread it."""
    urls = [url] if isinstance(url, str) else list(url)
    run = PolicyRun(policy)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        start = time.monotonic()
        tasks = [asyncio.create_task(_one(session, urls[i % len(urls)], r, start, run))
                 for i, r in enumerate(workload)]
        total = len(tasks)
        tty = sys.stderr.isatty()
        shown = -1
        while True:
            done = sum(t.done() for t in tasks)
            step = 25 * done // total
            if progress and (tty or step // 5 != shown // 5) and step != shown:
                bar = "#" * step + "." * (25 - step)
                print(f"{chr(13) if tty else ''}  {policy:<14} [{bar}] {done}/{total}", end="" if tty else "\n",
                      file=sys.stderr, flush=True)
                shown = step
            if done == total:
                break
            await asyncio.sleep(0.25)
        if progress and tty:
            print(file=sys.stderr)
        run.wall_s = time.monotonic() - start
    return run


def median_run(runs: list[PolicyRun]) -> PolicyRun:
    """The round whose mean TTFT is the median: a real run, not a blend of several."""
    if len(runs) == 1:
        return runs[0]
    ordered = sorted(runs, key=lambda r: r.summary()["ttft_mean_s"])
    return ordered[len(ordered) // 2]


def table(runs: list[PolicyRun]) -> str:
    head = (f"{'policy':<14}{'TTFT p50 ms':>12}{'TTFT p99 ms':>12}{'TTFT mean':>11}{'E2E mean s':>11}"
            f"{'out tok/s':>10}{'hit rate':>10}{'errors':>8}  requests per worker")
    lines = [head, "-" * len(head)]
    for r in runs:
        s = r.summary()
        spread = " ".join(f"{w}:{n}" for w, n in sorted(r.per_worker.items()))
        lines.append(f"{r.policy:<14}{s['ttft_p50_s'] * 1e3:>12.1f}{s['ttft_p99_s'] * 1e3:>12.1f}"
                     f"{s['ttft_mean_s'] * 1e3:>11.1f}{s['e2e_mean_s']:>11.2f}{s['throughput_tok_s']:>10.0f}"
                     f"{s['hit_rate']:>10.1%}{s['errors']:>8d}  {spread}")
    return "\n".join(lines)


def chart(runs: list[PolicyRun], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.policy for r in runs]
    sums = [r.summary() for r in runs]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    x = np.arange(len(names))
    a1.bar(x - 0.2, [s["ttft_p50_s"] * 1e3 for s in sums], 0.4, label="p50")
    a1.bar(x + 0.2, [s["ttft_p99_s"] * 1e3 for s in sums], 0.4, label="p99")
    a1.set_xticks(x, names, rotation=20)
    a1.set_ylabel("TTFT (ms)")
    a1.set_title("Time to first token")
    a1.legend()
    a2.bar(x, [s["hit_rate"] * 100 for s in sums], 0.5, color="tab:green")
    a2.set_xticks(x, names, rotation=20)
    a2.set_ylabel("prompt tokens served from cache (%)")
    a2.set_title("Cache hit rate (workers' cached_tokens)")
    fig.suptitle("kvrouter demo: same shared-prefix workload per policy")
    return save_figure(fig, path)


def save_figure(fig: Any, path: Path) -> Path:
    """Lay out, write as PNG (its folder made), close: every bench chart ends so."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(args: argparse.Namespace) -> int:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    workload = shared_prefix_workload(args.groups, args.per_group, args.rate, args.seed)
    started = time.monotonic()
    print(f"kvrouter demo: {args.workers} simulated workers (time-scale {args.time_scale}), "
          f"{len(workload)} requests in {args.groups} shared-prefix groups at {args.rate}/s, "
          f"policies: {', '.join(policies)}", flush=True)
    runs: list[PolicyRun] = []
    with ExitStack() as stack:
        workers = sim_workers(stack, args.workers, "--time-scale", str(args.time_scale),
                              "--num-gpu-blocks", str(args.gpu_blocks), replay=True)
        specs, urls = [w.spec for w in workers], [w.url for w in workers]
        print(f"workers up in {time.monotonic() - started:.1f} s", flush=True)
        rounds: list[list[PolicyRun]] = []
        skipped: dict[str, str] = {}
        for r in range(args.rounds):
            done = run_round(policies, r, specs, urls, workload, True, skipped)
            rounds.append(sorted(done, key=lambda x: policies.index(x.policy)))
    runs = [median_run([rnd[i] for rnd in rounds]) for i in range(len(rounds[0]))] if rounds else []
    print()
    if args.rounds > 1:
        print(f"median over {args.rounds} rounds (each policy's rounds in rotated order):")
    print(table(runs))
    try:
        shown = f"chart: {chart(runs, Path(args.chart))}"
    except ImportError:
        shown = "no chart: pip install 'kvrouter[charts]' (matplotlib) to draw one"
    print(f"\n{shown}   total {time.monotonic() - started:.0f} s")
    print("one workload, so a few points of hit rate are run-to-run noise; `kvrouter bench quality` pools 8 seeds")
    if args.json:
        Path(args.json).write_text(json.dumps({r.policy: r.summary() for r in runs}, indent=2))
    return 0 if all(not r.errors for r in runs) else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=DEMO_DEFAULTS["workers"])
    p.add_argument("--policies", default=DEMO_POLICIES,
                   help="comma-separated; 'smg' adds the SGLang model gateway (cache_aware) as a peer if installed")
    p.add_argument("--groups", type=int, default=DEMO_DEFAULTS["groups"],
                   help="shared-prefix groups (each its own system prompt)")
    p.add_argument("--per-group", type=int, default=DEMO_DEFAULTS["per_group"])
    p.add_argument("--rate", type=float, default=DEMO_DEFAULTS["rate"], help="arrivals per second")
    p.add_argument("--time-scale", type=float, default=DEMO_DEFAULTS["time_scale"],
                   help="workers' modelled-time multiplier")
    p.add_argument("--gpu-blocks", type=int, default=DEMO_DEFAULTS["gpu_blocks"],
                   help="KV blocks per worker (block size 16): one worker cannot hold every group's prefix")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat every policy N times (rotating the order) and report each policy's median round")
    p.add_argument("--chart", default="out/demo.png", help="where to write the PNG chart")
    p.add_argument("--json", default=None, help="also write the per-policy summary as JSON here")
