"""``kv-pressure``: an example scorer kept outside the product package, loaded through config alone.

It prices how full each candidate's KV cache is, by the engine's own ``vllm:kv_cache_usage_perc``: a full
cache must evict (or preempt) to admit anything, so at equal latency the emptier worker is the better
place. The cost is ``seconds_when_full`` x usage (0 when the engine's metrics are unknown or stale).

Use it in the router's YAML::

    scheduling:
      version: 1
      imports: [docs/examples/kv_pressure_scorer.py]
      plugins:
        - {type: kv-pressure, name: pressure, parameters: {seconds_when_full: 0.5}}
      profiles:
        - name: precise-roomy
          plugins: [healthy, not-draining, in-subset, serves-model, admission,
                    {ref: latency-cost}, {ref: pressure, weight: 1.0}, {ref: min-score}]
    routing: {policy: precise-roomy}
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.scheduling.plugins.base import Scorer
from router.scheduling.plugins.registry import register
from router.scheduling.snapshot import Candidate, Snapshot


@dataclass(frozen=True)
class KvPressureParams:
    seconds_when_full: float = 0.5  # what a full cache costs a request, in seconds of latency


@register
class KvPressure(Scorer):
    type_name = "kv-pressure"
    Params = KvPressureParams

    def score(self, snap: Snapshot, cands: Sequence[Candidate]) -> list[float]:
        full = self.params.seconds_when_full
        return [full * (c.metrics.kv_usage or 0.0) if c.metrics is not None else 0.0 for c in cands]
