"""SLO attainment and goodput against offered load: the ``slo_mixed`` scenario's workload (sim/suite.py) at
several multiples of the fleet's capacity, through a few profiles, flow control on as in the scenario.

    python -m sim.slo_sweep [--loads 0.6,0.8,1.0,1.2,1.4,1.6] [--policies precise,llmd,least_loaded]
                            [--quick] [--json] [--plot docs/img/slo_attainment.png]

docs/slo.md shows its chart and table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from sim.runner import SimConfig, Simulation, summarise
from sim.suite import slo_mixed_setup


def sweep(loads: list[float], policies: list[str], quick: bool = False) -> dict[str, Any]:
    """Per policy and load: overall attainment, the interactive (priority 0) requests' attainment, goodput."""
    out: dict[str, Any] = {"loads": loads, "policies": {}}
    for policy in policies:
        rows = []
        for load in loads:
            setup = slo_mixed_setup(quick, load)
            cfg = SimConfig(workers=setup.workers, policy=policy, engine=setup.engine, flow=setup.flow)
            s = summarise(Simulation(setup.requests, cfg).run())
            rows.append({"load": load, "slo_attainment": s["slo_attainment"],
                         "interactive_attainment": s["slo_by_priority"]["0"]["attainment"],
                         "batch_attainment": s["slo_by_priority"]["-1"]["attainment"],
                         "goodput_rps": s["goodput_rps"], "shed": s["shed"], "ttft_p99_s": s["ttft_p99_s"]})
        out["policies"][policy] = rows
    return out


def plot(result: dict[str, Any], path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for policy, rows in result["policies"].items():
        x = [r["load"] for r in rows]
        a1.plot(x, [r["interactive_attainment"] for r in rows], marker="o", label=policy)
        a2.plot(x, [r["goodput_rps"] for r in rows], marker="o", label=policy)
    a1.set_xlabel("offered load (x the fleet's capacity)")
    a1.set_ylabel("interactive attainment (TTFT 300 ms, TPOT 50 ms)")
    a2.set_xlabel("offered load (x the fleet's capacity)")
    a2.set_ylabel("goodput (requests/s meeting their objective)")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.suptitle("slo_mixed: interactive chats + sheddable batch, 8 simulated workers, flow control on", fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sim.slo_sweep", description=__doc__.splitlines()[0])
    p.add_argument("--loads", default="0.6,0.8,1.0,1.2,1.4,1.6")
    p.add_argument("--policies", default="precise,llmd,least_loaded")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", default=None, help="write the chart (PNG) here")
    a = p.parse_args(argv)
    result = sweep([float(x) for x in a.loads.split(",")], [x.strip() for x in a.policies.split(",")], a.quick)
    if a.plot:
        plot(result, a.plot)
    if a.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{'policy':<14}{'load':>6}{'interactive':>13}{'goodput/s':>11}{'shed':>6}{'TTFT p99':>10}")
        for policy, rows in result["policies"].items():
            for r in rows:
                print(f"{policy:<14}{r['load']:>6.1f}{r['interactive_attainment']:>13.1%}{r['goodput_rps']:>11.1f}"
                      f"{r['shed']:>6d}{r['ttft_p99_s']:>10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
