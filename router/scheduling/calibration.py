"""Fit one engine's step timing to what a profiling run measured (``kvrouter calibrate``; pure, no I/O).

The shape fitted is the one the router prices and the engine model runs (``engine_profile.StepTiming``): a
prefill step of ``x`` uncached tokens costs ``a x^2 + b x + c`` ms, a decode step ``a p^2 + b p + c`` ms at ``p``,
the fraction of KV blocks held by the requests running. Both are linear in their three coefficients, so each is
one least-squares solve; the residuals are relative (``(model - measured) / measured``), because the figures span
two orders of magnitude and a router cares about the error in proportion to the time.

A prompt longer than the engine's token budget (``max_num_batched_tokens``) is prefilled in several steps: full
budget-sized chunks, then the rest, as vLLM's scheduler cuts it (an idle engine gives the whole budget to one
prompt). The budget is found the same way as the coefficients: the fit is solved for every candidate budget,
multiples of ``BUDGET_STEP`` up to the longest prompt measured, and the candidate with the least residual wins if it
explains the data clearly better than no chunking (``BUDGET_EVIDENCE``); a budget above every prompt measured is
not seen, and is reported as not found. The prefill coefficients are held non-negative (a prompt's cost cannot
shrink with its tokens: a noisy engine's samples can pull an unconstrained quadratic below zero).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from router.scheduling.engine_profile import StepTiming

BUDGET_STEP = 256  # the budget is found to this many tokens
BUDGET_EVIDENCE = 0.5  # a budget must halve the squared residuals of the fit without chunking to be believed


@dataclass(frozen=True)
class PrefillSample:
    """One prompt on an idle engine: its uncached tokens, and its time to first token (its prefill steps)."""

    uncached_tokens: int
    ttft_s: float


@dataclass(frozen=True)
class DecodeSample:
    """A window in which ``batch`` requests decoded together: the mean KV fraction in use over it, and the mean
    time per decode step."""

    kv_usage: float
    step_s: float
    batch: int


@dataclass(frozen=True)
class TermFit:
    """Three coefficients (ms) and how well they fit: relative residuals over the samples."""

    a: float
    b: float
    c: float
    samples: int
    rms_relative_residual: float
    max_relative_residual: float

    def as_dict(self) -> dict[str, float | int]:
        return {"a": self.a, "b": self.b, "c": self.c, "samples": self.samples,
                "rms_relative_residual": round(self.rms_relative_residual, 5),
                "max_relative_residual": round(self.max_relative_residual, 5)}


@dataclass(frozen=True)
class Calibration:
    timing: StepTiming
    step_token_budget: int | None  # None: larger than every prompt measured (not seen)
    prefill: TermFit
    decode: TermFit


def prefill_chunks(tokens: int, budget: int | None) -> list[int]:
    """The chunks an idle engine prefills ``tokens`` in: full ``budget``-sized ones, then the rest."""
    if budget is None or tokens <= budget:
        return [tokens] if tokens > 0 else []
    full, rest = divmod(tokens, budget)
    return [budget] * full + ([rest] if rest else [])


def prefill_ms(timing: StepTiming, tokens: int, budget: int | None) -> float:
    """What the shape says an idle engine takes to prefill ``tokens``: the sum of its chunks' steps."""
    return sum(timing.prefill_ms(x) for x in prefill_chunks(tokens, budget))


