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

The engine is a server on the network, and calibrate believes nothing of what it sends until checked: every read is
capped (``Limits``: a ``/metrics`` page, a JSON answer, an SSE line, a whole stream), every request has an idle
timeout per read and an overall deadline (``--read-timeout``, ``--request-timeout``), and every figure read from it
(block size, KV blocks, max_model_len, token counts, histogram sums) is checked against a sane range before it sizes
a prompt or a sweep. Whatever fails ends as one ``CalibrationError`` line naming the engine, the probe and what was
wrong: a broken or hostile engine costs a bounded wait and a bounded amount of memory, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import re
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import yaml
import yarl
from prometheus_client.metrics_core import Metric
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
# the ranges a figure read from the engine must fall in before it sizes anything: wide enough for every vLLM
# configuration (block sizes of 1 to a hybrid model's few thousand tokens, contexts of millions), narrow enough
# that a prompt or a sweep sized from them stays small (a block size of 1e6 asked for a 4M-token prompt)
BLOCK_SIZE_RANGE = (1, 1 << 16)
GPU_BLOCKS_RANGE = (1, 1 << 31)
MODEL_LEN_RANGE = (1, 1 << 24)
TOKENS_RANGE = (0, 1 << 31)  # a token count in an answer's usage
MODEL_ID_CHARS = 4096
MIN_PROMPT = 32  # the prefill fit needs three lengths: 16, 24 and the longest


class CalibrationError(RuntimeError):
    """The engine cannot be calibrated (no metrics, no prefix caching, an error answer, a misbehaving server):
    one line that says which engine, which probe and what, and how to fix it where that is known."""


@dataclass(frozen=True)
class Limits:
    """How long calibrate waits and how much it reads from the engine before it gives up.

    The timeouts are sized from what the probes need: the longest wait for data on a healthy engine is a decode
    probe's last stream, whose first token comes after its whole batch's prefills (up to 85% of the KV cache); on
    the engine tier's CPU engine every request ends within a second, so 60 s idle and 300 s per request leave a
    large model on a CPU room to spare (raise them with the flags for more). The caps are hundreds of times what a
    vLLM engine sends: its ``/metrics`` is tens of KB, a model list a few hundred bytes, a stream event ~300 bytes
    a token; a stream may hold a megabyte plus 16 KB per token asked for."""

    read_timeout_s: float = 60.0  # no byte for this long (connecting, or reading an answer): give up
    request_timeout_s: float = 300.0  # one request, from connecting to the last byte of its answer
    metrics_bytes: int = 16 << 20
    json_bytes: int = 1 << 20
    line_bytes: int = 1 << 20  # one SSE line, up to its newline
    stream_bytes: int = 1 << 20  # a whole stream: this much ...
    stream_bytes_per_token: int = 16 << 10  # ... and this much per token asked for

    def stream_cap(self, max_tokens: int) -> int:
        return self.stream_bytes + max_tokens * self.stream_bytes_per_token


def _size(n: int) -> str:
    """A byte count as a person reads it: 16 MiB, 1040 KiB, 300 bytes."""
    if n % (1 << 20) == 0:
        return f"{n >> 20} MiB"
    return f"{n >> 10} KiB" if n % (1 << 10) == 0 else f"{n} bytes"


def _clean(text: object, limit: int = 200) -> str:
    """Something the engine sent, fit for one line of an error: control characters and newlines shown as spaces
    (no forged second line), and at most ``limit`` characters."""
    out = " ".join("".join(c if c.isprintable() else " " for c in str(text)).split())
    return out if len(out) <= limit else out[:limit] + "..."


_DIGITS = re.compile(r"[0-9]{1,20}")


