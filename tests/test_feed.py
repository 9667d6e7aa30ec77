"""Sequencing rules of the feed (pure, no sockets)."""

import json
import subprocess
import sys

from router.events.codec import AllBlocksCleared, BlockStored, EventBatch
from router.events.feed import Gap, IndexFeeder
from router.index import KvIndex, Medium


def stored(h: int, tokens: list[int], parent=None) -> EventBatch:
    return EventBatch(0.0, [BlockStored([h], parent, tokens, 2, None, "GPU", None, [None], 0, None)], 0)


def test_first_contact_mid_stream_asks_for_replay_from_zero():
    feeder = IndexFeeder(KvIndex(), block_size=2)
    gap = feeder.offer("w", 5, stored(1, [1, 2]), now=0.0)
    assert gap == Gap("w", 0, 5)
    replayed = [(s, stored(10 + s, [s, s])) for s in range(5)]
    assert feeder.fill_gap(gap, replayed, stored(1, [1, 2]), now=0.0)
    assert feeder.status("w", 0.0).state == "synced"
    assert sum(feeder.index.blocks_held("w").values()) == 6


def test_unsynced_worker_resyncs_after_fresh_events_or_a_clear():
    feeder = IndexFeeder(KvIndex(), block_size=2, resync_after_s=10.0)
    feeder.offer("w", 0, stored(1, [1, 2]), now=0.0)
    gap = feeder.offer("w", 3, stored(2, [3, 4]), now=1.0)
    assert gap is not None and not feeder.fill_gap(gap, [], stored(2, [3, 4]), now=1.0)
    assert feeder.status("w", 1.0).state == "unsynced"
    assert not feeder.index.holds("w", feeder.index.key_of("w", 1) or 0)  # cleared
    feeder.offer("w", 4, stored(3, [5, 6]), now=5.0)
    assert feeder.status("w", 5.0).state == "unsynced"
    feeder.offer("w", 5, stored(4, [7, 8]), now=11.5)
    assert feeder.status("w", 11.5).state == "synced"
    # an AllBlocksCleared also makes the state exact at once
    gap = feeder.offer("w", 9, stored(5, [9, 9]), now=12.0)
    feeder.fill_gap(gap, [], stored(5, [9, 9]), now=12.0)
    feeder.offer("w", 10, EventBatch(0.0, [AllBlocksCleared()], 0), now=12.1)
    assert feeder.status("w", 12.1).state == "synced"


def test_stale_is_reported_from_event_age():
    feeder = IndexFeeder(KvIndex(), block_size=2)
    feeder.offer("w", 0, stored(1, [1, 2]), now=100.0)
    assert feeder.status("w", 101.0, stale_after_s=5.0).state == "synced"
    st = feeder.status("w", 106.0, stale_after_s=5.0)
    assert st.state == "stale" and st.last_event_age_s == 6.0


def test_block_size_mismatch_and_orphans_are_counted_not_indexed():
    feeder = IndexFeeder(KvIndex(), block_size=2)
    feeder.offer("w", 0, EventBatch(0.0, [BlockStored([1], None, [1, 2, 3], 3, None, "GPU")], 0), 0.0)
    feeder.offer("w", 1, stored(2, [1, 2], parent=999), 0.0)
    f = feeder.feeds["w"]
    assert f.block_size_mismatch == 1 and f.orphan_blocks == 1
    assert sum(feeder.index.blocks_held("w").values()) == 0


def test_sglang_style_salt_field_is_folded_like_vllm_extra_keys():
    from router.keys import request_keys

    feeder = IndexFeeder(KvIndex(), block_size=2)
    ev = BlockStored([-5, -6], None, [1, 2, 3, 4], 2, None, "CPU_PINNED", cache_salt="t1")
    feeder.offer("s", 0, EventBatch(0.0, [ev], 0), 0.0)
    m = feeder.index.match(request_keys([1, 2, 3, 4], 2, cache_salt="t1"))
    assert m["s"].cpu == 2 and m["s"].gpu == 0


def test_cli_index_replay_json_has_stable_keys(fixture_path):
    out = subprocess.run(
        [sys.executable, "-m", "router.cli", "index", "replay", str(fixture_path), "--json", "--block-size", "32"],
        check=True, capture_output=True, text=True,
    ).stdout
    data = json.loads(out)
    w = data["workers"]["kv"]
    assert set(w) == {"blocks", "events", "malformed", "gaps"}
    assert w["blocks"] == {"GPU": 10, "CPU": 0, "STORAGE": 0}
    assert w["events"]["AllBlocksCleared"] == 1 and w["malformed"] == 0 and w["gaps"] == 0


