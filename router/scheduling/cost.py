"""Estimated time to first token on each candidate: what a prefix hit saves versus what the queue costs.

    ttft = queue wait + prefill(uncached tokens) + load-back(CPU/storage hits) + decode interference

- queue wait: prefill work already sent to the worker and not yet done (router accounting), or the engine's
  own waiting count when that says more (other routers also feed it). Engines batch prefills: pending work
  and this request's share steps of up to ``step_token_budget`` tokens, so the wait is what prefilling
  pending + own tokens costs beyond prefilling its own tokens alone, not a sum of per-request steps;
- prefill: the same quadratic-in-tokens shape as the engine (attention is quadratic), default calibrated to
  the engine model's timing (Dynamo's mocker fit);
- GPU hits are free; CPU-tier hits cost a load-back per token, storage hits more;
- running decodes share every step: a small per-request term;
- memory: when the KV blocks this request needs do not fit beside those the requests in flight hold, the
  engine admits it only as some finish (``memory_wait_s``, from the router's accounting: ``LoadTracker``).
A per-worker exponentially weighted factor learns how far observed TTFTs sit from these estimates.

The score adds what this request costs the others: its prefill stalls every decode running on that worker
for the prefill's length (``interference_s = running * prefill``), weighted by ``interference_weight``; and
the prefill compute itself, weighted by ``compute_weight``: two cold copies of one prefix finish no sooner
than one copy and a cache hit, but burn twice the GPU time (a burst of one new prefix stays together);
and, weighted by ``eviction_weight``, the cached tokens it pushes out, at their prefill price (the fleet pays
it again when they are asked for): the new tokens beyond the worker's free room (capacity minus what the
index says it holds: while caches fill, new prefixes go where they evict nothing and stay spread evenly
instead of thrashing one cache), plus, for a second copy of a prefix another worker holds, that copy scaled
by how full this cache is (a full fleet holds one prefix fewer for every duplicate).
Minimising TTFT alone piles conversations onto their holders and stretches everyone's end-to-end latency;
the interference term keeps cheap (cached) prefills on the holder and sends expensive cold ones where
fewer decodes would wait for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from router.index import PrefixMatch
from router.load import EngineMetrics, WorkerLoad
from router.scheduling.types import hit_tokens


@dataclass(frozen=True)
class CostParams:
    prefill_s_per_token: float = 1.518e-5
    prefill_s_per_token_sq: float = 4.21e-10
    prefill_step_s: float = 0.0165
    step_token_budget: int = 8192  # the engines' max_num_batched_tokens
    load_back_s_per_token: float = 1e-6  # CPU tier -> GPU
    storage_s_per_token: float = 5e-6  # storage tier -> GPU
    decode_s_per_running: float = 2e-4
    decode_step_s: float = 0.03  # a decode step of a busy engine: how fast requests in flight finish
    interference_weight: float = 0.05
    compute_weight: float = 1.0
    eviction_weight: float = 5.0
    waiting_prompt_tokens: int = 2048  # assumed size of each engine-reported waiting request
    learn_rate: float = 0.1  # EWMA weight of each observed TTFT (0 disables learning)
    learn_min_predicted_s: float = 0.1  # learn only from TTFTs the model says are this long or longer
    learn_min: float = 0.25
    learn_max: float = 4.0

    @classmethod
    def from_dict(cls, data: dict[str, float]) -> CostParams:
        known = {f.name for f in fields(cls)}
        bad = set(data) - known
        if bad:
            raise ValueError(f"unknown cost parameters {sorted(bad)}; known: {sorted(known)}")
        return cls(**data)


@dataclass(slots=True)
class Estimate:
    queue_s: float
    prefill_s: float
    decode_s: float
    uncached_tokens: int
    interference_s: float = 0.0  # decode time this prefill takes from requests already running there
    interference_weight: float = 0.0
    compute_weight: float = 0.0
    eviction_s: float = 0.0  # prefill value of the cached tokens this request would push out
    eviction_weight: float = 0.0

    @property
    def ttft_s(self) -> float:
        return self.queue_s + self.prefill_s + self.decode_s

    @property
    def score(self) -> float:
        return (self.ttft_s + self.interference_weight * self.interference_s + self.compute_weight * self.prefill_s
                + self.eviction_weight * self.eviction_s)


@dataclass
class CostModel:
    params: CostParams = field(default_factory=CostParams)
    scale: dict[str, float] = field(default_factory=dict)  # learned per worker

    def prefill_s(self, tokens: int) -> float:
        """Time to prefill ``tokens`` in as few steps as the token budget allows."""
        p = self.params
        if tokens <= 0:
            return 0.0
        steps = -(-tokens // max(p.step_token_budget, 1))
        per_step_sq = p.prefill_s_per_token_sq * tokens * tokens / steps  # attention is quadratic within a step
        return steps * p.prefill_step_s + p.prefill_s_per_token * tokens + per_step_sq

    def estimate(self, worker_id: str, prompt_tokens: int, block_size: int, match: PrefixMatch | None,
                 load: WorkerLoad | None, metrics: EngineMetrics | None, duplicate_tokens: int = 0,
                 resident_tokens: int = 0, capacity_tokens: int | None = None,
                 memory_wait_s: float = 0.0) -> Estimate:
        """``duplicate_tokens``: of this prompt, what another candidate already caches and this one would
        prefill again; ``resident_tokens`` / ``capacity_tokens``: what this worker's cache holds (by the
        index) and can hold (None: unknown, no eviction cost); ``memory_wait_s``: until requests in flight
        free room for this one's blocks (0 when it fits)."""
        p = self.params
        gpu = cpu = storage = 0
        if match is not None:
            gpu, cpu, storage = match.gpu * block_size, match.cpu * block_size, match.storage * block_size
        hit = hit_tokens((gpu + cpu + storage) // block_size, block_size, prompt_tokens)
        uncached = prompt_tokens - hit
        pending = load.pending_prefill_tokens if load else 0
        if metrics is not None and metrics.waiting is not None:
            # the engine's waiting count includes ours (known exactly); only the excess is other routers' work
            ours = (load.requests - load.decoding) if load else 0
            pending += max(0, int(metrics.waiting) - ours) * p.waiting_prompt_tokens
        own = self.prefill_s(uncached)
        queue = self.prefill_s(pending + uncached) - own if pending else 0.0  # batched with what is pending
        prefill = own + cpu * p.load_back_s_per_token + storage * p.storage_s_per_token
        running = load.decoding if load else 0
        if metrics is not None and metrics.running is not None:
            running = max(running, int(metrics.running))  # running includes ours: the larger count wins
        decode = running * p.decode_s_per_running
        k = self.scale.get(worker_id, 1.0)
        eviction = 0.0
        if capacity_tokens:
            overflow = uncached - max(0, capacity_tokens - resident_tokens)
            fullness = min(1.0, resident_tokens / capacity_tokens)
            eviction = self.prefill_s(overflow) + fullness * self.prefill_s(min(duplicate_tokens, uncached))
        return Estimate(queue * k + memory_wait_s, prefill * k, decode * k, uncached, running * prefill * k,
                        p.interference_weight, p.compute_weight, eviction * k, p.eviction_weight)

    def observe(self, worker_id: str, predicted_s: float | None, observed_s: float) -> None:
        """Fold one observed TTFT into the worker's correction factor.

        Short predictions are skipped: their observed TTFT is mostly fixed overhead (HTTP, tokenizing, the
        first chunk), and a factor learned from cache hits would inflate every estimate of the holder.
        """
        p = self.params
        if not predicted_s or predicted_s < p.learn_min_predicted_s or observed_s <= 0 or p.learn_rate <= 0:
            return
        k = self.scale.get(worker_id, 1.0)
        raw = k * observed_s / predicted_s  # predicted already included k
        k = (1 - p.learn_rate) * k + p.learn_rate * raw
        self.scale[worker_id] = min(max(k, p.learn_min), p.learn_max)
