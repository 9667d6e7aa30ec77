"""The relay and the routers' bus consumer against a real nats-server (JetStream) and real ZeroMQ sockets.

Every wait is on an event: a relay's acknowledged-record watermark, a consumer's applied stream sequence, a
condition polled with a deadline; never a fixed sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
import zmq.asyncio

from bench.nats import nats_server
from router.discovery import parse_worker_arg
from router.events.bus import RESET, UNSYNCED, decode_record, subject_of, worker_token
from router.events.bus_nats import BusSubscriber
from router.events.codec import AllBlocksCleared, EventBatch
from router.events.feed import IndexFeeder
from router.events.relay import Relay, parse_relay_worker
from router.events.subscriber import EventSource
from router.index import KvIndex
from tests.test_subscriber_sockets import BLOCK, workload
from tests.zmq_helpers import TestPublisher, wait_until

pytestmark = pytest.mark.sockets


@pytest.fixture(scope="module")
def nats():
    with nats_server() as s:
        yield s


@pytest.fixture
async def ctx():
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


@contextlib.asynccontextmanager
async def relay_for(url: str, pubs: dict[str, TestPublisher], ctx, **kw) -> AsyncIterator[Relay]:
    sources = [EventSource(wid, p.endpoint, p.replay_endpoint, p.topic) for wid, p in pubs.items()]
    relay = Relay(url, sources, block_size=BLOCK, ctx=ctx, replay_timeout_s=2.0, **kw)
    relay.feeder.resync_after_s = 3600  # unsynced stays unsynced unless an event says otherwise
    await relay.start()
    try:
        for p in pubs.values():  # the relay's subscription (after a previous relay's unsubscription, if any)
            while (await asyncio.wait_for(p.pub.recv(), 5))[:1] != b"\x01":
                pass
        await wait_until(lambda: set(pubs) <= relay.subscriber.ready, 10)
        for wid in pubs:  # each epoch's first record (a reset) is on the bus: the bus is reachable
            await published(relay, wid)
        yield relay
    finally:
        await relay.stop()


@contextlib.asynccontextmanager
async def consumer(url: str, **kw) -> AsyncIterator[BusSubscriber]:
    feeder = IndexFeeder(KvIndex(), block_size=BLOCK, resync_after_s=3600)
    sub = BusSubscriber(feeder, url, heartbeat_s=0.5, retry_s=0.1, **kw)
    await sub.start()
    try:
        yield sub
    finally:
        await sub.stop()


async def published(relay: Relay, wid: str, timeout: float = 15.0) -> int:
    """Wait until every record the relay enqueued for ``wid`` is acknowledged; its stream sequence."""
    box = relay.outboxes[wid]
    await wait_until(lambda: box.empty and box.acked_n == box.next_n - 1, timeout)
    return box.acked_stream_seq


async def caught_up(relay: Relay, sub: BusSubscriber, wid: str, timeout: float = 15.0) -> None:
    """The relay has published everything for ``wid`` and the consumer applied up to it."""
    seq = await published(relay, wid, timeout)
    await wait_until(lambda: sub.follower.state(wid).stream_seq >= seq, timeout)


def same_index(a: IndexFeeder, b: IndexFeeder, wid: str) -> bool:
    return a.index.export_worker(wid) == b.index.export_worker(wid)


async def sent_until(relay: Relay, wid: str, last_seq: int) -> None:
    await wait_until(lambda: (f := relay.feeder.feeds.get(wid)) is not None and f.last_seq == last_seq, 10)


async def bus_records(url: str, wid: str) -> list:
    """Every record of a worker on the bus, in stream order (read back with a plain ephemeral consumer)."""
    import nats as nats_client

    nc = await nats_client.connect(url)
    try:
        js = nc.jetstream()
        sub = await js.subscribe(subject_of(wid), ordered_consumer=True)
        info = await js.get_last_msg("KVROUTER_EVENTS", subject_of(wid))
        out = []
        while True:
            msg = await sub.next_msg(timeout=5)
            out.append(decode_record(msg.data))
            if msg.metadata.sequence.stream >= info.seq:
                return out
    finally:
        await nc.close()


def test_worker_tokens_are_subject_tokens_and_distinct():
    ids = ["10.0.0.1:8000", "10_2E0", "w.1", "w*1", "w>", "pod-a", "dp@1 x", "ü", ""]
    tokens = [worker_token(i) for i in ids]
    assert len(set(tokens)) == len(ids)
    assert all(t and not set(t) & set(".*> \t") for t in tokens)
    assert worker_token("pod-a") == "pod-a"


def test_relay_worker_arg_takes_an_id_or_the_routers_spec():
    assert parse_relay_worker("w1,events=tcp://e:5557,replay=tcp://e:5558") == EventSource(
        "w1", "tcp://e:5557", "tcp://e:5558", "")
    assert parse_relay_worker("http://10.0.0.1:8000,events=tcp://e:5557").worker_id == "10.0.0.1:8000"
    with pytest.raises(ValueError, match="events"):
        parse_relay_worker("w1,replay=tcp://e:5558")


def test_events_bus_option_and_config_key():
    from router.cli import _load_router_config, build_parser
    from router.config import ConfigError, load_config

    args = build_parser().parse_args(["epp", "--events-bus", "nats://nats:4222", "--worker", "http://w:8000"])
    assert _load_router_config(args, {}).events_bus == "nats://nats:4222"
    assert load_config(None, environ={"KVROUTER_EVENTS_BUS": "nats://n:4222"}).events_bus == "nats://n:4222"
    assert load_config(None).events_bus is None  # direct ZeroMQ stays the default
    with pytest.raises(ConfigError, match="exclude"):
        load_config(None, {"events_bus": "nats://n:4222", "events_bind": "tcp://*:5557"})
    with pytest.raises(ConfigError, match="nats://"):
        load_config(None, {"events_bus": "tcp://n:4222"})


async def test_relay_gap_restart_reset_and_unrecoverable_gap_reach_the_consumer_exactly(nats, ctx):
    """Through one relay: a gap the replay fills, an engine restart (seq back to 0), an AllBlocksCleared, and a
    gap older than the replay buffer. A consumer of the bus ends with the relay's index and its sync state."""
    pub = TestPublisher(ctx, topic="kv")
    wid = "gap-restart-w"
    async with relay_for(nats.url, {wid: pub}, ctx) as relay, consumer(nats.url) as sub:
        sub.add_source(EventSource(wid, ""))
        batches = workload(30, seed=1)
        for i, b in enumerate(batches):
            await pub.publish(b, send=i not in {5, 6, 17})  # dropped on the wire, kept for replay
        await sent_until(relay, wid, 29)
        relay_feed = relay.feeder.feeds[wid]
        assert relay_feed.gaps_filled == 2 and relay_feed.synced
        await caught_up(relay, sub, wid)
        assert same_index(relay.feeder, sub.feeder, wid) and len(relay.index) > 0

        pub.restart()  # engine restart: seq 0 again, empty cache, no AllBlocksCleared
        for b in workload(8, seed=2):
            await pub.publish(b)
        await sent_until(relay, wid, 7)
        assert relay_feed.resets == 1
        await pub.publish(EventBatch(100.0, [AllBlocksCleared()], 0))
        for b in workload(6, seed=3):
            await pub.publish(b)
        await sent_until(relay, wid, 14)
        await caught_up(relay, sub, wid)
        assert same_index(relay.feeder, sub.feeder, wid) and len(relay.index) > 0

        lost = {pub.seq, pub.seq + 1}  # never sent, and gone from the engine's replay buffer too
        for b in workload(5, seed=4):
            await pub.publish(b, send=pub.seq not in lost)
        pub.buffer = [(s, f) for s, f in pub.buffer if s not in lost]
        await sent_until(relay, wid, pub.seq - 1)
        assert not relay_feed.synced
        await caught_up(relay, sub, wid)
        assert same_index(relay.feeder, sub.feeder, wid)
        assert sub.feeder.status(wid, 0.0).state == "unsynced"
        assert sub.follower.state(wid).missed == 0
    await pub.close()
    kinds = [r.kind for r in await bus_records(nats.url, wid)]
    assert kinds[0] == RESET and kinds.count(RESET) == 2 and kinds.count(UNSYNCED) == 1


