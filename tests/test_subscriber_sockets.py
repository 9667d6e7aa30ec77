"""Real ZeroMQ sockets: gaps, replay, restarts, garbage, both topologies."""

import random

import pytest
import zmq.asyncio

from router.events.codec import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from router.events.feed import IndexFeeder
from router.events.subscriber import EventSource, KvEventSubscriber
from router.index import KvIndex, Medium
from tests.zmq_helpers import TestPublisher, wait_until

pytestmark = pytest.mark.sockets
BLOCK = 4


def workload(n_batches: int, seed: int = 0) -> list[EventBatch]:
    """Chained stores and removals, as an engine would publish them."""
    rng = random.Random(seed)
    batches, live, next_hash = [], [], 1
    for i in range(n_batches):
        events = []
        if live and rng.random() < 0.4:
            gone = rng.sample(live, min(len(live), rng.randint(1, 3)))
            live = [h for h in live if h not in gone]
            events.append(BlockRemoved(gone, "GPU", 0))
        n = rng.randint(1, 4)
        hashes = list(range(next_hash, next_hash + n))
        next_hash += n
        parent = live[-1] if live and rng.random() < 0.5 else None
        tokens = [rng.randrange(1000) for _ in range(n * BLOCK)]
        events.append(BlockStored(hashes, parent, tokens, BLOCK, None, "GPU", None, [None] * n, 0, "full_attention"))
        live.extend(hashes)
        batches.append(EventBatch(float(i), events, 0))
    return batches


@pytest.fixture
async def ctx():
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


async def run_stream(ctx, drop: set[int], replay: bool, batches: list[EventBatch]):
    pub = TestPublisher(ctx, replay=replay)
    feeder = IndexFeeder(KvIndex(), block_size=BLOCK, resync_after_s=3600)
    sub = KvEventSubscriber(feeder, ctx=ctx, replay_timeout_s=2.0)
    sub.add_source(EventSource("w", pub.endpoint, pub.replay_endpoint))
    await pub.wait_subscribed()
    await wait_until(lambda: "w" in sub.ready)  # connect-time replay read (nothing yet) before the stream
    for i, b in enumerate(batches):
        await pub.publish(b, send=i not in drop)
    last = len(batches) - 1
    await wait_until(lambda: feeder.feeds.get("w") is not None and feeder.feeds["w"].last_seq == last)
    await sub.stop()
    await pub.close()
    return feeder


async def test_gap_is_replayed_and_ends_identical_to_a_gap_free_run(ctx):
    batches = workload(40)
    clean = await run_stream(ctx, set(), True, batches)
    gappy = await run_stream(ctx, {5, 6, 7, 20}, True, batches)
    f = gappy.feeds["w"]
    assert f.gaps == 2 and f.gaps_filled == 2 and f.synced
    assert gappy.index.resident_keys("w") == clean.index.resident_keys("w")
    assert sum(gappy.index.blocks_held("w").values()) > 0
    assert f.events == clean.feeds["w"].events


async def test_without_replay_a_gap_clears_and_marks_unsynced(ctx):
    batches = workload(30)
    feeder = await run_stream(ctx, {10}, False, batches)
    f = feeder.feeds["w"]
    assert f.gaps == 1 and f.gaps_filled == 0
    assert not f.synced
    assert feeder.status("w", now=0.0).state == "unsynced"
    # what is left is a subset of the truth: only blocks stored after the gap
    clean = await run_stream(ctx, set(), False, batches)
    kept = feeder.index.resident_keys("w")
    truth = clean.index.resident_keys("w")
    assert kept[Medium.GPU] and kept[Medium.GPU] < truth[Medium.GPU]


async def test_seq_reset_means_engine_restart_and_clears(ctx):
    pub = TestPublisher(ctx)
    feeder = IndexFeeder(KvIndex(), block_size=BLOCK)
    sub = KvEventSubscriber(feeder, ctx=ctx)
    sub.add_source(EventSource("w", pub.endpoint, pub.replay_endpoint))
    await pub.wait_subscribed()
    await wait_until(lambda: "w" in sub.ready)
    for b in workload(5, seed=1):
        await pub.publish(b)
    await wait_until(lambda: feeder.feeds.get("w") is not None and feeder.feeds["w"].last_seq == 4)
    before = feeder.index.resident_keys("w")[0]
    pub.restart()
    fresh = workload(2, seed=2)
    for b in fresh:
        await pub.publish(b)
    await wait_until(lambda: feeder.feeds["w"].resets == 1 and feeder.feeds["w"].last_seq == 1)
    after = feeder.index.resident_keys("w")[0]
    assert before and after and before.isdisjoint(after)
    assert feeder.feeds["w"].synced
    await sub.stop()
    await pub.close()


