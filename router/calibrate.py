"""``kvrouter calibrate --worker URL``: measure one live engine's step costs and write them as a timing file.

A short profiling run against an engine serving nothing else:
1. checks: ``/metrics`` has vLLM's cache config (block size, KV blocks) and its TTFT histogram, and a prompt sent
   twice comes back with cached tokens (prefix caching on); otherwise a clear error says which is missing;
2. prefill: prompts of fresh random tokens (no prefix hits), lengths swept geometrically up to ``--max-prompt``
   (past the token budget, so the budget shows), one at a time on the idle engine, each prompt's TTFT read from
   the engine's own histogram (the change in its sum across the one request) beside the client's;
3. prefix hits: a prompt, then it again with a short new tail: the second TTFT is checked against the shape's
   price of its uncached tokens alone (reported, not fitted: what a hit saves is what the router bets on);
4. decode: ``B`` concurrent streams of ``L``-token prompts, for several batch sizes and KV loads; over the window
   where all ``B`` decode together, the time per step (client timings: one SSE event per token and step) and the
   KV fraction they hold (their blocks over the engine's, from the cache config);
5. the fits (router/scheduling/calibration.py) with their residuals, written as YAML that ``kvrouter sim --timing``,
   ``kvrouter worker sim --timing`` and the router (``routing.timing_file``) read.

The engine must be otherwise idle: every figure assumes the steps measured are the probe's own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import yaml
from prometheus_client.parser import text_string_to_metric_families

from router.scheduling.calibration import (
    Calibration,
    DecodeSample,
    PrefillSample,
    calibrate,
    fit_decode,
    kv_usage_over,
    prefill_ms,
)
from router.scheduling.engine_profile import StepTiming

TOKEN_IDS = (10, 3990)  # fresh prompts draw from here: inside every vocabulary of 4,000 tokens or more
TTFT_METRIC = "vllm:time_to_first_token_seconds"


class CalibrationError(RuntimeError):
    """The engine cannot be calibrated (no metrics, no prefix caching, an error answer): says which, and how."""


@dataclass
class EngineFacts:
    url: str
    model: str
    block_size: int
    num_gpu_blocks: int
    max_model_len: int | None


@dataclass
class Probe:
    """Everything measured, kept for the report."""

    prefill: list[PrefillSample] = field(default_factory=list)
    prefill_client_s: list[float] = field(default_factory=list)  # the client's TTFT of each prefill sample
    hits: list[tuple[int, int, float]] = field(default_factory=list)  # (prompt tokens, cached tokens, TTFT s)
    decode: list[DecodeSample] = field(default_factory=list)
    arrival_cost_s: float | None = None  # each short arrival's cost to the streams decoding beside it, measured
    arrival_step_s: float | None = None  # the fitted decode step in that window


@dataclass
class Stream:
    """One streamed completion: when each token's event arrived, and the usage."""

    started: float
    token_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0


def histogram_sum_count(text: str, name: str) -> tuple[float, float] | None:
    """(sum, count) of a histogram, summed over its label sets; None if absent."""
    total = count = 0.0
    seen = False
    for fam in text_string_to_metric_families(text):
        if fam.name != name:
            continue
        for s in fam.samples:
            if s.name == name + "_sum":
                total += s.value
                seen = True
            elif s.name == name + "_count":
                count += s.value
    return (total, count) if seen else None


def _cache_config(text: str) -> tuple[int, int] | None:
    for fam in text_string_to_metric_families(text):
        if fam.name == "vllm:cache_config_info":
            for s in fam.samples:
                try:
                    return int(s.labels["block_size"]), int(s.labels["num_gpu_blocks"])
                except (KeyError, ValueError):
                    return None
    return None


