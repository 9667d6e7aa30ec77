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
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    data = memoryview(_token_bytes(token_ids))
    step = block_size * 4
    n_blocks = len(data) // step
    keys = [0] * n_blocks
    key = parent_key
    if extras is None:
        for i in range(n_blocks):
            key = _xxh3(data[i * step : (i + 1) * step], key)
            keys[i] = key
    else:
        for i in range(n_blocks):
            seed = key ^ extra_seed(extras[i]) if extras[i] else key
            key = _xxh3(data[i * step : (i + 1) * step], seed & _MASK64)
            keys[i] = key
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
