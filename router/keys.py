"""Token ids -> chained block keys.

A block key names a whole prefix: ``key_i = xxh3_64(tokens of block i, seed=mix(key_{i-1}, extra_i))``.
The router computes the same keys from a request's tokens and from the ``token_ids`` that vLLM puts in
``BlockStored`` events, so the engine's hash seed and algorithm never need to be reproduced; an
engine-hash -> key map per worker resolves ``BlockRemoved``.

``extra_i`` follows vLLM's ``generate_block_hash_extra_keys``: LoRA name on every block, ``cache_salt`` on
block 0 only (so tenants with different salts never share a key, even for identical text).
Only full blocks get keys: the engine never caches a partial block.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

try:  # the compiled chain (router/_fastkeys.c): the same keys, an order of magnitude cheaper per block
    from router._fastkeys import chain as _compiled_chain
except ImportError:  # built without a C compiler: the Python loop below computes them
    _compiled_chain = None

ROOT_KEY = 0x6B76_726F_7574_6572  # "kvrouter": the parent of every block 0
_MASK64 = (1 << 64) - 1
_xxh3 = xxhash.xxh3_64_intdigest

Extra = tuple[Any, ...] | None


def extra_seed(extra: Extra) -> int:
    """Fold a block's extra keys (LoRA name, salt, ...) into a 64-bit value; 0 for none."""
    if not extra:
        return 0
    return _xxh3(repr(tuple(extra)).encode())


def request_extras(num_blocks: int, lora_name: str | None = None, cache_salt: str | None = None) -> list[Extra]:
    """Extra keys per block exactly as vLLM builds them for a request (lora, then salt on block 0)."""
    base: tuple[Any, ...] = (lora_name,) if lora_name else ()
    extras: list[Extra] = [base or None] * num_blocks
    if num_blocks and cache_salt:
        extras[0] = (*base, cache_salt)
    return extras


def _token_bytes(token_ids: Sequence[int] | np.ndarray | array) -> bytes:
    if type(token_ids) is list:  # (what the event decoder gives: checked first)
        return array("I", token_ids).tobytes()
    if isinstance(token_ids, np.ndarray):
        return np.ascontiguousarray(token_ids, dtype="<u4").tobytes()
    if isinstance(token_ids, array) and token_ids.typecode == "I":
        return token_ids.tobytes()
    return array("I", token_ids).tobytes()


def chain_keys(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    parent_key: int = ROOT_KEY,
    extras: Sequence[Extra] | None = None,
) -> list[int]:
    """Keys of the full blocks of ``token_ids``, continuing the chain from ``parent_key``.

    ``extras`` has one entry per full block (or is None). Token ids must fit in uint32;
    ``OverflowError``/``ValueError`` otherwise, which event ingestion counts as malformed.

    The chain is sequential (each block's seed is the previous key), so it cannot be batched: without extra
    keys it runs in C (router/_fastkeys.c) for the block sizes that covers; the Python loop below, one hash
    call per block, is the reference and the rest.
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    if extras is not None and len(extras) >= len(token_ids) // block_size and not any(extras):
        extras = None  # vLLM sends one None per block when there are no extra keys
    if extras is None and _compiled_chain is not None:
        keys = _compiled_chain(token_ids if type(token_ids) is list else _token_bytes(token_ids), block_size,
                               parent_key)
        if keys is not None:  # (None: a block size it does not cover)
            return keys
    data = _token_bytes(token_ids)  # bytes: slicing a bytes object is cheaper than a memoryview
    step = block_size * 4
    end = len(data) - len(data) % step
    key = parent_key
    if extras is None:
        return [key := _xxh3(data[i : i + step], key) for i in range(0, end, step)]
    keys = []
    for i, extra in zip(range(0, end, step), extras, strict=False):
        seed = key ^ extra_seed(extra) if extra else key
        key = _xxh3(data[i : i + step], seed & _MASK64)
        keys.append(key)
    if len(keys) < end // step:
        raise IndexError("fewer extra keys than blocks")
    return keys


def request_keys(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> list[int]:
    """Block keys of a request's prompt, as the index will know them from the engine's events."""
    n_blocks = len(token_ids) // block_size
    if not lora_name and not cache_salt:
        return chain_keys(token_ids, block_size)
    return chain_keys(token_ids, block_size, extras=request_extras(n_blocks, lora_name, cache_salt))
