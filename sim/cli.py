"""``kvrouter sim``: replay a trace or a synthetic workload through every policy and compare."""

from __future__ import annotations

import argparse
import json
import sys
import time

from router.scheduling import BUILTIN_PROFILES as POLICIES
from router.scheduling import RoutingConfig
from router.scheduling.disagg import MODES, DisaggParams
from router.scheduling.engine_profile import read_timing_file
from sim.oracle import ORACLE, sim_routing
from sim.report import Progress, plots, stable_json, table
from sim.runner import SimConfig, Simulation, pooled, summarise
from sim.suite import SUITES
from sim.workload import WORKLOADS, SimRequest, infinite_cache_bound, mooncake, repeat_trace
from workers.engine import EngineConfig, TimingModel

DEFAULT_POLICIES = "random,round_robin,least_loaded,session_hash,approx_prefix,precise"


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="Mooncake JSONL trace (e.g. ../shared/traces/mooncake_conversation_trace.jsonl)")
    src.add_argument("--workload", choices=sorted(WORKLOADS), help="a synthetic workload")
    src.add_argument("--suite", choices=sorted(SUITES),
                     help="every profile plus the oracle over a set of scenarios (sim/suite.py); "
                          "--quick, --scenarios, --policies, --json and --plots apply")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--prefill-workers", type=int, default=0,
                   help="prefill/decode disaggregation: the first P workers only prefill")
    p.add_argument("--decode-workers", type=int, default=0,
                   help="the next D only decode (the rest of --workers do both; --workers grows to P + D)")
    p.add_argument("--pd-mode", choices=MODES, default="conditional",
                   help="split every request (always), when it pays by the objective (conditional), or never")
    p.add_argument("--kv-bytes-per-token", type=int, default=DisaggParams.kv_bytes_per_token,
                   help="KV bytes a prompt token transfers (model shape: 2 x layers x KV heads x head dim x dtype)")
    p.add_argument("--link-gbit-s", type=float, default=DisaggParams.link_gbit_s, help="KV transfer link")
    p.add_argument("--policies", default=None,
                   help=f"comma-separated, from {sorted([*POLICIES, ORACLE])} (oracle: the precise objective on the "
                        "engines' true state, sim only); default: " + DEFAULT_POLICIES + ", or with --suite "
                        "every built-in profile and oracle")
    p.add_argument("--speedup", type=float, default=1.0, help="divide trace arrival times (more load)")
    p.add_argument("--rate", type=float, default=None, help="synthetic workloads: arrivals per second")
    p.add_argument("--jitter", type=float, default=3.0, help="spread the trace's ~3 s quantised timestamps (s)")
    p.add_argument("--limit", type=int, default=None, help="only the first N trace rows")
    p.add_argument("--repeat", type=int, default=1,
                   help="overlay N copies of the trace with distinct users (N x requests and rate), for scale runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=int, default=1,
                   help="run seeds SEED..SEED+N-1 (new arrivals, or new jitter for a trace) and pool their requests")
    p.add_argument("--block-size", type=int, default=None,
                   help="engine KV block size in tokens (default: 512 for a trace, whose own blocks are 512 "
                        "tokens, so finer blocks cannot hit more; 16 for synthetic workloads)")
    p.add_argument("--kv-tokens", type=int, default=1 << 20, help="KV cache per worker in tokens (default 1M)")
    p.add_argument("--gpu-blocks", type=int, default=None, help="KV blocks per worker (overrides --kv-tokens)")
    p.add_argument("--cpu-blocks", type=int, default=0, help="CPU offload tier per worker (blocks)")
    p.add_argument("--max-model-len", type=int, default=EngineConfig.max_model_len,
                   help="engine context limit in tokens: longer requests (prompt + output) are rejected, as a real "
                        "engine answers 400, and counted per policy as 'rejected' (default %(default)s)")
    p.add_argument("--timing", default=None, help="YAML/JSON overriding the engine timing model (kvrouter calibrate "
                   "--out writes one; its step_token_budget is the engines' max_num_batched_tokens)")
    p.add_argument("--json", action="store_true", help="print JSON with stable keys instead of the table")
    p.add_argument("--plots", default=None, metavar="DIR",
                   help="write PNGs here (TTFT CDF and hit/load; with --suite one per scenario); needs "
                        "pip install 'kvrouter[charts]'")
    p.add_argument("--quick", action="store_true", help="--suite: every scenario at a fraction of its size (CI)")
    p.add_argument("--scenarios", default=None, help="--suite: only these scenarios (comma-separated)")
    p.add_argument("--cost", action="append", default=[], metavar="KEY=VALUE",
                   help="--suite: the router's cost parameter for every profile (repeatable; e.g. kv_load_weight=0.25)")


