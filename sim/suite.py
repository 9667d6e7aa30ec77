"""``kvrouter sim --suite standard``: every scheduling profile, plus the oracle, over a fixed set of scenarios.

Each scenario is a workload, a fleet (8 engine models unless said) and its faults; every profile in
``router.scheduling.profiles.BUILTIN_PROFILES`` (read when the suite runs, so new built-in profiles join it) and
``oracle`` (sim/oracle.py: the precise objective on the engines' true state) replay it on the same seed. Per
scenario and profile: TTFT mean/p50/p99, E2E mean/p99, TPOT mean, token hit rate beside the scenario's
infinite-shared-cache bound, load imbalance, rejected/failed/shed counts.

Load factors of the conversation trace (``TRACE_SPEEDUPS``), calibrated once with ``python -m sim.suite
--calibrate``: least_loaded's mean TTFT over the first 1,000 rows is 0.270 s unloaded (arrivals 50x apart),
1.21x that at speedup 1.6 (``trace_light``) and 2.10x at speedup 5.0 (``trace_heavy``); 1.0 gives 1.07x, 4.0
1.81x. ``--quick`` runs every scenario at a fraction of its size (CI: well under a minute); the standard sizes
keep the whole suite to minutes on one core.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from router.scheduling import CostParams
from router.scheduling import profiles as _profiles
from router.scheduling.flow import FlowParams
from router.scheduling.slo import ServiceObjective
from sim.oracle import ORACLE, sim_routing
from sim.runner import EventFaults, SimConfig, SimResult, Simulation, summarise
from sim.workload import (
    SimRequest,
    cache_bound,
    hot_prefix,
    lora_zipf,
    merged,
    mooncake,
    multi_turn,
    shared_prefix,
    with_objective,
    zipf_prefixes,
)
from workers.engine import EngineConfig, TimingModel

TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
TRACE_ROWS = 1000  # the trace's first rows (about 5 minutes of it at speedup 1)
TRACE_ROWS_QUICK = 100
TRACE_JITTER_S = 3.0  # as kvrouter sim: spreads the trace's ~3 s quantised timestamps
# least_loaded mean TTFT / its unloaded mean TTFT: ~1.2x and >= 2x (python -m sim.suite --calibrate)
TRACE_SPEEDUPS = {"trace_light": 1.6, "trace_heavy": 5.0}
TRACE_ENGINE = EngineConfig(num_gpu_blocks=2048, block_size=512)  # the trace's own 512-token blocks, 1M tokens
SYNTH_ENGINE = EngineConfig(num_gpu_blocks=8192, block_size=16)  # 128K tokens of KV per worker
PRESSURE_GPU_BLOCKS = 2048  # 32K tokens per worker: the eviction and offload scenarios' small caches
PRESSURE_GPU_BLOCKS_QUICK = 512
WORKERS = 8
SUMMARY_KEYS = ("ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "e2e_mean_s", "e2e_p99_s", "tpot_mean_s",
                "hit_rate", "load_imbalance", "throughput_tok_s", "rejected", "failed", "shed", "no_endpoint",
                "completed", "requests", "wall_s", "slo_attainment", "goodput_rps", "slo_by_priority", "slo_by_tenant",
                "fleet_changes", "prediction")


@dataclass
class Setup:
    """One scenario, built: its requests and fleet."""

    requests: list[SimRequest]
    engine: EngineConfig
    workers: int = WORKERS
    engines: dict[int, EngineConfig] = field(default_factory=dict)  # per-worker overrides
    faults: dict[int, EventFaults] = field(default_factory=dict)
    restart_busiest_at: float | None = None
    roles: dict[int, str] = field(default_factory=dict)  # prefill/decode disaggregation (default: all both)
    notes: dict[str, Any] = field(default_factory=dict)
    flow: FlowParams | None = None  # the router's flow control (router/scheduling/flow.py), the same for every profile
    joins: dict[int, float] = field(default_factory=dict)  # a fleet that changes (SimConfig.joins, .drains)
    drains: dict[int, float] = field(default_factory=dict)
    loras: frozenset[str] = frozenset()  # LoRA adapters every worker serves (SimConfig.loras)

    @property
    def fleet_cache_tokens(self) -> int:
        blocks = sum(self.engines.get(i, self.engine).num_gpu_blocks for i in range(self.workers))
        return blocks * self.engine.block_size


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    build: Callable[[bool, Path], Setup]  # (quick, trace path)
    needs_trace: bool = False


def half_compute(timing: TimingModel) -> TimingModel:
    """A worker with half the compute: every step takes twice as long (prefill, decode, load-back)."""
    return TimingModel(**{k: 2.0 * v for k, v in timing.as_dict().items()})


# ---- the scenarios ----------------------------------------------------------------------------------------
def _trace(name: str) -> Callable[[bool, Path], Setup]:
    def build(quick: bool, trace: Path) -> Setup:
        rows = TRACE_ROWS_QUICK if quick else TRACE_ROWS
        reqs = mooncake(trace, limit=rows, speedup=TRACE_SPEEDUPS[name], jitter_s=TRACE_JITTER_S)
        return Setup(reqs, TRACE_ENGINE, notes={"speedup": TRACE_SPEEDUPS[name], "rows": rows})
    return build


def _shared_prefix(quick: bool, _: Path) -> Setup:
    g, n = (8, 6) if quick else (64, 16)
    return Setup(shared_prefix(g, n, 2048, 128, 256, rate=16.0), SYNTH_ENGINE)


def _conversations(quick: bool) -> list[SimRequest]:
    c, t = (12, 4) if quick else (120, 5)
    return multi_turn(c, t, 1024, 200, 150, rate=2.0, think_s=5.0, real_answers=True)


def _multi_turn(quick: bool, _: Path) -> Setup:
    return Setup(_conversations(quick), SYNTH_ENGINE)


def _hot_prefix(quick: bool, _: Path) -> Setup:
    return Setup(hot_prefix(60 if quick else 600, 8192, (1, 2), SYNTH_ENGINE.block_size, 128, rate=12.0), SYNTH_ENGINE)


def _zipf(quick: bool, _: Path) -> Setup:
    return Setup(zipf_prefixes(80 if quick else 800, 24, 4096, 1.1, (64, 256), 128, rate=16.0), SYNTH_ENGINE)


def _pressure_workload(quick: bool) -> tuple[list[SimRequest], EngineConfig]:
    blocks = PRESSURE_GPU_BLOCKS_QUICK if quick else PRESSURE_GPU_BLOCKS
    n, k = (120, 200) if quick else (800, 300)
    reqs = zipf_prefixes(n, k, 2048, 0.6, (64, 256), 64, rate=12.0, salt=1)
    return reqs, dataclasses.replace(SYNTH_ENGINE, num_gpu_blocks=blocks)


def _eviction(quick: bool, _: Path) -> Setup:
    reqs, engine = _pressure_workload(quick)
    return Setup(reqs, engine)


def _cpu_offload(quick: bool, _: Path) -> Setup:
    reqs, engine = _pressure_workload(quick)
    return Setup(reqs, dataclasses.replace(engine, cpu_blocks=4 * engine.num_gpu_blocks))


def _heterogeneous(quick: bool, _: Path) -> Setup:
    g, n = (8, 6) if quick else (32, 16)
    slow = dataclasses.replace(SYNTH_ENGINE, timing=half_compute(SYNTH_ENGINE.timing))
    return Setup(shared_prefix(g, n, 2048, 128, 256, rate=20.0, seed=1), SYNTH_ENGINE, engines={0: slow},
                 notes={"slow_worker": "w0"})


def _restart(quick: bool, _: Path) -> Setup:
    reqs = _conversations(quick)
    at = round(reqs[-1].arrival / 2, 3)
    return Setup(reqs, SYNTH_ENGINE, restart_busiest_at=at,
                 notes={"restart": "the worker holding the most cached blocks", "restart_at": at})


def _event_delay(quick: bool, _: Path) -> Setup:
    g, n = (8, 6) if quick else (32, 16)
    workers = WORKERS
    return Setup(shared_prefix(g, n, 2048, 128, 256, rate=16.0, seed=2, grouped=True), SYNTH_ENGINE,
                 faults={i: EventFaults(delay_s=0.2) for i in range(workers)}, notes={"event_delay_s": 0.2})


def _disaggregated(quick: bool, trace: Path) -> Setup:
    """The heavy trace on 2 prefill-only and 6 decode-only workers, each split decided by the objective (the
    routing config's default ``conditional`` mode)."""
    setup = _trace("trace_heavy")(quick, trace)
    setup.roles = {i: "prefill" if i < 2 else "decode" for i in range(setup.workers)}
    setup.notes["roles"] = "2 prefill : 6 decode"
    return setup


# ---- the SLO scenarios (docs/slo.md) ---------------------------------------------------------------------------
INTERACTIVE = ServiceObjective(0.3, 0.05, 0, "interactive")  # the chat: TTFT <= 300 ms, TPOT <= 50 ms
BATCH = ServiceObjective(None, None, -1, "batch")  # no latency targets, sheddable
# The fleets' capacities for the SLO workloads, in requests/s: least_loaded's completions per second over the
# middle half of a run, where they stop growing with the offered rate (8 SYNTH_ENGINE workers; rates 40-200/s
# for the mix, 60-400/s for the tenants' shape). Each scenario offers OVERLOAD times that.
SLO_MIXED_CAPACITY_RPS = 42.0
NOISY_TENANT_CAPACITY_RPS = 150.0
OVERLOAD = 1.3
SLO_FLOW = FlowParams(enabled=True)


def _slo_mixed(quick: bool, _: Path) -> Setup:
    return slo_mixed_setup(quick, OVERLOAD)


def slo_mixed_setup(quick: bool, load: float) -> Setup:
    """Interactive chats with targets (two thirds of the requests: 16 shared 1K-token system prompts, 128-token
    questions and answers) and sheddable batch jobs (4K-token documents of their own, 384-token answers), together
    at ``load`` times the fleet's capacity (the scenario: 1.3x)."""
    n = 300 if quick else 1200
    rate = load * SLO_MIXED_CAPACITY_RPS
    chats = with_objective(shared_prefix(16, 2 * n // 3 // 16, 1024, 128, 128, rate=rate * 2 / 3, seed=3),
                           INTERACTIVE, "chat", "i-")
    batch = with_objective(shared_prefix(n // 3, 1, 4096, 64, 384, rate=rate / 3, seed=4), BATCH, "batch", "b-")
    return Setup(merged(chats, batch), SYNTH_ENGINE, flow=SLO_FLOW,
                 notes={"offered_rps": rate, "capacity_rps": SLO_MIXED_CAPACITY_RPS})


def _noisy_tenant(quick: bool, _: Path) -> Setup:
    """Four tenants of interactive chats (each its own 32 Zipf-popular 1K-token system prompts), one of them
    sending 10x what each of the others sends; together 1.3x the fleet's capacity."""
    n = 650 if quick else 3900
    rate = OVERLOAD * NOISY_TENANT_CAPACITY_RPS
    tenants = []
    for t in range(4):
        share = (10 if t == 0 else 1) / 13
        reqs = zipf_prefixes(int(n * share), 32, 1024, 1.1, (128, 512), 256, rate=rate * share, seed=10 + t,
                             salt=10 + t)
        tenants.append(with_objective(reqs, INTERACTIVE, "noisy" if t == 0 else f"quiet{t}", f"t{t}-"))
    return Setup(merged(*tenants), SYNTH_ENGINE, flow=SLO_FLOW,
                 notes={"offered_rps": rate, "capacity_rps": NOISY_TENANT_CAPACITY_RPS, "noisy_share": 10 / 13})


LORA_ADAPTERS = 32
LORA_SLOTS = 4  # vLLM's --max-loras per engine: a few of the 32 adapters at a time


def lora_load_ms(k: int) -> float:
    """Adapter k's load time: 20 to 80 ms by its rank (the adapters of a fleet differ in size)."""
    return 20.0 + 20.0 * (k % 4)


def _lora_zipf(quick: bool, _: Path) -> Setup:
    """32 LoRA adapters of Zipf popularity on 8 workers of 4 adapter slots each; each adapter's application has
    its own 512-token system prompt."""
    n = 300 if quick else 2400
    engine = dataclasses.replace(SYNTH_ENGINE, max_loras=LORA_SLOTS, lora_load_ms_by_adapter=tuple(
        (f"lora-{k}", lora_load_ms(k)) for k in range(LORA_ADAPTERS)))
    reqs = lora_zipf(n, LORA_ADAPTERS, 1.1, 512, (64, 192), 128, rate=40.0, seed=6)
    return Setup(reqs, engine, loras=frozenset(f"lora-{k}" for k in range(LORA_ADAPTERS)),
                 notes={"adapters": LORA_ADAPTERS, "max_loras": LORA_SLOTS})


SCALE_OUT_RATE = 24.0  # zipf-popular prefixes at 24/s: the eight workers busy, a ninth worth having


def _scale_out(quick: bool, _: Path) -> Setup:
    """Zipf-popular 4K-token prefixes on eight workers; a ninth joins with an empty cache a third of the way in,
    and w0 is drained two thirds of the way in (it finishes its own requests, then leaves the fleet)."""
    n = 600 if quick else 1800
    span = n / SCALE_OUT_RATE
    reqs = zipf_prefixes(n, 24, 4096, 1.1, (64, 256), 128, rate=SCALE_OUT_RATE, seed=5)
    return Setup(reqs, SYNTH_ENGINE, workers=WORKERS + 1, joins={WORKERS: round(span / 3, 1)},
                 drains={0: round(2 * span / 3, 1)}, notes={"joins": f"w{WORKERS} at {round(span / 3, 1)} s",
                                                            "drains": f"w0 at {round(2 * span / 3, 1)} s"})


def _slo_heterogeneous(quick: bool, _: Path) -> Setup:
    """The heterogeneous fleet (w0 with half the compute) under the shared-prefix groups at three times the
    heterogeneous scenario's rate, every request with tight targets (TTFT <= 100 ms, TPOT <= 15 ms: the slow
    worker's decode step alone misses the latter once it is busy)."""
    g, n = (8, 6) if quick else (32, 16)
    slow = dataclasses.replace(SYNTH_ENGINE, timing=half_compute(SYNTH_ENGINE.timing))
    tight = ServiceObjective(0.1, 0.015, 0, "tight")
    reqs = with_objective(shared_prefix(g, n, 2048, 128, 256, rate=60.0, seed=1), tight)
    return Setup(reqs, SYNTH_ENGINE, engines={0: slow}, flow=SLO_FLOW, notes={"slow_worker": "w0"})


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("trace_light", "Mooncake conversation trace, ~1.2x least_loaded's unloaded mean TTFT",
             _trace("trace_light"), needs_trace=True),
    Scenario("trace_heavy", "Mooncake conversation trace, >= 2x least_loaded's unloaded mean TTFT",
             _trace("trace_heavy"), needs_trace=True),
    Scenario("shared_prefix", "generated-shared-prefix, SGLang's shape: 64 groups x 16, 2048 system, 128 question, "
             "256 output; 16/s",
             _shared_prefix),
    Scenario("multi_turn", "conversations: each turn = previous prompt + the engine's answer + a new question",
             _multi_turn),
    Scenario("hot_prefix", "one hot 8K-token prefix + 1-2 blocks of each request's own, Poisson 12/s", _hot_prefix),
    Scenario("zipf_prefixes", "24 hot 4K-token prefixes of Zipf(1.1) popularity, 16/s", _zipf),
    Scenario("eviction", "300 2K-token prefixes, Zipf(0.6), 12/s: a working set 2-3x the fleet's GPU cache",
             _eviction),
    Scenario("cpu_offload", "the eviction workload with a CPU tier of 4x the GPU blocks per worker", _cpu_offload),
    Scenario("heterogeneous", "shared-prefix groups (32 x 16) at 20/s, worker w0 with half the compute",
             _heterogeneous),
    Scenario("restart", "the conversations, the worker with the most cache restarting mid-run (events from seq 0, "
             "no AllBlocksCleared; what it held fails)",
             _restart),
    Scenario("event_delay", "shared-prefix bursts (32 groups x 16, a group's prompts back to back), every event "
             "200 ms late",
             _event_delay),
    Scenario("disaggregated", "the heavy trace on 2 prefill + 6 decode workers, split when it pays",
             _disaggregated, needs_trace=True),
    Scenario("slo_mixed", "interactive chats (TTFT 300 ms, TPOT 50 ms) + sheddable batch (priority -1) at 1.3x "
             "capacity, flow control on", _slo_mixed),
    Scenario("noisy_tenant", "four tenants' chats (TTFT 300 ms, TPOT 50 ms), one sending 10x each other's, at 1.3x "
             "capacity, flow control on", _noisy_tenant),
    Scenario("slo_heterogeneous", "shared-prefix groups at 60/s on the heterogeneous fleet (w0 half speed), tight "
             "targets (TTFT 100 ms, TPOT 15 ms), flow control on", _slo_heterogeneous),
    Scenario("lora_zipf", "32 LoRA adapters of Zipf popularity, 4 adapter slots per worker, loads of 20-80 ms, 40/s",
             _lora_zipf),
    Scenario("scale_out", "zipf-popular prefixes at 24/s on 8 workers; a 9th joins cold at 1/3 of the run, w0 is "
             "drained at 2/3", _scale_out),
)}
SUITES = {"standard": tuple(SCENARIOS)}


def suite_profiles() -> list[str]:
    """Every built-in profile as the router has them now, then the oracle."""
    return [*_profiles.BUILTIN_PROFILES, ORACLE]


# ---- running ---------------------------------------------------------------------------------------------
def run_scenario(scenario: Scenario, policies: Sequence[str], quick: bool = False, trace: Path = TRACE,
                 seed: int = 0, keep: dict[str, SimResult] | None = None,
                 cost: CostParams | None = None) -> dict[str, Any]:
    started = time.perf_counter()
    setup = scenario.build(quick, trace)
    bound, working = cache_bound(setup.requests, setup.engine.block_size)
    out: dict[str, Any] = {
        "description": scenario.description, "requests": len(setup.requests), "workers": setup.workers,
        "block_size": setup.engine.block_size, "gpu_blocks": setup.engine.num_gpu_blocks,
        "cpu_blocks": setup.engine.cpu_blocks, "fleet_cache_tokens": setup.fleet_cache_tokens,
        "working_set_tokens": working, "bound_hit_rate": bound, **setup.notes,
    }
    results: dict[str, Any] = {}
    for name in policies:
        # the router's cost parameters, when given, for every profile (the oracle's too)
        routing = None if cost is None else sim_routing(name, setup.engine.block_size, seed, cost=cost)
        cfg = SimConfig(workers=setup.workers, policy=name, engine=setup.engine, engines=setup.engines,
                        faults=setup.faults, seed=seed, restart_busiest_at=setup.restart_busiest_at, routing=routing,
                        roles=setup.roles, flow=setup.flow, joins=setup.joins, drains=setup.drains,
                        loras=setup.loras)
        res = Simulation(setup.requests, cfg).run()
        s = summarise(res)
        results[name] = {k: s[k] for k in SUMMARY_KEYS}
        if keep is not None:
            keep[name] = res
    out["policies"] = results
    out["wall_s"] = round(time.perf_counter() - started, 2)
    return out


def run_suite(suite: str = "standard", quick: bool = False, trace: Path = TRACE, policies: Sequence[str] | None = None,
              scenarios: Sequence[str] | None = None, plots_dir: str | Path | None = None,
              progress: Callable[[str], None] | None = None, cost: CostParams | None = None) -> dict[str, Any]:
    policies = list(policies or suite_profiles())
    names = list(scenarios or SUITES[suite])
    started = time.perf_counter()
    out: dict[str, Any] = {"suite": suite, "quick": quick, "profiles": policies,
                           "trace_speedups": dict(TRACE_SPEEDUPS), "scenarios": {}}
    for name in names:
        sc = SCENARIOS[name]
        if sc.needs_trace and not Path(trace).exists():
            out["scenarios"][name] = {"description": sc.description, "skipped": f"{trace} absent", "policies": {},
                                      "bound_hit_rate": None}
            continue
        keep: dict[str, SimResult] | None = {} if plots_dir else None
        out["scenarios"][name] = run_scenario(sc, policies, quick, Path(trace), keep=keep, cost=cost)
        if plots_dir and keep:
            from sim.report import scenario_plot

            scenario_plot(name, sc.description, keep, out["scenarios"][name], plots_dir)
        if progress:
            progress(f"{name}: {out['scenarios'][name]['wall_s']:.1f} s")
    out["standings"] = standings(out)
    out["wall_s"] = round(time.perf_counter() - started, 2)
    return out


def standings(result: dict[str, Any]) -> dict[str, Any]:
    """Per scenario: which profile won mean TTFT and mean E2E, and precise's distance to the best profile other
    than the oracle and to the oracle (positive: precise is slower, in percent); which won goodput, and precise's
    goodput over the best other profile's."""
    out = {}
    for name, sc in result["scenarios"].items():
        pol = sc.get("policies") or {}
        if not pol:
            continue
        row: dict[str, Any] = {}
        for metric in ("ttft_mean_s", "e2e_mean_s"):
            best = min(pol, key=lambda p: pol[p][metric])
            others = [p for p in pol if p not in (ORACLE, "precise")]
            row[metric] = {"winner": best, "winner_value": pol[best][metric]}
            if "precise" in pol:
                v = pol["precise"][metric]
                if others:
                    b = min(others, key=lambda p: pol[p][metric])
                    row[metric]["best_other"] = b
                    row[metric]["precise_vs_best_other_pct"] = _pct(v, pol[b][metric])
                if ORACLE in pol:
                    row[metric]["precise_vs_oracle_pct"] = _pct(v, pol[ORACLE][metric])
        # goodput (requests meeting their objective per second): higher is better, precise's as a ratio
        best = max(pol, key=lambda p: pol[p]["goodput_rps"])
        row["goodput_rps"] = {"winner": best, "winner_value": pol[best]["goodput_rps"]}
        others = [p for p in pol if p not in (ORACLE, "precise")]
        if "precise" in pol and others:
            b = max(others, key=lambda p: pol[p]["goodput_rps"])
            ref = pol[b]["goodput_rps"]
            row["goodput_rps"]["best_other"] = b
            row["goodput_rps"]["precise_vs_best_other_ratio"] = (
                round(pol["precise"]["goodput_rps"] / ref, 3) if ref else None)
        out[name] = row
    return out


def _pct(v: float, ref: float) -> float | None:
    return round(100.0 * (v - ref) / ref, 1) if ref else None


# ---- the CLI ---------------------------------------------------------------------------------------------
def main_suite(args: argparse.Namespace) -> int:
    from sim.report import suite_table

    if args.suite not in SUITES:
        print(f"kvrouter sim: unknown suite {args.suite!r}; choose from {sorted(SUITES)}", file=sys.stderr)
        return 2
    trace = TRACE
    policies = None
    if args.policies:
        policies = [p.strip() for p in args.policies.split(",") if p.strip()]
        known = suite_profiles()
        bad = [p for p in policies if p not in known]
        if bad:
            print(f"kvrouter sim: unknown policies {bad}; choose from {known}", file=sys.stderr)
            return 2
    scenarios = [s.strip() for s in args.scenarios.split(",")] if args.scenarios else None
    if scenarios and (bad := [s for s in scenarios if s not in SCENARIOS]):
        print(f"kvrouter sim: unknown scenarios {bad}; choose from {list(SCENARIOS)}", file=sys.stderr)
        return 2

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    cost = None
    if args.cost:
        try:
            cost = CostParams.from_dict({k: yaml.safe_load(v) for k, _, v in (c.partition("=") for c in args.cost)})
        except (ValueError, TypeError) as exc:
            print(f"kvrouter sim: --cost: {exc}", file=sys.stderr)
            return 2
    result = run_suite(args.suite, args.quick, trace, policies, scenarios, args.plots, progress, cost)
    if cost is not None:
        result["cost"] = dataclasses.asdict(cost)
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        print(suite_table(result))
    return 0


def calibrate(trace: Path = TRACE, rows: int = TRACE_ROWS, targets: Sequence[float] = (1.2, 2.0),
              speedups: Sequence[float] = (1.0, 1.4, 1.6, 1.8, 2.0, 3.0, 4.0, 5.0, 6.0)) -> dict[str, Any]:
    """least_loaded's mean TTFT on the trace rows at each speedup over its unloaded mean TTFT (arrivals 50x
    apart); the smallest speedup reaching each target ratio."""
    def mean_ttft(speedup: float, scrape: float = 1.0) -> float:
        reqs = mooncake(trace, limit=rows, speedup=speedup, jitter_s=TRACE_JITTER_S)
        cfg = SimConfig(workers=WORKERS, policy="least_loaded", engine=TRACE_ENGINE, scrape_interval_s=scrape)
        return summarise(Simulation(reqs, cfg).run())["ttft_mean_s"]

    base = mean_ttft(0.02, scrape=30.0)
    ratios = {s: mean_ttft(s) / base for s in speedups}
    pick = {t: next((s for s, r in ratios.items() if r >= t), None) for t in targets}
    return {"unloaded_ttft_mean_s": base, "ratio_by_speedup": ratios, "speedup_for_ratio": pick}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="calibrate the trace scenarios' load factors")
    p.add_argument("--calibrate", action="store_true", required=True)
    p.add_argument("--trace", default=str(TRACE))
    a = p.parse_args()
    print(json.dumps(calibrate(Path(a.trace)), indent=2))
