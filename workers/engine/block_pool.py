"""A paged KV block pool with prefix caching, as vLLM v1's ``BlockPool`` does it. Pure.

- Full blocks get an engine hash (parent hash, tokens, extra keys) and stay cached after their request
  frees them; a free queue ordered oldest-freed first supplies new blocks, evicting the cached block it
  hands out (``BlockRemoved``). Blocks are freed tail first, so a prefix outlives its extensions.
- Optional CPU tier: a cached GPU block evicted from the pool is offloaded there (``BlockStored`` with
  ``medium: CPU``), kept LRU within its own capacity (``BlockRemoved`` CPU when dropped). A prefix hit in
  the CPU tier is loaded back into a GPU block (charged by the timing model).
- Every change that vLLM would publish is appended to ``pending_events`` for the engine to batch per step.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import struct
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from router.events.codec import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

NONE_HASH = 0x5EED_0F_E9_61_9E  # the engine's own root, unlike the router's
_MIX = 0xD6E8FEB86659FD93
_MASK = (1 << 64) - 1


def engine_block_hash(parent: int | None, tokens: bytes | memoryview, extra: tuple[Any, ...] | None) -> int:
    """The engine's own block hash, as vLLM's ``xxhash`` option: (parent, tokens, extra keys) -> 64 bits.

    ``tokens`` are the block's uint32 token ids as bytes. Deliberately another function than the router's
    keys (other root, parent mixed differently): the router must resolve blocks from the events' token ids,
    never by reproducing the engine's hash.
    """
    seed = ((parent if parent is not None else NONE_HASH) * _MIX) & _MASK
    if extra:
        seed ^= xxhash.xxh3_64_intdigest(repr(extra).encode())
    return xxhash.xxh3_64_intdigest(tokens, seed)


# ---- vLLM's own block hashes (vllm/v1/core/kv_cache_utils.py and vllm/utils/hashing.py, vLLM 0.32) --------------
# ``native``: the engine model's fast hash above (the default: the router never needs the engine's hash). The others
# are vLLM's ``--prefix-caching-hash-algo`` values, reproduced bit for bit so that peers which recompute vLLM's hashes
# from a request's tokens (vllm-router's kv_aware, llm-d's precise scorer) find the simulated workers' blocks.
VLLM_HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
HASH_ALGOS = ("native", *VLLM_HASH_ALGOS)
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"  # vLLM's seed for cryptographic algorithms without PYTHONHASHSEED


def _cbor(obj: Any, out: bytearray) -> None:
    """Canonical CBOR (RFC 8949 core deterministic, as ``cbor2.dumps(obj, canonical=True)``) of what a block hash
    holds: ints, bytes, str, None, bools and tuples/lists of them. Written here so the engine model needs no cbor2."""
    if obj is None:
        out.append(0xF6)
    elif obj is True or obj is False:
        out.append(0xF5 if obj else 0xF4)
    elif isinstance(obj, int):
        if obj >= 0:
            _cbor_head(0, obj, out)
        else:
            _cbor_head(1, -1 - obj, out)
    elif isinstance(obj, (bytes, bytearray, memoryview)):
        b = bytes(obj)
        _cbor_head(2, len(b), out)
        out += b
    elif isinstance(obj, str):
        b = obj.encode()
        _cbor_head(3, len(b), out)
        out += b
    elif isinstance(obj, (tuple, list)):
        _cbor_head(4, len(obj), out)
        for x in obj:
            _cbor(x, out)
    else:
        raise TypeError(f"no canonical CBOR here for {type(obj).__name__}")


def _cbor_head(major: int, n: int, out: bytearray) -> None:
    if n >= 1 << 64:
        raise ValueError("integer too large for a CBOR head")
    m = major << 5
    if n < 24:
        out.append(m | n)
    elif n < 1 << 8:
        out += struct.pack(">BB", m | 24, n)
    elif n < 1 << 16:
        out += struct.pack(">BH", m | 25, n)
    elif n < 1 << 32:
        out += struct.pack(">BI", m | 26, n)
    else:
        out += struct.pack(">BQ", m | 27, n)


def cbor_canonical(obj: Any) -> bytes:
    out = bytearray()
    _cbor(obj, out)
    return bytes(out)


def _pickled(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


_SERIALIZE: dict[str, Callable[[Any], bytes]] = {
    "sha256": _pickled, "sha256_cbor": cbor_canonical, "xxhash": _pickled, "xxhash_cbor": cbor_canonical}


def vllm_hash_fn(algo: str) -> Callable[[Any], bytes]:
    """vLLM's ``get_hash_fn_by_name``: sha256 / xxh3-128 over pickle (protocol 5) or canonical CBOR."""
    if algo not in _SERIALIZE:
        raise ValueError(f"unknown prefix caching hash algorithm {algo!r}; one of {', '.join(VLLM_HASH_ALGOS)}")
    ser = _SERIALIZE[algo]
    if algo.startswith("sha256"):
        return lambda obj: hashlib.sha256(ser(obj)).digest()
    return lambda obj: xxhash.xxh3_128_digest(ser(obj))