def run(args: argparse.Namespace) -> int:
    if args.plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("kvrouter sim: --plots needs matplotlib: pip install 'kvrouter[charts]'", file=sys.stderr)
            return 2
    if getattr(args, "suite", None):
        from sim.suite import main_suite

        return main_suite(args)
    policies = [p.strip() for p in (args.policies or DEFAULT_POLICIES).split(",") if p.strip()]
    known = [*POLICIES, ORACLE]
    unknown = [p for p in policies if p not in known]
    if unknown:
        print(f"kvrouter sim: unknown policies {unknown}; choose from {sorted(known)}", file=sys.stderr)
        return 2
    if args.block_size is None:
        args.block_size = 512 if args.trace else 16
    if args.gpu_blocks is None:
        args.gpu_blocks = args.kv_tokens // args.block_size
    timing, budget = TimingModel(), EngineConfig.max_num_batched_tokens
    if args.timing:  # a calibrated engine: its coefficients, and its token budget where the file has one
        spec = read_timing_file(args.timing)
        timing, budget = TimingModel(**spec.coefficients), spec.step_token_budget or budget
    engine = EngineConfig(num_gpu_blocks=args.gpu_blocks, block_size=args.block_size, cpu_blocks=args.cpu_blocks,
                          max_model_len=args.max_model_len, timing=timing, max_num_batched_tokens=budget)
    source = args.trace or args.workload
    workloads = [_workload(args, seed) for seed in range(args.seed, args.seed + max(1, args.seeds))]
    requests = [r for w in workloads for r in w]
    bound = sum(infinite_cache_bound(w, args.block_size) * _prompt_tokens(w) for w in workloads) / max(
        1, _prompt_tokens(requests))
    results, summaries = {}, {}
    started = time.perf_counter()
    roles = pd_roles(args)
    for name in policies:
        runs = [Simulation(w, SimConfig(workers=args.workers, policy=name, engine=engine, seed=seed, roles=roles,
                                        routing=pd_routing(args, name, seed) if roles else None)).run(
                    Progress(name, enabled=False if args.json or len(workloads) > 1 else None))
                for seed, w in zip(range(args.seed, args.seed + len(workloads)), workloads, strict=True)]
        results[name] = runs[0] if len(runs) == 1 else pooled(runs)
        summaries[name] = summarise(results[name])
    extra = {"source": source, "requests": len(requests), "workers": args.workers, "speedup": args.speedup,
             "prefill_workers": args.prefill_workers, "decode_workers": args.decode_workers,
             "pd_mode": args.pd_mode if roles else None,
             "block_size": args.block_size, "gpu_blocks": args.gpu_blocks, "seed": args.seed, "seeds": len(workloads),
             "wall_s": round(time.perf_counter() - started, 2)}
    if args.json:
        print(json.dumps(stable_json(summaries, bound, extra), indent=2, sort_keys=True))
    else:
        seeds = f" ({len(workloads)} seeds pooled)" if len(workloads) > 1 else ""
        print(f"{source}: {len(requests)} requests{seeds}, {args.workers} workers, speedup {args.speedup}, "
              f"block {args.block_size}, {args.gpu_blocks} blocks/worker")
        print(table(summaries, bound))
        print(f"total wall time {extra['wall_s']:.1f} s")
    if args.plots:
        for path in plots(results, args.plots):
            print(f"wrote {path}", file=sys.stderr)
    return 0


def pd_roles(args: argparse.Namespace) -> dict[int, str]:
    """Worker index -> role, from --prefill-workers / --decode-workers (empty: an aggregated fleet)."""
    p, d = args.prefill_workers, args.decode_workers
    if not p and not d:
        return {}
    args.workers = max(args.workers, p + d)
    return {i: "prefill" if i < p else "decode" if i < p + d else "both" for i in range(args.workers)}


def pd_routing(args: argparse.Namespace, policy: str, seed: int) -> RoutingConfig:
    pd = DisaggParams(args.pd_mode, kv_bytes_per_token=args.kv_bytes_per_token, link_gbit_s=args.link_gbit_s)
    return sim_routing(policy, args.block_size, seed, disaggregation=pd)


def _workload(args: argparse.Namespace, seed: int) -> list[SimRequest]:
    if args.trace:
        return repeat_trace(mooncake(args.trace, limit=args.limit, speedup=args.speedup, jitter_s=args.jitter,
                                     seed=seed), args.repeat)
    kw = {"seed": seed} | ({"rate": args.rate} if args.rate else {})
    requests = WORKLOADS[args.workload](**kw)
    if args.speedup != 1.0:
        for r in requests:
            r.arrival /= args.speedup
    return requests


def _prompt_tokens(requests: list[SimRequest]) -> int:
    return sum(r.num_tokens for r in requests)