async def test_late_replica_is_exact_from_snapshot_and_stream(nats, ctx):
    """A replica started after the stream's early records are gone (retention) is exact from the relay's
    snapshot plus the records after it; one without the snapshot knows it is not (unsynced)."""
    import nats as nats_client

    pub = TestPublisher(ctx, topic="kv")
    wid = "late-replica-w"
    async with relay_for(nats.url, {wid: pub}, ctx) as relay:
        for b in workload(40, seed=5):
            await pub.publish(b)
        await sent_until(relay, wid, 39)
        await published(relay, wid)
        assert await relay.snapshot(wid)
        snap_seq = relay.outboxes[wid].acked_stream_seq
        for b in workload(20, seed=6)[:]:
            await pub.publish(EventBatch(b.ts + 1000, b.events, 0))
        await sent_until(relay, wid, 59)
        await published(relay, wid)
        nc = await nats_client.connect(nats.url)  # retention at work: everything up to the snapshot gone
        await nc.jetstream().purge_stream("KVROUTER_EVENTS", subject=subject_of(wid), seq=snap_seq + 1)
        await nc.close()
        pub.buffer.clear()  # and the engine's replay buffer no longer reaches back either

        async with consumer(nats.url) as late, consumer(nats.url, use_snapshots=False) as blind:
            late.add_source(EventSource(wid, ""))
            blind.add_source(EventSource(wid, ""))
            await caught_up(relay, late, wid)
            await caught_up(relay, blind, wid)
            await wait_until(lambda: wid in late.ready)
            assert late.snapshot_loads == 1
            assert same_index(relay.feeder, late.feeder, wid) and len(relay.index) > 0
            assert late.follower.state(wid).batches == 20  # only the records after the snapshot
            assert late.feeder.status(wid, 0.0).state == "synced"
            assert blind.follower.state(wid).missed == 1
            assert blind.feeder.status(wid, 0.0).state == "unsynced"
    await pub.close()


