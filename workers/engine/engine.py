"""The one engine model: block pool + continuous-batching scheduler + timing. Pure, clock-agnostic.

``step(now)`` schedules one engine step (a token budget shared by decodes first, then chunked prefills,
then newly admitted requests), applies it, and returns how long it took, the KV events vLLM would publish
for it and the tokens it produced. The simulator advances a virtual clock by that duration; the live
simulated worker sleeps it (scaled). Neither forks this code.
"""

from __future__ import annotations

import enum
from array import array
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from router.events.codec import KvEvent
from workers.engine.block_pool import _MASK, _MIX, NONE_HASH, BlockPool, CachedBlock, engine_block_hash
from workers.engine.timing import TimingModel

_xxh3 = xxhash.xxh3_64_intdigest


@dataclass(frozen=True)
class EngineConfig:
    num_gpu_blocks: int = 2048
    block_size: int = 16
    cpu_blocks: int = 0
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int = 131072
    vocab_size: int = 32000
    timing: TimingModel = field(default_factory=TimingModel)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(eq=False)
class EngineRequest:
    request_id: str
    prompt: np.ndarray  # uint32 token ids (a list is converted)
    max_tokens: int
    cache_salt: str | None = None
    lora_name: str | None = None
    arrival: float = 0.0
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    block_tokens: list[bytes | memoryview] = field(default_factory=list)  # per full block, beside its hash
    num_cached_tokens: int | None = None  # prompt tokens served from cache, fixed at first admission
    load_back_tokens: int = 0
    # prefill/decode disaggregation: prompt tokens whose KV a prefill engine computed and sent here (full
    # blocks; the driver adds the request once the transfer has arrived); what of it was not cached here already
    # is admitted as received: stored in the pool (and published) without being computed
    remote_kv_tokens: int = 0
    external_tokens: int = 0  # prompt tokens received from the prefill engine at admission
    first_token_at: float | None = None
    finished_at: float | None = None
    status: Status = Status.WAITING
    _seed: int = 0
    _prompt_bytes: memoryview = field(init=False, repr=False)
    prompt_len: int = field(init=False)

    def __post_init__(self) -> None:
        self.prompt = np.asarray(self.prompt, dtype=np.uint32)
        self.prompt_len = len(self.prompt)
        self._prompt_bytes = memoryview(self.prompt.tobytes())
        self._seed = xxhash.xxh3_64_intdigest(self._prompt_bytes)

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + len(self.output)

    def token_bytes(self, start: int, end: int) -> bytes | memoryview:
        """Tokens [start, end) of prompt + output as uint32 bytes, without materialising the sequence."""
        n = len(self.prompt)
        if end <= n:
            return self._prompt_bytes[start * 4 : end * 4]
        tail = array("I", self.output[max(start - n, 0) : end - n]).tobytes()
        return tail if start >= n else bytes(self._prompt_bytes[start * 4 :]) + tail

    def extra(self, block_index: int) -> tuple[Any, ...] | None:
        base: tuple[Any, ...] = (self.lora_name,) if self.lora_name else ()
        if block_index == 0 and self.cache_salt:
            return (*base, self.cache_salt)
        return base or None

    def next_token(self, vocab: int) -> int:
        """Synthetic, deterministic in (prompt, position): same output cached or not, as at temperature 0."""
        return (self._seed + 2654435761 * (len(self.output) + 1)) % vocab

    def next_tokens(self, k: int, vocab: int) -> list[int]:
        """The next ``k`` tokens ``next_token`` would give, one after another (a long decode run's in one numpy
        pass: the same residues, taken term by term modulo ``vocab``)."""
        m, seed = len(self.output), self._seed
        if k < 32:
            return [(seed + 2654435761 * j) % vocab for j in range(m + 1, m + k + 1)]
        j = np.arange(m + 1, m + k + 1, dtype=np.int64) % vocab
        return ((seed % vocab + (2654435761 % vocab) * j) % vocab).tolist()


