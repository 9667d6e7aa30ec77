"""A fleet that changes, in the simulator (issue 45): a worker joining with an empty cache gets load at once,
and a drained worker takes no new request, finishes its own and leaves, losing none."""

from __future__ import annotations

import pytest

from sim.runner import SimConfig, Simulation, fleet_changes, summarise
from sim.suite import SCENARIOS, run_scenario
from sim.workload import zipf_prefixes
from workers.engine import EngineConfig

ENGINE = EngineConfig(num_gpu_blocks=4096, block_size=16)


@pytest.mark.parametrize("policy", ["precise", "round_robin", "llmd"])
def test_a_joining_worker_takes_load_and_a_drained_one_leaves_without_losing_a_request(policy):
    reqs = zipf_prefixes(300, 8, 2048, 1.1, (32, 64), 32, rate=20.0, seed=1)
    span = reqs[-1].arrival
    join_at, drain_at = span / 3, 2 * span / 3
    res = Simulation(reqs, SimConfig(workers=4, policy=policy, engine=ENGINE, joins={3: join_at},
                                     drains={0: drain_at})).run()
    routed = [r for r in res.records if r.worker is not None]
    # nothing reaches w3 before discovery has it; it serves requests after
    assert not [r for r in routed if r.worker == "w3" and r.arrival < join_at]
    assert [r for r in routed if r.worker == "w3"]
    # nothing new reaches w0 once it drains, and what it had finished
    assert not [r for r in routed if r.worker == "w0" and r.arrival > drain_at]
    assert all(r.outcome == "routed" and r.finished_at is not None for r in res.records)
    events = [(w, what) for _, w, what in res.membership]
    assert events == [("w3", "joined"), ("w0", "drained"), ("w0", "left")]
    changes = fleet_changes(res)
    assert changes is not None and summarise(res)["fleet_changes"] == changes
    (join,) = changes["joins"]
    (drain,) = changes["drains"]
    assert join["worker"] == "w3" and join["fair_share"] == pytest.approx(1 / 4)
    assert join["time_to_fair_share_s"] is not None and join["share_first_30s"] > 0
    assert drain == {"worker": "w0", "at_s": drain_at, "routed_after_drain": 0, "failed": 0,
                     "left_after_s": drain["left_after_s"]}
    assert drain["left_after_s"] is not None and drain["left_after_s"] >= 0


def test_a_fleet_that_does_not_change_reports_none():
    reqs = zipf_prefixes(40, 4, 512, 1.1, (16, 32), 8, rate=20.0)
    res = Simulation(reqs, SimConfig(workers=2, policy="precise", engine=ENGINE)).run()
    assert fleet_changes(res) is None and res.membership == []


def test_the_scale_out_scenario_reports_the_join_and_the_drain():
    out = run_scenario(SCENARIOS["scale_out"], ["precise", "round_robin"], quick=True)
    for policy, s in out["policies"].items():
        (join,) = s["fleet_changes"]["joins"]
        (drain,) = s["fleet_changes"]["drains"]
        assert join["worker"] == "w8" and drain["worker"] == "w0", policy
        assert drain["failed"] == 0 and drain["routed_after_drain"] == 0, policy
        assert s["failed"] == 0 and s["completed"] == s["requests"], policy
