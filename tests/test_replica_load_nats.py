"""Two router replicas sharing in-flight load over a real nats-server (bench/nats.py): each folds the other's
requests into its own accounting; a replica that dies without a word has its load expire."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import pytest

from bench.nats import nats_server
from router.load.bus import LoadSync, NatsLoadBus
from router.load.exchange import LoadExchange
from tests.test_replica_load import replica, request, send

pytestmark = pytest.mark.sockets


async def until(condition: Callable[[], bool], deadline_s: float) -> float:
    """Poll ``condition`` until true; the seconds it took, or a failure at ``deadline_s``."""
    t0 = time.monotonic()
    while not condition():
        if time.monotonic() - t0 > deadline_s:
            raise AssertionError(f"not within {deadline_s} s")
        await asyncio.sleep(0.005)
    return time.monotonic() - t0


def synced(ex: LoadExchange, url: str) -> LoadSync:
    ex.silence_s = 1.0
    return LoadSync(ex, NatsLoadBus(url, ex.replica_id), heartbeat_s=0.2)


async def test_two_replicas_in_flight_views_converge_over_nats_within_one_second():
    with nats_server() as server:
        a, ea = replica("a")
        b, eb = replica("b")
        sa, sb = synced(ea, server.url), synced(eb, server.url)
        await sa.start()
        await sb.start()
        try:
            assert sa.bus.connected and sb.bus.connected  # type: ignore[attr-defined]
            await until(lambda: "a" in eb.peers and "b" in ea.peers, 5.0)  # each has heard the other's heartbeat
            ha = [send(a, request(f"a{i}", base=100 * i), "w0", time.monotonic()) for i in range(3)]
            hb = [send(b, request(f"b{i}", base=7000 + 100 * i), "w1", time.monotonic()) for i in range(2)]
            ha[0].first_token(time.monotonic())

            def agree() -> bool:
                la, lb = a.load.load, b.load.load
                return all((la(w).requests, la(w).decoding, la(w).active_blocks)
                           == (lb(w).requests, lb(w).decoding, lb(w).active_blocks) for w in ("w0", "w1"))

            await until(agree, 1.0)
            assert (b.load.load("w0").requests, b.load.load("w0").decoding) == (3, 1)
            assert a.load.load("w1").requests == 2
            assert b.load.load("w0").active_blocks == a.load.load("w0").active_blocks == 3 * (4 + 3)
            # and back down: every end reaches the other side
            now = time.monotonic()
            for h in ha + hb:
                h.complete(now)
            await until(lambda: a.load.load("w1").requests == 0 and b.load.load("w0").requests == 0, 1.0)
            assert b.load.load("w0").active_keys == {} and a.load.load("w1").active_blocks == 0
        finally:
            await sa.stop()
            await sb.stop()


async def test_a_dead_replicas_load_expires_over_nats():
    with nats_server() as server:
        a, ea = replica("a")
        b, eb = replica("b")
        sa, sb = synced(ea, server.url), synced(eb, server.url)
        await sa.start()
        await sb.start()
        try:
            for i in range(4):
                send(a, request(f"a{i}", base=100 * i), "w0", time.monotonic())
            await until(lambda: b.load.load("w0").requests == 4, 5.0)
            # replica a dies: no farewell, no more heartbeats (its connection just closes)
            assert sa._task is not None
            sa._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sa._task
            await sa.bus._nc.close()  # type: ignore[attr-defined]
            assert b.load.load("w0").requests == 4  # it still counts until the silence is long enough
            await until(lambda: b.load.load("w0").requests == 0, 10.0)
            assert "a" not in eb.peers and eb.stats.replicas_expired == 1
            assert b.load.load("w0").active_blocks == 0
        finally:
            await sb.stop()


async def test_replica_without_a_reachable_bus_routes_on_its_own_load():
    """A bus that is down must not stop a replica: it starts, counts its own requests, publishes nothing."""
    core, ex = replica("lonely")
    sync = LoadSync(ex, NatsLoadBus("nats://127.0.0.1:1", "lonely"), heartbeat_s=0.2)
    await sync.start()
    try:
        assert not sync.bus.connected  # type: ignore[attr-defined]
        send(core, request("r"), "w0", time.monotonic())
        await asyncio.sleep(0)  # the flush runs (and publishes nowhere)
        assert core.load.load("w0").requests == 1
    finally:
        await sync.stop()