@dataclass(slots=True)  # not frozen: one is made per running request per step, and frozen ones build slowly
class TokenOutput:
    request: EngineRequest
    token: int
    first: bool
    finished: bool
    count: int = 1  # tokens this output stands for (several after a fast-forwarded decode run)


@dataclass(slots=True)
class StepResult:
    duration_s: float
    events: list[KvEvent]
    outputs: list[TokenOutput]
    prefill_tokens: int = 0
    decode_reqs: int = 0


@dataclass
class EngineStats:
    prefix_queries_tokens: int = 0
    prefix_hits_tokens: int = 0
    external_tokens: int = 0  # prompt tokens admitted as received from a prefill engine
    preemptions: int = 0
    steps: int = 0
    finished: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0


class EngineModel:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        c = self.config
        self.pool = BlockPool(c.num_gpu_blocks, c.block_size, c.cpu_blocks)
        self.timing = c.timing
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.stats = EngineStats()

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, req: EngineRequest) -> None:
        if not len(req.prompt):
            raise ValueError("empty prompt")
        if len(req.prompt) + req.max_tokens > self.config.max_model_len:
            raise ValueError(
                f"prompt ({len(req.prompt)}) + max_tokens ({req.max_tokens}) exceeds max_model_len "
                f"{self.config.max_model_len}"
            )
        need = -(-(len(req.prompt) + req.max_tokens) // self.config.block_size)
        if need > self.config.num_gpu_blocks:
            raise ValueError(f"request needs {need} KV blocks, the engine has {self.config.num_gpu_blocks}")
        self.waiting.append(req)

    def abort(self, req: EngineRequest) -> None:
        if req.status is Status.WAITING and req in self.waiting:
            self.waiting.remove(req)
        elif req.status is Status.RUNNING:
            self.running.remove(req)
            self.pool.free_blocks(req.block_ids)
            req.block_ids = []
        req.status = Status.ABORTED

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_usage(self) -> float:
        return self.pool.usage

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def take_events(self) -> list[KvEvent]:
        """Events not tied to a step (a prefix-cache reset while idle)."""
        return self.pool.take_events()

    # ---- hashing -----------------------------------------------------------------------------
    def _hashes_upto(self, req: EngineRequest, n_blocks: int) -> list[int]:
        bs = self.config.block_size
        hs = req.block_hashes
        if not req.lora_name and not req.cache_salt and len(hs) < n_blocks:
            # hot path (every admission hashes the whole prompt): engine_block_hash inlined
            step = bs * 4
            mv, out = req._prompt_bytes, req.block_tokens
            parent = hs[-1] if hs else NONE_HASH
            for i in range(len(hs), min(n_blocks, len(req.prompt) // bs)):
                data = mv[i * step : (i + 1) * step]
                parent = _xxh3(data, (parent * _MIX) & _MASK)
                hs.append(parent)
                out.append(data)
        while len(hs) < n_blocks:
            i = len(hs)
            data = req.token_bytes(i * bs, (i + 1) * bs)
            hs.append(engine_block_hash(hs[-1] if hs else None, data, req.extra(i)))
            req.block_tokens.append(data)
        return hs

    def _contents(self, req: EngineRequest, start: int, end: int) -> list[CachedBlock]:
        """What blocks [start, end) of a request hold, to cache or load them."""
        hs = self._hashes_upto(req, end)
        toks = req.block_tokens
        return [CachedBlock(hs[i], hs[i - 1] if i else None, toks[i], req.extra(i)) for i in range(start, end)]

    # ---- scheduling --------------------------------------------------------------------------
    def _blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.config.block_size)

    def _preempt(self, victim: EngineRequest) -> None:
        self.running.remove(victim)
        self.pool.free_blocks(victim.block_ids)
        victim.block_ids = []
        victim.num_computed = 0
        victim.status = Status.WAITING
        self.waiting.appendleft(victim)
        self.stats.preemptions += 1

    def _admit(self, req: EngineRequest, budget: int) -> tuple[int, int]:
        """Try to start a waiting request: (tokens scheduled, tokens loaded back from CPU); 0 = not admitted."""
        bs = self.config.block_size
        max_hit_blocks = (req.num_tokens - 1) // bs  # the last token is always computed
        hashes = self._hashes_upto(req, max_hit_blocks)
        gpu_hits, cpu_hits = self.pool.lookup(hashes)
        received = 0
        remote_blocks = min(req.remote_kv_tokens // bs, max_hit_blocks) if req.num_cached_tokens is None else 0
        if remote_blocks > len(gpu_hits):  # the transfer brings what the local cache lacks (CPU hits unused)
            cpu_hits = 0
            received = remote_blocks - len(gpu_hits)
        hit_blocks = len(gpu_hits) + cpu_hits + received
        cached = hit_blocks * bs
        n = min(req.num_tokens - cached, budget)
        new_blocks = self._blocks_for(cached + n) - hit_blocks
        free_after_touch = self.pool.num_free - sum(1 for b in gpu_hits if self.pool.blocks[b].ref_cnt == 0)
        if new_blocks + cpu_hits + received > free_after_touch:
            return 0, 0
        self.pool.touch(gpu_hits)
        loaded = self.pool.load_from_cpu(self._contents(req, len(gpu_hits), len(gpu_hits) + cpu_hits))
        arrived = self.pool.allocate(received)
        if received:  # the received blocks are full and final: cached (and published) like computed ones
            self.pool.cache_full_blocks(arrived, self._contents(req, len(gpu_hits), remote_blocks))
        req.block_ids = gpu_hits + loaded + arrived + self.pool.allocate(new_blocks)
        req.num_computed = cached
        if req.num_cached_tokens is None:
            req.num_cached_tokens = cached - received * bs
            req.external_tokens = received * bs
            self.stats.external_tokens += received * bs
            req.load_back_tokens = cpu_hits * bs
            self.stats.prefix_queries_tokens += len(req.prompt)
            self.stats.prefix_hits_tokens += cached
            self.stats.prompt_tokens += len(req.prompt)
        req.status = Status.RUNNING
        self.running.append(req)
        return n, cpu_hits * bs

    def _grow(self, req: EngineRequest, n: int) -> bool:
        """Make room for ``n`` more tokens, preempting lower-priority (later) requests, else ``req`` itself."""
        need = self._blocks_for(req.num_computed + n) - len(req.block_ids)
        while need > self.pool.num_free:
            if self.running[-1] is req:
                self._preempt(req)
                return False
            self._preempt(self.running[-1])
        if need > 0:
            req.block_ids += self.pool.allocate(need)
        return True

    def step(self, now: float, until: float | None = None) -> StepResult:
        """One engine step starting at ``now``.

        ``until``: the driver promises nothing will reach this engine before that time (the simulator knows
        its next arrival). A step that is pure decode may then fast-forward through several identical decode
        steps at once, stopping before ``until``, before any request finishes and before memory runs out;
        the result is the same as stepping one at a time, except that the KV events of the run are
        published once, at its end, and KV usage is taken as at its start.
        """
        c = self.config
        budget = c.max_num_batched_tokens
        scheduled: list[tuple[EngineRequest, int]] = []
        prefill_tokens = decode_reqs = load_back = 0
        bs, running_status = c.block_size, Status.RUNNING
        schedule = scheduled.append
        for req in list(self.running):  # a copy: _grow may preempt
            if budget <= 0:
                break
            if req.status is not running_status:
                continue  # preempted earlier in this loop
            computed = req.num_computed
            n = min(req.prompt_len + len(req.output) - computed, budget)  # num_tokens, inlined: hot
            if n <= 0:
                continue
            if computed + n > len(req.block_ids) * bs and not self._grow(req, n):
                continue
            schedule((req, n))
            budget -= n
            if n == 1 and req.output:
                decode_reqs += 1
            else:
                prefill_tokens += n
        while self.waiting and budget > 0 and len(self.running) < c.max_num_seqs:
            req = self.waiting[0]
            n, loaded = self._admit(req, budget)
            if n == 0:
                break
            self.waiting.popleft()
            schedule((req, n))
            load_back += loaded
            budget -= n
            if n == 1 and req.output:
                decode_reqs += 1
            else:
                prefill_tokens += n
        usage = self.pool.usage
        duration = self.timing.step_ms(prefill_tokens, decode_reqs, usage, load_back) / 1000.0
        if until is not None and not prefill_tokens and not self.waiting and decode_reqs == len(self.running):
            k = self._decode_run_length(now, until, duration)
            if k > 1:
                return self._decode_run(k, duration, now)
        end = now + duration
        outputs = self._apply(scheduled, end)
        self.stats.steps += 1
        return StepResult(duration, self.pool.take_events(), outputs, prefill_tokens, decode_reqs)

    def _decode_run_length(self, now: float, until: float, step_s: float) -> int:
        if step_s <= 0:
            return 1
        k = int(min((until - now) / step_s, 1e9))
        for r in self.running:
            left = r.max_tokens - len(r.output)
            if left < k:
                k = left
        if k <= 1:
            return 1
        # blocks for k tokens each (the first step's are already allocated by _grow)
        bs = self.config.block_size
        need = sum(-(-(r.num_computed + k) // bs) - len(r.block_ids) for r in self.running)
        return k if need <= self.pool.num_free else 1

    def _decode_run(self, k: int, step_s: float, now: float) -> StepResult:
        bs = self.config.block_size
        vocab = self.config.vocab_size
        outputs: list[TokenOutput] = []
        for req in list(self.running):
            extra = self._blocks_for(req.num_computed + k) - len(req.block_ids)
            if extra > 0:
                req.block_ids += self.pool.allocate(extra)
            before_full = req.num_computed // bs
            req.output += req.next_tokens(k, vocab)  # each step computes one token's KV, samples the next
            req.num_computed += k
            after_full = req.num_computed // bs
            if after_full > before_full:
                self.pool.cache_full_blocks(req.block_ids[before_full:after_full],
                                            self._contents(req, before_full, after_full))
            self.stats.generation_tokens += k
            done = len(req.output) >= req.max_tokens
            if done:
                self._finish(req, now + k * step_s)
            outputs.append(TokenOutput(req, req.output[-1], False, done, k))
        self.stats.steps += k
        return StepResult(k * step_s, self.pool.take_events(), outputs, 0, len(outputs))

    def _finish(self, req: EngineRequest, end: float) -> None:
        req.finished_at = end
        req.status = Status.FINISHED
        self.running.remove(req)
        self.pool.free_blocks(req.block_ids)
        self.stats.finished += 1

    def _apply(self, scheduled: list[tuple[EngineRequest, int]], end: float) -> list[TokenOutput]:
        bs = self.config.block_size
        vocab = self.config.vocab_size
        outputs: list[TokenOutput] = []
        add = outputs.append
        generated = 0
        for req, n in scheduled:
            before_full = req.num_computed // bs
            computed = req.num_computed = req.num_computed + n
            after_full = computed // bs
            if after_full > before_full:
                self.pool.cache_full_blocks(req.block_ids[before_full:after_full],
                                            self._contents(req, before_full, after_full))
            out = req.output
            if computed < req.prompt_len + len(out):
                continue  # chunked prefill: more to do
            token = (req._seed + 2654435761 * (len(out) + 1)) % vocab  # next_token, inlined: once per token
            out.append(token)
            generated += 1
            first = req.first_token_at is None
            if first:
                req.first_token_at = end
            done = len(out) >= req.max_tokens
            if done:
                self._finish(req, end)
            add(TokenOutput(req, token, first, done))
        self.stats.generation_tokens += generated
        return outputs
