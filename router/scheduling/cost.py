"""The routing objective: the seconds of user-visible latency a choice costs, everyone's, in one unit.

For a request and a candidate worker, with ``p0`` the worker's KV fraction in use (the router's accounting, or
the engine's own ``kv_usage`` when that says more) and ``p1`` that fraction once this request's new blocks are
added (the prompt blocks no request in flight there shares, its partial block and its output):

    own TTFT   = queue + batch wait + prefill(uncached) + load-back + memory wait beyond the batch wait
    own decode = max_tokens x step(p1)
    stall      = running x (prefill steps - the decode steps they replace)   (its prefill holds every decode there)
    slowdown   = others' remaining output x (step(p1) - step(p0))          (its KV slows their every step)
    eviction   = P(reuse) x prefill(cached tokens it pushes out)            (the fleet pays them again if asked)
    behind     = requests waiting there x what its prefill adds to theirs   (each of them waits that much longer)
    preemption = P(its decode runs out of blocks) x its recompute           (the engine preempts the latest first)
    score      = own TTFT + own decode + stall + slowdown + eviction + behind + preemption

- queue: prefill already sent there and not done (router accounting; the engine's waiting count when it says
  more: other routers feed it too). Engines batch prefill in steps of up to ``step_token_budget`` tokens, so the
  wait is what prefilling pending + own tokens costs beyond its own alone;
- batch wait: an engine runs at most so many requests at once (``max_num_seqs``), and the rest
  wait for a running one to finish: the requests there beyond that limit (the engine's running and waiting
  counts with the router's own brought up to now, or the router's own when they are more) each wait for one
  to end, and its places free one every (a request's decode) / (limit) on average, so it waits that long per
  request ahead of it (``slot_steps``: decode steps; the limit is learned from the engine's own counts,
  router/load/metrics.py ``BatchLimit``);
- a prefill step beside running decodes lasts at least their decode step (``max(prefill, decode)``);
- GPU hits are free; CPU-tier hits cost a load-back per token, storage-tier hits more;
- memory wait, as the engine admits (workers/engine/engine.py ``_admit``, vLLM's scheduler): a waiting request
  starts once its prompt's new blocks fit in the blocks free NOW, after those other routers' requests waiting
  ahead of it take and the engine's watermark (``admission_lack``); the blocks in use now are the engine's own
  ``kv_usage`` where fresh (brought up to now by ``FleetState.engine_view``), else the router's in-flight
  prompts and the output they have generated so far (``blocks_in_use``). Not every request's blocks to its
  last token: a running request grows one token a step, and when decode runs out of blocks the engine preempts
  the latest request (recompute), which is the preemption term, not a wait. When it lacks blocks, it waits
  until enough requests in flight end; both waits are for requests ending there, so only the memory wait
  beyond the batch wait adds;
- behind: the requests waiting there now (the engine's count with the router's own brought up to now, or the
  router's own when more; and a share of those flow control holds) each wait for its prefill's compute: what
  adding its uncached tokens to the prefill queued there costs (``prefill(pending + own) - prefill(pending)``).
  The count now stands for the count behind it when it runs (a queue leaves behind a departing request, in
  distribution, what an arriving one finds). So a cache hit's saved compute counts once for itself and once
  for each request waiting: locality under load follows from the seconds, not from a weight;
- preemption: the blocks the requests there hold at their last tokens (the larger of their footprint and what
  is in use now) plus its own beyond the capacity are what decode will lack; the engine preempts the latest
  admitted first, this request, so the fraction of its blocks that overflow is the chance it is preempted, and
  it then recomputes its prompt and the output it had (``remaining_fraction`` of it), priced as a prefill;
- P(reuse): the fraction of evicted blocks the fleet is later asked for again (``ReuseTracker``, learned from
  the events and the requests; a prior until then); the pushed-out tokens are what it stores anew (uncached
  prompt and output) beyond the free room
  (capacity minus what the index says the cache holds), so a second copy of a prefix in a full fleet pays for
  the prefix it evicts, and while caches fill nothing is priced.

Every term is seconds some request waits, so the terms add with no weights. Step costs come from the worker's
``EngineProfile``: the timing shape (``StepTiming``, one place) corrected online by robust fits of its observed
TTFTs and inter-token times. The only assumed quantities are named parameters below (``remaining_fraction``:
on average half of a request in flight's output is still to come; ``waiting_prompt_tokens``: the size of a
request the engine reports waiting that this router did not send).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any

import numpy as np

from router.index import PrefixMatch
from router.load import EngineMetrics, WorkerLoad
from router.scheduling.engine_profile import DEFAULT_TIMING, EngineProfile, RobustLine, StepTiming
from router.scheduling.scalar_ops import SCALAR_OPS


@dataclass(frozen=True)
class CostParams:
    prefill_a: float = DEFAULT_TIMING.prefill_a  # the engines' step timing until their fits learn (StepTiming)
    prefill_b: float = DEFAULT_TIMING.prefill_b
    prefill_c: float = DEFAULT_TIMING.prefill_c
    decode_a: float = DEFAULT_TIMING.decode_a
    decode_b: float = DEFAULT_TIMING.decode_b
    decode_c: float = DEFAULT_TIMING.decode_c
    load_back_ms_per_token: float = DEFAULT_TIMING.load_back_ms_per_token
    storage_ms_per_token: float = 0.005  # storage tier -> GPU
    step_token_budget: int = 8192  # the engines' max_num_batched_tokens
    # loading a LoRA adapter a worker does not hold (router/scheduling/lora.py): tens of ms from the engine's CPU
    # cache, more from disk; the router's prior for every adapter
    lora_load_ms: float = 30.0
    remaining_fraction: float = 0.5  # of a request in flight's output, the part still to come, on average
    waiting_prompt_tokens: int = 2048  # assumed size of each engine-reported waiting request we did not send
    reuse_prior: float = 0.5  # P(an evicted block is asked for again) until the fleet has shown it
    # the fraction of the KV blocks an engine keeps free when it admits a request (vLLM v0's watermark, 0.01 by
    # default); the simulated engine keeps none (workers/engine/engine.py ``_admit``)
    kv_watermark: float = 0.0
    # how the decode time the KV load decides (its own decode, the slowdown its KV brings the others) counts
    # against the rest: 1, every second alike (the whole latency); 0, TTFT first (docs/benchmarks.md: the
    # sensitivity table; the ``precise_ttft`` profile)
    kv_load_weight: float = 1.0
    learn: bool = True  # fit each worker's TTFT and inter-token time online (False: the timing as given)
    fit_window: int = 256  # samples each fit keeps
    fit_prior_samples: float = 4.0  # how many samples' worth the timing defaults weigh in each fit

    @classmethod
    def from_dict(cls, data: dict[str, float]) -> CostParams:
        known = {f.name for f in fields(cls)}
        bad = set(data) - known
        if bad:
            raise ValueError(f"unknown cost parameters {sorted(bad)}; known: {sorted(known)}")
        return cls(**data)

    @cached_property  # (read by every pricing of a candidate; the params are frozen)
    def timing(self) -> StepTiming:
        return StepTiming(self.prefill_a, self.prefill_b, self.prefill_c, self.decode_a, self.decode_b,
                          self.decode_c, self.load_back_ms_per_token)


def slot_steps(xp: Any, limited: Any, waiting: Any, running: Any, requests: Any, output_tokens: Any, limit: Any,
               max_tokens: int) -> Any:
    """The decode steps a request waits for a place in the engine's batch (arrays with ``xp`` numpy, one
    worker's numbers with ``SCALAR_OPS``; 0 where ``limited`` is false: no limit known, or no fresh counts).

    The engine holds ``max(requests, waiting + running)`` requests (its counts with the router's own brought
    up to now, ``FleetState.engine_view``; the router's in flight when they are more: the larger evidence,
    never both added), of which ``limit`` run; each one beyond waits for a running one to end. A place frees
    once per request's decode (``output_tokens`` / ``requests``: the mean ``max_tokens`` of the router's in
    flight there, this request's own where it has none), ``limit`` places at once: one frees every
    (its decode) / ``limit``, and this request waits that long for each request ahead of it."""
    total = xp.maximum(requests, xp.trunc(xp.where(limited, waiting, 0.0)) + xp.trunc(xp.where(limited, running, 0.0)))
    ahead = xp.maximum(0.0, total - limit)
    per_request = xp.where(requests > 0, output_tokens / xp.maximum(requests, 1.0), max_tokens)
    return xp.where(limited, ahead / xp.where(limited, limit, 1.0) * per_request, 0.0)


def blocks_in_use(xp: Any, known_kv: Any, kv: Any, cap: Any, active: Any, output_tokens: Any, block_size: int,
                  remaining_fraction: float) -> Any:
    """The KV blocks a worker's requests hold now (arrays with ``xp`` numpy, one worker's numbers with
    ``SCALAR_OPS``): what the engine admits against. Its own ``kv_usage`` where fresh (``known_kv``: the ground
    truth, with the router's dispatches and completions since the scrape brought in, ``FleetState.engine_view``);
    else the router's in-flight footprint (``active``: prompts and every output to its last token) less the
    output still to come (``remaining_fraction`` of their ``max_tokens``), since a running request holds its
    prompt and what it has generated so far, not its last token's blocks."""
    own = xp.maximum(0.0, active - remaining_fraction * output_tokens / block_size)
    return xp.where(known_kv, kv * cap, own)


def admission_lack(xp: Any, cap: Any, used: Any, pending: Any, admit: Any, block_size: int, watermark: float
                   ) -> Any:
    """The KV blocks a request lacks to be admitted (whole blocks; <= 0: it is admitted as its turn comes), by the
    engine's rule
    (workers/engine/engine.py ``_admit``; vLLM's scheduler): its prompt's new blocks (``admit``: those no request
    in flight holds, and its partial block; its output's come a token at a time as it decodes) against the blocks
    free now (capacity less those in use), less what the prompts queued ahead of it and not among those take
    first (``pending`` tokens: the engine admits in order) and the watermark it keeps free."""
    return xp.ceil(admit - (cap - used - xp.ceil(pending / block_size) - watermark * cap))


def preempt_fraction(xp: Any, known: Any, final: Any, new: Any, cap: Any, watermark: float) -> Any:
    """The chance its decode is preempted: the blocks the requests there hold at their last tokens (``final``) and
    its own (``new``) beyond what the engine may fill are what decode runs out of; the engine preempts the latest
    admitted first, and that is this request, so the fraction of its blocks that overflow (0 with the capacity
    unknown)."""
    over = final + new - (cap - watermark * cap)
    return xp.where(known, xp.minimum(xp.maximum(over / xp.maximum(new, 1.0), 0.0), 1.0), 0.0)


def prompt_blocks_to_admit(prompt_tokens: int, n_keys: int, block_size: int) -> int:
    """A request's partial last prompt block (0 or 1): admitted with its full prompt blocks (``n_keys``)."""
    return max(0, -(-(prompt_tokens - n_keys * block_size) // block_size))


@dataclass(slots=True)
class Estimate:
    queue_s: float  # waiting for the prefill ahead of it, for a place in the batch and for memory
    prefill_s: float  # its own prefill and load-back
    decode_s: float  # its own decode: max_tokens steps at the KV load it brings
    uncached_tokens: int
    stall_s: float = 0.0  # decode time its prefill steps take from the requests running there
    slowdown_s: float = 0.0  # decode time its KV adds to their remaining steps
    eviction_s: float = 0.0  # expected re-prefill of the cached tokens it pushes out
    kv_load_weight: float = 1.0  # how the KV-load terms (own decode, slowdown) count against the rest
    step_s: float = 0.0  # the decode step it will see (s per output token)
    # own TTFT by the timing shape alone, before this worker's fit: what the fit learns on, and only when nothing
    # is queued ahead of it (0 then): a queue estimate's error depends on the load, and a fit that learned it
    # would make busy workers look fast and draw more load to them
    model_ttft_s: float = 0.0
    model_step_s: float = 0.0  # the decode step by the shape alone
    batch_wait_s: float = 0.0  # the part of ``queue_s`` spent waiting for a place in the engine's batch
    behind_s: float = 0.0  # what its prefill adds to the wait of the requests waiting there (each of them)
    preempt_s: float = 0.0  # its expected recompute when decode runs out of blocks there

    @property
    def ttft_s(self) -> float:
        return self.queue_s + self.prefill_s

    @property
    def interference_s(self) -> float:
        """What it costs the requests already there."""
        return self.stall_s + self.slowdown_s

    @property
    def score(self) -> float:
        return (self.queue_s + self.prefill_s + self.stall_s + self.eviction_s + self.behind_s
                + self.kv_load_weight * (self.decode_s + self.slowdown_s + self.preempt_s))


@dataclass(slots=True)
class Estimates:
    """``Estimate``'s terms for every candidate of a decision, as arrays in the candidates' order."""

    queue_s: np.ndarray
    prefill_s: np.ndarray
    decode_s: np.ndarray
    uncached_tokens: np.ndarray
    stall_s: np.ndarray
    slowdown_s: np.ndarray
    eviction_s: np.ndarray
    kv_load_weight: float
    step_s: np.ndarray
    model_ttft_s: np.ndarray
    model_step_s: np.ndarray
    batch_wait_s: np.ndarray
    behind_s: np.ndarray
    preempt_s: np.ndarray

    def scores(self, kv_load_weight: float | None = None) -> np.ndarray:
        w = self.kv_load_weight if kv_load_weight is None else kv_load_weight
        return (self.queue_s + self.prefill_s + self.stall_s + self.eviction_s + self.behind_s
                + w * (self.decode_s + self.slowdown_s + self.preempt_s))

    def row(self, i: int) -> Estimate:
        return Estimate(float(self.queue_s[i]), float(self.prefill_s[i]), float(self.decode_s[i]),
                        int(self.uncached_tokens[i]), float(self.stall_s[i]), float(self.slowdown_s[i]),
                        float(self.eviction_s[i]), self.kv_load_weight, float(self.step_s[i]),
                        float(self.model_ttft_s[i]), float(self.model_step_s[i]), float(self.batch_wait_s[i]),
                        float(self.behind_s[i]), float(self.preempt_s[i]))


_COLUMNS = ("gpu", "cpu", "storage", "pending", "running", "others_left", "inflight", "cap_blocks", "used", "kv",
            "new_blocks", "resident", "memory_wait", "ttft_slope", "decode_slope", "slot_steps", "behind")


class Columns:
    """What the objective reads of each candidate: ``add`` per candidate gathers one row, the columns are read
    as arrays (one conversion of every row at once: a thousand candidates cost one ``np.array``, not fifteen
    lists grown one item at a time)."""

    __slots__ = ("_arrays", "block_size", "max_tokens", "prompt_tokens", "rows")

    def __init__(self, prompt_tokens: int, block_size: int, max_tokens: int) -> None:
        self.prompt_tokens, self.block_size, self.max_tokens = prompt_tokens, block_size, max_tokens
        self.rows: list[tuple[float, ...]] = []  # one per candidate, in ``_COLUMNS`` order
        self._arrays: np.ndarray | None = None

    def __getattr__(self, name: str) -> np.ndarray:
        """A column as a float array (``cols.gpu``...), every candidate's value in order."""
        try:
            i = _COLUMNS.index(name)
        except ValueError:
            raise AttributeError(name) from None
        if self._arrays is None or self._arrays.shape[1] != len(self.rows):
            self._arrays = (np.array(self.rows, dtype=float).T if self.rows
                            else np.zeros((len(_COLUMNS), 0), dtype=float))
        return self._arrays[i]

    def add(self, costs: CostModel, worker_id: str, match: PrefixMatch | None, load: WorkerLoad | None,
            metrics: EngineMetrics | None, new_blocks: int, resident_tokens: int, capacity_tokens: int | None,
            memory_wait_s: float, remaining_tokens: float | None = None, held_share: float = 0.0) -> None:
        p = costs.params
        w = worker_numbers(p, load, metrics, self.max_tokens, capacity_tokens, self.block_size)
        # over its decode, the requests there now end as it runs (``remaining_fraction`` of theirs to come)
        others_left = p.remaining_fraction * w.output if remaining_tokens is None else remaining_tokens
        prof = costs.profile(worker_id)
        g, c, st = (0, 0, 0) if match is None else (match.gpu, match.cpu, match.storage)
        self.rows.append((g, c, st, w.pending, w.running, others_left, max(w.requests, w.running), w.cap, w.used,
                          w.kv, new_blocks, resident_tokens, memory_wait_s, prof.ttft.slope, prof.decode.slope,
                          w.slots, w.waiting + held_share))


@dataclass(slots=True)
class WorkerNumbers:
    """What the objective reads of one worker's load and fresh metrics (``worker_numbers``)."""

    pending: float  # prefill tokens queued there: the router's own, and other routers' waiting requests
    others: float  # of those, other routers' (their prompts are not in ``used``)
    running: float
    requests: float  # the router's own in flight
    output: float  # their max_tokens
    active: float  # the blocks the router's own hold at their last tokens
    cap: float  # KV capacity in blocks (0: unknown)
    used: float  # blocks in use now (``blocks_in_use``)
    kv: float
    slots: float  # decode steps it waits for a place in the batch (``slot_steps``)
    waiting: float  # requests waiting there: the engine's count or the router's own, the larger


def worker_numbers(p: CostParams, load: WorkerLoad | None, metrics: EngineMetrics | None, max_tokens: int,
                   capacity_tokens: int | None, block_size: int) -> WorkerNumbers:
    """One worker's numbers as the objective reads them (``latency_cost._inputs``' rules, for one worker): the
    router's accounting with the engine's fresh counts where they say more (other routers feed it too)."""
    if load is None:
        pending = running = requests = ours = output = 0
        active = 0.0
    else:
        pending, running, requests = load.pending_prefill_tokens, load.decoding, load.requests
        ours, output, active = requests - running, load.output_tokens, float(load.active_blocks)
    kv = None
    slots = 0.0
    waiting = ours
    others = 0
    if metrics is not None:
        if metrics.waiting is not None and metrics.running is not None and metrics.batch_limit:
            slots = slot_steps(SCALAR_OPS, True, float(metrics.waiting), float(metrics.running), float(requests),
                               float(output), float(metrics.batch_limit), max_tokens)
        if metrics.waiting is not None:
            # the engine's waiting count includes ours (known exactly); only the excess is other routers' work
            others = max(0, int(metrics.waiting) - ours) * p.waiting_prompt_tokens
            pending += others
            waiting = max(ours, int(metrics.waiting))
        if metrics.running is not None:
            running = max(running, int(metrics.running))  # running includes ours: the larger count wins
        kv = metrics.kv_usage
    cap = capacity_tokens // block_size if capacity_tokens else 0
    used = blocks_in_use(SCALAR_OPS, cap > 0 and kv is not None, kv or 0.0, float(cap), active, float(output),
                         block_size, p.remaining_fraction)
    return WorkerNumbers(pending, others, running, requests, output, active, cap, used, kv or 0.0, slots, waiting)


@dataclass
class CostModel:
    params: CostParams = field(default_factory=CostParams)
    profiles: dict[str, EngineProfile] = field(default_factory=dict)  # per worker, once it has taught something
    changed: set[str] = field(default_factory=set)  # workers whose profile may have changed (the fleet's columns)

    def __post_init__(self) -> None:
        self._default = self._new_profile()  # what a worker not observed yet is priced by (never fitted)

    def _new_profile(self) -> EngineProfile:
        p = self.params
        return EngineProfile(p.timing, p.step_token_budget,
                             RobustLine(window=p.fit_window, prior_samples=p.fit_prior_samples, fit_intercept=False),
                             RobustLine(window=p.fit_window, prior_samples=p.fit_prior_samples, fit_intercept=False))

    def profile(self, worker_id: str) -> EngineProfile:
        """The worker's fitted profile, or the timing as given for one not observed yet (a query: creates none)."""
        return self.profiles.get(worker_id) or self._default

    def _learning(self, worker_id: str) -> EngineProfile:
        self.changed.add(worker_id)  # what it learns next may move its fit
        prof = self.profiles.get(worker_id)
        if prof is None:
            prof = self.profiles[worker_id] = self._new_profile()
        return prof

    def forget(self, worker_id: str) -> None:
        self.changed.add(worker_id)
        self.profiles.pop(worker_id, None)

    def prefill_s(self, tokens: int, worker_id: str | None = None) -> float:
        """Seconds to prefill ``tokens`` alone on an idle worker (the default profile when none is named)."""
        prof = self.profile(worker_id) if worker_id else self._default
        model, _ = prof.prefill_s(tokens)
        return prof.ttft.slope * model if model else 0.0

    def estimate(self, worker_id: str, prompt_tokens: int, block_size: int, match: PrefixMatch | None,
                 load: WorkerLoad | None, metrics: EngineMetrics | None, *, max_tokens: int = 0,
                 new_blocks: int = 0, resident_tokens: int = 0, capacity_tokens: int | None = None,
                 memory_wait_s: float = 0.0, reuse: float | None = None,
                 remaining_tokens: float | None = None, held_share: float = 0.0) -> Estimate:
        """One candidate's terms (``estimate_many`` of one). ``new_blocks``: the KV blocks this request adds
        there (its prompt blocks no request in flight shares, its partial block and output); ``resident_tokens``
        / ``capacity_tokens``: what the GPU cache holds (by the index) and can hold (None: unknown, so no
        eviction or KV-load term); ``memory_wait_s``: until requests in flight free room for its blocks;
        ``reuse``: P(an evicted block is asked for again); ``remaining_tokens``: the output the requests there
        have still to generate, when known (else ``remaining_fraction`` of theirs); ``held_share``: the requests
        flow control holds that would wait behind it there."""
        cols = Columns(prompt_tokens, block_size, max_tokens)
        cols.add(self, worker_id, match, load, metrics, new_blocks, resident_tokens, capacity_tokens, memory_wait_s,
                 remaining_tokens, held_share)
        return self.estimate_many(cols, reuse).row(0)

    def memory_lack(self, prompt_tokens: int, n_keys: int, shared: int, block_size: int, load: WorkerLoad | None,
                    metrics: EngineMetrics | None, capacity_tokens: int | None) -> float:
        """The KV blocks a request lacks to be admitted on a worker now (``admission_lack`` on the worker's numbers;
        <= 0: none): ``n_keys`` full prompt blocks of which ``shared`` a request in flight there holds."""
        w = worker_numbers(self.params, load, metrics, 0, capacity_tokens, block_size)
        admit = n_keys - shared + prompt_blocks_to_admit(prompt_tokens, n_keys, block_size)
        return admission_lack(SCALAR_OPS, float(w.cap), w.used, float(w.others), float(admit), block_size,
                              self.params.kv_watermark)

    def estimate_many(self, cols: Columns, reuse: float | None = None) -> Estimates:
        """Every candidate's terms at once (numpy over the candidates: a decision over a thousand workers costs
        a few array operations, not a thousand function calls)."""
        return Estimates(*self.terms(np, cols, reuse))

    def terms(self, xp: Any, cols: Columns, reuse: float | None = None) -> tuple:
        """The objective's terms, in ``Estimates``' field order, of the candidates ``cols`` holds: arrays of them
        with ``xp`` numpy, or one candidate's floats with ``xp`` router/scheduling/scalar_ops.py's ``SCALAR_OPS``
        (``cols`` then holds that candidate's numbers). One formula for both, the same to the last bit."""
        p, t = self.params, self.params.timing
        bs, prompt, max_tokens = cols.block_size, cols.prompt_tokens, cols.max_tokens
        gpu, cpu = xp.asarray(cols.gpu, dtype=float), xp.asarray(cols.cpu, dtype=float)
        storage = xp.asarray(cols.storage, dtype=float)
        hit = xp.minimum((gpu + cpu + storage) * bs, max(prompt - 1, 0))
        uncached = prompt - hit
        pending = xp.asarray(cols.pending, dtype=float)
        running = xp.asarray(cols.running, dtype=float)
        others_left = xp.asarray(cols.others_left, dtype=float)
        inflight = xp.maximum(xp.asarray(cols.inflight, dtype=float), 1.0)
        overlap = xp.minimum(1.0, others_left / inflight / max_tokens) if max_tokens else xp.ones_like(pending)
        cap = xp.asarray(cols.cap_blocks, dtype=float)
        known = cap > 0
        safe_cap = xp.where(known, cap, 1.0)
        used = xp.asarray(cols.used, dtype=float)
        new = xp.asarray(cols.new_blocks, dtype=float)
        kv = xp.asarray(cols.kv, dtype=float)
        p0 = xp.where(known, used / safe_cap, kv)
        p1 = xp.where(known, (used + new) / safe_cap, kv)
        own_p = xp.where(known, (overlap * used + new) / safe_cap, kv)
        dk = xp.asarray(cols.decode_slope, dtype=float)
        k = xp.asarray(cols.ttft_slope, dtype=float)

        model_own_step = t.decode_s_array(own_p, xp)
        d0, d1, own_step = dk * t.decode_s_array(p0, xp), dk * t.decode_s_array(p1, xp), dk * model_own_step
        floor = xp.where(running > 0, d0, 0.0)
        budget = p.step_token_budget
        own, steps = t.prefill_s_array(uncached, budget, floor, xp)
        queue = xp.where(pending > 0, t.prefill_s_array(pending + uncached, budget, floor, xp)[0] - own, 0.0)
        load_back = (cpu * bs * t.load_back_ms_per_token + storage * bs * p.storage_ms_per_token) / 1000.0
        model_ttft = queue + own + load_back
        ttft = k * model_ttft
        queue_s = k * queue
        prefill_s = ttft - queue_s
        slot_steps = xp.asarray(cols.slot_steps, dtype=float)
        batch_wait = slot_steps * d0  # (d0: the decode step the requests there run at now, as fitted)
        stall = running * xp.maximum(0.0, k * own - steps * d0)
        # what the requests there will hold at their last tokens: those in use now and the output still to come
        final = used + others_left / bs
        if max_tokens:
            others_left = xp.minimum(others_left, running * max_tokens)  # slowed only while it decodes
        slowdown = others_left * (d1 - d0)
        share = p.reuse_prior if reuse is None else reuse
        overflow = uncached + max_tokens - xp.maximum(0.0, cap * bs - xp.asarray(cols.resident, dtype=float))
        overflow = xp.where(known, xp.maximum(overflow, 0.0), 0.0)
        eviction = share * k * t.prefill_s_array(overflow, budget, 0.0, xp)[0]  # their re-prefill, priced cold
        # each request waiting there waits for what its prefill (and load-back) adds to the prefill queued there
        alone = xp.where(pending > 0, t.prefill_s_array(pending, budget, floor, xp)[0], 0.0)
        behind = xp.asarray(cols.behind, dtype=float) * (k * (queue + own - alone + load_back))
        # decode running out of blocks preempts it (the latest admitted): its prompt and the output it had, again
        chance = preempt_fraction(xp, known, final, new, cap, p.kv_watermark)
        redo = t.prefill_s_array(uncached + p.remaining_fraction * max_tokens, budget, floor, xp)[0]
        preempt = chance * (k * redo)
        # the memory wait beyond the batch wait: both are for requests there to end
        queue_total = queue_s + batch_wait + xp.maximum(0.0, xp.asarray(cols.memory_wait, dtype=float) - batch_wait)
        # the shape's TTFT only where nothing is ahead of it (a queue's estimate is not what the fit learns)
        model_ttft = xp.where(pending > 0, 0.0, xp.where(slot_steps > 0, 0.0, model_ttft))
        return (queue_total, prefill_s, max_tokens * own_step, uncached, stall, slowdown, eviction, p.kv_load_weight,
                own_step, model_ttft, model_own_step, batch_wait, behind, preempt)

    # ---- learning ---------------------------------------------------------------------------------
    def observe_ttft(self, worker_id: str, model_s: float | None, observed_s: float) -> None:
        """One observed TTFT against the timing shape's prediction for it (``Estimate.model_ttft_s``)."""
        if self.params.learn and model_s and model_s > 0:
            self._learning(worker_id).ttft.add(model_s, observed_s)

    def observe_step(self, worker_id: str, model_step_s: float | None, observed_s: float) -> None:
        """One request's observed mean inter-token time against the model's decode step for it."""
        if self.params.learn and model_step_s and model_step_s > 0:
            self._learning(worker_id).decode.add(model_step_s, observed_s)