class EngineClient:
    def __init__(self, session: aiohttp.ClientSession, facts: EngineFacts) -> None:
        self.session, self.facts = session, facts

    async def metrics(self) -> str:
        async with self.session.get(self.facts.url + "/metrics") as r:
            if r.status != 200:
                raise CalibrationError(f"{self.facts.url}/metrics answered {r.status}")
            return await r.text()

    async def ttft_histogram(self) -> tuple[float, float]:
        h = histogram_sum_count(await self.metrics(), TTFT_METRIC)
        if h is None:
            raise CalibrationError(f"{self.facts.url}/metrics has no {TTFT_METRIC}")
        return h

    async def stream(self, prompt: list[int], max_tokens: int, on_token: asyncio.Event | None = None) -> Stream:
        """One streamed completion; ``on_token`` is set when its first token arrives."""
        body = {"model": self.facts.model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0.0}
        out = Stream(time.monotonic())
        async with self.session.post(self.facts.url + "/v1/completions", json=body) as r:
            if r.status != 200:
                raise CalibrationError(f"{self.facts.url}/v1/completions answered {r.status}: "
                                       f"{(await r.text())[:300]}")
            buf = b""
            async for chunk in r.content.iter_any():
                now = time.monotonic()
                buf += chunk
                *events, buf = buf.split(b"\n\n")
                for ev in events:
                    line = ev.strip()
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    data = json.loads(line[6:])
                    if data.get("choices"):
                        out.token_times.append(now)
                        if on_token is not None:
                            on_token.set()
                    usage = data.get("usage")
                    if usage:
                        out.prompt_tokens = usage.get("prompt_tokens", 0)
                        out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        if not out.token_times:
            raise CalibrationError(f"{self.facts.url}: a streamed completion returned no tokens")
        return out


async def engine_facts(session: aiohttp.ClientSession, url: str) -> EngineFacts:
    url = url.rstrip("/")
    try:
        async with session.get(url + "/v1/models") as r:
            models = (await r.json())["data"]
        async with session.get(url + "/metrics") as r:
            text = await r.text() if r.status == 200 else ""
    except (aiohttp.ClientError, KeyError, ValueError, TypeError) as e:
        raise CalibrationError(f"{url}: not an OpenAI-compatible engine ({e})") from None
    if not models:
        raise CalibrationError(f"{url}/v1/models lists no model")
    cache = _cache_config(text)
    if cache is None:
        raise CalibrationError(f"{url}/metrics has no vllm:cache_config_info (block size, KV blocks): calibrate "
                               "reads a vLLM engine's own metrics; is this a vLLM engine, with metrics on?")
    if histogram_sum_count(text, TTFT_METRIC) is None:
        raise CalibrationError(f"{url}/metrics has no {TTFT_METRIC}")
    return EngineFacts(url, models[0]["id"], cache[0], cache[1], models[0].get("max_model_len"))


def _progress(label: str, done: int, total: int) -> None:
    """A bar redrawn in place on a terminal; elsewhere (a log, CI) a line at each fifth of the way."""
    tty = sys.stderr.isatty()
    if not tty and done != total and (5 * done) // max(total, 1) == (5 * (done - 1)) // max(total, 1):
        return
    bar = "#" * (25 * done // max(total, 1))
    print(f"{chr(13) if tty else ''}  {label:<9} [{bar:<25}] {done}/{total}",
          end="\n" if done >= total or not tty else "", file=sys.stderr, flush=True)


@dataclass
class Plan:
    max_prompt: int
    repeats: int = 2
    decode_tokens: int = 32
    batches: tuple[int, ...] = (1, 4, 16, 32)
    loads: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.85)


def decode_window(streams: list[Stream]) -> tuple[float, float]:
    """When every one of ``streams`` decodes: from the last first token to the first last token."""
    return max(s.token_times[0] for s in streams), min(s.token_times[-1] for s in streams)


