"""``kvrouter bench fidelity``: do the simulator's verdicts hold on real engines?

One workload through the live proxy in front of N real vLLM engines, once per policy, and the same workload
through the simulator with the engines' calibrated timing; per policy, real against simulated mean and p99 TTFT,
E2E and hit rate, the ratio sim/real, and the rank agreement over the policies (Kendall's tau).

- Engines: ``--backend vllm`` (default) starts N vLLM engines: on a CPU machine a random-weight Llama
  (workers/vllm/build_tiny_model.py; ``--shape tiny``, the default, or ``--shape prefill``, whose prefill
  dominates a 1K-token prompt's TTFT), each bound to its own core; with ``--model`` and ``--gpu``, that model,
  one engine per GPU (``CUDA_VISIBLE_DEVICES=i``), ``--engines`` of them. Every engine runs with the block
  size, KV blocks, token budget and batch limit the simulator is then given, so the two see one fleet.
  ``--backend sim`` runs simulated workers instead (the pipeline's own check: both sides are then the engine
  model, and any gap is the live path's: HTTP, events, scrapes).
- Timing: engine 0 is calibrated first (``kvrouter calibrate``, router/calibrate.py), or ``--timing FILE``;
  the proxy's cost prior (``routing.timing_file``) and the simulated engines both take that file.
- Workload: the first rows of the shared Mooncake conversation trace, each 512-token trace block shrunk to one
  engine block (the sharing structure kept, the prompts 16x shorter, so CPU engines serve them in minutes),
  outputs capped; merged with a shared-prefix shape (groups of requests on one system prompt). Token ids are the
  same on both sides: the proxy sends them as the prompt, the simulator replays them.
- Each policy starts cold: the engines' prefix caches are reset and a fresh router built.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from bench.demo import DemoRequest, PolicyRun, run_policy, save_figure
from bench.load import p99, sim_workers
from router.scheduling import CostParams, RoutingConfig
from router.scheduling.engine_profile import TIMING_KEYS, read_timing_file
from sim.runner import SimConfig, Simulation
from sim.suite import TRACE
from sim.workload import SimRequest, merged, shared_prefix, tokens_for_blocks
from workers.engine import EngineConfig, TimingModel

POLICIES = ["precise", "least_loaded", "round_robin", "approx_prefix", "llmd"]
RANKED = ("precise", "least_loaded", "round_robin")  # the order issue 44 asks the simulator to keep
TOKEN_LOW, TOKEN_SPAN = 10, 3980  # token ids inside the tiny model's 4,000-token vocabulary


@dataclass(frozen=True)
class Fleet:
    """What every engine runs with, live and simulated alike."""

    engines: int = 2
    block_size: int = 32
    num_gpu_blocks: int = 256  # 8,192 tokens per engine: the workload's working set is larger
    max_model_len: int = 4096
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64

    def engine_flags(self) -> list[str]:
        return ["--max-num-batched-tokens", str(self.max_num_batched_tokens), "--max-num-seqs",
                str(self.max_num_seqs)]

    def sim_flags(self) -> list[str]:
        return ["--block-size", str(self.block_size), "--num-gpu-blocks", str(self.num_gpu_blocks),
                "--max-model-len", str(self.max_model_len), *self.engine_flags()]


@dataclass(frozen=True)
class Shape:
    trace_rows: int
    trace_rate: float  # requests/s of the trace part
    groups: int
    per_group: int
    shared_rate: float
    max_output: int = 32

    @staticmethod
    def of(quick: bool) -> Shape:
        # 16 groups' 1K-token system prompts are 16K tokens: the two engines' caches (8K each) hold them only if
        # the groups are split between them, so where a policy sends a group decides its hits
        return Shape(100, 4.0, 8, 6, 2.0) if quick else Shape(200, 4.0, 16, 8, 3.0)


def _remap(tokens: np.ndarray) -> np.ndarray:
    return (TOKEN_LOW + tokens.astype(np.int64) % TOKEN_SPAN).astype(np.uint32)


def trace_slice(path: Path, shape: Shape, fleet: Fleet) -> list[SimRequest]:
    """The trace's first rows, each 512-token block one engine block; arrivals compressed to the shape's rate."""
    rows = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            rows.append(json.loads(line))
            if len(rows) >= shape.trace_rows:
                break
    span = max((rows[-1]["timestamp"] - rows[0]["timestamp"]) / 1000.0, 1e-9)
    squeeze = len(rows) / shape.trace_rate / span
    out = []
    for i, row in enumerate(rows):
        bs = fleet.block_size
        n = max(1, math.ceil(row["input_length"] * bs / 512))
        output = max(1, min(shape.max_output, int(row["output_length"])))
        if n + output > fleet.max_model_len:
            continue
        prompt = _remap(tokens_for_blocks(list(row["hash_ids"]), bs).ravel()[:n])
        if len(prompt) < n:
            continue
        out.append(SimRequest(f"t{i}", (row["timestamp"] - rows[0]["timestamp"]) / 1000.0 * squeeze, prompt, output))
    return out


def workload(shape: Shape, fleet: Fleet, seed: int = 0, trace: Path = TRACE) -> list[SimRequest]:
    shared = shared_prefix(shape.groups, shape.per_group, 1024, 64, shape.max_output, shape.shared_rate, seed)
    for r in shared:
        r.prompt = _remap(r.tokens)
    return merged(trace_slice(trace, shape, fleet), shared)


def live_requests(requests: list[SimRequest], model: str) -> list[DemoRequest]:
    return [DemoRequest(r.arrival, {"model": model, "prompt": [int(t) for t in r.tokens],
                                    "max_tokens": r.output_len, "ignore_eos": True, "temperature": 0.0,
                                    "stream": True, "stream_options": {"include_usage": True}},
                        r.session or r.request_id) for r in requests]


def figures(ttft: list[float], e2e: list[float], tpot: list[float | None], prompt: int, cached: int,
            errors: int = 0) -> dict[str, float]:
    """The same figures from both sides, by the same arithmetic (p99: nearest rank)."""
    steps = [t for t in tpot if t is not None]
    return {"ttft_mean_s": float(np.mean(ttft)), "ttft_p99_s": p99(ttft), "e2e_mean_s": float(np.mean(e2e)),
            "e2e_p99_s": p99(e2e), "tpot_mean_s": float(np.mean(steps)) if steps else float("nan"),
            "hit_rate": cached / prompt if prompt else 0.0, "requests": len(ttft), "errors": errors}


def live_figures(run: PolicyRun) -> dict[str, float]:
    return figures(run.ttft, run.e2e, run.tpot, run.prompt_tokens, run.cached_tokens, run.errors)


ENGINE_HISTOGRAMS = {"engine_ttft_mean_s": ("vllm:time_to_first_token_seconds",),
                     "engine_itl_mean_s": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")}


async def engine_histograms(urls: list[str]) -> dict[str, tuple[float, float]]:
    """(sum, count) over the fleet of the engines' own TTFT and inter-token histograms (where they have them)."""
    import aiohttp

    from router.calibrate import histogram_sum_count

    out: dict[str, tuple[float, float]] = {}
    async with aiohttp.ClientSession() as session:
        for url in urls:
            async with session.get(url + "/metrics") as r:
                text = await r.text()
            for key, names in ENGINE_HISTOGRAMS.items():
                for name in names:
                    h = histogram_sum_count(text, name)
                    if h is not None:
                        s, c = out.get(key, (0.0, 0.0))
                        out[key] = (s + h[0], c + h[1])
                        break
    return out


