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
            "rejected", "e2e_mean_s", "load_imbalance", "completed", "requests", "wall_s")
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
