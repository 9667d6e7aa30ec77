import random
from array import array

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from router import _fastkeys
from router import keys as keys_module
from router.keys import ROOT_KEY, chain_keys, request_extras, request_keys

tokens_st = st.lists(st.integers(min_value=0, max_value=2**32 - 1), min_size=0, max_size=200)


@settings(deadline=None)  # a loaded CI box must not turn a slow example into a failure
@given(tokens_st, st.integers(min_value=1, max_value=17))
def test_keys_are_prefix_closed_and_chain(tokens, block_size):
    keys = request_keys(tokens, block_size)
    assert len(keys) == len(tokens) // block_size
    for cut in range(0, len(tokens) + 1, block_size):
        assert request_keys(tokens[:cut], block_size) == keys[: cut // block_size]
    if len(keys) >= 2:  # continuing the chain from block k's key gives the same later keys
        assert chain_keys(tokens[block_size:], block_size, parent_key=keys[0]) == keys[1:]


def test_a_changed_token_changes_its_block_and_every_later_key():
    tokens = list(range(64))
    base = request_keys(tokens, 16)
    tokens[20] = 999
    changed = request_keys(tokens, 16)
    assert changed[0] == base[0]
    assert all(a != b for a, b in zip(base[1:], changed[1:], strict=True))


def test_partial_block_gets_no_key_and_numpy_input_matches_lists():
    tokens = list(range(40))
    assert request_keys(tokens, 16) == request_keys(tokens[:32], 16)
    assert request_keys(np.array(tokens, dtype=np.int64), 16) == request_keys(tokens, 16)


def test_cache_salt_isolates_tenants_and_lora_separates_adapters():
    tokens = list(range(64))
    plain = request_keys(tokens, 16)
    a = request_keys(tokens, 16, cache_salt="tenant-a")
    b = request_keys(tokens, 16, cache_salt="tenant-b")
    lora = request_keys(tokens, 16, lora_name="sql-adapter")
    assert len({plain[0], a[0], b[0], lora[0]}) == 4
    assert set(plain).isdisjoint(a) and set(a).isdisjoint(b) and set(plain).isdisjoint(lora)
    assert request_keys(tokens, 16, cache_salt="tenant-a") == a  # deterministic


def test_request_extras_follow_vllm_order():
    assert request_extras(3, "lora", "salt") == [("lora", "salt"), ("lora",), ("lora",)]
    assert request_extras(2, None, "salt") == [("salt",), None]
    assert request_extras(2) == [None, None]


def test_bad_tokens_and_block_size_are_errors():
    with pytest.raises(OverflowError):
        request_keys([-1] * 16, 16)
    with pytest.raises(ValueError):
        chain_keys([1, 2], 0)
    assert chain_keys([], 16, parent_key=ROOT_KEY) == []


def test_one_none_extra_per_block_is_no_extras_and_every_token_container_agrees():
    """vLLM sends ``extra_keys`` as one None per block: the keys are those of no extras at all, from a list,
    a tuple, an array('I') or a numpy array of the same tokens."""
    from array import array

    tokens = list(range(1000, 1064))
    keys = chain_keys(tokens, 16, parent_key=12345)
    assert chain_keys(tokens, 16, 12345, [None] * 4) == keys
    assert chain_keys(tuple(tokens), 16, 12345) == keys
    assert chain_keys(array("I", tokens), 16, 12345) == keys
    assert chain_keys(np.array(tokens, dtype=np.uint32), 16, 12345) == keys
    salted = chain_keys(tokens, 16, 12345, [("s",), None, None, None])
    assert salted[0] != keys[0] and all(a != b for a, b in zip(salted, keys, strict=True))
    with pytest.raises(IndexError):
        chain_keys(tokens, 16, 12345, [("s",), None])  # fewer extras than blocks


def test_the_compiled_chain_is_built():
    """The package's build compiles router/_fastkeys.c (setup.py); without it every key takes the Python loop."""
    assert keys_module._compiled_chain is not None, "router._fastkeys was not built: is a C compiler installed?"


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 70), st.integers(0, 2**64 - 1), st.data())
def test_the_compiled_chain_computes_the_python_keys(block_size, parent, data):
    """Block sizes it covers (5 to 60 tokens: 20 to 240 bytes, both XXH3 length classes) and ones it hands back
    to the Python path; token lists, arrays and numpy arrays; the same keys as the xxhash package's loop."""
    tokens = data.draw(st.lists(st.integers(0, 2**32 - 1), max_size=block_size * 5))
    with_c = chain_keys(tokens, block_size, parent)
    saved = keys_module._compiled_chain
    keys_module._compiled_chain = None
    try:
        reference = chain_keys(tokens, block_size, parent)
    finally:
        keys_module._compiled_chain = saved
    assert with_c == reference
    assert chain_keys(np.array(tokens, dtype=np.uint32), block_size, parent) == reference
    assert chain_keys(array("I", tokens), block_size, parent) == reference


def test_the_compiled_hash_is_xxh3():
    rng = random.Random(7)
    for n in range(17, 241):
        for _ in range(4):
            block = rng.randbytes(n)
            seed = rng.getrandbits(64)
            assert _fastkeys.xxh3(block, seed) == xxhash.xxh3_64_intdigest(block, seed)


@pytest.mark.parametrize("bad", [[-1] * 16, [2**32] * 16, [1.5] * 16])
def test_the_compiled_chain_rejects_what_the_python_one_rejects(bad):
    with pytest.raises((OverflowError, TypeError)) as compiled:
        chain_keys(bad, 16)
    saved = keys_module._compiled_chain
    keys_module._compiled_chain = None
    try:
        with pytest.raises((OverflowError, TypeError)) as python:
            chain_keys(bad, 16)
    finally:
        keys_module._compiled_chain = saved
    assert compiled.type is python.type