def group_schedstat(pgids: list[int]) -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting for one) of every thread of every process in these
    process groups (the engines: each its own session), from /proc/PID/task/TID/schedstat."""
    run = wait = 0.0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if os.getpgid(int(proc.name)) not in pgids:
                continue
            for task in (proc / "task").iterdir():
                fields = (task / "schedstat").read_text().split()
                run += int(fields[0]) / 1e9
                wait += int(fields[1]) / 1e9
        except (OSError, ValueError, IndexError):
            continue  # a process that ended meanwhile
    return run, wait


@dataclass
class CpuWatch:
    """What the machine did around one policy's run: this process's CPU (the proxy and the load generator share
    the engines' cores here) and the engines' time on and waiting for a CPU."""

    pgids: list[int]

    def __enter__(self) -> CpuWatch:
        self.t0, self.cpu0 = time.monotonic(), time.process_time()
        self.sched0 = group_schedstat(self.pgids) if self.pgids else (0.0, 0.0)
        return self

    def __exit__(self, *_: object) -> None:
        wall = time.monotonic() - self.t0
        run, wait = group_schedstat(self.pgids) if self.pgids else (0.0, 0.0)
        self.figures = {"router_and_client_cpu_share": (time.process_time() - self.cpu0) / wall}
        if self.pgids:
            self.figures |= {"engines_cpu_share": (run - self.sched0[0]) / wall / len(self.pgids),
                             "engines_waiting_share": (wait - self.sched0[1]) / wall / len(self.pgids)}


def engine_side(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, float]:
    """The engines' own means over one run: what they measured, without the proxy and the client around them."""
    out = {}
    for key in ENGINE_HISTOGRAMS:
        if key in before and key in after and after[key][1] > before[key][1]:
            out[key] = (after[key][0] - before[key][0]) / (after[key][1] - before[key][1])
    return out


def simulate(requests: list[SimRequest], policy: str, fleet: Fleet, coefficients: dict[str, float],
             seed: int = 0) -> dict[str, float]:
    engine = EngineConfig(num_gpu_blocks=fleet.num_gpu_blocks, block_size=fleet.block_size,
                          max_num_batched_tokens=fleet.max_num_batched_tokens, max_num_seqs=fleet.max_num_seqs,
                          max_model_len=fleet.max_model_len, timing=TimingModel(**coefficients))
    cost = CostParams(**coefficients, step_token_budget=fleet.max_num_batched_tokens)
    routing = RoutingConfig(policy=policy, block_size=fleet.block_size, seed=seed, cost=cost)
    result = Simulation(requests, SimConfig(workers=fleet.engines, policy=policy, engine=engine, seed=seed,
                                            routing=routing, scrape_interval_s=0.5)).run()
    done = [r for r in result.records if r.first_token_at is not None and r.finished_at is not None]
    return figures([r.ttft for r in done], [r.finished_at - r.arrival for r in done], [r.tpot for r in done],
                   sum(r.prompt_tokens for r in done), sum(r.cached_tokens for r in done),
                   len(result.records) - len(done))


def median_round(runs: list[dict[str, float]]) -> dict[str, float]:
    """The round whose mean TTFT is the median (a real run, not a blend), with every round's mean TTFT."""
    chosen = sorted(runs, key=lambda r: r["ttft_mean_s"])[len(runs) // 2]
    return chosen | {"rounds_ttft_mean_s": [r["ttft_mean_s"] for r in runs]}


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's tau-a between two orderings of the same items (ties count as neither)."""
    n, s = len(a), 0
    for i in range(n):
        for j in range(i + 1, n):
            s += int(np.sign(a[i] - a[j]) * np.sign(b[i] - b[j]))
    return s / (n * (n - 1) / 2) if n > 1 else 1.0


def compare(real: dict[str, dict[str, float]], simulated: dict[str, dict[str, float]]) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for policy in real:
        r, s = real[policy], simulated[policy]
        rows[policy] = {"real": r, "sim": s, "ratio": {
            k: (s[k] / r[k] if r[k] else None) for k in ("ttft_mean_s", "ttft_p99_s", "e2e_mean_s", "e2e_p99_s",
                                                         "tpot_mean_s")},
            "hit_rate_points": 100 * (s["hit_rate"] - r["hit_rate"])}
    names = list(real)
    tau = {k: kendall_tau([real[p][k] for p in names], [simulated[p][k] for p in names])
           for k in ("ttft_mean_s", "e2e_mean_s", "hit_rate")}
    ranked = [p for p in RANKED if p in real]
    order_real = sorted(ranked, key=lambda p: real[p]["ttft_mean_s"])
    order_sim = sorted(ranked, key=lambda p: simulated[p]["ttft_mean_s"])
    return {"policies": rows, "kendall_tau": tau, "ttft_order_real": order_real, "ttft_order_sim": order_sim,
            "ttft_order_agrees": order_real == order_sim}


@contextlib.contextmanager
def fleet_urls(args: argparse.Namespace, fleet: Fleet, workdir: Path):  # type: ignore[no-untyped-def]
    """(worker specs, worker URLs, served model name, the engines' process groups) of the engines, stopped on
    exit."""
    if args.backend == "sim":
        timing = ["--timing", args.timing] if args.timing else []
        with contextlib.ExitStack() as stack:
            ws = sim_workers(stack, fleet.engines, *fleet.sim_flags(), *timing, replay=True)
            yield [w.spec for w in ws], [w.url for w in ws], "sim-model", []
        return
    from workers.vllm.engines import Engine, build_tiny_model, engine_port, running

    model: Path | str = args.model or build_tiny_model(workdir / f"{args.shape}-model", shape=args.shape)
    group = [Engine(f"e{i}", engine_port(), engine_port(), engine_port(), None if args.gpu else i % 2, model,
                    workdir / f"e{i}.log", extra=tuple(fleet.engine_flags()), block_size=fleet.block_size,
                    num_gpu_blocks=fleet.num_gpu_blocks, max_model_len=fleet.max_model_len,
                    served_name="tiny" if args.model is None else "model",
                    env=(("CUDA_VISIBLE_DEVICES", str(i)),) if args.gpu else ())
             for i in range(fleet.engines)]
    with running(group):
        yield ([e.spec for e in group], [e.url for e in group], group[0].served_name,
               [e.proc.pid for e in group if e.proc is not None])


def run(args: argparse.Namespace) -> dict[str, Any]:
    fleet = Fleet(engines=args.engines, block_size=args.block_size, num_gpu_blocks=args.gpu_blocks)
    shape = Shape.of(args.quick)
    requests = workload(shape, fleet, args.seed)
    policies = args.policies.split(",") if args.policies else POLICIES
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvrouter-fidelity-") as tmp:
        workdir = Path(tmp)
        with fleet_urls(args, fleet, workdir) as (specs, urls, model, pgids):
            print(f"fidelity: {len(urls)} {args.backend} engines up in {time.monotonic() - started:.0f} s",
                  file=sys.stderr, flush=True)
            timing_path = args.timing
            if timing_path is None:
                from router.calibrate import dump, run_calibration

                # the budget is the one the engines were started with: on a noisy CPU engine the fit cannot
                # resolve one more chunk's few milliseconds (it found 3584 for 2048)
                cal = asyncio.run(run_calibration(urls[0], {"max_prompt": fleet.max_model_len - 64},
                                                  fleet.max_num_batched_tokens))
                timing_path = str(workdir / "timing.yaml")
                Path(timing_path).write_text(dump(cal))
            timing_doc = yaml.safe_load(Path(timing_path).read_text())
            coefficients = read_timing_file(timing_path).coefficients
            live = live_requests(requests, model)
            rounds: dict[str, list[dict[str, float]]] = {p: [] for p in policies}
            for r in range(args.rounds):  # each round in a rotated order: no policy always runs first
                for policy in policies[r % len(policies):] + policies[:r % len(policies)]:
                    overrides = {"routing.timing_file": timing_path}
                    before = asyncio.run(engine_histograms(urls))
                    with CpuWatch(pgids) as cpu:
                        pr = asyncio.run(run_policy(policy, specs, urls, live, True, fleet.block_size, overrides))
                    rounds[policy].append(live_figures(pr) | engine_side(before, asyncio.run(engine_histograms(urls)))
                                          | cpu.figures)
            real = {p: median_round(rounds[p]) for p in policies}
    simulated = {p: simulate(requests, p, fleet, coefficients, args.seed) for p in policies}
    out = compare(real, simulated)
    out.update({"backend": args.backend, "engines": fleet.engines,
                "model": args.model or (args.shape if args.backend == "vllm" else None), "requests": len(requests),
                "rounds": args.rounds,
                "fleet": fleet.__dict__, "timing": {k: timing_doc.get(k) for k in (*TIMING_KEYS, "step_token_budget")
                                                     if k in timing_doc},
                "calibration_residuals": {k: (timing_doc.get("calibration") or {}).get(k)
                                          for k in ("prefill", "decode")},
                "wall_s": round(time.monotonic() - started, 1)})
    return out


def table(res: dict[str, Any]) -> str:
    head = (f"{'policy':<14}{'TTFT mean ms real/sim':>23}{'ratio':>7}{'TTFT p99 ms':>17}{'ratio':>7}"
            f"{'E2E mean s':>14}{'ratio':>7}{'hit rate real/sim':>20}")
    lines = [head, "-" * len(head)]
    for policy, row in res["policies"].items():
        r, s, q = row["real"], row["sim"], row["ratio"]
        lines.append(f"{policy:<14}{r['ttft_mean_s'] * 1e3:>13.1f} / {s['ttft_mean_s'] * 1e3:<7.1f}"
                     f"{q['ttft_mean_s']:>7.2f}{r['ttft_p99_s'] * 1e3:>8.0f} / {s['ttft_p99_s'] * 1e3:<6.0f}"
                     f"{q['ttft_p99_s']:>7.2f}{r['e2e_mean_s']:>7.2f} / {s['e2e_mean_s']:<5.2f}{q['e2e_mean_s']:>7.2f}"
                     f"{r['hit_rate']:>11.1%} / {s['hit_rate']:<6.1%}")
    lines.append("per output token, ms: " + "; ".join(
        f"{p} client {row['real']['tpot_mean_s'] * 1e3:.2f}"
        + (f", engine {row['real']['engine_itl_mean_s'] * 1e3:.2f}" if "engine_itl_mean_s" in row["real"] else "")
        + f", sim {row['sim']['tpot_mean_s'] * 1e3:.2f}" for p, row in res["policies"].items()))
    cpu = [(p, row["real"]) for p, row in res["policies"].items() if "engines_waiting_share" in row["real"]]
    if cpu:
        lines.append("CPU: " + "; ".join(
            f"{p} router+client {r['router_and_client_cpu_share']:.0%} of a core, engines on CPU "
            f"{r['engines_cpu_share']:.0%} and waiting for one {r['engines_waiting_share']:.0%}" for p, r in cpu))
    tau = res["kendall_tau"]
    lines.append(f"Kendall tau (real vs sim over the policies): TTFT {tau['ttft_mean_s']:.2f}, E2E "
                 f"{tau['e2e_mean_s']:.2f}, hit rate {tau['hit_rate']:.2f}; TTFT order of {', '.join(RANKED)}: "
                 f"real {res['ttft_order_real']}, sim {res['ttft_order_sim']}")
    return "\n".join(lines)


def chart(res: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(res["policies"])
    x = np.arange(len(names))
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, key, label, scale in ((axes[0], "ttft_mean_s", "mean TTFT (ms)", 1e3),
                                  (axes[1], "e2e_mean_s", "mean E2E (s)", 1.0),
                                  (axes[2], "hit_rate", "hit rate (%)", 100.0)):
        ax.bar(x - 0.2, [res["policies"][p]["real"][key] * scale for p in names], 0.4, label="real vLLM")
        ax.bar(x + 0.2, [res["policies"][p]["sim"][key] * scale for p in names], 0.4, label="simulator")
        ax.set_xticks(x, names, rotation=20)
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(f"kvrouter bench fidelity: {res['engines']} {res['backend']} engines, {res['requests']} requests")
    return save_figure(fig, path)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engines", type=int, default=2, help="engines in the fleet (default 2)")
    p.add_argument("--backend", choices=["vllm", "sim"], default="vllm",
                   help="vllm: real engines (default); sim: simulated workers, the pipeline's self-check")
    p.add_argument("--model", default=None, help="a real model (path or name) instead of the tiny CPU model")
    p.add_argument("--shape", choices=["tiny", "prefill"], default="tiny",
                   help="the CPU model's size (workers/vllm/build_tiny_model.py): tiny (default, prefill cheap beside "
                   "a step's fixed cost) or prefill (a 1K-token prompt's TTFT is mostly prefill: hits decide TTFT)")
    p.add_argument("--gpu", action="store_true", help="one engine per GPU (CUDA_VISIBLE_DEVICES=i), not bound to "
                   "CPU cores")
    p.add_argument("--gpu-blocks", type=int, default=Fleet.num_gpu_blocks, help="KV blocks per engine")
    p.add_argument("--block-size", type=int, default=Fleet.block_size)
    p.add_argument("--timing", default=None, help="a timing file (kvrouter calibrate --out) instead of calibrating")
    p.add_argument("--policies", default=None, help=f"comma-separated (default {','.join(POLICIES)})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1,
                   help="run every policy N times (order rotated each round); the median round by mean TTFT")
    p.add_argument("--chart", default=None, help="write a PNG chart here")


def main(args: argparse.Namespace) -> int:
    res = run(args)
    if args.json:
        print(json.dumps(res, indent=2, sort_keys=True))
    else:
        print(table(res))
    if args.chart:
        try:
            print(f"chart: {chart(res, Path(args.chart))}", file=sys.stderr)
        except ImportError:
            print("no chart: pip install 'kvrouter[charts]'", file=sys.stderr)
    return 0 if all(row["real"]["errors"] == 0 for row in res["policies"].values()) else 1
