import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
