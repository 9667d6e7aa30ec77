"""Step timing of the engine model: prefill cost of *uncached* tokens, decode cost of KV in use.

The shape and its default calibration live in ``router.scheduling.engine_profile.StepTiming`` (the router's
cost model prices steps the same way): NVIDIA Dynamo's mocker polynomials (REFERENCE.md section 5), prefill
ms = 4.21e-7*T^2 + 1.518e-2*T + 16.5 (T = uncached tokens in the step), decode step ms = -25.74*p^2 + 54.01*p
+ 5.74 (p = fraction of KV blocks in use). A step with prefill work carries the
running decodes along, so it costs max(prefill, decode). CPU-tier hits cost a load-back per token.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from router.scheduling.engine_profile import StepTiming, read_timing_file


@dataclass(frozen=True)
class TimingModel(StepTiming):
    """The router's ``StepTiming`` (one shape, one set of defaults), with how a whole engine step adds up."""

    def step_ms(self, prefill_tokens: int, decode_reqs: int, kv_usage: float, load_back_tokens: int = 0) -> float:
        ms = self.prefill_ms(prefill_tokens)
        if decode_reqs:
            ms = max(ms, self.decode_ms(kv_usage))
        return ms + load_back_tokens * self.load_back_ms_per_token

    @classmethod
    def from_file(cls, path: str | Path) -> TimingModel:
        """Override any coefficient from a timing file (``read_timing_file``: YAML or JSON, unknown keys an
        error); its ``step_token_budget``, if any, is the engine's ``max_num_batched_tokens``, read by callers."""
        return cls(**read_timing_file(path).coefficients)

    def as_dict(self) -> dict[str, float]:
        return asdict(self)