def _solve(rows: np.ndarray, y: np.ndarray, nonnegative: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Least squares on relative errors: each row scaled by 1/y. The coefficients, and the relative residuals.
    ``nonnegative``: no coefficient below 0 (a prefill's cost cannot shrink with its tokens): one that comes out
    negative is held at 0 and the others refitted, until none does."""
    w = 1.0 / y
    scaled = rows * w[:, None]
    free = np.ones(rows.shape[1], dtype=bool)
    coef = np.zeros(rows.shape[1])
    while free.any():
        sol, *_ = np.linalg.lstsq(scaled[:, free], np.ones_like(y), rcond=None)
        coef[:] = 0.0
        coef[free] = sol
        if not nonnegative or (coef >= 0).all():
            break
        free &= coef > 0
    return coef, rows @ coef / y - 1.0


def _term(coef: np.ndarray, rel: np.ndarray) -> TermFit:
    return TermFit(float(coef[0]), float(coef[1]), float(coef[2]), len(rel), float(np.sqrt(np.mean(rel * rel))),
                   float(np.max(np.abs(rel))))


def _prefill_rows(samples: Sequence[PrefillSample], budget: int | None) -> np.ndarray:
    rows = []
    for s in samples:
        chunks = prefill_chunks(s.uncached_tokens, budget)
        rows.append((sum(x * x for x in chunks), sum(chunks), len(chunks)))
    return np.array(rows, dtype=float)


def fit_prefill(samples: Sequence[PrefillSample], budget: int | None = None) -> tuple[TermFit, int | None]:
    """The prefill coefficients, and the budget: ``budget`` as given, else the candidate that fits best."""
    usable = [s for s in samples if s.uncached_tokens > 0 and s.ttft_s > 0]
    if len(usable) < 3 or len({s.uncached_tokens for s in usable}) < 3:
        raise ValueError("the prefill fit needs prompts of at least three different lengths")
    y = np.array([s.ttft_s * 1000.0 for s in usable])
    if budget is not None:
        coef, rel = _solve(_prefill_rows(usable, budget), y, nonnegative=True)
        return _term(coef, rel), budget
    longest = max(s.uncached_tokens for s in usable)
    unchunked = _solve(_prefill_rows(usable, None), y, nonnegative=True)
    best: tuple[float, int | None, np.ndarray, np.ndarray] = (float(unchunked[1] @ unchunked[1]), None, *unchunked)
    for candidate in range(BUDGET_STEP, longest, BUDGET_STEP):
        coef, rel = _solve(_prefill_rows(usable, candidate), y, nonnegative=True)
        sse = float(rel @ rel)
        if sse < best[0] * (1 - 1e-9):
            best = (sse, candidate, coef, rel)
    # a budget is found only where chunking explains the data clearly better than one step per prompt: on a noisy
    # engine some candidate always fits the noise a little better (one step's few ms are within it)
    if best[1] is not None and best[0] > BUDGET_EVIDENCE * float(unchunked[1] @ unchunked[1]):
        best = (float(unchunked[1] @ unchunked[1]), None, *unchunked)
    _, found, coef, rel = best
    return _term(coef, rel), found


def fit_decode(samples: Sequence[DecodeSample]) -> TermFit:
    usable = [s for s in samples if s.step_s > 0 and 0 <= s.kv_usage <= 1]
    if len(usable) < 3 or len({round(s.kv_usage, 3) for s in usable}) < 3:
        raise ValueError("the decode fit needs windows at three different KV loads at least")
    p = np.array([s.kv_usage for s in usable])
    coef, rel = _solve(np.column_stack((p * p, p, np.ones_like(p))), np.array([s.step_s * 1000.0 for s in usable]))
    return _term(coef, rel)


def calibrate(prefill: Sequence[PrefillSample], decode: Sequence[DecodeSample], budget: int | None = None,
              load_back_ms_per_token: float | None = None) -> Calibration:
    """Both fits, as the timing the router and the simulator read. The CPU-tier load-back is not measured here:
    it keeps the value given (or the default)."""
    pf, found = fit_prefill(prefill, budget)
    df = fit_decode(decode)
    lb = StepTiming().load_back_ms_per_token if load_back_ms_per_token is None else load_back_ms_per_token
    return Calibration(StepTiming(pf.a, pf.b, pf.c, df.a, df.b, df.c, lb), found, pf, df)


def kv_usage_over(batch: int, prompt_tokens: int, first: int, last: int, block_size: int, num_blocks: int) -> float:
    """The mean KV fraction ``batch`` requests of ``prompt_tokens`` hold while they decode their tokens ``first``
    to ``last`` (each request's blocks: its prompt and the tokens generated so far, rounded up to blocks)."""
    if last < first or num_blocks <= 0:
        raise ValueError("kv_usage_over: an empty window, or no blocks")
    blocks = [math.ceil((prompt_tokens + j) / block_size) for j in range(first, last + 1)]
    return batch * (sum(blocks) / len(blocks)) / num_blocks