def _int_in(value: object, what: str, lo: int, hi: int, label: bool = False) -> int:
    """``value`` as an int in [lo, hi]: a JSON integer, or with ``label`` a metric label's decimal digits (no
    "1e6", "1_000", " 16", floats or booleans); else a ``ValueError`` saying what was found."""
    if label and isinstance(value, str) and _DIGITS.fullmatch(value):
        n: int | None = int(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        n = None
    if n is None or not lo <= n <= hi:
        raise ValueError(f"{what} is {_clean(json.dumps(value), 60)}, not an integer in [{lo}, {hi}]")
    return n


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


def _histogram(families: Sequence[Metric], name: str) -> tuple[float, float] | None:
    total = count = 0.0
    seen = False
    for fam in families:
        if fam.name != name:
            continue
        for s in fam.samples:
            if s.name == name + "_sum":
                total += s.value
                seen = True
            elif s.name == name + "_count":
                count += s.value
    return (total, count) if seen else None


def histogram_sum_count(text: str, name: str) -> tuple[float, float] | None:
    """(sum, count) of a histogram, summed over its label sets; None if absent."""
    return _histogram(list(text_string_to_metric_families(text)), name)


def _cache_config(families: Sequence[Metric]) -> tuple[int, int] | None:
    """(block size, KV blocks) from vLLM's ``cache_config_info``; None where there is none; a ``ValueError`` where
    its labels are missing or out of range (they size every prompt of the sweep)."""
    for fam in families:
        if fam.name == "vllm:cache_config_info":
            for s in fam.samples:
                return (_int_in(s.labels.get("block_size"), "vllm:cache_config_info block_size", *BLOCK_SIZE_RANGE,
                                label=True),
                        _int_in(s.labels.get("num_gpu_blocks"), "vllm:cache_config_info num_gpu_blocks",
                                *GPU_BLOCKS_RANGE, label=True))
    return None


class EngineClient:
    """Every exchange with the engine, bounded (``Limits``) and checked; a failure is a ``CalibrationError``
    naming the engine, the probe under way (``probe``, set by the ``Calibrator``) and the request."""

    def __init__(self, session: aiohttp.ClientSession, facts: EngineFacts | None = None, *, url: str = "",
                 limits: Limits | None = None) -> None:
        self.session = session
        self._facts = facts
        self.url = facts.url if facts is not None else url.rstrip("/")
        self.limits = limits or Limits()
        self.probe = "engine check"

    @property
    def facts(self) -> EngineFacts:
        if self._facts is None:
            raise RuntimeError("EngineClient.facts read before the engine check")
        return self._facts

    @facts.setter
    def facts(self, facts: EngineFacts) -> None:
        self._facts = facts

    def fail(self, what: str) -> CalibrationError:
        return CalibrationError(f"{self.url}: {self.probe}: {_clean(what, 600)}")

    @contextlib.asynccontextmanager
    async def _guard(self, where: str) -> AsyncIterator[None]:
        """One request under the overall deadline; a timeout or a connection's failure said as what it was."""
        lim = self.limits
        deadline = asyncio.timeout(lim.request_timeout_s)
        try:
            async with deadline:
                yield
        except CalibrationError:
            raise
        except TimeoutError as e:
            if deadline.expired():
                what = f"no complete answer within {lim.request_timeout_s:g} s (--request-timeout)"
            elif isinstance(e, aiohttp.ConnectionTimeoutError):
                what = f"could not connect within {lim.read_timeout_s:g} s (--read-timeout)"
            else:
                what = f"no data for {lim.read_timeout_s:g} s (--read-timeout)"
            raise self.fail(f"{where}: {what}") from None
        except aiohttp.ClientError as e:
            raise self.fail(f"{where}: {type(e).__name__}: {e}") from None

    async def _read_capped(self, r: aiohttp.ClientResponse, cap: int, where: str) -> bytes:
        """The whole body, or an error once it passes ``cap`` bytes (it is never held beyond that)."""
        if r.content_length is not None and r.content_length > cap:
            raise self.fail(f"{where}: the answer's Content-Length {r.content_length} exceeds the {_size(cap)} cap")
        buf = bytearray()
        while chunk := await r.content.read(1 << 16):
            buf += chunk
            if len(buf) > cap:
                raise self.fail(f"{where}: the answer exceeds the {_size(cap)} cap")
        return bytes(buf)

    async def _excerpt(self, r: aiohttp.ClientResponse) -> str:
        """The start of an error answer, for the message; nothing if it does not come."""
        try:
            text = (await r.content.read(300)).decode("utf-8", "replace")
        except (TimeoutError, aiohttp.ClientError):
            return ""
        return f": {_clean(text)}" if text.strip() else ""

    async def get(self, path: str, cap: int) -> tuple[int, bytes]:
        """(status, body) of a GET; the body of a 200 read up to ``cap`` bytes, of anything else an excerpt."""
        where = f"GET {path}"
        async with self._guard(where), self.session.get(self.url + path) as r:
            if r.status != 200:
                return r.status, (await self._excerpt(r)).encode()
            return 200, await self._read_capped(r, cap, where)

    async def get_json(self, path: str) -> Any:
        status, body = await self.get(path, self.limits.json_bytes)
        if status != 200:
            raise self.fail(f"GET {path} answered HTTP {status}{body.decode()}")
        try:
            return json.loads(body)
        except (ValueError, RecursionError) as e:
            raise self.fail(f"GET {path}: the answer is not JSON ({type(e).__name__}: {e})") from None

    async def metrics_families(self, required: bool = True) -> list[Metric] | None:
        """``/metrics``, parsed; None where it is not served and ``required`` is false."""
        status, body = await self.get("/metrics", self.limits.metrics_bytes)
        if status != 200:
            if not required:
                return None
            raise self.fail(f"GET /metrics answered HTTP {status}{body.decode()}")
        try:
            return list(text_string_to_metric_families(body.decode("utf-8")))
        except (ValueError, IndexError, KeyError, TypeError) as e:
            raise self.fail(f"GET /metrics: not Prometheus text ({type(e).__name__}: {e})") from None

    def ttft_of(self, families: Sequence[Metric]) -> tuple[float, float]:
        h = _histogram(families, TTFT_METRIC)
        if h is None:
            raise self.fail(f"GET /metrics has no {TTFT_METRIC}")
        if not all(math.isfinite(v) and v >= 0 for v in h):
            raise self.fail(f"GET /metrics: {TTFT_METRIC} has sum {h[0]} and count {h[1]}: not finite, "
                            "non-negative figures")
        return h

    async def ttft_histogram(self) -> tuple[float, float]:
        return self.ttft_of(await self.metrics_families() or [])

    async def stream(self, prompt: list[int], max_tokens: int, on_token: asyncio.Event | None = None) -> Stream:
        """One streamed completion; ``on_token`` is set when its first token arrives. The SSE stream is read line
        by line, each line and the whole stream capped, each event checked (a JSON object, its usage counts)."""
        body = {"model": self.facts.model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0.0}
        where = "POST /v1/completions"
        line_cap, cap = self.limits.line_bytes, self.limits.stream_cap(max_tokens)
        out = Stream(time.monotonic())
        async with self._guard(where), self.session.post(self.url + "/v1/completions", json=body) as r:
            if r.status != 200:
                raise self.fail(f"{where} answered HTTP {r.status}{await self._excerpt(r)}")
            pending, total = bytearray(), 0
            async for chunk in r.content.iter_any():
                now = time.monotonic()
                total += len(chunk)
                start = 0
                while (end := chunk.find(b"\n", start)) >= 0:
                    pending += chunk[start:end]
                    if len(pending) > line_cap:
                        break
                    self._event(bytes(pending), out, now, on_token, where)
                    pending.clear()
                    start = end + 1
                else:
                    pending += chunk[start:]
                if len(pending) > line_cap:
                    raise self.fail(f"{where}: a stream line exceeds the {_size(line_cap)} cap without a newline")
                if total > cap:
                    raise self.fail(f"{where}: the stream exceeds the {_size(cap)} cap for {max_tokens} tokens")
            if pending:
                self._event(bytes(pending), out, time.monotonic(), on_token, where)
        if not out.token_times:
            raise self.fail("a streamed completion returned no tokens")
        return out

    def _event(self, line: bytes, out: Stream, now: float, on_token: asyncio.Event | None, where: str) -> None:
        """One SSE line: a ``data:`` line's JSON event counted (a token, the usage); anything else skipped."""
        line = line.rstrip(b"\r")
        if not line.startswith(b"data:"):
            return  # a blank line between events, a comment, an event: or id: field
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return
        try:
            data = json.loads(payload)
        except (ValueError, RecursionError) as e:
            raise self.fail(f"{where}: a stream event is not JSON ({type(e).__name__}: {e})") from None
        if not isinstance(data, dict):
            raise self.fail(f"{where}: a stream event is {type(data).__name__}, not a JSON object")
        if "error" in data or data.get("object") == "error":
            err = data.get("error") or data
            raise self.fail(f"{where}: the engine streamed an error: "
                            f"{_clean(err.get('message', err) if isinstance(err, dict) else err)}")
        choices = data.get("choices")
        if choices is not None and not isinstance(choices, list):
            raise self.fail(f"{where}: a stream event's choices is {type(choices).__name__}, not a list")
        if choices:
            out.token_times.append(now)
            if on_token is not None:
                on_token.set()
        usage = data.get("usage")
        if usage is None:
            return
        details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
        if not isinstance(usage, dict) or not isinstance(details, dict | None):
            raise self.fail(f"{where}: a stream event's usage is not a JSON object of counts")
        try:
            out.prompt_tokens = _int_in(usage.get("prompt_tokens", 0), "usage.prompt_tokens", *TOKENS_RANGE)
            out.cached_tokens = _int_in((details or {}).get("cached_tokens") or 0,
                                        "usage.prompt_tokens_details.cached_tokens", 0, out.prompt_tokens)
        except ValueError as e:
            raise self.fail(f"{where}: {e}") from None


async def engine_facts(session: aiohttp.ClientSession, url: str, limits: Limits | None = None) -> EngineFacts:
    """The engine's model, cache config and context length, each checked before it sizes anything."""
    client = EngineClient(session, url=url, limits=limits)
    url = client.url
    models = await client.get_json("/v1/models")
    data = models.get("data") if isinstance(models, dict) else None
    if not isinstance(data, list):
        raise client.fail('GET /v1/models: not an OpenAI model list (no "data" list): is this an '
                          "OpenAI-compatible engine?")
    if not data:
        raise client.fail("GET /v1/models lists no model")
    first = data[0]
    model = first.get("id") if isinstance(first, dict) else None
    if not isinstance(model, str) or not 0 < len(model) <= MODEL_ID_CHARS:
        raise client.fail(f"GET /v1/models: the first model's id is {_clean(json.dumps(model), 60)}, not a "
                          f"string of 1 to {MODEL_ID_CHARS} characters")
    try:
        max_len = first.get("max_model_len")
        max_model_len = None if max_len is None else _int_in(max_len, "max_model_len", *MODEL_LEN_RANGE)
    except ValueError as e:
        raise client.fail(f"GET /v1/models: {e}") from None
    families = await client.metrics_families(required=False) or []
    try:
        cache = _cache_config(families)
    except ValueError as e:
        raise client.fail(f"GET /metrics: {e}") from None
    if cache is None:
        raise client.fail("GET /metrics has no vllm:cache_config_info (block size, KV blocks): calibrate reads a "
                          "vLLM engine's own metrics; is this a vLLM engine, with metrics on?")
    client.ttft_of(families)
    return EngineFacts(url, model, cache[0], cache[1], max_model_len)


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


async def _all(coros: Iterable[Awaitable[Any]]) -> list[Any]:
    """Like ``asyncio.gather``, but the first failure cancels the rest and is raised alone: a broken engine fails
    every stream of a batch, and one error is said (the others' requests closed, none left to log a traceback)."""
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(c) for c in coros]
    except BaseExceptionGroup as group:
        first: BaseException = group
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None
    return [t.result() for t in tasks]


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
            raise self.client.fail("a prompt sent twice reported no cached tokens: start the engine with "
                                   "--enable-prefix-caching and --enable-prompt-tokens-details")

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
        engine = after[0] - before[0]
        one = after[1] - before[1] == 1 and 0 <= engine < self.client.limits.request_timeout_s
        return s, engine if one else s.token_times[0] - s.started

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
            streams = await _all(self.client.stream(self.fresh(prompt), m) for _ in range(batch))
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

        async def decoding() -> list[Stream]:
            return await _all(self.client.stream(self.fresh(prompt), m, on_token=started) for _ in range(batch))

        streams, _ = await _all((decoding(), arrive()))
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
        """Each probe in turn, named on the client so that a failure says which one it was in."""
        probe = Probe()
        for name, step in (("prefix-caching check", lambda: self.check_prefix_caching()),
                           ("prefill sweep", lambda: self.prefill(probe)), ("prefix hits", lambda: self.hits(probe)),
                           ("decode probe", lambda: self.decode(probe)),
                           ("arrival probe", lambda: self.arrivals(probe))):
            self.client.probe = name
            await step()
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