async def test_bus_restart_loses_no_batch(nats, ctx):
    """One relay serving two engines (as one per node); the nats-server restarts while they keep publishing:
    the relay holds and retries, the consumer's ordered consumers resume; every batch arrives once, in order.
    Then the bus stays down while batches come (they wait in the relay's outboxes) and comes back."""
    pubs = {f"restart-w{i}": TestPublisher(ctx, topic="kv") for i in range(2)}
    batches = workload(90, seed=7)

    async def publish(part: slice) -> None:
        for b in batches[part]:
            for p in pubs.values():
                await p.publish(b)
            await asyncio.sleep(0)

    async def all_caught_up(relay: Relay, sub: BusSubscriber, last_seq: int) -> None:
        for wid in pubs:
            await sent_until(relay, wid, last_seq)
            await caught_up(relay, sub, wid, timeout=30)
            assert same_index(relay.feeder, sub.feeder, wid)

    async with relay_for(nats.url, pubs, ctx) as relay, consumer(nats.url) as sub:
        for wid in pubs:
            sub.add_source(EventSource(wid, ""))
        await publish(slice(0, 20))
        await all_caught_up(relay, sub, 19)
        restarting = asyncio.create_task(asyncio.to_thread(nats.restart))
        await publish(slice(20, 40))  # while the bus is going down and coming back
        await restarting
        await publish(slice(40, 60))
        await all_caught_up(relay, sub, 59)

        await asyncio.to_thread(nats.stop)
        await publish(slice(60, 80))
        for wid in pubs:
            await sent_until(relay, wid, 79)
        assert relay.stats()["pending"] > 0  # held for the bus
        await asyncio.to_thread(nats.start)
        await publish(slice(80, 90))
        await all_caught_up(relay, sub, 89)
        for wid in pubs:
            st = sub.follower.state(wid)
            assert (st.missed, relay.outboxes[wid].dropped, st.batches) == (0, 0, 90)
        assert len(relay.index) > 0
    for p in pubs.values():
        await p.close()


async def test_a_restarted_relay_starts_a_new_epoch_and_the_consumer_follows_it(nats, ctx):
    """A relay restart: the new process's first record is a reset, then the engine's replay buffer again; the
    consumer that followed the old relay ends with the new relay's index, with nothing counted missing."""
    pub = TestPublisher(ctx, topic="kv")
    wid = "relay-restart-w"
    batches = workload(30, seed=9)
    async with consumer(nats.url) as sub:
        sub.add_source(EventSource(wid, ""))
        async with relay_for(nats.url, {wid: pub}, ctx) as first:
            for b in batches[:20]:
                await pub.publish(b)
            await sent_until(first, wid, 19)
            await caught_up(first, sub, wid)
            old_epoch = first.epoch
        async with relay_for(nats.url, {wid: pub}, ctx) as second:
            for b in batches[20:]:
                await pub.publish(b)
            await sent_until(second, wid, 29)
            await caught_up(second, sub, wid)
            assert second.epoch != old_epoch and sub.follower.state(wid).epoch == second.epoch
            assert same_index(second.feeder, sub.feeder, wid) and len(second.index) > 0
            assert sub.follower.state(wid).missed == 0
            assert sub.feeder.status(wid, 0.0).state == "synced"
    await pub.close()