def test_cli_bench_index_quick_json():
    out = subprocess.run([sys.executable, "-m", "router.cli", "bench", "index", "--quick", "--json"],
                         check=True, capture_output=True, text=True).stdout
    data = json.loads(out)
    assert data["ingest_block_events_per_s"] > 0
    assert set(data["match_p99_ms"]) == {"8k", "32k"} and data["bytes_per_resident_block"] > 0
    compact = data["layouts"]["compact"]  # under steady eviction the compact layout stays within its budget
    assert 0 < compact["bytes_per_resident_block_churn"] <= 40


def test_replayed_batches_before_a_clear_are_skipped_and_the_result_is_the_same():
    batches = [stored(100 + i, [i, i]) for i in range(6)]
    batches[3] = EventBatch(0.0, [AllBlocksCleared(), *stored(200, [9, 9]).events], 0)
    replayed = list(enumerate(batches))
    fast = IndexFeeder(KvIndex(), block_size=2)
    gap = fast.offer("w", 6, stored(300, [7, 7]), now=0.0)
    assert fast.fill_gap(gap, replayed, stored(300, [7, 7]), now=0.0)
    slow = IndexFeeder(KvIndex(), block_size=2)
    for seq, b in replayed:
        slow.offer("w", seq, b, now=0.0)
    slow.offer("w", 6, stored(300, [7, 7]), now=0.0)
    assert fast.index.engine_hashes("w") == slow.index.engine_hashes("w")
    assert fast.feeds["w"].superseded_batches == 3 and fast.feeds["w"].synced


def test_a_replay_that_reaches_back_to_a_clear_is_exact_without_seq_zero():
    """A long-lived engine's replay buffer no longer holds seq 0, but holds its last cache reset."""
    batches = {seq: stored(100 + seq, [seq, seq]) for seq in range(20, 26)}
    batches[22] = EventBatch(0.0, [AllBlocksCleared(), *stored(200, [9, 9]).events], 0)
    feeder = IndexFeeder(KvIndex(), block_size=2)
    gap = feeder.offer("w", 26, stored(300, [7, 7]), now=0.0)  # first contact: ask for 0..25
    assert feeder.fill_gap(gap, list(batches.items()), stored(300, [7, 7]), now=0.0)
    f = feeder.feeds["w"]
    assert f.synced and f.superseded_batches == 2 and f.last_seq == 26
    assert feeder.index.engine_hashes("w")[Medium.GPU] == {200, 123, 124, 125, 300}
    # the same buffer without the reset cannot say what the engine held before seq 20: unsynced, cleared
    del batches[22]
    batches[22] = stored(122, [22, 22])
    other = IndexFeeder(KvIndex(), block_size=2)
    gap = other.offer("w", 26, stored(300, [7, 7]), now=0.0)
    assert not other.fill_gap(gap, list(batches.items()), stored(300, [7, 7]), now=0.0)
    assert not other.feeds["w"].synced and other.index.engine_hashes("w")[Medium.GPU] == {300}


def test_connect_time_replay_skips_duplicates_but_still_sees_a_restart():
    feeder = IndexFeeder(KvIndex(), block_size=2)
    history = [(seq, EventBatch(float(seq), stored(10 + seq, [seq, seq]).events, 0)) for seq in range(5)]
    assert feeder.bootstrap("w", history, now=0.0)
    f = feeder.feeds["w"]
    assert f.synced and f.last_seq == 4 and len(feeder.index.engine_hashes("w")[Medium.GPU]) == 5
    assert feeder.offer("w", 4, history[4][1], now=0.1) is None and f.duplicates == 1 and f.resets == 0
    # the engine restarted meanwhile: seq 0 again, but a batch it never sent before
    assert feeder.offer("w", 0, EventBatch(9.0, stored(99, [1, 1]).events, 0), now=0.2) is None
    assert f.resets == 1 and feeder.index.engine_hashes("w")[Medium.GPU] == {99}
    # a buffer that neither starts at seq 0 nor holds a reset says nothing exact: left to the live path
    other = IndexFeeder(KvIndex(), block_size=2)
    assert not other.bootstrap("w", history[2:], now=0.0)
    assert "w" not in other.feeds  # no feed made: the worker still counts as not heard from, not unsynced
    assert not other.bootstrap("v", [], now=0.0) and "v" not in other.feeds
