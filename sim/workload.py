"""Requests for the simulator: the Mooncake trace, and synthetic shared-prefix and multi-turn workloads.

Token ids are synthesised deterministically: each Mooncake hash id (one 512-token block, standing for the
whole prefix up to it) becomes 512 tokens derived from the id alone, so requests that share hash ids share
tokens, and block keys at any engine block size stay consistent.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from router.scheduling.slo import NO_OBJECTIVE, ObjectiveError, ServiceObjective, parse_target_ms

try:  # the synthesis in one pass in C (sim/_fastworkload.c), built where a compiler was; numpy's below the reference
    from sim._fastworkload import hash_id_tokens as _compiled_hash_id_tokens
except ImportError:  # pragma: no cover - a build without the extension
    _compiled_hash_id_tokens = None

TRACE_BLOCK = 512
VOCAB = 32000
_M2 = np.uint64(0xBF58476D1CE4E5B9)


@dataclass(slots=True)
class SimRequest:
    request_id: str
    arrival: float  # seconds
    prompt: np.ndarray | int  # uint32 prompt token ids, or the length of a trace row's prompt (made on use)
    output_len: int
    session: str | None = None
    hash_ids: tuple[int, ...] = ()  # trace block ids, for the independent cache bound
    objective: ServiceObjective = NO_OBJECTIVE  # its TTFT/TPOT targets and priority (router/scheduling/slo.py)
    tenant: str | None = None  # whose request it is, for attainment per tenant
    lora: str | None = None  # the LoRA adapter it asks for (None: the base model)

    @property
    def tokens(self) -> np.ndarray:
        """Trace rows synthesise their tokens on use: a whole trace of them would not fit in memory."""
        if isinstance(self.prompt, np.ndarray):
            return self.prompt
        return tokens_for_hash_ids(list(self.hash_ids), self.prompt)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) if isinstance(self.prompt, np.ndarray) else self.prompt


def tokens_for_block(block_id: int, n: int = TRACE_BLOCK, salt: int = 0) -> np.ndarray:
    """``n`` pseudo-random token ids determined by ``block_id`` alone (splitmix-style mixing)."""
    return tokens_for_blocks([block_id], n, salt)[0]


_LANES: dict[int, np.ndarray] = {}  # n -> arange(n) * _M2, the per-position half of the mix


def tokens_for_blocks(block_ids: list[int], n: int = TRACE_BLOCK, salt: int = 0) -> np.ndarray:
    """``tokens_for_block`` of every id at once: a ``(len(block_ids), n)`` array, one numpy pass for a whole
    prompt (a trace row's 20-odd blocks cost what one did)."""
    lanes = _LANES.get(n)
    if lanes is None:
        lanes = _LANES[n] = np.arange(n, dtype=np.uint64) * _M2
    ids = np.array(block_ids, dtype=np.int64).astype(np.uint64)  # two's complement: -1 is 2**64 - 1, as & mask
    seeds = (ids * np.uint64(2) + np.uint64(1 + salt * 0x1000003)) * np.uint64(0x9E3779B97F4A7C15)
    x = seeds[:, None] ^ lanes[None, :]
    x ^= x >> np.uint64(31)
    x *= _M2
    x ^= x >> np.uint64(29)
    return (x % np.uint64(VOCAB)).astype(np.uint32)


def tokens_for_hash_ids(hash_ids: list[int], length: int) -> np.ndarray:
    """A trace row's prompt: each hash id's 512 tokens, cut to ``length`` (padded deterministically past its
    blocks)."""
    if _compiled_hash_id_tokens is not None:
        ids = np.array(hash_ids, dtype=np.int64)
        return np.frombuffer(_compiled_hash_id_tokens(ids, length), dtype=np.uint32)
    return py_tokens_for_hash_ids(hash_ids, length)


def py_tokens_for_hash_ids(hash_ids: list[int], length: int) -> np.ndarray:
    """``tokens_for_hash_ids`` in numpy passes: the reference of the compiled synthesis."""
    if not hash_ids:
        return tokens_for_block(-1, length)
    toks = tokens_for_blocks(hash_ids).ravel()
    if len(toks) < length:  # a trace row whose length runs past its blocks: pad deterministically
        toks = np.concatenate([toks, tokens_for_block(hash_ids[-1], length - len(toks), salt=7)])
    return toks[:length]


def trace_objective(row: dict, where: str) -> ServiceObjective:
    """A trace row's optional objective columns: ``slo_ttft_ms``, ``slo_tpot_ms`` (targets, milliseconds) and
    ``priority`` (an integer, negative: sheddable). A row without them has no objective."""
    ttft, tpot, priority = row.get("slo_ttft_ms"), row.get("slo_tpot_ms"), row.get("priority", 0)
    if ttft is None and tpot is None and priority == 0:
        return NO_OBJECTIVE
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ObjectiveError(f"{where}: priority: expected an integer, got {priority!r}")
    return ServiceObjective(None if ttft is None else parse_target_ms(f"{where}: slo_ttft_ms", str(ttft)),
                            None if tpot is None else parse_target_ms(f"{where}: slo_tpot_ms", str(tpot)), priority)


def mooncake(path: str | Path, limit: int | None = None, speedup: float = 1.0, jitter_s: float = 0.0,
             seed: int = 0) -> list[SimRequest]:
    """Mooncake JSONL: ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids``; optionally
    ``slo_ttft_ms``, ``slo_tpot_ms``, ``priority`` (``trace_objective``) and ``tenant`` (a string).

    ``speedup`` divides arrival times; ``jitter_s`` spreads the trace's ~3 s quantised timestamps uniformly.
    """
    rng = np.random.default_rng(seed)
    out = []
    with open(path, encoding="utf-8") as fh:
        for i, line in enumerate(fh):
            if limit is not None and i >= limit:
                break
            row = json.loads(line)
            t = row["timestamp"] / 1000.0
            if jitter_s:
                t += float(rng.uniform(0, jitter_s))
            hashes = list(row["hash_ids"])
            n = int(row["input_length"])
            tenant = row.get("tenant")
            out.append(SimRequest(f"r{i}", t / speedup, n, max(1, int(row["output_length"])), None, tuple(hashes),
                                  trace_objective(row, f"{path}:{i + 1}"), None if tenant is None else str(tenant)))
    out.sort(key=lambda r: r.arrival)
    t0 = out[0].arrival if out else 0.0
    for r in out:
        r.arrival -= t0
    return out


def repeat_trace(requests: list[SimRequest], times: int) -> list[SimRequest]:
    """``times`` copies of a trace over the same time window, each with its own hash ids except the shared
    system prompt (id 0): as many more users, the same conversations' shape, ``times`` the arrival rate."""
    if times <= 1:
        return requests
    out = list(requests)
    for k in range(1, times):
        off = k * 100_000_000
        for r in requests:
            ids = tuple(h if h == 0 else h + off for h in r.hash_ids)
            out.append(SimRequest(f"{r.request_id}x{k}", r.arrival, r.prompt, r.output_len, r.session, ids,
                                  r.objective, r.tenant))
    out.sort(key=lambda r: r.arrival)
    return out


def shared_prefix(groups: int = 64, per_group: int = 16, system_tokens: int = 2048, question_tokens: int = 128,
                  output_tokens: int = 256, rate: float = 8.0, seed: int = 0,
                  grouped: bool = False) -> list[SimRequest]:
    """SGLang's generated-shared-prefix shape (64 x 16, 2048 system, 128 question, 256 output), Poisson arrivals,
    prompts of all groups interleaved at random (``grouped``: each group's prompts back to back, groups in
    random order: a burst per new prefix)."""
    rng = np.random.default_rng(seed)
    order = [(g, q) for g in range(groups) for q in range(per_group)]
    rng.shuffle(order)
    if grouped:
        rank = {g: i for i, g in enumerate(rng.permutation(groups).tolist())}
        order.sort(key=lambda gq: rank[gq[0]])
    t = 0.0
    out = []
    for g, q in order:
        t += float(rng.exponential(1.0 / rate))
        system = tokens_for_block(10_000_000 + g, system_tokens)
        question = tokens_for_block(20_000_000 + g * per_group + q, question_tokens)
        out.append(SimRequest(f"g{g}q{q}", t, np.concatenate([system, question]), output_tokens, f"group-{g}"))
    return out


def multi_turn(conversations: int = 200, turns: int = 5, system_tokens: int = 1024, user_tokens: int = 200,
               output_tokens: int = 150, rate: float = 4.0, think_s: float = 5.0, seed: int = 0,
               real_answers: bool = False) -> list[SimRequest]:
    """Conversations whose every turn extends the previous prompt with the previous answer and a new question.

    The answer is a stand-in, or (``real_answers``) the very tokens the engine model generates for that prompt
    (its output is deterministic in the prompt, as at temperature 0), so a turn also hits the previous answer's
    KV blocks, as a chat client sending the conversation back does on vLLM."""
    rng = np.random.default_rng(seed)
    out = []
    start = 0.0
    system = tokens_for_block(30_000_000, system_tokens)
    for c in range(conversations):
        start += float(rng.exponential(1.0 / rate))
        prompt = system
        t = start
        for k in range(turns):
            user = tokens_for_block(40_000_000 + c * 1000 + k, user_tokens)
            prompt = np.concatenate([prompt, user])
            out.append(SimRequest(f"c{c}t{k}", t, prompt, output_tokens, f"conv-{c}"))
            answer = (engine_answer(prompt, output_tokens) if real_answers
                      else tokens_for_block(50_000_000 + c * 1000 + k, output_tokens))
            prompt = np.concatenate([prompt, answer])
            t += think_s + float(rng.exponential(think_s))
    out.sort(key=lambda r: r.arrival)
    return out


def engine_answer(prompt: np.ndarray, output_tokens: int, vocab: int = VOCAB) -> np.ndarray:
    """The tokens the engine model generates for ``prompt`` (workers.engine: deterministic in the prompt)."""
    from workers.engine import EngineRequest

    return np.array(EngineRequest("answer", prompt, output_tokens).next_tokens(output_tokens, vocab), dtype=np.uint32)


def hot_prefix(requests: int = 600, prefix_tokens: int = 8192, unique_blocks: tuple[int, int] = (1, 2),
               block_size: int = 16, output_tokens: int = 128, rate: float = 12.0, seed: int = 0) -> list[SimRequest]:
    """One hot prefix: every prompt is the same ``prefix_tokens`` plus 1-2 blocks of its own; Poisson arrivals
    (SGLang issue #21199's shape: routing all of it to the holder overloads it)."""
    rng = np.random.default_rng(seed)
    prefix = tokens_for_block(60_000_000, prefix_tokens)
    out, t = [], 0.0
    lo, hi = unique_blocks
    for i in range(requests):
        t += float(rng.exponential(1.0 / rate))
        own = tokens_for_block(61_000_000 + seed * 1_000_000 + i, int(rng.integers(lo, hi + 1)) * block_size)
        out.append(SimRequest(f"h{i}", t, np.concatenate([prefix, own]), output_tokens))
    return out


def zipf_prefixes(requests: int = 800, prefixes: int = 24, prefix_tokens: int = 4096, zipf_s: float = 1.1,
                  suffix_tokens: tuple[int, int] = (64, 256), output_tokens: int = 128, rate: float = 12.0,
                  seed: int = 0, salt: int = 0) -> list[SimRequest]:
    """Several hot prefixes of unequal popularity: prefix k (0-based) is drawn with probability proportional to
    ``1 / (k + 1) ** zipf_s``; each prompt adds a suffix of its own (uniform in ``suffix_tokens``)."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, prefixes + 1) ** zipf_s
    weights /= weights.sum()
    base = 70_000_000 + salt * 1_000_000
    cache: dict[int, np.ndarray] = {}
    out, t = [], 0.0
    lo, hi = suffix_tokens
    for i in range(requests):
        t += float(rng.exponential(1.0 / rate))
        k = int(rng.choice(prefixes, p=weights))
        if k not in cache:
            cache[k] = tokens_for_block(base + k, prefix_tokens)
        suffix = tokens_for_block(base + 500_000 + seed * 100_000 + i, int(rng.integers(lo, hi + 1)))
        out.append(SimRequest(f"z{i}p{k}", t, np.concatenate([cache[k], suffix]), output_tokens, f"prefix-{k}"))
    return out


def lora_zipf(requests: int = 1200, adapters: int = 32, zipf_s: float = 1.1, system_tokens: int = 512,
              question_tokens: tuple[int, int] = (64, 192), output_tokens: int = 128, rate: float = 20.0,
              seed: int = 0) -> list[SimRequest]:
    """Requests for LoRA adapters of Zipf popularity: adapter k (``lora-k``) drawn with probability proportional
    to ``1 / (k + 1) ** zipf_s``; each adapter's application has its own system prompt (its requests share it, keyed
    with the adapter's name as vLLM keys them), then a question of its own."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, adapters + 1) ** zipf_s
    weights /= weights.sum()
    systems = tokens_for_blocks([80_000_000 + k for k in range(adapters)], system_tokens)
    out, t = [], 0.0
    lo, hi = question_tokens
    for i in range(requests):
        t += float(rng.exponential(1.0 / rate))
        k = int(rng.choice(adapters, p=weights))
        question = tokens_for_block(81_000_000 + seed * 100_000 + i, int(rng.integers(lo, hi + 1)))
        out.append(SimRequest(f"l{i}a{k}", t, np.concatenate([systems[k], question]), output_tokens, f"lora-{k}",
                              lora=f"lora-{k}"))
    return out


def with_objective(requests: list[SimRequest], objective: ServiceObjective, tenant: str | None = None,
                   prefix: str = "") -> list[SimRequest]:
    """The same requests carrying ``objective`` and ``tenant`` (their ids prefixed, so that workloads merge)."""
    return [SimRequest(prefix + r.request_id, r.arrival, r.prompt, r.output_len, r.session, r.hash_ids, objective,
                       tenant) for r in requests]


def merged(*workloads: list[SimRequest]) -> list[SimRequest]:
    """Several workloads over the same time window, in arrival order."""
    return sorted((r for w in workloads for r in w), key=lambda r: r.arrival)


def demo_shape(rate: float = 16.0, seed: int = 0) -> list[SimRequest]:
    """``kvrouter demo``'s workload: 24 groups x 6, ~1,880-token system prompts, 64-token questions, 48 output
    tokens, 16/s (the demo's fleet: ``--workers 3 --gpu-blocks 1024``)."""
    return shared_prefix(24, 6, 1880, 64, 48, rate, seed)


WORKLOADS = {"lora_zipf": lora_zipf,
             "shared_prefix": shared_prefix, "multi_turn": multi_turn, "demo": demo_shape, "hot_prefix": hot_prefix,
             "zipf_prefixes": zipf_prefixes}


def prefix_keys(r: SimRequest, block: int, with_output: bool = False) -> tuple[list, int, int]:
    """Prefix-closed keys of a request's full blocks, their size and how many of them the prompt has: a Mooncake
    row's hash ids (512-token blocks, each naming its whole prefix), else a running digest of the raw token
    bytes per ``block`` (an independent hash: not the router's keys, not the engine's). ``with_output``: of a
    token prompt, also the blocks the engine model fills while generating its answer (all but the last token's
    KV), which a later prompt repeating the answer hits."""
    n = r.num_tokens
    if r.hash_ids and len(r.hash_ids) * TRACE_BLOCK >= n:
        return list(r.hash_ids), TRACE_BLOCK, len(r.hash_ids)
    tokens = r.tokens
    if with_output and r.output_len > 1:
        tokens = np.concatenate([tokens, engine_answer(tokens, r.output_len)[:-1]])
    data = tokens.tobytes()
    h = hashlib.blake2b(digest_size=16)
    keys = []
    step = block * 4
    for i in range(len(tokens) // block):
        h.update(data[i * step : (i + 1) * step])
        keys.append(h.copy().digest())
    return keys, block, n // block


def infinite_cache_bound(requests: list[SimRequest], block: int) -> float:
    """Token hit rate of one infinite cache shared by all, computed from the requests' own content.

    Keys from ``prefix_keys``: independent of the router's keys and of the engine model. Like an engine, it never
    counts the last prompt token as a hit, and it holds what each answer filled too (a conversation's next turn
    repeats the answer).
    """
    return cache_bound(requests, block)[0]


def working_set_tokens(requests: list[SimRequest], block: int) -> int:
    """Tokens of distinct full blocks over the whole workload (prompts and answers): what an infinite cache ends up
    holding."""
    return cache_bound(requests, block)[1]


def cache_bound(requests: list[SimRequest], block: int) -> tuple[float, int]:
    """``infinite_cache_bound`` and ``working_set_tokens`` in one pass."""
    seen: set = set()
    hit = total = working = 0
    for r in sorted(requests, key=lambda r: r.arrival):
        n = r.num_tokens
        total += n
        keys, size, prompt_blocks = prefix_keys(r, block, with_output=True)
        matched = 0
        for k in keys[:prompt_blocks]:
            if k not in seen:
                break
            matched += 1
        hit += min(matched * size, n - 1)
        for k in keys[matched:]:
            if k not in seen:
                seen.add(k)
                working += size
    return (hit / total if total else 0.0), working