def resolve_none_hash_seed(algo: str, python_hash_seed: str | None) -> str:
    """vLLM's ``resolve_none_hash_seed``: PYTHONHASHSEED when set; else a fixed seed for sha256 and sha256_cbor
    (every engine agrees) and fresh random bytes for the xxhash ones (not collision resistant: the seed stays
    secret, and two engines then never share a hash)."""
    if python_hash_seed is not None:
        return python_hash_seed
    if algo.startswith("xxhash"):
        return os.urandom(32).hex()
    return DEFAULT_NONE_HASH_SEED


class VllmBlockHasher:
    """vLLM's ``hash_block_tokens`` for one engine: digest = algo((parent digest or NONE_HASH, tokens, extra keys)),
    NONE_HASH = algo(seed). The chain runs on full digests; what the events carry (and the pool keys) is the
    digest's last 8 bytes as an unsigned int, as ``maybe_convert_block_hash`` sends them."""

    __slots__ = ("algo", "fn", "none_hash", "seed")

    def __init__(self, algo: str, python_hash_seed: str | None = None) -> None:
        self.algo = algo
        self.fn = vllm_hash_fn(algo)
        self.seed = resolve_none_hash_seed(algo, python_hash_seed)
        self.none_hash: bytes = self.fn(self.seed)

    def digest(self, parent: bytes | None, tokens: Sequence[int], extra_keys: tuple[Any, ...] | None) -> bytes:
        return self.fn((parent or self.none_hash, tuple(tokens), extra_keys))

    @staticmethod
    def to_int(digest: bytes) -> int:
        return int.from_bytes(digest[-8:], "big")

    def chain(self, tokens: Sequence[int], block_size: int,
              extra_keys: Callable[[int], tuple[Any, ...] | None] = lambda i: None) -> list[int]:
        """The int hashes of every full block of ``tokens`` (a whole prompt), as vLLM publishes them."""
        out, parent = [], None
        for i in range(len(tokens) // block_size):
            parent = self.digest(parent, tokens[i * block_size : (i + 1) * block_size], extra_keys(i))
            out.append(self.to_int(parent))
        return out


def vllm_extra_keys(lora_name: str | None, cache_salt: str | None, block_index: int,
                    lora_path: str | None = None) -> tuple[Any, ...] | None:
    """vLLM 0.32's ``generate_block_hash_extra_keys`` for text requests: ("lora", name, path) on every block of a
    LoRA request, then ("cache_salt", salt) on block 0. (The events carry them untagged: name, salt.) A simulated
    adapter has no files: its path is its name unless given."""
    keys: list[tuple[str, ...]] = []
    if lora_name:
        keys.append(("lora", lora_name, lora_path or lora_name))
    if block_index == 0 and cache_salt:
        keys.append(("cache_salt", cache_salt))
    return tuple(keys) if keys else None


@dataclass(slots=True)
class CachedBlock:
    """What is known of a full block's content: enough to publish it and to offload it."""

    hash: int
    parent: int | None
    tokens: bytes | memoryview  # block_size uint32 token ids
    extra: tuple[Any, ...] | None


@dataclass(slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    cached: CachedBlock | None = None


@dataclass
class BlockPool:
    num_blocks: int
    block_size: int
    cpu_blocks: int = 0
    blocks: list[Block] = field(init=False)
    free: OrderedDict[int, None] = field(init=False)  # block ids, oldest-freed first
    cached: dict[int, list[int]] = field(init=False)  # engine hash -> GPU block ids holding it
    cpu: OrderedDict[int, CachedBlock] = field(init=False)  # engine hash -> content, LRU first
    pending_events: list[KvEvent] = field(init=False)

    def __post_init__(self) -> None:
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        self.free = OrderedDict((i, None) for i in range(self.num_blocks))
        self.cached = {}
        self.cpu = OrderedDict()
        self.pending_events = []

    # ---- queries -----------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def lookup(self, hashes: Sequence[int]) -> tuple[list[int], int]:
        """Longest cached prefix: GPU block ids hit, then how many further blocks the CPU tier holds."""
        gpu: list[int] = []
        for h in hashes:
            bids = self.cached.get(h)
            if not bids:
                break
            gpu.append(bids[0])
        cpu_hits = 0
        for h in hashes[len(gpu) :]:
            if h not in self.cpu:
                break
            cpu_hits += 1
        return gpu, cpu_hits

    # ---- allocation --------------------------------------------------------------------------
    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on hit blocks (pulling free ones out of the free queue)."""
        for bid in block_ids:
            b = self.blocks[bid]
            if b.ref_cnt == 0:
                del self.free[bid]
            b.ref_cnt += 1

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise MemoryError(f"need {n} blocks, {len(self.free)} free")
        out = []
        for _ in range(n):
            bid, _ = self.free.popitem(last=False)
            b = self.blocks[bid]
            if b.cached is not None:
                self._evict(b)
            b.ref_cnt = 1
            out.append(bid)
        return out

    def _evict(self, b: Block) -> None:
        c = b.cached
        assert c is not None
        copies = self.cached[c.hash]
        copies.remove(b.block_id)
        if not copies:
            del self.cached[c.hash]
        b.cached = None
        self.pending_events.append(BlockRemoved([c.hash], "GPU", 0))
        if self.cpu_blocks and c.hash not in self.cpu:
            self.cpu[c.hash] = c
            self.pending_events.append(self._stored_event([c], "CPU"))
            if len(self.cpu) > self.cpu_blocks:
                old, _ = self.cpu.popitem(last=False)
                self.pending_events.append(BlockRemoved([old], "CPU", 0))

    def free_blocks(self, block_ids: Sequence[int]) -> None:
        """Release a request's blocks, tail first, so its prefix is evicted last."""
        for bid in reversed(block_ids):
            b = self.blocks[bid]
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free[bid] = None

    def cache_full_blocks(self, block_ids: Sequence[int], contents: Sequence[CachedBlock]) -> None:
        """Blocks just filled: register them for reuse and publish them (one event per call)."""
        new: list[CachedBlock] = []
        blocks, cached, cpu = self.blocks, self.cached, self.cpu
        for bid, c in zip(block_ids, contents, strict=True):
            b = blocks[bid]
            if b.cached is not None:
                continue
            # computed twice concurrently: vLLM keeps both copies and publishes both (same hash)
            b.cached = c
            copies = cached.get(c.hash)
            if copies is None:
                cached[c.hash] = [bid]
            else:
                copies.append(bid)
            new.append(c)
            if cpu and c.hash in cpu:
                cpu.move_to_end(c.hash)
        # one event per run of consecutive blocks (a skipped block breaks the parent chain)
        run: list[CachedBlock] = []
        for c in new:
            if run and c.parent != run[-1].hash:
                self.pending_events.append(self._stored_event(run, "GPU"))
                run = []
            run.append(c)
        if run:
            self.pending_events.append(self._stored_event(run, "GPU"))

    def load_from_cpu(self, contents: Sequence[CachedBlock]) -> list[int]:
        """Bring CPU-tier hits back into fresh GPU blocks (they stay in the CPU tier too)."""
        for c in contents:  # most recent first, so offloads made by this allocation do not drop them
            self.cpu.move_to_end(c.hash)
        bids = self.allocate(len(contents))
        self.cache_full_blocks(bids, contents)
        return bids

    def _stored_event(self, contents: Sequence[CachedBlock], medium: str) -> BlockStored:
        tokens = array("I")  # list-like; the codec sends it as a list
        for c in contents:  # one copy, block by block (a join, then an array of it, copied twice)
            tokens.frombytes(c.tokens)
        extras = [list(c.extra) if c.extra else None for c in contents]
        return BlockStored(
            [c.hash for c in contents], contents[0].parent, tokens, self.block_size, None, medium,
            None, extras, 0, "full_attention",
        )

    def reset_prefix_cache(self) -> bool:
        """vLLM refuses while blocks are in use; otherwise forget every cached block."""
        if any(b.ref_cnt for b in self.blocks):
            return False
        for b in self.blocks:
            b.cached = None
        self.cached.clear()
        self.cpu.clear()
        self.pending_events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KvEvent]:
        events, self.pending_events = self.pending_events, []
        return events
