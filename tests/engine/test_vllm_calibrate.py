"""``kvrouter calibrate`` against a real vLLM CPU engine (issue 44): the probe runs on the engine's own metrics
and streams, finds its prefix caching, and writes a timing file the router and the simulator read."""

import asyncio
import math

import pytest
import yaml

from router.calibrate import run_calibration
from router.config import load_config
from router.scheduling.calibration import prefill_ms
from router.scheduling.engine_profile import read_timing_file
from tests.engine.conftest import BLOCK, GPU_BLOCKS

pytestmark = [pytest.mark.engine, pytest.mark.sockets]


def test_calibrate_a_real_engine(engines, tmp_path):
    e = engines[0]
    # the engine tier's engines: 48 blocks of 32 tokens, max_model_len 1024; the probe fits inside both
    result = asyncio.run(run_calibration(e.url, {"max_prompt": 1000, "repeats": 1, "decode_tokens": 16}, None,
                                         progress=None))
    cal = result["calibration"]
    assert cal["block_size"] == BLOCK and cal["num_gpu_blocks"] == GPU_BLOCKS  # read from vllm:cache_config_info
    assert len(cal["prefill_samples"]) >= 10 and len(cal["decode_samples"]) >= 3
    coefficients = {k: result[k] for k in ("prefill_a", "prefill_b", "prefill_c", "decode_a", "decode_b",
                                           "decode_c")}
    assert all(math.isfinite(v) for v in coefficients.values())
    # more tokens cost more: the fitted prefill rises over the sweep, as the engine's own TTFTs did
    path = tmp_path / "timing.yaml"
    path.write_text(yaml.safe_dump(result, sort_keys=False))
    timing = read_timing_file(path).timing()
    shortest, longest = cal["prefill_samples"][0], cal["prefill_samples"][-1]
    assert longest[1] > shortest[1]
    budget = result["step_token_budget"]
    assert prefill_ms(timing, longest[0], budget) > prefill_ms(timing, shortest[0], budget)
    assert min(timing.prefill_a, timing.prefill_b, timing.prefill_c) >= 0
    # what an arrival during decode costs is measured and reported beside the shape's price
    assert cal["arrival_cost_ms"] is not None and cal["arrival_model_ms"] is not None
    # the hit probes came back with the engine's cached tokens (prefix caching found on)
    assert all(h["cached_tokens"] > 0 for h in cal["prefix_hits"])
    cfg = load_config(None, {"routing.timing_file": str(path)}, environ={})
    assert cfg.routing.cost.prefill_b == pytest.approx(result["prefill_b"])
