"""The README's main job, small: workers as processes, the proxy, two policies, a table and a chart."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.sockets


def test_demo_runs_and_reports_every_policy(tmp_path):
    chart = tmp_path / "demo.png"
    summary = tmp_path / "demo.json"
    out = subprocess.run(
        [sys.executable, "-m", "router.cli", "demo", "--policies", "round_robin,precise", "--groups", "6",
         "--per-group", "3", "--rate", "30", "--chart", str(chart), "--json", str(summary)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any(line.startswith("round_robin") for line in lines) and any(line.startswith("precise") for line in lines)
    assert chart.stat().st_size > 10_000 and chart.read_bytes()[:4] == b"\x89PNG"
    import json

    data = json.loads(summary.read_text())
    assert set(data) == {"round_robin", "precise"}
    for s in data.values():
        assert s["errors"] == 0 and s["requests"] == 18 and 0 <= s["hit_rate"] <= 1
    assert data["precise"]["hit_rate"] > 0  # the workers reported cached tokens for routed prefixes


def test_quality_bench_pools_every_policy_over_seeds():
    out = subprocess.run([sys.executable, "-m", "router.cli", "bench", "quality", "--seeds", "1", "--json"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    import json

    res = json.loads(out.stdout)
    assert res["seeds"] == 1 and res["requests_per_seed"] == 144
    pol = res["policies"]
    assert set(pol) == {"round_robin", "approx_prefix", "precise", "smg", "vllm-router"}
    for name in ("round_robin", "approx_prefix", "precise"):
        assert pol[name]["requests"] == 144 and pol[name]["errors"] == 0 and len(pol[name]["per_seed"]) == 1
        assert 0.0 <= pol[name]["slo_attainment"] <= 1.0 and pol[name]["goodput_rps"] >= 0.0
    assert "skipped" in pol["smg"] or pol["smg"]["requests"] == 144  # the peer runs where it is installed
    assert "skipped" in pol["vllm-router"] or pol["vllm-router"]["requests"] == 144  # installed by the bench
    # cache-aware routing keeps shared prefixes where they are cached; round robin scatters them
    assert pol["precise"]["hit_rate"] > 2 * pol["round_robin"]["hit_rate"]
    assert pol["round_robin"]["precise_higher_hit_rate_seeds"] == 1
