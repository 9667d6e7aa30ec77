"""Simulator output: a terminal table, stable JSON, and PNG plots."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

from sim.runner import SimResult

COLUMNS = [
    ("ttft_mean_s", "TTFT mean s", "{:.3f}"),
    ("ttft_p50_s", "p50", "{:.3f}"),
    ("ttft_p99_s", "p99", "{:.3f}"),
    ("e2e_mean_s", "E2E mean s", "{:.2f}"),
    ("hit_rate", "hit rate", "{:.1%}"),
    ("throughput_tok_s", "out tok/s", "{:,.0f}"),
    ("load_imbalance", "imbalance", "{:.2f}"),
    ("shed", "shed", "{:d}"),
    ("rejected", "rejected", "{:d}"),
    ("wall_s", "wall s", "{:.1f}"),
]


class Progress:
    """A one-line progress bar on stderr (only when it is a terminal, unless forced)."""

    def __init__(self, label: str, enabled: bool | None = None) -> None:
        self.label = label
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._last = -1

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or not total:
            return
        pct = done * 100 // total
        if pct == self._last:
            return
        self._last = pct
        bar = "#" * (pct // 4) + "." * (25 - pct // 4)
        end = "\n" if done >= total else ""
        print(f"\r{self.label:<16} [{bar}] {pct:3d}% {done}/{total}", end=end, file=sys.stderr, flush=True)


def table(summaries: dict[str, dict[str, Any]], bound: float | None) -> str:
    head = f"{'policy':<14}" + "".join(f"{title:>12}" for _, title, _ in COLUMNS)
    lines = [head, "-" * len(head)]
    for name, s in summaries.items():
        cells = "".join(f"{fmt.format(s[key]):>12}" for key, _, fmt in COLUMNS)
        lines.append(f"{name:<14}{cells}")
    if bound is not None:
        lines.append(f"infinite shared cache bound on token hit rate: {bound:.1%}")
    return "\n".join(lines)


def stable_json(summaries: dict[str, dict[str, Any]], bound: float, extra: dict[str, Any]) -> dict[str, Any]:
    keys = ("ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "hit_rate", "throughput_tok_s", "shed",
            "rejected", "failed", "e2e_mean_s", "e2e_p99_s", "tpot_mean_s", "load_imbalance", "completed",
            "requests", "wall_s", "slo_attainment", "goodput_rps", "slo_by_priority", "slo_by_tenant")
    return {"policies": {n: {k: s[k] for k in keys} for n, s in summaries.items()}, "bound_hit_rate": bound, **extra}


def plots(results: dict[str, SimResult], out_dir: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, res in results.items():
        ttft = np.sort([r.ttft for r in res.records if r.ttft is not None])
        if len(ttft):
            ax.plot(ttft, np.arange(1, len(ttft) + 1) / len(ttft), label=name)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s, virtual)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF per policy")
    ax.grid(alpha=0.3)
    ax.legend()
    paths.append(out / "ttft_cdf.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, (a1, a2) = plt.subplots(2, 1, figsize=(7, 6.5), sharex=True)
    for name, res in results.items():
        if not res.timeline:
            continue
        t = [p[0] for p in res.timeline]
        a1.plot(t, [p[1] for p in res.timeline], label=name)
        a2.plot(t, [max(p[2]) - min(p[2]) for p in res.timeline], label=name)
    a1.set_ylabel("cumulative token hit rate")
    a1.set_title("Hit rate and load spread over time")
    a2.set_ylabel("in flight: max - min worker")
    a2.set_xlabel("time (s, virtual)")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    paths.append(out / "hit_and_load.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


# ---- the scenario suite (sim/suite.py) ----------------------------------------------------------------------
SUITE_COLUMNS = [
    ("ttft_mean_s", "TTFT mean", "{:.3f}"),
    ("ttft_p50_s", "p50", "{:.3f}"),
    ("ttft_p99_s", "p99", "{:.3f}"),
    ("e2e_mean_s", "E2E mean", "{:.2f}"),
    ("e2e_p99_s", "E2E p99", "{:.2f}"),
    ("tpot_mean_s", "TPOT ms", "{:.1f}"),
    ("hit_rate", "hit", "{:.1%}"),
    ("load_imbalance", "imbalance", "{:.2f}"),
    ("rejected", "rejected", "{:d}"),
    ("failed", "failed", "{:d}"),
    ("shed", "shed", "{:d}"),
    ("slo_attainment", "SLO met", "{:.1%}"),
    ("goodput_rps", "goodput/s", "{:.2f}"),
]


def _cell(key: str, fmt: str, value: Any) -> str:
    if value is None:
        return "-"
    return fmt.format(value * 1000 if key == "tpot_mean_s" else value)


def suite_table(result: dict[str, Any]) -> str:
    """Every scenario's table of profiles, then the standings: who won mean TTFT and mean E2E, and where precise
    stands against the best other profile and against the oracle."""
    lines = []
    width = max([14, *(len(p) + 2 for p in result.get("profiles", []))])
    for name, sc in result["scenarios"].items():
        if sc.get("skipped"):
            lines += [f"== {name}: skipped ({sc['skipped']})", ""]
            continue
        lines.append(f"== {name}: {sc['description']}")
        bound = sc.get("bound_hit_rate")
        lines.append(f"   {sc['requests']} requests, {sc['workers']} workers, block {sc['block_size']}, "
                     f"{sc['gpu_blocks']} GPU blocks/worker" + (f" + {sc['cpu_blocks']} CPU" if sc.get("cpu_blocks")
                                                               else "")
                     + f"; working set {sc['working_set_tokens']:,} tokens vs fleet cache "
                       f"{sc['fleet_cache_tokens']:,}; infinite-cache bound {bound:.1%}; {sc['wall_s']:.1f} s")
        head = f"{'profile':<{width}}" + "".join(f"{title:>11}" for _, title, _ in SUITE_COLUMNS)
        lines += [head, "-" * len(head)]
        for p, s in sc["policies"].items():
            lines.append(f"{p:<{width}}" + "".join(f"{_cell(k, fmt, s.get(k)):>11}" for k, _, fmt in SUITE_COLUMNS))
        lines.append("")
    lines.append("standings (precise vs: + is slower, in %)")
    head = (f"{'scenario':<15}{'TTFT winner':>22}{'vs best other':>15}{'vs oracle':>11}"
            f"{'E2E winner':>22}{'vs best other':>15}{'vs oracle':>11}")
    lines += [head, "-" * len(head)]
    for name, row in result.get("standings", {}).items():
        cells = []
        for metric in ("ttft_mean_s", "e2e_mean_s"):
            r = row[metric]
            cells.append(f"{r['winner'] + ' ' + format(r['winner_value'], '.3f'):>22}"
                         f"{_pct_cell(r.get('precise_vs_best_other_pct')):>15}"
                         f"{_pct_cell(r.get('precise_vs_oracle_pct')):>11}")
        lines.append(f"{name:<15}" + "".join(cells))
    if "wall_s" in result:
        lines.append(f"total wall time {result['wall_s']:.1f} s")
    return "\n".join(lines)


def _pct_cell(v: float | None) -> str:
    return "-" if v is None else f"{v:+.1f}%"


def scenario_plot(name: str, description: str, results: dict[str, SimResult], summary: dict[str, Any],
                  out_dir: str | Path) -> Path:
    """One PNG per scenario: the TTFT CDF of every profile, and mean/p99 TTFT and mean E2E side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.8))
    colors = plt.get_cmap("tab20").colors
    for i, (policy, res) in enumerate(results.items()):
        ttft = np.sort([r.ttft for r in res.records if r.ttft is not None and r.outcome == "routed"])
        if len(ttft):
            a1.plot(ttft, np.arange(1, len(ttft) + 1) / len(ttft), label=policy, color=colors[i % len(colors)],
                    linestyle="--" if policy == "oracle" else "-")
    a1.set_xscale("log")
    a1.set_xlabel("time to first token (s, virtual)")
    a1.set_ylabel("fraction of requests")
    a1.grid(alpha=0.3)
    a1.legend(fontsize=8)
    pols = list(summary["policies"])
    x = np.arange(len(pols))
    w = 0.27
    for i, (key, label) in enumerate((("ttft_mean_s", "TTFT mean"), ("ttft_p99_s", "TTFT p99"),
                                      ("e2e_mean_s", "E2E mean"))):
        a2.bar(x + (i - 1) * w, [summary["policies"][p][key] for p in pols], w, label=label)
    for xi, p in zip(x, pols, strict=True):
        a2.annotate(f"{summary['policies'][p]['hit_rate']:.0%}", (xi, 0), xycoords=("data", "axes fraction"),
                    xytext=(0, 3), textcoords="offset points", ha="center", fontsize=7)
    a2.set_xticks(x, pols, rotation=30, ha="right", fontsize=8)
    a2.set_yscale("log")
    a2.set_ylabel("seconds (log); token hit rate at the foot of each profile")
    a2.grid(alpha=0.3, axis="y")
    a2.legend(fontsize=8)
    bound = summary.get("bound_hit_rate")
    fig.suptitle(f"{name}: {description}" + (f" (bound {bound:.0%})" if bound is not None else ""), fontsize=10)
    path = out / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
