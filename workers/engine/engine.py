"""The one engine model: block pool + continuous-batching scheduler + timing. Pure, clock-agnostic.

``step(now)`` schedules one engine step (a token budget shared by decodes first, then chunked prefills,
then newly admitted requests), applies it, and returns how long it took, the KV events vLLM would publish
for it and the tokens it produced. The simulator advances a virtual clock by that duration; the live
simulated worker sleeps it (scaled). Neither forks this code.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from router.events.codec import KvEvent
from workers.engine.block_pool import (
    _MASK,
    _MIX,
    HASH_ALGOS,
    NONE_HASH,
    BlockPool,
    CachedBlock,
    VllmBlockHasher,
    engine_block_hash,
    vllm_extra_keys,
)
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
    # LoRA adapters, as vLLM's --max-loras: at most this many in one batch, loaded in as many slots (least recently
    # used out); 0: no limit and no load (adapters cost nothing). Loading one lasts ``lora_load_ms`` (per
    # adapter in ``lora_load_ms_by_adapter``), added to the step that first schedules it
    max_loras: int = 0
    lora_load_ms: float = 30.0
    lora_load_ms_by_adapter: tuple[tuple[str, float], ...] = ()
    # the block hash, as vLLM's --prefix-caching-hash-algo: "native" (the model's own fast xxh3 chain, the default:
    # kvrouter keys blocks by their token ids, never by the engine's hash) or vLLM's sha256 | sha256_cbor | xxhash |
    # xxhash_cbor, bit for bit, for peers that recompute vLLM's hashes. ``hash_seed``: PYTHONHASHSEED as the engine
    # would see it (None: unset; then vLLM's fixed seed for sha256*, a random one for xxhash*)
    hash_algo: str = "native"
    hash_seed: str | None = None

    def __post_init__(self) -> None:
        if self.hash_algo not in HASH_ALGOS:
            raise ValueError(f"hash_algo {self.hash_algo!r}: one of {', '.join(HASH_ALGOS)}")


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


# the synthetic sampler: output token j (1-based) of a request is (seed + _TOKEN_MULT * j) % vocab
_TOKEN_MULT = 2654435761


@dataclass(eq=False)
class EngineRequest:
    """One request and its place in the engine.

    While it runs, its hot counters (tokens computed, tokens generated) live in its engine's batch arrays, not
    here: a decode step over the batch is then a few array operations. ``num_computed``, ``n_out`` and
    ``output`` read them wherever they are. The output tokens are never stored: the synthetic sampler makes
    token j a function of (prompt, j), so ``output`` computes them.
    """

    request_id: str
    prompt: np.ndarray  # uint32 token ids (a list is converted)
    max_tokens: int
    cache_salt: str | None = None
    lora_name: str | None = None
    arrival: float = 0.0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    block_tokens: list[bytes | memoryview] = field(default_factory=list)  # per full block, beside its hash
    block_digests: list[bytes] = field(default_factory=list)  # vLLM's full digests, the chain (a vLLM hash_algo)
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
    vocab: int = field(default=32000, repr=False)  # the engine's, set when it is added
    _computed: int = field(default=0, init=False, repr=False)  # while not in a running batch
    _n_out: int = field(default=0, init=False, repr=False)
    _batch: EngineModel | None = field(default=None, init=False, repr=False)  # the engine running it

    def __post_init__(self) -> None:
        self.prompt = np.asarray(self.prompt, dtype=np.uint32)
        self.prompt_len = len(self.prompt)
        self._prompt_bytes = memoryview(self.prompt.tobytes())
        self._seed = xxhash.xxh3_64_intdigest(self._prompt_bytes)

    # ---- counters, wherever they live --------------------------------------------------------
    @property
    def num_computed(self) -> int:
        e = self._batch
        return self._computed if e is None else int(e._batch[_COMP, e._slot(self)])

    @num_computed.setter
    def num_computed(self, value: int) -> None:
        e = self._batch
        if e is not None:
            raise AttributeError("a running request's progress is its engine's to change")
        self._computed = value

    @property
    def n_out(self) -> int:
        """Tokens generated so far."""
        e = self._batch
        return self._n_out if e is None else int(e._batch[_NOUT, e._slot(self)])

    @property
    def output(self) -> list[int]:
        """The tokens generated so far (computed: the sampler is a function of prompt and position)."""
        return self.output_tokens(0, self.n_out).tolist()

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.n_out

    def output_tokens(self, start: int, end: int) -> np.ndarray:
        """Output tokens [start, end) (0-based), as int64: (seed + M*j) % vocab term by term modulo vocab."""
        v = self.vocab
        j = np.arange(start + 1, end + 1, dtype=np.int64) % v
        return (self._seed % v + (_TOKEN_MULT % v) * j) % v

    def token_bytes(self, start: int, end: int) -> bytes | memoryview:
        """Tokens [start, end) of prompt + output as uint32 bytes, without materialising the sequence."""
        n = self.prompt_len
        if end <= n:
            return self._prompt_bytes[start * 4 : end * 4]
        tail = self.output_tokens(max(start - n, 0), end - n).astype(np.uint32).tobytes()
        return tail if start >= n else bytes(self._prompt_bytes[start * 4 :]) + tail

    def extra(self, block_index: int) -> tuple[Any, ...] | None:
        base: tuple[Any, ...] = (self.lora_name,) if self.lora_name else ()
        if block_index == 0 and self.cache_salt:
            return (*base, self.cache_salt)
        return base or None

    def next_token(self, vocab: int) -> int:
        """Synthetic, deterministic in (prompt, position): same output cached or not, as at temperature 0."""
        return (self._seed + _TOKEN_MULT * (self.n_out + 1)) % vocab

    def next_tokens(self, k: int, vocab: int) -> list[int]:
        """The next ``k`` tokens ``next_token`` would give, one after another (a long decode run's in one numpy
        pass: the same residues, taken term by term modulo ``vocab``)."""
        m, seed = self.n_out, self._seed
        if k < 32:
            return [(seed + _TOKEN_MULT * j) % vocab for j in range(m + 1, m + k + 1)]
        j = np.arange(m + 1, m + k + 1, dtype=np.int64) % vocab
        return ((seed % vocab + (_TOKEN_MULT % vocab) * j) % vocab).tolist()


@dataclass(slots=True)  # not frozen: one is made per running request per step, and frozen ones build slowly
class TokenOutput:
    request: EngineRequest
    token: int
    first: bool
    finished: bool
    count: int = 1  # tokens this output stands for (several after a fast-forwarded decode run)


class StepResult:
    """What one step (or one fast-forwarded decode run) did.

    ``outputs``: one ``TokenOutput`` per request that produced a token, in schedule order (what a streaming
    server forwards); built when first read, since a decode step of the array batch makes none.
    ``notable``: the outputs that are a first token or a finish, in the same order: all a driver that only
    times requests needs (the simulator), without one object per decode token.
    """

    __slots__ = ("_build", "_outputs", "decode_reqs", "duration_s", "events", "notable", "prefill_tokens")

    def __init__(self, duration_s: float, events: list[KvEvent], outputs: list[TokenOutput] | None,
                 prefill_tokens: int = 0, decode_reqs: int = 0, notable: list[TokenOutput] | None = None,
                 build: Callable[[], list[TokenOutput]] | None = None) -> None:
        self.duration_s, self.events = duration_s, events
        self.prefill_tokens, self.decode_reqs = prefill_tokens, decode_reqs
        self._outputs, self._build = outputs, build
        if notable is None:
            notable = [o for o in outputs or () if o.first or o.finished]
        self.notable = notable

    @property
    def outputs(self) -> list[TokenOutput]:
        if self._outputs is None:
            self._outputs = self._build() if self._build is not None else []
            self._build = None
        return self._outputs


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
    lora_loads: int = 0  # adapters loaded into a slot


# rows of EngineModel._batch, one column per running request in schedule order: tokens computed, tokens in the
# sequence (prompt + generated), tokens the blocks held cover, where the next full block ends, tokens generated,
# max tokens, the computed count at which its next output is notable (its first token, else its last), and the
# least of that and the next block's end: the one comparison that tells a step whether Python has work there
_COMP, _NTOK, _NOUT, _CAP, _NEXTB, _MAX, _STOP, _EVENT = range(8)  # the first three adjacent: a quiet step's
_ROWS = 8


class EngineModel:
    """The engine: a waiting queue, a running batch, a block pool.

    The running batch is held twice over: ``running`` (the requests, in schedule order: what preemption,
    admission and the drivers see) and ``_batch``, an int64 array with one column per running request
    (tokens computed, tokens in the sequence, blocks held, tokens generated, max tokens, the sampler's seed
    modulo vocab, first token given). A step computes every request's share of the token budget, the tokens
    it produces and the blocks it fills as array operations; Python runs per request only where something
    happens to it (a block to allocate or fill, its first token, its end, an admission). A step that would
    preempt runs ``_reference_step``, the one-request-at-a-time scheduler this replaced, on the requests
    themselves (``vectorised=False`` runs every step so: the property tests hold the two equal).
    """

    def __init__(self, config: EngineConfig | None = None, vectorised: bool = True) -> None:
        self.config = config or EngineConfig()
        c = self.config
        self.pool = BlockPool(c.num_gpu_blocks, c.block_size, c.cpu_blocks)
        self.timing = c.timing
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.stats = EngineStats()
        self.vectorised = vectorised
        self._batch = np.zeros((_ROWS, max(c.max_num_seqs, 1)), dtype=np.int64)
        self._slots: dict[EngineRequest, int] | None = None  # request -> column, rebuilt when read after a change
        # steps ahead in which nothing happens to any running request (each decodes one token, no block to
        # allocate or fill, no first or last token), as long as nothing is admitted: each is one array addition
        self._quiet = 0
        self.loras: OrderedDict[str, None] = OrderedDict()  # adapters loaded in slots, least recently used first
        self._lora_load_ms = dict(c.lora_load_ms_by_adapter)
        self._step_lora_ms = 0.0  # adapters loaded by the step being built
        self._vllm_hasher = VllmBlockHasher(c.hash_algo, c.hash_seed) if c.hash_algo != "native" else None

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
        req.vocab = self.config.vocab_size
        self.waiting.append(req)

    def abort(self, req: EngineRequest) -> None:
        if req.status is Status.WAITING and req in self.waiting:
            self.waiting.remove(req)
        elif req.status is Status.RUNNING:
            self._detach_all()
            self.running.remove(req)
            self._attach_all()
            self._quiet = 0
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

    # ---- the batch arrays --------------------------------------------------------------------
    def _slot(self, req: EngineRequest) -> int:
        """The batch column of a running request (for reads from outside a step: rare)."""
        if self._slots is None:
            self._slots = {r: i for i, r in enumerate(self.running)}
        return self._slots[req]

    def _attach(self, start: int) -> None:
        """Columns for ``running[start:]`` (just admitted, or all of them after a reference step)."""
        b, bs = self._batch, self.config.block_size
        for i in range(start, len(self.running)):
            r = self.running[i]
            comp, ntok = r._computed, r.prompt_len + r._n_out
            b[_COMP, i], b[_NTOK, i], b[_NOUT, i], b[_MAX, i] = comp, ntok, r._n_out, r.max_tokens
            b[_CAP, i] = len(r.block_ids) * bs
            nextb = b[_NEXTB, i] = (comp // bs + 1) * bs
            stop = b[_STOP, i] = ntok if r.first_token_at is None else r.prompt_len + r.max_tokens - 1
            b[_EVENT, i] = min(stop, nextb)
            r._batch = self
        self._slots = None

    def _attach_all(self) -> None:
        self._attach(0)

    def _detach(self, i: int) -> None:
        """The counters of column ``i`` back onto its request, which leaves the batch."""
        r, b = self.running[i], self._batch
        r._computed, r._n_out = int(b[_COMP, i]), int(b[_NOUT, i])
        r._batch = None

    def _detach_all(self) -> None:
        for i in range(len(self.running)):
            self._detach(i)
        self._slots = None

    def _compact(self, gone: np.ndarray) -> None:
        """Drop the columns (and running requests) at indexes ``gone`` (ascending), keeping the order."""
        n = len(self.running)
        keep = np.ones(n, dtype=bool)
        keep[gone] = False
        self._batch[:, : n - len(gone)] = self._batch[:, :n][:, keep]
        running = self.running
        for i in gone[::-1].tolist():
            del running[i]
        self._slots = None

    # ---- hashing -----------------------------------------------------------------------------
    def _hashes_upto(self, req: EngineRequest, n_blocks: int) -> list[int]:
        bs = self.config.block_size
        hs = req.block_hashes
        if self._vllm_hasher is not None:
            if len(hs) < n_blocks:
                self._vllm_hashes_upto(req, n_blocks)
            return hs
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

    def _vllm_hashes_upto(self, req: EngineRequest, n_blocks: int) -> None:
        """vLLM's chain (``hash_block_tokens`` over its tagged extra keys): full digests kept per request as the
        parents of the next blocks, their last 8 bytes as the block hashes the pool keys and the events carry."""
        vh = self._vllm_hasher
        assert vh is not None
        bs = self.config.block_size
        hs, ds, toks = req.block_hashes, req.block_digests, req.block_tokens
        parent = ds[-1] if ds else None
        while len(hs) < n_blocks:
            i = len(hs)
            data = req.token_bytes(i * bs, (i + 1) * bs)
            parent = vh.digest(parent, memoryview(data).cast("B").cast("I"),
                               vllm_extra_keys(req.lora_name, req.cache_salt, i))
            ds.append(parent)
            hs.append(vh.to_int(parent))
            toks.append(data)

    def _contents(self, req: EngineRequest, start: int, end: int) -> list[CachedBlock]:
        """What blocks [start, end) of a request hold, to cache or load them."""
        hs = self._hashes_upto(req, end)
        toks = req.block_tokens
        return [CachedBlock(hs[i], hs[i - 1] if i else None, toks[i], req.extra(i)) for i in range(start, end)]

    # ---- scheduling --------------------------------------------------------------------------
    def _blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.config.block_size)

    def _admit_waiting(self, budget: int) -> Iterator[tuple[EngineRequest, int, int]]:
        """Start waiting requests in arrival order while the step's token budget and ``max_num_seqs`` allow,
        stopping at the first that does not fit (no overtaking): each (request, tokens scheduled, tokens loaded
        back from CPU). Both the array step and the reference step admit this way. A request whose adapter
        cannot join the batch (every LoRA slot held by an adapter running requests use) is skipped, as vLLM's
        scheduler skips it, and stays at its place in the queue."""
        self._step_lora_ms = 0.0
        slots = self.config.max_loras  # 0: adapters are not limited, nor loaded
        active = {r.lora_name for r in self.running if r.lora_name} if slots else set()
        skipped: list[EngineRequest] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            adapter = req.lora_name if slots else None
            if adapter and adapter not in active and len(active) >= slots:
                skipped.append(self.waiting.popleft())
                continue
            n, loaded = self._admit(req, budget)
            if n == 0:
                break
            self.waiting.popleft()
            if adapter:
                active.add(adapter)
                self._load_adapter(adapter, active)
            budget -= n
            yield req, n, loaded
        if skipped:
            self.waiting.extendleft(reversed(skipped))

    def _load_adapter(self, adapter: str, active: set[str]) -> None:
        """``adapter`` joins the batch: loaded into a slot unless it holds one (an idle adapter's slot is taken,
        the least recently used first); its load lasts into this step."""
        if adapter in self.loras:
            self.loras.move_to_end(adapter)
            return
        while len(self.loras) >= self.config.max_loras:
            idle = next((a for a in self.loras if a not in active), None)
            if idle is None:
                break
            del self.loras[idle]
        self.loras[adapter] = None
        self.stats.lora_loads += 1
        self._step_lora_ms += self._lora_load_ms.get(adapter, self.config.lora_load_ms)

    @property
    def loras_of(self) -> tuple[frozenset[str], frozenset[str]]:
        """The adapters of the running requests and of the waiting ones (vLLM's lora_requests_info)."""
        return (frozenset(r.lora_name for r in self.running if r.lora_name),
                frozenset(r.lora_name for r in self.waiting if r.lora_name))

    def _admit(self, req: EngineRequest, budget: int) -> tuple[int, int]:
        """Try to start a waiting request: (tokens scheduled, tokens loaded back from CPU); 0 = not admitted.
        It joins ``running`` with its counters on itself (the caller gives it a batch column)."""
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
        req._computed = cached
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

    def step(self, now: float, until: float | None = None) -> StepResult:
        """One engine step starting at ``now``.

        ``until``: the driver promises nothing will reach this engine before that time (the simulator knows
        its next arrival). A step that is pure decode may then fast-forward through several identical decode
        steps at once, stopping before ``until``, before any request finishes and before memory runs out;
        the result is the same as stepping one at a time, except that the KV events of the run are
        published once, at its end, and KV usage is taken as at its start.
        """
        if not self.vectorised:
            return self._reference_fallback(now, until)
        n_run = len(self.running)
        c = self.config
        b = self._batch
        budget = c.max_num_batched_tokens
        quiet, self._quiet = self._quiet, 0
        if quiet > 0 and not self.waiting and n_run <= budget:
            return self._quiet_step(now, until, quiet)
        total = 0
        every_one_scheduled = True  # each running request gets at least one token (the budget covers all)
        if n_run:
            comp = b[_COMP, :n_run]
            need = b[_NTOK, :n_run] - comp  # tokens each still has to compute (>= 1)
            total = int(need.sum())
            if total <= budget:  # all of it fits: the usual case
                sched = need
            else:  # decodes first, then prefill chunks, in order, while the budget lasts
                before = np.cumsum(need) - need
                sched = np.minimum(need, np.maximum(budget - before, 0))
                total = int(sched.sum())
                every_one_scheduled = False
            growing = np.flatnonzero(comp + sched > b[_CAP, :n_run])
            if len(growing) and not self._grow_batch(growing, sched):
                return self._reference_fallback(now, until)  # memory runs out: someone is preempted
            budget -= total
        else:
            sched = np.zeros(0, dtype=np.int64)
        admitted: list[int] = []  # tokens scheduled for each admitted request, in admission order
        load_back = 0
        for _req, n, loaded in self._admit_waiting(budget):
            admitted.append(n)
            load_back += loaded
        if admitted:
            self._attach(n_run)
            sched = np.concatenate([sched, np.array(admitted, dtype=np.int64)])
            total += sum(admitted)
        n_all = len(self.running)
        nout = b[_NOUT, :n_all]
        if every_one_scheduled and total == n_all:  # one token each: decodes, but for prompts down to their last token
            decode_reqs = int(np.count_nonzero(nout))
        else:
            decode_reqs = int(np.count_nonzero((sched == 1) & (nout > 0)))
        prefill_tokens = total - decode_reqs
        usage = self.pool.usage
        duration = (self.timing.step_ms(prefill_tokens, decode_reqs, usage, load_back) + self._step_lora_ms) / 1000.0
        self._step_lora_ms = 0.0
        if until is not None and not prefill_tokens and not self.waiting and decode_reqs == n_all:
            k = self._decode_run_length(now, until, duration)
            if k > 1:
                return self._decode_run(k, duration, now)
        return self._apply(sched, now + duration, duration, prefill_tokens, decode_reqs)

    def _quiet_step(self, now: float, until: float | None, quiet: int) -> StepResult:
        """A step in which every running request decodes one token and nothing else happens (``_quiet``)."""
        n = len(self.running)
        duration = self.timing.step_ms(0, n, self.pool.usage, 0) / 1000.0
        if until is not None:
            k = self._decode_run_length(now, until, duration)
            if k > 1:
                return self._decode_run(k, duration, now)
        b = self._batch
        b[_COMP : _NOUT + 1, :n] += 1  # tokens computed, in the sequence, generated
        self.stats.generation_tokens += n
        self.stats.steps += 1
        self._quiet = quiet - 1
        return StepResult(duration, self.pool.take_events(), None, 0, n, [],
                          _outputs_builder(list(self.running), None, b[_NOUT, :n].copy(), {}, 1))

    def _grow_batch(self, growing: np.ndarray, sched: np.ndarray) -> bool:
        """Blocks for the requests at ``growing`` to compute their scheduled tokens, allocated in schedule order
        (as the reference scheduler does); ``False``, allocating nothing, when the pool cannot give them all."""
        b, bs = self._batch, self.config.block_size
        ends = (b[_COMP, growing] + sched[growing]).tolist()
        caps = b[_CAP, growing].tolist()
        extra = [-(-e // bs) - cap // bs for e, cap in zip(ends, caps, strict=True)]
        if sum(extra) > self.pool.num_free:
            return False
        running, allocate = self.running, self.pool.allocate
        for i, x, cap in zip(growing.tolist(), extra, caps, strict=True):
            running[i].block_ids += allocate(x)
            b[_CAP, i] = cap + x * bs
        return True

    def _apply(self, sched: np.ndarray, end: float, duration: float, prefill_tokens: int,
               decode_reqs: int) -> StepResult:
        """Apply a scheduled step to the batch: tokens computed, blocks filled, tokens produced, requests done.

        Every request's counters move in a few array operations; Python visits only the columns where the
        computed count reaches ``_EVENT`` (a block filled, a first token, a last token)."""
        n = len(self.running)
        b = self._batch
        comp, ntok, nout = b[_COMP, :n], b[_NTOK, :n], b[_NOUT, :n]
        after = comp + sched
        events_at = np.flatnonzero(after >= b[_EVENT, :n])
        produced = after == ntok  # the prompt (and what was generated) all computed: a token is sampled
        comp_before = comp.copy() if len(events_at) else comp
        comp[:] = after
        nout += produced
        ntok += produced
        generated = int(np.count_nonzero(produced))
        self.stats.generation_tokens += generated
        notable: list[TokenOutput] = []
        flags: dict[int, tuple[bool, bool]] = {}
        gone: list[int] = []
        if len(events_at):
            notable, gone = self._visit(events_at, comp_before, produced, end, flags)
        build = _outputs_builder(list(self.running), produced, nout.copy(), flags, 1) if generated else None
        if gone:
            self._compact(np.array(gone, dtype=np.int64))
        self.stats.steps += 1
        n = len(self.running)
        if n:  # how many steps ahead are quiet: all decoding, each short of its next event and of its blocks' end
            comp = b[_COMP, :n]
            if (b[_NTOK, :n] - comp == 1).all():
                self._quiet = int(min((b[_EVENT, :n] - comp).min() - 1, (b[_CAP, :n] - comp).min()))
        return StepResult(duration, self.pool.take_events(), None if generated else [], prefill_tokens,
                          decode_reqs, notable, build)

    def _visit(self, events_at: np.ndarray, comp_before: np.ndarray, produced: np.ndarray, end: float,
               flags: dict[int, tuple[bool, bool]]) -> tuple[list[TokenOutput], list[int]]:
        """The per-request part of a step, in schedule order: blocks filled are cached and published, a first
        token is stamped, a last one finishes its request. Returns the notable outputs and the finished
        columns."""
        b, bs, pool, running = self._batch, self.config.block_size, self.pool, self.running
        notable: list[TokenOutput] = []
        gone: list[int] = []
        idx = events_at.tolist()
        afters, befores = b[_COMP, events_at].tolist(), comp_before[events_at].tolist()
        nextbs, stops, nouts = b[_NEXTB, events_at].tolist(), b[_STOP, events_at].tolist(), b[_NOUT, events_at].tolist()
        made = produced[events_at].tolist()
        for m, i in enumerate(idx):
            req, after, nextb, stop = running[i], afters[m], nextbs[m], stops[m]
            if after >= nextb:  # full blocks to cache and publish
                lo, hi = befores[m] // bs, after // bs
                pool.cache_full_blocks(req.block_ids[lo:hi], self._contents(req, lo, hi))
                nextb = b[_NEXTB, i] = (hi + 1) * bs
            if made[m]:
                first = req.first_token_at is None
                done = nouts[m] >= req.max_tokens
                if first:
                    req.first_token_at = end
                    stop = b[_STOP, i] = req.prompt_len + req.max_tokens - 1
                if done:
                    self._detach(i)
                    self._finish(req, end)
                    gone.append(i)
                if first or done:
                    flags[i] = (first, done)
                    notable.append(TokenOutput(req, (req._seed + _TOKEN_MULT * nouts[m]) % req.vocab, first, done))
            b[_EVENT, i] = min(stop, nextb)
        return notable, gone

    def _finish(self, req: EngineRequest, end: float) -> None:
        """A request's last token: its blocks freed (it leaves ``running`` with the caller's compaction)."""
        req.finished_at = end
        req.status = Status.FINISHED
        self.pool.free_blocks(req.block_ids)
        self.stats.finished += 1

    def _decode_run_length(self, now: float, until: float, step_s: float) -> int:
        if step_s <= 0:
            return 1
        k = int(min((until - now) / step_s, 1e9))
        if k <= 1:  # the next arrival comes within a step (the usual case under load)
            return 1
        n = len(self.running)
        b = self._batch
        left = int((b[_MAX, :n] - b[_NOUT, :n]).min())
        if left < k:
            k = left
        if k <= 1:
            return 1
        # blocks for k tokens each (the first step's are already allocated)
        bs = self.config.block_size
        need = int((-(-(b[_COMP, :n] + k) // bs)).sum()) - int(b[_CAP, :n].sum()) // bs
        return k if need <= self.pool.num_free else 1

    def _decode_run(self, k: int, step_s: float, now: float) -> StepResult:
        """``k`` decode steps at once over the whole batch (every request decoding, none ending before the last)."""
        bs = self.config.block_size
        n = len(self.running)
        b = self._batch
        comp, cap, nextb, nout = b[_COMP, :n], b[_CAP, :n], b[_NEXTB, :n], b[_NOUT, :n]
        after = comp + k
        busy = np.flatnonzero((after > cap) | (after >= nextb))  # a block to allocate or to publish
        running, pool = self.running, self.pool
        if len(busy):
            afters, befores, caps = after[busy].tolist(), comp[busy].tolist(), cap[busy].tolist()
            for m, i in enumerate(busy.tolist()):  # per request, allocation then caching: the reference's order
                req, a = running[i], afters[m]
                extra = -(-a // bs) - caps[m] // bs
                if extra > 0:
                    req.block_ids += pool.allocate(extra)
                    b[_CAP, i] = caps[m] + extra * bs
                lo, hi = befores[m] // bs, a // bs
                if hi > lo:
                    pool.cache_full_blocks(req.block_ids[lo:hi], self._contents(req, lo, hi))
                    b[_NEXTB, i] = (hi + 1) * bs
                    b[_EVENT, i] = min(int(b[_STOP, i]), int(b[_NEXTB, i]))
        comp[:] = after
        nout += k
        b[_NTOK, :n] += k
        self.stats.generation_tokens += k * n
        end = now + k * step_s
        notable: list[TokenOutput] = []
        flags: dict[int, tuple[bool, bool]] = {}
        gone = np.flatnonzero(nout >= b[_MAX, :n])
        if len(gone):
            for i, j in zip(gone.tolist(), nout[gone].tolist(), strict=True):
                req = running[i]
                self._detach(i)
                self._finish(req, end)
                flags[i] = (False, True)
                notable.append(TokenOutput(req, (req._seed + _TOKEN_MULT * j) % req.vocab, False, True, k))
        build = _outputs_builder(list(running), None, nout.copy(), flags, k)
        if len(gone):
            self._compact(gone)
        self.stats.steps += k
        return StepResult(k * step_s, pool.take_events(), None, 0, n, notable, build)

    # ---- the reference scheduler: one request at a time, on the requests themselves ------------
    def _reference_fallback(self, now: float, until: float | None) -> StepResult:
        """Run this step on the requests themselves (preemption, or ``vectorised=False``), then rebuild the
        batch."""
        self._detach_all()
        try:
            return self._reference_step(now, until)
        finally:
            self._attach_all()

    def _preempt(self, victim: EngineRequest) -> None:
        self.running.remove(victim)
        self.pool.free_blocks(victim.block_ids)
        victim.block_ids = []
        victim._computed = 0
        victim.status = Status.WAITING
        self.waiting.appendleft(victim)
        self.stats.preemptions += 1

    def _grow(self, req: EngineRequest, n: int) -> bool:
        """Make room for ``n`` more tokens, preempting lower-priority (later) requests, else ``req`` itself."""
        need = self._blocks_for(req._computed + n) - len(req.block_ids)
        while need > self.pool.num_free:
            if self.running[-1] is req:
                self._preempt(req)
                return False
            self._preempt(self.running[-1])
        if need > 0:
            req.block_ids += self.pool.allocate(need)
        return True

    def _reference_step(self, now: float, until: float | None) -> StepResult:
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
            computed = req._computed
            n = min(req.prompt_len + req._n_out - computed, budget)
            if n <= 0:
                continue
            if computed + n > len(req.block_ids) * bs and not self._grow(req, n):
                continue
            schedule((req, n))
            budget -= n
            if n == 1 and req._n_out:
                decode_reqs += 1
            else:
                prefill_tokens += n
        for req, n, loaded in self._admit_waiting(budget):
            schedule((req, n))
            load_back += loaded
            if n == 1 and req._n_out:
                decode_reqs += 1
            else:
                prefill_tokens += n
        usage = self.pool.usage
        duration = (self.timing.step_ms(prefill_tokens, decode_reqs, usage, load_back) + self._step_lora_ms) / 1000.0
        self._step_lora_ms = 0.0
        if until is not None and not prefill_tokens and not self.waiting and decode_reqs == len(self.running):
            k = self._reference_run_length(now, until, duration)
            if k > 1:
                return self._reference_run(k, duration, now)
        end = now + duration
        outputs = self._reference_apply(scheduled, end)
        self.stats.steps += 1
        return StepResult(duration, self.pool.take_events(), outputs, prefill_tokens, decode_reqs)

    def _reference_run_length(self, now: float, until: float, step_s: float) -> int:
        if step_s <= 0:
            return 1
        k = int(min((until - now) / step_s, 1e9))
        for r in self.running:
            left = r.max_tokens - r._n_out
            if left < k:
                k = left
        if k <= 1:
            return 1
        bs = self.config.block_size
        need = sum(-(-(r._computed + k) // bs) - len(r.block_ids) for r in self.running)
        return k if need <= self.pool.num_free else 1

    def _reference_run(self, k: int, step_s: float, now: float) -> StepResult:
        bs = self.config.block_size
        vocab = self.config.vocab_size
        outputs: list[TokenOutput] = []
        for req in list(self.running):
            extra = self._blocks_for(req._computed + k) - len(req.block_ids)
            if extra > 0:
                req.block_ids += self.pool.allocate(extra)
            before_full = req._computed // bs
            req._n_out += k  # each step computes one token's KV, samples the next
            req._computed += k
            after_full = req._computed // bs
            if after_full > before_full:
                self.pool.cache_full_blocks(req.block_ids[before_full:after_full],
                                            self._contents(req, before_full, after_full))
            self.stats.generation_tokens += k
            done = req._n_out >= req.max_tokens
            if done:
                self._finish(req, now + k * step_s)
                self.running.remove(req)
            outputs.append(TokenOutput(req, (req._seed + _TOKEN_MULT * req._n_out) % vocab, False, done, k))
        self.stats.steps += k
        return StepResult(k * step_s, self.pool.take_events(), outputs, 0, len(outputs))

    def _reference_apply(self, scheduled: list[tuple[EngineRequest, int]], end: float) -> list[TokenOutput]:
        bs = self.config.block_size
        vocab = self.config.vocab_size
        outputs: list[TokenOutput] = []
        add = outputs.append
        generated = 0
        for req, n in scheduled:
            before_full = req._computed // bs
            computed = req._computed = req._computed + n
            after_full = computed // bs
            if after_full > before_full:
                self.pool.cache_full_blocks(req.block_ids[before_full:after_full],
                                            self._contents(req, before_full, after_full))
            if computed < req.prompt_len + req._n_out:
                continue  # chunked prefill: more to do
            req._n_out += 1
            token = (req._seed + _TOKEN_MULT * req._n_out) % vocab
            generated += 1
            first = req.first_token_at is None
            if first:
                req.first_token_at = end
            done = req._n_out >= req.max_tokens
            if done:
                self._finish(req, end)
                self.running.remove(req)
            add(TokenOutput(req, token, first, done))
        self.stats.generation_tokens += generated
        return outputs


def _outputs_builder(running: list[EngineRequest], produced: np.ndarray | None, n_out: np.ndarray,
                     flags: dict[int, tuple[bool, bool]], count: int) -> Callable[[], list[TokenOutput]]:
    """The step's ``TokenOutput``s, made only if someone reads them (the live worker streams them): one per
    column that ``produced`` a token (None: every one), its ``n_out``-th; ``flags``: (first, finished) of the
    notable ones."""

    def build() -> list[TokenOutput]:
        out = []
        plain = (False, False)
        made = range(len(n_out)) if produced is None else np.flatnonzero(produced).tolist()
        for i, j in zip(made, (n_out if produced is None else n_out[produced]).tolist(), strict=True):
            req = running[i]
            first, done = flags.get(i, plain)
            out.append(TokenOutput(req, (req._seed + _TOKEN_MULT * j) % req.vocab, first, done, count))
        return out

    return build
