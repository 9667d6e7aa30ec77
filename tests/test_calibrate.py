"""``kvrouter calibrate``: the fits recover a known timing, and a live run against the simulated worker started
with a known timing file recovers each term (issue 44: within 10%, the step time within 5% over the sweep)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math

import numpy as np
import pytest
import yaml
from aiohttp import web

from bench.load import sim_workers
from router.calibrate import CalibrationError, prefill_lengths, run_calibration
from router.config import ConfigError, load_config
from router.scheduling.calibration import (
    DecodeSample,
    PrefillSample,
    calibrate,
    fit_prefill,
    kv_usage_over,
    prefill_chunks,
    prefill_ms,
)
from router.scheduling.engine_profile import StepTiming, read_timing_file
from workers.engine import TimingModel

# a slower engine than the defaults (8x every coefficient): steps long beside the simulated worker's own
# per-step overhead (its loop and timer, about a millisecond a step, which calibrate measures as part of the step)
SLOWER = 8
KNOWN = StepTiming(*(SLOWER * v for v in (4.21e-7, 1.518e-2, 16.5, -25.74, 54.01, 5.74)))


def test_chunks_are_cut_as_an_idle_vllm_scheduler_cuts_them():
    assert prefill_chunks(5000, 2048) == [2048, 2048, 904]
    assert prefill_chunks(4096, 2048) == [2048, 2048]
    assert prefill_chunks(100, None) == [100] and prefill_chunks(0, 2048) == []


def test_the_fits_recover_the_shape_and_the_budget_from_exact_samples():
    lengths = prefill_lengths(12000)
    prefill = [PrefillSample(n, prefill_ms(KNOWN, n, 4096) / 1000) for n in lengths]
    decode = [DecodeSample(p, KNOWN.decode_ms(p) / 1000, 8) for p in (0.05, 0.2, 0.4, 0.6, 0.8, 0.95)]
    cal = calibrate(prefill, decode)
    assert cal.step_token_budget == 4096
    for name in ("prefill_a", "prefill_b", "prefill_c", "decode_a", "decode_b", "decode_c"):
        assert getattr(cal.timing, name) == pytest.approx(getattr(KNOWN, name), rel=1e-6), name
    assert cal.prefill.max_relative_residual < 1e-9 and cal.decode.max_relative_residual < 1e-9
    # a budget above every prompt measured is not seen: reported as not found, not guessed
    short = [PrefillSample(n, prefill_ms(KNOWN, n, None) / 1000) for n in (16, 64, 256, 1024, 2048)]
    assert fit_prefill(short)[1] is None
    with pytest.raises(ValueError, match="three different lengths"):
        fit_prefill(short[:2])


def test_kv_usage_over_a_window_counts_prompt_and_generated_blocks():
    # 4 requests of 30 tokens, 16-token blocks: 2 blocks each until token 3 makes 33, then 3
    assert kv_usage_over(4, 30, 0, 1, 16, 100) == pytest.approx(0.08)
    assert kv_usage_over(4, 30, 3, 4, 16, 100) == pytest.approx(0.12)


def _step_errors(fitted: StepTiming, budget: int, lengths: list[int], loads: list[float]) -> float:
    errs = [abs(prefill_ms(fitted, n, budget) / prefill_ms(KNOWN, n, budget) - 1) for n in lengths]
    errs += [abs(fitted.decode_ms(p) / KNOWN.decode_ms(p) - 1) for p in loads]
    return max(errs)


def test_calibrating_the_simulated_worker_recovers_its_timing_file(tmp_path):
    known = tmp_path / "known.yaml"
    known.write_text(yaml.safe_dump({k: getattr(KNOWN, k) for k in
                                     ("prefill_a", "prefill_b", "prefill_c", "decode_a", "decode_b", "decode_c")}))
    with contextlib.ExitStack() as stack:
        # the budget is vLLM's GPU default: a whole step of 8K tokens is where the quadratic term shows
        (w,) = sim_workers(stack, 1, "--timing", str(known), "--num-gpu-blocks", "1024",
                           "--max-num-batched-tokens", "8192", "--max-model-len", "16384")
        result = asyncio.run(run_calibration(w.url, {"max_prompt": 12000, "repeats": 1, "decode_tokens": 16},
                                             None, progress=None))
    fitted = StepTiming(**{k: result[k] for k in ("prefill_a", "prefill_b", "prefill_c", "decode_a", "decode_b",
                                                  "decode_c")})
    assert result["step_token_budget"] == 8192
    for name in ("prefill_a", "prefill_b", "prefill_c", "decode_a", "decode_b", "decode_c"):
        assert getattr(fitted, name) == pytest.approx(getattr(KNOWN, name), rel=0.10), name
    loads = [s[0] for s in result["calibration"]["decode_samples"]]
    assert len(loads) >= 3 and min(loads) < 0.2 and max(loads) > 0.6
    assert _step_errors(fitted, 8192, prefill_lengths(12000), list(np.linspace(min(loads), max(loads), 9))) < 0.05
    # a short prompt arriving during a decode window costs the streams there what the shape says (its prefill
    # step's excess over a decode step), within a tenth of a step: the engine model has no other cost for it
    cal = result["calibration"]
    assert cal["arrival_cost_ms"] is not None
    step_ms = fitted.decode_ms(0.5)
    assert abs(cal["arrival_cost_ms"] - cal["arrival_model_ms"]) < 0.1 * step_ms, cal
    # a prefix hit costs its uncached tokens: the shape's price of the tail, as measured
    for hit in result["calibration"]["prefix_hits"]:
        assert hit["cached_tokens"] > 0 and hit["ttft_ms"] == pytest.approx(hit["model_ms"], rel=0.10)

    # the file it writes is read by the simulator, the simulated worker and the router alike
    out = tmp_path / "timing.yaml"
    out.write_text(yaml.safe_dump(result, sort_keys=False))
    spec = read_timing_file(out)
    assert spec.step_token_budget == 8192 and spec.timing() == fitted
    assert TimingModel.from_file(out).prefill_b == fitted.prefill_b
    cfg = load_config(None, {"routing.timing_file": str(out), "routing.cost.prefill_c": 1.5}, environ={})
    assert cfg.routing.cost.step_token_budget == 8192
    assert cfg.routing.cost.decode_b == fitted.decode_b
    assert cfg.routing.cost.prefill_c == 1.5  # an explicit routing.cost key wins over the file


def test_a_bad_timing_file_is_a_config_error_naming_it(tmp_path):
    bad = tmp_path / "t.yaml"
    bad.write_text("prefil_c: 1\n")
    with pytest.raises(ConfigError, match="unknown timing keys"):
        load_config(None, {"routing.timing_file": str(bad)}, environ={})
    bad.write_text("step_token_budget: -3\n")
    with pytest.raises(ConfigError, match="step_token_budget"):
        load_config(None, {"routing.timing_file": str(bad)}, environ={})
    with pytest.raises(ConfigError, match="timing_file"):
        load_config(None, {"routing.timing_file": str(tmp_path / "missing.yaml")}, environ={})


@contextlib.asynccontextmanager
async def serving(app: web.Application):  # type: ignore[no-untyped-def]
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


async def _models(_: web.Request) -> web.Response:
    return web.json_response({"data": [{"id": "m", "max_model_len": 4096}]})


async def test_an_engine_without_vllm_metrics_is_a_clear_error():
    """A real OpenAI-shaped server that is not a vLLM engine (no /metrics): calibrate says what is missing."""
    app = web.Application()
    app.router.add_get("/v1/models", _models)
    async with serving(app) as url:
        with pytest.raises(CalibrationError, match="vllm:cache_config_info"):
            await run_calibration(url, {}, None, progress=None)


async def test_an_engine_without_prefix_caching_is_a_clear_error():
    """A stand-in (named so) for a vLLM started without --enable-prefix-caching: its metrics and a stream that
    never reports cached tokens. The real engine tier cannot start a second engine just for this refusal."""
    metrics = ('vllm:cache_config_info{block_size="16",num_gpu_blocks="512",num_cpu_blocks="0"} 1.0\n'
               "# TYPE vllm:time_to_first_token_seconds histogram\n"
               'vllm:time_to_first_token_seconds_bucket{le="+Inf"} 0\n'
               "vllm:time_to_first_token_seconds_count 0\nvllm:time_to_first_token_seconds_sum 0\n")

    async def get_metrics(_: web.Request) -> web.Response:
        return web.Response(text=metrics)

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        r = web.StreamResponse()
        await r.prepare(request)
        await r.write(b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n')
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": 1, "prompt_tokens_details": None}
        await r.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        await r.write(b"data: [DONE]\n\n")
        return r

    app = web.Application()
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/metrics", get_metrics)
    app.router.add_post("/v1/completions", completions)
    async with serving(app) as url:
        with pytest.raises(CalibrationError, match="enable-prefix-caching"):
            await run_calibration(url, {}, None, progress=None)


def test_prefill_lengths_sweep_geometrically_to_the_longest():
    lengths = prefill_lengths(5000)
    assert lengths[0] == 16 and lengths[-1] == 5000 and lengths == sorted(set(lengths))
    assert all(b / a <= 2 for a, b in itertools.pairwise(lengths)) and not math.isnan(sum(lengths))
