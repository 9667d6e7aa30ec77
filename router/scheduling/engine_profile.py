"""What one engine's steps cost, and what each worker's observed latencies teach about it.

``StepTiming`` is the one place the step-cost shape and its defaults live (the engine model in ``workers/engine``
subclasses it): a step that prefills ``T`` uncached tokens takes ``a T^2 + b T + c`` ms (attention is quadratic
within a step), a decode step ``a p^2 + b p + c`` ms at ``p``, the fraction of KV blocks held by requests in flight
(decode is memory-bound: every running request's KV is read each step). A step that prefills while others decode
carries them along and lasts ``max(prefill, decode)``. Defaults: NVIDIA Dynamo's mocker polynomials, fitted by
them to a real engine (REFERENCE.md section 5).

``EngineProfile`` is one worker's: the timing, the step token budget, and two robust online fits that correct the
timing from what the worker actually did: observed TTFT against the model's prediction (``speed x model``, a line
through the origin that long TTFTs weigh most: a slower GPU, a different model; the few milliseconds of HTTP and
tokenizing around a short one barely move it) and observed inter-token time against the model's decode step.
Until samples arrive the fits sit at their prior (speed 1), so the defaults rule; each sample moves them by least
squares, with Huber weights so one stalled request cannot. ``RobustLine`` can fit an intercept too.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import yaml


@dataclass(frozen=True)
class StepTiming:
    prefill_a: float = 4.21e-7  # prefill step ms = a T^2 + b T + c (T: uncached tokens in the step)
    prefill_b: float = 1.518e-2
    prefill_c: float = 16.5
    decode_a: float = -25.74  # decode step ms = a p^2 + b p + c (p: fraction of KV blocks in use)
    decode_b: float = 54.01
    decode_c: float = 5.74
    load_back_ms_per_token: float = 0.001  # CPU tier -> GPU

    def prefill_ms(self, uncached_tokens: float) -> float:
        t = uncached_tokens
        return self.prefill_a * t * t + self.prefill_b * t + self.prefill_c if t > 0 else 0.0

    def decode_ms(self, kv_usage: float) -> float:
        p = min(max(kv_usage, 0.0), 1.0)
        return max(0.0, self.decode_a * p * p + self.decode_b * p + self.decode_c)

    # the same two shapes over arrays (the routing objective prices every candidate at once), in seconds;
    # ``xp``: numpy, or router/scheduling/scalar_ops.py's functions for one candidate's floats
    def decode_s_array(self, kv_usage: np.ndarray, xp: Any = np) -> np.ndarray:
        p = xp.clip(kv_usage, 0.0, 1.0)
        return xp.maximum(0.0, self.decode_a * p * p + self.decode_b * p + self.decode_c) / 1000.0

    def prefill_s_array(self, tokens: np.ndarray, budget: int, floor_s: np.ndarray | float = 0.0, xp: Any = np
                        ) -> tuple[np.ndarray, np.ndarray]:
        """``EngineProfile.prefill_s`` over arrays: seconds to prefill ``tokens`` in steps of at most ``budget``,
        each lasting at least ``floor_s``; and the steps."""
        steps = xp.ceil(tokens / max(budget, 1))
        chunk = tokens / xp.maximum(steps, 1.0)
        per_step = (self.prefill_a * chunk * chunk + self.prefill_b * chunk + self.prefill_c) / 1000.0
        return xp.where(tokens > 0, steps * xp.maximum(per_step, floor_s), 0.0), steps


DEFAULT_TIMING = StepTiming()
TIMING_KEYS = tuple(f.name for f in fields(StepTiming))


@dataclass(frozen=True)
class TimingFile:
    """A timing file (``kvrouter calibrate --out``, or written by hand): coefficients that override the
    defaults, and the engine's token budget where it says."""

    coefficients: dict[str, float]
    step_token_budget: int | None = None

    def timing(self) -> StepTiming:
        return StepTiming(**self.coefficients)


def parse_timing(data: Mapping[str, Any] | None, where: str) -> TimingFile:
    """The keys: any of ``StepTiming``'s fields, ``step_token_budget`` (an integer, or null: not known) and
    ``calibration`` (how it was measured, for people: ignored). Any other key is an error naming it."""
    data = dict(data or {})
    data.pop("calibration", None)
    budget = data.pop("step_token_budget", None)
    bad = set(data) - set(TIMING_KEYS)
    if bad:
        raise ValueError(f"{where}: unknown timing keys {sorted(bad)}; known: "
                         f"{sorted([*TIMING_KEYS, 'step_token_budget', 'calibration'])}")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0):
        raise ValueError(f"{where}: step_token_budget must be a positive integer, not {budget!r}")
    try:
        coefficients = {k: float(v) for k, v in data.items()}
    except (TypeError, ValueError):
        raise ValueError(f"{where}: every timing coefficient must be a number") from None
    return TimingFile(coefficients, budget)