async def test_outbox_overflow_while_the_bus_is_down_makes_consumers_unsynced(ctx):
    """Down longer than the outbox holds: records dropped and counted, and the consumer learns it is unsynced
    (the relay cleared its own entries too, so both still agree)."""
    with nats_server() as s:
        pub = TestPublisher(ctx, topic="kv")
        wid = "overflow-w"
        async with relay_for(s.url, {wid: pub}, ctx, outbox_limit=5) as relay, consumer(s.url) as sub:
            sub.add_source(EventSource(wid, ""))
            batches = workload(30, seed=8)
            for b in batches[:5]:
                await pub.publish(b)
            await caught_up(relay, sub, wid)
            assert sub.feeder.status(wid, 0.0).state == "synced"
            await asyncio.to_thread(s.stop)
            for b in batches[5:25]:
                await pub.publish(b)
            await sent_until(relay, wid, 24)
            assert relay.outboxes[wid].dropped > 0
            await asyncio.to_thread(s.start)
            for b in batches[25:]:
                await pub.publish(b)
            await sent_until(relay, wid, 29)
            await caught_up(relay, sub, wid, timeout=30)
            assert same_index(relay.feeder, sub.feeder, wid)
            assert sub.feeder.status(wid, 0.0).state == "unsynced"
            assert sub.follower.state(wid).missed >= 1  # the dropped records' numbers are skipped
        await pub.close()


async def test_replicas_on_the_bus_match_a_direct_subscriber(nats, ctx):
    """`kvrouter relay` in its own process between a simulated worker and two fleets configured with
    ``events_bus``: the first follows live, the second starts later from a snapshot asked for over NATS; both
    end with the index a direct ZeroMQ subscriber of the same engine has, ready and without a problem."""
    import json
    import subprocess
    import sys

    import aiohttp
    import nats as nats_client

    from router.config import load_config
    from router.events.subscriber import KvEventSubscriber
    from router.frontends.fleet import fleet_from_config
    from router.scheduling import RoutingCore
    from tests.sim_helpers import start_worker

    w = await start_worker(topic="w0")
    ev, rp = w.publisher.endpoint, w.publisher.replay_endpoint
    relay = subprocess.Popen([sys.executable, "-m", "router.cli", "relay", "--bus", nats.url, "--worker",
                              f"replica-w0,events={ev},replay={rp}", "--log-level", "warning"])
    direct = IndexFeeder(KvIndex(), block_size=16)
    direct_sub = KvEventSubscriber(direct, ctx=ctx)
    direct_sub.add_source(EventSource("replica-w0", ev, rp, "w0"))
    config = load_config(None, {"events_bus": nats.url})
    config.workers = [parse_worker_arg(f"{w.url},id=replica-w0")]
    fleets = []
    try:
        async def fleet() -> object:
            f = fleet_from_config(RoutingCore(config.routing), config)
            await f.start()
            fleets.append(f)
            return f

        def agree(f) -> bool:
            rows = direct.index.export_worker("replica-w0")
            return bool(rows) and f.core.index.export_worker("replica-w0") == rows

        first = await fleet()
        async with aiohttp.ClientSession() as s:
            for i in range(6):
                body = {"prompt": f"document {i} " * 80, "max_tokens": 2}
                async with s.post(w.url + "/v1/completions", json=body) as r:
                    assert r.status == 200
        await wait_until(lambda: agree(first), 20)
        nc = await nats_client.connect(nats.url)
        reply = json.loads((await nc.request("kvrouter.relay.snapshot", b"", timeout=10)).data)
        await nc.close()
        assert reply["written"] == 1
        second = await fleet()
        await wait_until(lambda: agree(second) and "replica-w0" in second.subscriber.ready, 20)
        assert second.subscriber.snapshot_loads == 1
        for f, (batches, loads) in ((first, (True, 0)), (second, (False, 1))):  # the second: all from the snapshot
            assert f.diagnose()["replica-w0"].problem is None
            assert f.core.feeder.status("replica-w0", f.clock()).state == "synced"
            families = {m.name: m.samples[0].value for m in f.subscriber.metric_families()}
            assert (families["kvrouter_bus_batches"] > 0, families["kvrouter_bus_snapshot_loads"]) == (batches, loads)
    finally:
        for f in fleets:
            await f.stop()
        await direct_sub.stop()
        relay.terminate()
        relay.wait(10)
        await w.stop()


def test_cli_bench_bus_quick_relays_every_stream_exactly_into_both_replicas():
    """`kvrouter bench bus --quick`: synthetic engines -> relay -> nats-server -> 2 replica processes, and the
    direct-ZeroMQ baseline; both replicas' indexes equal the generated truth in both topologies."""
    import json
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "router.cli", "bench", "bus", "--quick", "--streams", "8", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.stdout[-4000:], run.stderr[-4000:])  # what was not exact, and why
    data = json.loads(run.stdout)
    assert data["exact"] and data["streams"] == 8
    for topology in ("bus", "direct"):
        assert data[topology]["exact"] == [True, True] and data[topology]["unsynced"] == [0, 0]
        assert data[topology]["block_events_per_s"] > 0
    assert [s["missed"] for s in data["bus"]["stats"]] == [0, 0]
