"""Golden tests on frames recorded from a real vLLM 0.32.0 engine (../shared/fixtures)."""

from collections import Counter

import msgspec
import pytest

from router.events.codec import (
    AllBlocksCleared,
    BlockStored,
    RawBlockStored,
    decode_message,
    decode_replay_frames,
    encode_payload,
    token_ids_of,
)
from router.events.feed import IndexFeeder
from router.events.recording import read_recording
from router.events.replay_file import replay_file
from router.index import KvIndex, Medium
from router.keys import request_keys

BLOCK = 32


@pytest.fixture
def recording(fixture_path):
    return list(read_recording(fixture_path))


def live(recording, raw_tokens=False):
    return [decode_message(r.frames, raw_tokens) for r in recording if r.kind == "pub"]


@pytest.mark.parametrize("raw_tokens", [False, True])
def test_every_frame_decodes_and_reencodes_byte_exact(recording, raw_tokens):
    msgs = live(recording, raw_tokens)
    assert [m.seq for m in msgs] == list(range(len(msgs)))
    assert all(m.topic == "kv" and m.batch.data_parallel_rank == 0 for m in msgs)
    for rec, msg in zip([r for r in recording if r.kind == "pub"], msgs, strict=True):
        assert encode_payload(msg.batch) == rec.frames[2]


def test_event_counts_match_an_independent_decode(recording, fixture_path):
    expected: Counter[str] = Counter()
    for r in recording:
        if r.kind == "pub":
            for ev in msgspec.msgpack.decode(r.frames[2])[1]:
                expected[ev["type"]] += 1
    report = replay_file(fixture_path, block_size=BLOCK)
    feed = report.feeder.feeds["kv"]
    assert dict(feed.events) == dict(expected)
    assert expected["BlockStored"] == 20 and expected["AllBlocksCleared"] == 1
    assert feed.malformed == 0 and feed.gaps == 0 and feed.orphan_blocks == 0
    assert feed.unknown_removals == 0  # every BlockRemoved resolved through the engine-hash map


def test_stored_token_ids_rebuild_the_recorded_prompts(recording):
    tokenized = next(r for r in recording if r.kind == "request" and r.raw["path"] == "/tokenize")
    prompt = tokenized.raw["response"]["tokens"]
    msgs = live(recording)
    roots = [e for m in msgs for e in m.batch.events if isinstance(e, BlockStored)]
    first = next(e for e in roots if e.token_ids[:8] == prompt[:8])
    n_full = len(prompt) // BLOCK
    assert first.token_ids == prompt[: n_full * BLOCK]
    # the next block (prompt tail + generated tokens) chains onto the prompt's last block
    child = next(e for e in roots if e.parent_block_hash == first.block_hashes[-1])
    assert child.token_ids[: len(prompt) - n_full * BLOCK] == prompt[n_full * BLOCK :]
    # every request that began a new prefix stored floor(prompt_tokens / block) full blocks
    pending = None
    checked = 0
    for r in recording:
        if r.kind == "pub":
            evs = [e for e in decode_message(r.frames).batch.events if isinstance(e, BlockStored)]
            if evs and evs[0].parent_block_hash is None:
                pending = sum(len(e.block_hashes) for e in evs)
        elif r.kind == "request" and r.raw["path"] == "/v1/completions" and pending is not None:
            assert pending == r.raw["response"]["usage"]["prompt_tokens"] // BLOCK
            checked += 1
            pending = None
    assert checked >= 12


def test_cache_salt_request_gets_other_keys_than_the_unsalted_one(recording):
    index = KvIndex()
    feeder = IndexFeeder(index, block_size=BLOCK)
    salted = plain = None
    for m in live(recording):
        feeder.offer("kv", m.seq, m.batch, 0.0)
        for e in m.batch.events:
            if isinstance(e, BlockStored) and e.parent_block_hash is None:
                if e.extra_keys and e.extra_keys[0] == ["tenant-a"]:
                    salted = e
                elif plain is None:
                    plain = e
        if salted is not None:
            break
    assert salted is not None and plain is not None
    assert salted.token_ids[:BLOCK] == plain.token_ids[:BLOCK]  # same text ...
    k_salted = index.key_of("kv", salted.block_hashes[0])
    k_plain = index.key_of("kv", plain.block_hashes[0])
    assert k_salted != k_plain  # ... different tenant, different key
    # the router computes the same keys from the request side as the index did from the events
    assert request_keys(salted.token_ids, BLOCK, cache_salt="tenant-a")[0] == k_salted
    assert request_keys(plain.token_ids, BLOCK)[0] == k_plain
    hits = index.match(request_keys(plain.token_ids, BLOCK, cache_salt="tenant-b"))
    assert hits == {}


def test_after_all_blocks_cleared_index_holds_exactly_what_followed(recording, fixture_path):
    report = replay_file(fixture_path, block_size=BLOCK)
    index = report.feeder.index
    last = live(recording)[-1]
    assert isinstance(last.batch.events[0], AllBlocksCleared)
    after = [e for e in last.batch.events[1:] if isinstance(e, BlockStored)]
    stored_after = [h for e in after for h in e.block_hashes]
    assert index.blocks_held("kv") == {Medium.GPU: len(stored_after), Medium.CPU: 0, Medium.STORAGE: 0}
    tokens = [t for e in after for t in e.token_ids]
    match = index.match(request_keys(tokens, BLOCK))
    assert match["kv"].gpu == len(stored_after)
    earlier = next(e for m in live(recording)[:-1] for e in m.batch.events if isinstance(e, BlockStored))
    assert index.match(request_keys(earlier.token_ids, BLOCK)) == {}


def test_replay_frames_decode_the_same_as_live_frames(recording):
    by_seq = {m.seq: m for m in live(recording)}
    replies = [r for r in recording if r.kind == "replay"]
    decoded = [decode_replay_frames(r.frames) for r in replies]
    assert decoded[-1] is None  # the end marker
    assert [m.seq for m in decoded[:-1]] == list(range(replies[0].raw["from_seq"], max(by_seq)))
    for m in decoded[:-1]:
        assert m == by_seq[m.seq]


def test_the_routers_decode_indexes_exactly_what_a_full_decode_does(recording):
    """The router's ingest decodes token ids raw (``RawBlockStored``, read into uint32s by ``token_ids_of``):
    the same blocks, keys and counts as from fully decoded events, on every prefix of the recording."""
    feeders = {raw: IndexFeeder(KvIndex(), block_size=BLOCK) for raw in (False, True)}
    full, raw = live(recording), live(recording, raw_tokens=True)
    assert any(type(e) is RawBlockStored for m in raw for e in m.batch.events)
    for a, b in zip(full, raw, strict=True):
        feeders[False].offer("kv", a.seq, a.batch, 0.0)
        feeders[True].offer("kv", b.seq, b.batch, 0.0)
        for e in a.batch.events:
            if isinstance(e, BlockStored):
                assert token_ids_of(next(x for x in b.batch.events if getattr(x, "block_hashes", None) ==
                                         e.block_hashes).token_ids).tolist() == e.token_ids
                assert [feeders[True].index.key_of("kv", h) for h in e.block_hashes] == \
                    [feeders[False].index.key_of("kv", h) for h in e.block_hashes]
        assert feeders[True].index.blocks_held("kv") == feeders[False].index.blocks_held("kv")
    f_full, f_raw = feeders[False].feeds["kv"], feeders[True].feeds["kv"]
    assert dict(f_raw.events) == dict(f_full.events) and f_raw.malformed == f_full.malformed == 0