def read_timing_file(path: str | Path) -> TimingFile:
    """A YAML (``.yaml``/``.yml``) or JSON timing file (``parse_timing``)."""
    text = Path(path).read_text()
    try:
        data = yaml.safe_load(text) if str(path).endswith((".yaml", ".yml")) else json.loads(text)
    except (yaml.YAMLError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid YAML/JSON: {e}") from None
    if data is not None and not isinstance(data, Mapping):
        raise ValueError(f"{path}: a timing file is a mapping of coefficients")
    return parse_timing(data, str(path))


class RobustLine:
    """``y = intercept + slope x`` fitted to the last ``window`` samples by Huber-weighted least squares, pulled
    towards a prior (``prior_samples`` pseudo-samples' worth): a few samples move it a little, many decide it.
    Refitted every ``refit_every`` samples (a 2x2 solve over at most ``window`` points).

    The samples live in a numpy ring (oldest first when read), and the medians are taken by one partition each:
    a refit follows every few requests per worker, and the simulator's profile had a twentieth of its time in
    building arrays from tuples and in ``np.median``'s generic machinery. The arithmetic is the same, term by
    term, so the fit is the same to the last bit."""

    HUBER_K = 1.345  # Huber's constant: 95% efficiency on Gaussian residuals

    def __init__(self, intercept: float = 0.0, slope: float = 1.0, *, window: int = 256, prior_samples: float = 4.0,
                 refit_every: int = 8, slope_bounds: tuple[float, float] = (0.1, 10.0),
                 fit_intercept: bool = True) -> None:
        self.prior = (intercept, slope)
        self.intercept, self.slope = intercept, slope
        self.window = window
        self._xy = np.empty((window, 2))  # ring of (x, y); _count filled, the next write at _head
        self._count = self._head = 0
        self.prior_samples = prior_samples
        self.refit_every = max(1, refit_every)
        self.slope_bounds = slope_bounds
        self.fit_intercept = fit_intercept
        self._since_fit = 0

    def __len__(self) -> int:
        return self._count

    @property
    def samples(self) -> np.ndarray:
        """The last ``window`` samples, oldest first, as rows (x, y)."""
        xy, n, head = self._xy, self._count, self._head
        if n < self.window:
            return xy[:n]
        return xy if head == 0 else np.concatenate((xy[head:], xy[:head]))

    def predict(self, x: float) -> float:
        return self.intercept + self.slope * x

    def add(self, x: float, y: float) -> None:
        if not (x > 0 and y > 0 and math.isfinite(x) and math.isfinite(y)):
            return
        self._xy[self._head] = (x, y)
        self._head = (self._head + 1) % self.window
        self._count = min(self._count + 1, self.window)
        self._since_fit += 1
        if self._since_fit >= self.refit_every or self._count < self.refit_every:
            self._since_fit = 0
            self.fit()

    def fit(self) -> None:
        if not self._count:
            return
        xy = self.samples
        x, y = xy[:, 0], xy[:, 1]
        a0, b0 = self.prior
        # the prior as ``prior_samples`` points on the prior line, spread as the data are (so it pulls both
        # parameters alike, however far the data sit from x = 0)
        n0, mx, mxx = self.prior_samples, float(np.mean(x)), float(np.mean(x * x))
        w = np.ones_like(x)
        a, b = self.intercept, self.slope
        y_floor = 0.05 * _median(y)  # the residual scale's floor: 5% of a typical y (a near-perfect fit must not
        y_a0 = y - a0                # down-weight all)
        for _ in range(4):
            wx = w * x
            if self.fit_intercept:
                sw, swx, swxx = w.sum() + n0, wx.sum() + n0 * mx, (wx * x).sum() + n0 * mxx
                swy = (w * y).sum() + n0 * (a0 + b0 * mx)
                swxy = (wx * y).sum() + n0 * (a0 * mx + b0 * mxx)
                det = sw * swxx - swx * swx
                if det <= 0:
                    break
                a, b = (swxx * swy - swx * swxy) / det, (sw * swxy - swx * swy) / det
            else:
                a = a0
                b = ((wx * y_a0).sum() + n0 * b0 * mxx) / ((wx * x).sum() + n0 * mxx)
            abs_r = np.abs(y - a - b * x)
            # residual scale: the MAD's, floored
            scale = max(1.4826 * _median(abs_r), y_floor, 1e-12)
            cut = self.HUBER_K * scale
            w = np.minimum(1.0, cut / np.maximum(abs_r, 1e-300))
        lo, hi = self.slope_bounds
        self.slope = float(min(max(b, lo), hi))
        self.intercept = float(max(a, 0.0))


def _median(a: np.ndarray) -> float:
    """``np.median`` of a non-empty 1-D array of finite floats: the middle order statistic, or the mean of the
    two middle ones, from one partition."""
    n = len(a)
    mid = n // 2
    if n % 2:
        return float(np.partition(a, mid)[mid])
    part = np.partition(a, (mid - 1, mid))
    return float((part[mid - 1] + part[mid]) / 2)


@dataclass
class EngineProfile:
    """One worker's step costs: the timing shape, corrected by what its TTFTs and inter-token times showed."""

    timing: StepTiming = DEFAULT_TIMING
    step_token_budget: int = 8192  # the engine's max_num_batched_tokens
    ttft: RobustLine = field(default_factory=lambda: RobustLine(fit_intercept=False))  # observed TTFT vs the model's
    decode: RobustLine = field(default_factory=lambda: RobustLine(fit_intercept=False))  # inter-token vs step

    def decode_step_s(self, kv_usage: float) -> float:
        """A decode step at this KV usage, as this worker runs them."""
        return self.decode.predict(self.timing.decode_ms(kv_usage) / 1000.0)

    def prefill_s(self, tokens: int, floor_s: float = 0.0) -> tuple[float, int]:
        """Model seconds (before the TTFT fit) to prefill ``tokens`` in as few steps as the budget allows, each
        step lasting at least ``floor_s`` (the decode step of the requests running beside it); and the steps."""
        if tokens <= 0:
            return 0.0, 0
        steps = -(-tokens // max(self.step_token_budget, 1))
        per_step = self.timing.prefill_ms(tokens / steps) / 1000.0
        return steps * max(per_step, floor_s), steps