def prefill_lengths(max_prompt: int) -> list[int]:
    """Geometric from 16 tokens to ``max_prompt``, with the midpoints between powers of two."""
    out, n = [], 16
    while n < max_prompt:
        out += [n, n * 3 // 2]
        n *= 2
    return sorted({x for x in out if x < max_prompt} | {max_prompt})


def decode_shapes(plan: Plan, facts: EngineFacts) -> list[tuple[int, int]]:
    """(batch, prompt tokens) pairs whose decode windows hold each target KV load, where a prompt fits."""
    capacity = facts.num_gpu_blocks * facts.block_size
    limit = (facts.max_model_len or 1 << 30) - plan.decode_tokens - 1
    shapes = []
    for load in plan.loads:
        for batch in plan.batches:
            prompt = int(load * capacity / batch) - plan.decode_tokens // 2
            if facts.block_size <= prompt <= min(limit, plan.max_prompt):
                shapes.append((batch, prompt))
                break  # one batch size per load: the smallest whose prompt fits
    return shapes


class Calibrator:
    def __init__(self, client: EngineClient, plan: Plan, seed: int = 0,
                 progress: Callable[[str, int, int], None] | None = _progress) -> None:
        self.client, self.plan = client, plan
        self.rng = np.random.default_rng(seed)
        self.progress = progress or (lambda *_: None)

    def fresh(self, n: int) -> list[int]:
        return [int(t) for t in self.rng.integers(*TOKEN_IDS, size=n)]

    async def check_prefix_caching(self) -> None:
        prompt = self.fresh(4 * self.client.facts.block_size)
        await self.client.stream(prompt, 1)
        again = await self.client.stream(prompt, 1)
        if again.cached_tokens <= 0:
            raise CalibrationError(f"{self.client.facts.url}: a prompt sent twice reported no cached tokens: start "
                                   "the engine with --enable-prefix-caching and --enable-prompt-tokens-details")

    async def prefill(self, probe: Probe) -> None:
        lengths = prefill_lengths(self.plan.max_prompt)
        for warm in (16, 256):  # the first requests of an engine pay one-off costs (graphs, allocations)
            await self.client.stream(self.fresh(min(warm, self.plan.max_prompt)), 1)
        todo = [n for n in lengths for _ in range(self.plan.repeats)]
        for i, n in enumerate(todo):
            s, engine_ttft = await self.timed(self.fresh(n))
            probe.prefill.append(PrefillSample(n - s.cached_tokens, engine_ttft))
            probe.prefill_client_s.append(s.token_times[0] - s.started)
            self.progress("prefill", i + 1, len(todo))

    async def timed(self, prompt: list[int]) -> tuple[Stream, float]:
        """One prompt alone on the engine, and its TTFT as the engine measured it (the change in its histogram's
        sum across this one request; the client's where another request slipped in)."""
        before = await self.client.ttft_histogram()
        s = await self.client.stream(prompt, 1)
        after = await self.client.ttft_histogram()
        return s, after[0] - before[0] if after[1] - before[1] == 1 else s.token_times[0] - s.started

    async def hits(self, probe: Probe) -> None:
        bs = self.client.facts.block_size
        for n in (8 * bs, min(32 * bs, self.plan.max_prompt - bs)):
            base = self.fresh(n)
            await self.client.stream(base, 1)
            s, ttft = await self.timed(base + self.fresh(bs // 2))
            probe.hits.append((s.prompt_tokens, s.cached_tokens, ttft))

    async def decode(self, probe: Probe) -> None:
        facts, m = self.client.facts, self.plan.decode_tokens
        shapes = decode_shapes(self.plan, facts)
        for i, (batch, prompt) in enumerate(shapes):
            streams = await asyncio.gather(*(self.client.stream(self.fresh(prompt), m) for _ in range(batch)))
            start, end = decode_window(streams)
            steps, firsts, lasts = [], [], []
            for s in streams:
                idx = [j for j, t in enumerate(s.token_times) if start <= t <= end]
                if len(idx) >= 2 and s.token_times[idx[-1]] > s.token_times[idx[0]]:
                    steps.append((s.token_times[idx[-1]] - s.token_times[idx[0]]) / (idx[-1] - idx[0]))
                    firsts.append(idx[0])
                    lasts.append(idx[-1])
            if steps:
                usage = kv_usage_over(batch, prompt, int(np.median(firsts)), int(np.median(lasts)),
                                      facts.block_size, facts.num_gpu_blocks)
                probe.decode.append(DecodeSample(usage, float(np.median(steps)), batch))
            self.progress("decode", i + 1, len(shapes))

    async def arrivals(self, probe: Probe, count: int = 4, tokens: int = 32) -> None:
        """A decode window with short prompts arriving during it, one after another: what each arrival costs the
        streams decoding beside it, measured (the window's time beyond its steps at the fitted decode step, per
        arrival inside it) against the shape's price of it (its prefill step's excess over a decode step).
        Reported, not fitted: an engine whose own per-request work (parsing a prompt, formatting its tokens)
        shares the model's CPU shows here as a cost the shape does not have."""
        facts = self.client.facts
        shapes = decode_shapes(self.plan, facts)
        try:
            step_fit = fit_decode(probe.decode)
        except ValueError:
            return
        if not shapes:
            return
        batch, prompt = shapes[len(shapes) // 2]
        m = 3 * self.plan.decode_tokens
        sent: list[tuple[float, float]] = []  # (sent, first token) of each arrival

        started = asyncio.Event()  # a decoding stream's first token: the arrivals go from then on

        async def arrive() -> None:
            await started.wait()
            for _ in range(count):
                s = await self.client.stream(self.fresh(tokens), 1)
                sent.append((s.started, s.token_times[0]))

        streams, _ = await asyncio.gather(
            asyncio.gather(*(self.client.stream(self.fresh(prompt), m, on_token=started) for _ in range(batch))),
            arrive())
        start, end = decode_window(streams)
        inside = [a for a in sent if start < a[1] < end]
        if not inside or end <= start:
            return
        per_stream = [sum(1 for t in s.token_times if start <= t <= end) - 1 for s in streams]
        steps = float(np.median(per_stream))
        usage = kv_usage_over(batch, prompt, 0, m - 1, facts.block_size, facts.num_gpu_blocks)
        step_s = StepTiming(decode_a=step_fit.a, decode_b=step_fit.b, decode_c=step_fit.c).decode_ms(usage) / 1000.0
        probe.arrival_cost_s = ((end - start) - steps * step_s) / len(inside)
        probe.arrival_step_s = step_s

    async def run(self) -> Probe:
        probe = Probe()
        await self.check_prefix_caching()
        await self.prefill(probe)
        await self.hits(probe)
        await self.decode(probe)
        await self.arrivals(probe)
        return probe


def report(facts: EngineFacts, probe: Probe, cal: Calibration) -> dict[str, Any]:
    """The fitted timing and how it was measured: the file ``kvrouter calibrate --out`` writes."""
    t = cal.timing
    hits = [{"prompt_tokens": n, "cached_tokens": c, "ttft_ms": round(ttft * 1000, 3),
             "model_ms": round(prefill_ms(t, n - c, cal.step_token_budget), 3)} for n, c, ttft in probe.hits]
    overhead = [c - e.ttft_s for c, e in zip(probe.prefill_client_s, probe.prefill, strict=True)]
    return {
        "prefill_a": t.prefill_a, "prefill_b": t.prefill_b, "prefill_c": t.prefill_c,
        "decode_a": t.decode_a, "decode_b": t.decode_b, "decode_c": t.decode_c,
        "step_token_budget": cal.step_token_budget,
        "calibration": {  # how it was measured: read by people, ignored by the readers of the timing
            "engine": facts.url, "model": facts.model, "block_size": facts.block_size,
            "num_gpu_blocks": facts.num_gpu_blocks, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "prefill": cal.prefill.as_dict(), "decode": cal.decode.as_dict(),
            "budget_found": cal.step_token_budget is not None,
            "client_overhead_ms_median": round(float(np.median(overhead)) * 1000, 3) if overhead else None,
            "prefix_hits": hits,
            "load_back": "not measured (the default kept)",
            # a short prompt arriving during a decode window: what it cost the streams there, measured, against
            # the shape's price (its prefill step beyond a decode step); reported, not fitted
            "arrival_cost_ms": None if probe.arrival_cost_s is None else round(probe.arrival_cost_s * 1000, 3),
            "arrival_model_ms": None if probe.arrival_step_s is None else round(max(
                0.0, t.prefill_ms(32) - probe.arrival_step_s * 1000), 3),
            "prefill_samples": [[s.uncached_tokens, round(s.ttft_s * 1000, 3)] for s in probe.prefill],
            "decode_samples": [[round(s.kv_usage, 4), round(s.step_s * 1000, 3), s.batch] for s in probe.decode],
        },
    }


async def run_calibration(url: str, plan_args: dict[str, Any], budget: int | None, seed: int = 0,
                          progress: Callable[[str, int, int], None] | None = _progress) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        facts = await engine_facts(session, url)
        max_prompt = plan_args.pop("max_prompt", None) or 8192
        if facts.max_model_len:
            max_prompt = min(max_prompt, facts.max_model_len - 2)
        plan = Plan(max_prompt=max_prompt, **plan_args)
        probe = await Calibrator(EngineClient(session, facts), plan, seed, progress).run()
    try:
        cal = calibrate(probe.prefill, probe.decode, budget)
    except ValueError as e:
        raise CalibrationError(f"{url}: {e} (the engine's KV cache or max_model_len is too small for the sweep: "
                               "try a smaller --decode-tokens or --max-prompt)") from None
    return report(facts, probe, cal)


def dump(result: dict[str, Any]) -> str:
    head = (f"# kvrouter calibrate: {result['calibration']['engine']} ({result['calibration']['model']}), "
            f"{result['calibration']['measured_at']}\n# read by: kvrouter sim --timing, kvrouter worker sim "
            "--timing, routing.timing_file\n")
    return head + yaml.safe_dump(result, sort_keys=False)


def summary(result: dict[str, Any]) -> str:
    c = result["calibration"]
    p, d = c["prefill"], c["decode"]
    budget = result["step_token_budget"]
    lines = [
        f"engine {c['engine']}: model {c['model']}, block size {c['block_size']}, {c['num_gpu_blocks']} KV blocks",
        f"prefill step ms = {result['prefill_a']:.4g} T^2 + {result['prefill_b']:.4g} T + {result['prefill_c']:.4g}"
        f"   ({p['samples']} prompts; residual rms {p['rms_relative_residual']:.1%}, max "
        f"{p['max_relative_residual']:.1%})",
        f"decode step ms  = {result['decode_a']:.4g} p^2 + {result['decode_b']:.4g} p + {result['decode_c']:.4g}"
        f"   ({d['samples']} windows; residual rms {d['rms_relative_residual']:.1%}, max "
        f"{d['max_relative_residual']:.1%})",
        f"token budget    = {budget if budget is not None else 'not reached by the longest prompt'}",
    ]
    if c.get("arrival_cost_ms") is not None:
        lines.append(f"an arrival during decode cost the streams {c['arrival_cost_ms']:.1f} ms against the "
                     f"shape's {c['arrival_model_ms']:.1f} ms")
    for h in c["prefix_hits"]:
        lines.append(f"prefix hit: {h['cached_tokens']}/{h['prompt_tokens']} tokens cached, TTFT "
                     f"{h['ttft_ms']:.1f} ms against the shape's {h['model_ms']:.1f} ms")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--worker", required=True, help="the engine's base URL (http://HOST:PORT), serving nothing else")
    p.add_argument("--out", default=None, help="write the timing file here (YAML); default: print it")
    p.add_argument("--max-prompt", type=int, default=None,
                   help="longest prompt of the prefill sweep (default 8192, at most max_model_len)")
    p.add_argument("--step-token-budget", type=int, default=None,
                   help="the engine's max_num_batched_tokens, if known (default: found from the sweep)")
    p.add_argument("--decode-tokens", type=int, default=32, help="tokens each decode probe generates")
    p.add_argument("--repeats", type=int, default=2, help="prompts per prefill length")
    p.add_argument("--seed", type=int, default=0)


def main(args: argparse.Namespace) -> int:
    plan_args = {"max_prompt": args.max_prompt, "decode_tokens": args.decode_tokens, "repeats": args.repeats}
    try:
        result = asyncio.run(run_calibration(args.worker, plan_args, args.step_token_budget, args.seed))
    except CalibrationError as e:
        print(f"kvrouter calibrate: {e}", file=sys.stderr)
        return 2
    except aiohttp.ClientError as e:
        print(f"kvrouter calibrate: {args.worker}: {e}", file=sys.stderr)
        return 2
    print(summary(result), file=sys.stderr)
    text = dump(result)
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        print(text, end="")
    return 0
