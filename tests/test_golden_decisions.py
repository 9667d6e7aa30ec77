"""The built-in profiles rank a recorded decision set exactly as the core before the plugin framework did."""

import json

import pytest

from tests.golden_scenarios import POLICIES, RECORDING, SEEDS, play

RECORDED = json.loads(RECORDING.read_text())


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("policy", POLICIES)
def test_profile_reproduces_the_recorded_decisions(policy, seed):
    got = play(policy, seed)
    want = RECORDED[f"{policy}/{seed}"]
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, f"decision {i}: {g} != recorded {w}"