async def test_garbage_frames_are_counted_and_skipped(ctx):
    pub = TestPublisher(ctx, replay=False)
    feeder = IndexFeeder(KvIndex(), block_size=BLOCK)
    sub = KvEventSubscriber(feeder, ctx=ctx)
    sub.add_source(EventSource("w", pub.endpoint))
    await pub.wait_subscribed()
    good = workload(3, seed=3)
    await pub.publish(good[0])
    await pub.send_raw([b"kv", b"\x00" * 8, b"\xc1 not msgpack"])
    await pub.send_raw([b"kv", b"short", b""])
    await pub.send_raw([b"only-one-frame"])
    await pub.send_raw([b"kv", (1).to_bytes(8, "big"), b"\x92\x01\x02"])  # valid msgpack, wrong shape
    bad_event = BlockStored([1, 2], None, [1, 2, 3], BLOCK, None, "GPU")  # too few tokens
    await pub.publish(EventBatch(1.0, [bad_event, *good[1].events], 0))
    await pub.publish(good[2])
    await wait_until(lambda: feeder.feeds.get("w") is not None and feeder.feeds["w"].last_seq == 2)
    f = feeder.feeds["w"]
    assert f.malformed == 5  # four bad frames + one bad event inside a good batch
    assert f.gaps == 0 and f.synced
    assert f.events["BlockStored"] == 3
    await sub.stop()
    await pub.close()


async def test_bind_topology_names_workers_by_topic(ctx):
    feeder = IndexFeeder(KvIndex(), block_size=BLOCK)
    sub = KvEventSubscriber(feeder, ctx=ctx, bind="tcp://127.0.0.1:*")
    await sub.start()
    pubs = [TestPublisher(ctx, topic=t, replay=False, connect=sub.bound_endpoint) for t in ("w1", "w2")]
    for p in pubs:
        await p.wait_subscribed()
    for i, p in enumerate(pubs):
        for b in workload(3, seed=10 + i):
            await p.publish(b)
        await p.publish(EventBatch(9.0, [AllBlocksCleared()], 0))
        await p.publish(workload(1, seed=20 + i)[0])
    await wait_until(lambda: all(feeder.feeds.get(w) and feeder.feeds[w].last_seq == 4 for w in ("w1", "w2")))
    for w in ("w1", "w2"):
        assert feeder.feeds[w].events["AllBlocksCleared"] == 1
        assert sum(feeder.index.blocks_held(w).values()) > 0
    assert feeder.index.resident_keys("w1")[0].isdisjoint(feeder.index.resident_keys("w2")[0])
    await sub.stop()
    for p in pubs:
        await p.close()


async def test_a_long_lived_engine_is_known_at_connect_before_any_live_batch(ctx):
    """The router meets an engine mid-life: its replay buffer is read at connect, not when traffic starts."""
    batches = workload(30, seed=4)
    clean = await run_stream(ctx, set(), True, batches)
    pub = TestPublisher(ctx)
    for b in batches[:25]:  # published before the router exists: only the replay buffer has them
        await pub.publish(b, send=False)
    feeder = IndexFeeder(KvIndex(), block_size=BLOCK, resync_after_s=3600)
    sub = KvEventSubscriber(feeder, ctx=ctx, replay_timeout_s=2.0)
    sub.add_source(EventSource("w", pub.endpoint, pub.replay_endpoint))
    await wait_until(lambda: "w" in sub.ready)
    f = feeder.feeds["w"]
    assert f.synced and f.last_seq == 24 and f.gaps == 0  # known before a single live batch
    await pub.wait_subscribed()
    await pub.send_raw(pub.buffer[24][1])  # seq 24 also arriving live (published during the replay): skipped
    for b in batches[25:]:
        await pub.publish(b)
    await wait_until(lambda: f.last_seq == 29)
    assert f.gaps == 0 and f.resets == 0 and f.duplicates == 1
    assert feeder.index.resident_keys("w") == clean.index.resident_keys("w")
    await sub.stop()
    await pub.close()