def check_url(url: str) -> str:
    """``--worker`` as an engine's base URL (http or https, a host), without a trailing slash."""
    try:
        parsed = yarl.URL(url)
    except (ValueError, TypeError) as e:
        raise CalibrationError(f"--worker {_clean(url, 100)}: not a URL ({e})") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise CalibrationError(f"--worker {_clean(url, 100)}: not an engine's base URL (http://HOST:PORT)")
    return url.rstrip("/")


def plan_for(facts: EngineFacts, plan_args: dict[str, Any]) -> Plan:
    """The sweep for this engine: the longest prompt within its context; an engine whose block size leaves no
    room for the probes' prompts (eight and a half blocks for a prefix hit) is refused before any is sent."""
    asked = plan_args.pop("max_prompt", None) or 8192
    max_prompt = asked
    if facts.max_model_len:
        max_prompt = min(max_prompt, facts.max_model_len - 2)
    need = max(MIN_PROMPT, 8 * facts.block_size + facts.block_size // 2)
    if max_prompt < need:
        raise CalibrationError(
            f"{facts.url}: engine check: block size {facts.block_size} and max_model_len {facts.max_model_len} "
            f"leave prompts of {max_prompt} tokens (--max-prompt {asked}); the "
            f"probes need {need} (eight and a half blocks)")
    return Plan(max_prompt=max_prompt, **plan_args)


async def run_calibration(url: str, plan_args: dict[str, Any], budget: int | None, seed: int = 0,
                          progress: Callable[[str, int, int], None] | None = _progress,
                          limits: Limits | None = None) -> dict[str, Any]:
    """The whole run: the engine checked, probed and fitted. ``limits`` bounds every exchange (``Limits``)."""
    limits = limits or Limits()
    url = check_url(url)
    # no byte for read_timeout_s (connecting or reading) ends a request; the overall deadline is each request's
    # own (EngineClient._guard). Answers arrive uncompressed: a compressed one is not inflated past any cap.
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=limits.read_timeout_s, sock_read=limits.read_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0), auto_decompress=False,
                                     headers={"Accept-Encoding": "identity"}) as session:
        facts = await engine_facts(session, url, limits)
        plan = plan_for(facts, dict(plan_args))
        probe = await Calibrator(EngineClient(session, facts, limits=limits), plan, seed, progress).run()
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


