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