def _positive(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}") from None
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}")
        return value
    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--worker", required=True, help="the engine's base URL (http://HOST:PORT), serving nothing else")
    p.add_argument("--out", default=None, help="write the timing file here (YAML); default: print it")
    p.add_argument("--max-prompt", type=_positive(int), default=None,
                   help="longest prompt of the prefill sweep (default 8192, at most max_model_len)")
    p.add_argument("--step-token-budget", type=_positive(int), default=None,
                   help="the engine's max_num_batched_tokens, if known (default: found from the sweep)")
    p.add_argument("--decode-tokens", type=_positive(int), default=32, help="tokens each decode probe generates")
    p.add_argument("--repeats", type=_positive(int), default=2, help="prompts per prefill length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--read-timeout", type=_positive(float), default=Limits.read_timeout_s, metavar="S",
                   help="give up on a request when the engine sends nothing for S seconds, connecting or "
                   f"answering (default {Limits.read_timeout_s:g})")
    p.add_argument("--request-timeout", type=_positive(float), default=Limits.request_timeout_s, metavar="S",
                   help="give up on a request not answered in full within S seconds (default "
                   f"{Limits.request_timeout_s:g}; raise both for a large model on a CPU)")


def main(args: argparse.Namespace) -> int:
    """Exit 0 with the timing file written; 2 with one line on stderr naming the engine, the probe and what was
    wrong, whatever the engine sent (the last clauses catch what the checks did not foresee, said as one line)."""
    plan_args = {"max_prompt": args.max_prompt, "decode_tokens": args.decode_tokens, "repeats": args.repeats}
    limits = Limits(read_timeout_s=args.read_timeout, request_timeout_s=args.request_timeout)
    try:
        result = asyncio.run(run_calibration(args.worker, plan_args, args.step_token_budget, args.seed,
                                             limits=limits))
    except CalibrationError as e:
        print(f"kvrouter calibrate: {_clean(e, 1000)}", file=sys.stderr)
        return 2
    except (aiohttp.ClientError, OSError, ValueError, TimeoutError) as e:
        print(f"kvrouter calibrate: {_clean(args.worker, 100)}: {type(e).__name__}: {_clean(e, 600)}",
              file=sys.stderr)
        return 2
    print(summary(result), file=sys.stderr)
    text = dump(result)
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        print(text, end="")
    return 0
