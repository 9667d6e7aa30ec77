"""The event bus attacked and misconfigured, against a real nats-server (issue 50, finding 10).

What was tried: a record on one worker's subject naming another worker (a RESET there cleared the other's
index); records naming workers the router does not follow (each one created state, forever); garbage on a
followed subject (counted in an unexported stat only); a bus with no authentication (anyone who reached NATS
rewrote every replica's index). Now a record is applied only to the worker of the subject it was read on, names
outside the followed set create nothing, every drop is a Prometheus counter with a reason from a fixed set, and
the relay and the routers present credentials (user/password, token, TLS client certificates) that a server
with per-user permissions checks: the relay may publish records, a router may only read them. A client without
the right credentials is refused with a one-line error and keeps running (a router: load-only routing).

Every wait is on an event (a counter reaching its value, an acknowledged watermark), never a fixed sleep.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq.asyncio
from prometheus_client import generate_latest

from bench.load import free_port, running
from bench.nats import _jetstream_healthy, nats_server, nats_server_binary
from router.events.bus import (
    BATCH,
    MALFORMED,
    RESET,
    UNKNOWN_WORKER,
    UNSYNCED,
    WORKER_MISMATCH,
    BusRecord,
    encode_record,
    subject_of,
)
from router.events.bus_nats import BusSubscriber
from router.events.codec import EventBatch
from router.events.subscriber import EventSource
from router.nats_connection import NatsAuth
from tests.test_relay_nats import caught_up, consumer, published, relay_for, same_index, sent_until
from tests.test_subscriber_sockets import BLOCK, workload
from tests.zmq_helpers import TestPublisher, wait_until

pytestmark = pytest.mark.sockets

# docs/event-bus.md's server configuration, verbatim: one account, a relay user that may publish records and
# snapshots and a router user that may only read them (through its own consumers). Passwords from the
# environment ($RELAY_PASSWORD, $ROUTER_PASSWORD), as the docs have it.
ACCOUNTS = """
accounts {
  KVROUTER {
    jetstream: enabled
    users: [
      # kvrouter relay: publishes records and snapshots, creates the stream and the bucket
      {user: relay, password: $RELAY_PASSWORD, permissions: {
        publish: {allow: [
          "kvrouter.events.>", "_INBOX.>",
          "$JS.API.STREAM.CREATE.KVROUTER_EVENTS", "$JS.API.STREAM.UPDATE.KVROUTER_EVENTS",
          "$O.kvrouter-snapshots.>",
          "$JS.API.STREAM.INFO.OBJ_kvrouter-snapshots", "$JS.API.STREAM.CREATE.OBJ_kvrouter-snapshots",
          "$JS.API.STREAM.MSG.GET.OBJ_kvrouter-snapshots", "$JS.API.STREAM.PURGE.OBJ_kvrouter-snapshots"]}
        subscribe: {allow: ["kvrouter.relay.snapshot", "_INBOX.>"]}
      }}
      # a router replica: reads records and snapshots through consumers of its own; publishes no record
      {user: router, password: $ROUTER_PASSWORD, permissions: {
        publish: {allow: [
          "$JS.API.CONSUMER.CREATE.KVROUTER_EVENTS", "$JS.API.CONSUMER.CREATE.KVROUTER_EVENTS.>",
          "$JS.API.STREAM.MSG.GET.KVROUTER_EVENTS", "$JS.FC.KVROUTER_EVENTS.>",
          "$JS.API.STREAM.NAMES", "$JS.API.STREAM.INFO.OBJ_kvrouter-snapshots",
          "$JS.API.STREAM.MSG.GET.OBJ_kvrouter-snapshots", "$JS.API.DIRECT.GET.OBJ_kvrouter-snapshots.>",
          "$JS.API.CONSUMER.CREATE.OBJ_kvrouter-snapshots", "$JS.API.CONSUMER.CREATE.OBJ_kvrouter-snapshots.>",
          "$JS.FC.OBJ_kvrouter-snapshots.>"]}
        subscribe: {allow: ["_INBOX.>"]}
      }}
    ]
  }
}
"""
RELAY = NatsAuth(user="relay", password="relay-secret")
ROUTER = NatsAuth(user="router", password="router-secret")


@contextlib.contextmanager
def configured_nats(body: str, env: dict[str, str] | None = None, **files: str) -> Iterator[tuple[str, Path]]:
    """A nats-server with JetStream run from a config file holding ``body`` (after listen/http/jetstream);
    ``files`` are written beside it first. Its URL (nats://) and the directory."""
    with tempfile.TemporaryDirectory(prefix="kvrouter-nats-auth-") as d:
        port, monitor = free_port(), free_port()
        conf = Path(d) / "nats.conf"
        conf.write_text(f"listen: 127.0.0.1:{port}\nhttp: 127.0.0.1:{monitor}\n"
                        f"jetstream {{ store_dir: {json.dumps(d)} }}\n{body}")
        cmd = [nats_server_binary(), "-c", str(conf)]
        with running(cmd, lambda: _jetstream_healthy(monitor), 30.0, "nats-server", stderr=subprocess.DEVNULL,
                     env={**os.environ, **(env or {})}):
            yield f"nats://127.0.0.1:{port}", Path(d)


@pytest.fixture(scope="module")
def nats():
    with nats_server() as s:
        yield s


@pytest.fixture
async def ctx():
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


async def publish_raw(url: str, items: list[tuple[str, bytes]], auth: NatsAuth | None = None) -> None:
    """Publish as an attacker who reached the bus would: plain NATS publishes the stream captures, then one
    acknowledged JetStream publish behind them (every earlier one is stored once it returns)."""
    import nats as nats_client

    nc = await nats_client.connect(url, **(auth.options() if auth else {}))
    try:
        for subject, data in items[:-1]:
            await nc.publish(subject, data)
        await nc.flush()
        subject, data = items[-1]
        await nc.jetstream().publish(subject, data)
    finally:
        await nc.close()


def dropped_samples(sub: BusSubscriber) -> dict[str, float]:
    families = {m.name: m for m in sub.metric_families()}
    return {s.labels["reason"]: s.value for s in families["kvrouter_bus_records_dropped"].samples}


def state_size(sub: BusSubscriber) -> tuple[int, ...]:
    """Everything the consumer keeps per worker."""
    return (len(sub.follower.states), len(sub.feeder.feeds), len(sub.feeder.index.workers()), len(sub.lag_msgs),
            len(sub.lag_s), len(sub.ready), len(sub._tasks))


# ---- (a) a record's worker is its subject's ---------------------------------------------------------------------
async def test_a_reset_on_one_workers_subject_naming_another_leaves_the_other_intact(nats, ctx):
    """A RESET (and a batch, and an unsynced) published on w1's subject naming w2 cleared w2 on 5996e11 (4,068
    -> 0 blocks, still "synced"). Now each is dropped and counted as worker_mismatch; w2 keeps its blocks and its
    sync state, w1 is untouched and its relay's next records still apply in sequence."""
    pubs = {"mm-w1": TestPublisher(ctx, topic="kv"), "mm-w2": TestPublisher(ctx, topic="kv")}
    async with relay_for(nats.url, pubs, ctx) as relay, consumer(nats.url) as sub:
        for wid in pubs:
            sub.add_source(EventSource(wid, ""))
        for b in workload(20, seed=11):
            for p in pubs.values():
                await p.publish(b)
        for wid in pubs:
            await sent_until(relay, wid, 19)
            await caught_up(relay, sub, wid)
        w2_before = sub.feeder.index.export_worker("mm-w2")
        assert w2_before and sub.feeder.status("mm-w2", 0.0).state == "synced"

        forged = [BusRecord(RESET, "mm-w2", relay.epoch, 0),
                  BusRecord(UNSYNCED, "mm-w2", "attacker", 0),
                  BusRecord(BATCH, "mm-w2", relay.epoch, 10_000, 99, True, EventBatch(1.0, [], 0))]
        await publish_raw(nats.url, [(subject_of("mm-w1"), encode_record(r)) for r in forged])
        await wait_until(lambda: sub.follower.dropped[WORKER_MISMATCH] == 3, 15)

        assert sub.feeder.index.export_worker("mm-w2") == w2_before
        assert sub.feeder.status("mm-w2", 0.0).state == "synced"
        assert same_index(relay.feeder, sub.feeder, "mm-w1")
        for b in workload(5, seed=12):  # the relay's own records go on in sequence: nothing counted missing
            await pubs["mm-w1"].publish(EventBatch(b.ts + 1000, b.events, 0))
        await sent_until(relay, "mm-w1", 24)
        await caught_up(relay, sub, "mm-w1")
        assert same_index(relay.feeder, sub.feeder, "mm-w1")
        assert sub.follower.state("mm-w1").missed == 0
        assert dropped_samples(sub) == {MALFORMED: 0, WORKER_MISMATCH: 3, UNKNOWN_WORKER: 0}
    for p in pubs.values():
        await p.close()


# ---- (b) names the router does not follow create nothing ---------------------------------------------------------
async def test_records_for_unknown_workers_create_no_state_and_are_counted(nats, ctx):
    """10,000 records naming workers no discovery listed, on a followed worker's subject (and 1,000 more on their
    own subjects, which no replica subscribes to): the consumer's per-worker state is the size it was, each one
    it read is counted as unknown_worker, and the followed worker goes on exactly. On 5996e11 each name made a
    FollowState and a feed forever (RSS +30 MB for 60K names). Garbage is counted as malformed."""
    pub = TestPublisher(ctx, topic="kv")
    wid = "known-w"
    async with relay_for(nats.url, {wid: pub}, ctx) as relay, consumer(nats.url) as sub:
        sub.add_source(EventSource(wid, ""))
        for b in workload(10, seed=13):
            await pub.publish(b)
        await sent_until(relay, wid, 9)
        await caught_up(relay, sub, wid)
        before = state_size(sub)

        kinds = (RESET, UNSYNCED, BATCH)
        items = [(subject_of(wid), encode_record(BusRecord(kinds[i % 3], f"ghost-{i}", "attacker", i % 2, i, True,
                                                           EventBatch(1.0, [], 0) if i % 3 == 2 else None)))
                 for i in range(10_000)]
        items += [(subject_of(f"ghost-{i}"), encode_record(BusRecord(RESET, f"ghost-{i}", "attacker", 0)))
                  for i in range(1_000)]
        items += [(subject_of(wid), b"\xc1 not msgpack"), (subject_of(wid), encode_record(
            BusRecord("format-disk", wid, relay.epoch, 1))), (subject_of(wid), b"\x93\x01")]
        items.append((subject_of("ghost-last"), b"end"))  # the acknowledged one: every record before is stored
        await publish_raw(nats.url, items)
        await wait_until(lambda: sub.follower.dropped[UNKNOWN_WORKER] == 10_000 and
                         sub.follower.dropped[MALFORMED] == 3, 60)

        assert state_size(sub) == before
        assert set(sub.follower.states) == set(sub.feeder.feeds) == {wid}
        assert dropped_samples(sub) == {MALFORMED: 3, WORKER_MISMATCH: 0, UNKNOWN_WORKER: 10_000}
        assert sub.stats()["malformed"] == 3
        for b in workload(5, seed=14):
            await pub.publish(EventBatch(b.ts + 1000, b.events, 0))
        await sent_until(relay, wid, 14)
        await caught_up(relay, sub, wid)
        assert same_index(relay.feeder, sub.feeder, wid) and len(sub.feeder.index) > 0
        assert sub.follower.state(wid).missed == 0 and sub.feeder.status(wid, 0.0).state == "synced"
    await pub.close()


def test_a_follower_drops_what_its_subject_does_not_name_without_io():
    """The pure rule, without a bus: applied only to the subject's worker, only for followed workers; a
    snapshot of a worker not followed is not restored either."""
    from router.events.bus import BusFollower, IndexSnapshot
    from router.events.feed import IndexFeeder, run_steps
    from router.index import KvIndex

    follower = BusFollower(IndexFeeder(KvIndex(), block_size=16))
    follower.follow("w1")
    for i in range(100):
        run_steps(follower.apply_steps("w1", BusRecord(RESET, f"x{i}", "e", 0), i + 1, 0.0))
    run_steps(follower.apply_steps("nobody", BusRecord(RESET, "nobody", "e", 0), 101, 0.0))
    follower.restore(IndexSnapshot("ghost", "e", 3, 7, None, True, 16, []), 0.0)
    run_steps(follower.apply_steps("w1", BusRecord(RESET, "w1", "e", -1), 102, 0.0))
    assert follower.dropped == {MALFORMED: 1, WORKER_MISMATCH: 0, UNKNOWN_WORKER: 102}
    assert set(follower.states) == {"w1"} and not follower.feeder.feeds
    assert follower.states["w1"].stream_seq == 102  # read past: a resubscription starts after them
    run_steps(follower.apply_steps("w1", BusRecord(RESET, "w1", "e", 0), 103, 0.0))
    assert follower.states["w1"].n == 0 and set(follower.feeder.feeds) == {"w1"}


# ---- (c) authentication and permissions ------------------------------------------------------------------------
async def test_relay_and_router_with_credentials_work_and_without_are_refused(ctx, caplog):
    """nats-server with docs/event-bus.md's accounts: the relay and a router with their credentials relay and
    follow (a snapshot too); a router without credentials, or with a wrong password, is refused with one clear
    error line, keeps running and reports the bus down; the router's credentials cannot publish a record; a
    relay with a wrong password holds its records and says why."""
    import nats as nats_client
    from nats import errors as nats_errors

    env = {"RELAY_PASSWORD": "relay-secret", "ROUTER_PASSWORD": "router-secret"}
    caplog.set_level(logging.ERROR, logger="router.nats_connection")
    pub = TestPublisher(ctx, topic="kv")
    wid = "auth-w"
    with configured_nats(ACCOUNTS, env) as (url, _):
        async with relay_for(url, {wid: pub}, ctx, auth=RELAY) as relay, \
                consumer(url, auth=ROUTER) as sub, consumer(url) as anonymous, \
                consumer(url, auth=NatsAuth(user="router", password="guess")) as guessing:
            for s in (sub, anonymous, guessing):
                s.add_source(EventSource(wid, ""))
            for b in workload(15, seed=15):
                await pub.publish(b)
            await sent_until(relay, wid, 14)
            await caught_up(relay, sub, wid)
            assert same_index(relay.feeder, sub.feeder, wid) and len(sub.feeder.index) > 0
            assert await relay.snapshot(wid)
            async with consumer(url, auth=ROUTER) as late:  # a router reads the snapshot bucket too
                late.add_source(EventSource(wid, ""))
                await wait_until(lambda: wid in late.ready, 15)
                assert late.snapshot_loads == 1 and same_index(relay.feeder, late.feeder, wid)

            for refused in (anonymous, guessing):
                await wait_until(lambda r=refused: r.refused is not None, 15)
                assert "authorization violation" in refused.refused
                assert not refused.connected and refused.ready == set()
                assert len(refused.feeder.index) == 0  # no prefix credit: load-only routing
                families = {m.name: m.samples[0].value for m in refused.metric_families()}
                assert families["kvrouter_bus_connected"] == 0.0
            assert {m.name: m.samples[0].value for m in sub.metric_families()}["kvrouter_bus_connected"] == 1.0
            lines = [r.getMessage() for r in caplog.records if "authorization violation" in r.getMessage()]
            assert lines and all(url in line for line in lines)
            assert len(lines) <= 2  # once per refused client, not once per retry

            head = sub.follower.state(wid).stream_seq
            nc = await nats_client.connect(url, **ROUTER.options())  # a router's credentials cannot write records
            try:
                with pytest.raises((nats_errors.TimeoutError, nats_errors.NoRespondersError)):  # dropped: no ack
                    await nc.jetstream().publish(subject_of(wid), encode_record(BusRecord(RESET, wid, "x", 0)),
                                                 timeout=2)
            finally:
                await nc.close()
            for b in workload(3, seed=16):
                await pub.publish(EventBatch(b.ts + 1000, b.events, 0))
            await sent_until(relay, wid, 17)
            await caught_up(relay, sub, wid)
            assert sub.follower.state(wid).stream_seq == head + 3  # the relay's three, nothing between
            assert same_index(relay.feeder, sub.feeder, wid)

        wrong = NatsAuth(user="relay", password="nope")
        from router.events.relay import Relay

        bad = Relay(url, [EventSource(wid, pub.endpoint, pub.replay_endpoint, pub.topic)], block_size=16, ctx=ctx,
                    auth=wrong)
        await bad.start()
        try:
            await wait_until(lambda: bad.refused is not None, 15)
            stats = bad.stats()
            assert "authorization violation" in stats["refused"] and not stats["bus_ready"]
            assert stats["pending"] >= 1 and stats["published"] == 0  # its reset waits in the outbox
        finally:
            await bad.stop(flush_timeout_s=0)
    await pub.close()


async def test_token_auth_through_the_router_config_and_the_fleet(ctx):
    """A token-protected server: a fleet configured with events_bus_auth (the token from the environment, as a
    Kubernetes Secret would give it) follows the relay; one with a wrong token starts anyway, routes on load
    (no blocks), and exports the bus as down and its drop counters on /metrics."""
    from router.config import load_config
    from router.discovery import parse_worker_arg
    from router.frontends.fleet import fleet_from_config
    from router.frontends.metrics import RouterMetrics
    from router.scheduling import RoutingCore

    pub = TestPublisher(ctx, topic="kv")
    wid = "token-w"
    with configured_nats('authorization { token: "s3cret-token" }') as (url, d):
        token_file = d / "token"
        token_file.write_text("s3cret-token\n")
        async with relay_for(url, {wid: pub}, ctx, auth=NatsAuth(token_file=str(token_file))) as relay:
            for b in workload(8, seed=17):
                await pub.publish(b)
            await sent_until(relay, wid, 7)
            seq = await published(relay, wid)

            fleets = []
            try:
                for token in ("s3cret-token", "wrong-token"):
                    config = load_config(None, {"events_bus": url, "routing.block_size": BLOCK},
                                         environ={"KVROUTER_EVENTS_BUS_AUTH__TOKEN": token})
                    config.workers = [parse_worker_arg(f"http://127.0.0.1:{free_port()},id={wid}")]
                    fleet = fleet_from_config(RoutingCore(config.routing), config)
                    await fleet.start()
                    fleets.append(fleet)
                good, bad = fleets
                await wait_until(lambda: good.subscriber.follower.state(wid).stream_seq >= seq, 15)
                assert same_index(relay.feeder, good.core.feeder, wid) and len(good.core.index) > 0
                await wait_until(lambda: bad.subscriber.refused is not None, 15)
                assert len(bad.core.index) == 0 and not bad.subscriber.connected  # routed on load: no credit
                text = generate_latest(RouterMetrics(bad).registry).decode()
                assert "kvrouter_bus_connected 0.0" in text
                assert 'kvrouter_bus_records_dropped_total{reason="worker_mismatch"} 0.0' in text
                good_text = generate_latest(RouterMetrics(good).registry).decode()
                assert "kvrouter_bus_connected 1.0" in good_text
            finally:
                for f in fleets:
                    await f.stop()
    await pub.close()


def test_the_documented_server_configuration_is_the_tested_one():
    assert ACCOUNTS.strip() in (Path(__file__).parent.parent / "docs" / "event-bus.md").read_text()


def test_events_bus_auth_config_is_checked_and_keeps_secrets_out_of_repr(tmp_path):
    from router.config import ConfigError, load_config

    bus = {"events_bus": "nats://n:4222"}
    cfg = load_config(None, {**bus, "events_bus_auth": {"user": "router", "password": "pw"}})
    assert cfg.events_bus_auth.options() == {"user": "router", "password": "pw"}
    assert "pw" not in repr(cfg)
    env = {"KVROUTER_EVENTS_BUS_AUTH__USER": "router", "KVROUTER_EVENTS_BUS_AUTH__PASSWORD": "12345"}
    assert load_config(None, bus, environ=env).events_bus_auth.options()["password"] == "12345"
    for auth, words in (({"password": "pw"}, "password needs user"),
                        ({"user": "u", "password": "p", "token": "t"}, "one way"),
                        ({"token": "t", "token_file": "/x"}, "not both"),
                        ({"tls_ca": str(tmp_path / "missing.pem")}, "no such file"),
                        ({"tls_key": "/k"}, "tls_key needs tls_cert"),
                        ({"password_files": "/x"}, "unknown keys")):
        with pytest.raises(ConfigError, match=words):
            load_config(None, {**bus, "events_bus_auth": auth})
    with pytest.raises(ConfigError, match="events_bus is not"):
        load_config(None, {"events_bus_auth": {"token": "t"}})


def test_relay_cli_refuses_auth_options_that_cannot_work(tmp_path, capsys):
    from router.cli import main

    base = ["relay", "--bus", "nats://127.0.0.1:1", "--worker", "w,events=tcp://127.0.0.1:1"]
    assert main([*base, "--bus-password-file", str(tmp_path / "none")]) == 2
    assert "password needs user" in capsys.readouterr().err
    assert main([*base, "--bus-user", "relay", "--bus-password-file", str(tmp_path / "none")]) == 2
    assert "no such file" in capsys.readouterr().err


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, made with the openssl CLI."""
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=kvrouter-test-ca",
             "-keyout", str(d / "ca.key"), "-out", str(d / "ca.pem"))
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1"), ("client", "extendedKeyUsage=clientAuth")):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", str(d / f"{name}.key"),
                 "-out", str(d / f"{name}.csr"))
        (d / f"{name}.ext").write_text(ext + "\n")
        _openssl("x509", "-req", "-in", str(d / f"{name}.csr"), "-CA", str(d / "ca.pem"), "-CAkey",
                 str(d / "ca.key"), "-CAcreateserial", "-days", "2", "-extfile", str(d / f"{name}.ext"),
                 "-out", str(d / f"{name}.pem"))
    return d


async def test_mutual_tls_relay_and_router_work_and_a_client_without_a_certificate_is_refused(ctx, pki):
    """nats-server requiring TLS with client certificates: a relay and a router with the CA and a client
    certificate relay and follow; a router with the CA but no certificate is refused (a TLS error, said as one)
    and keeps running."""
    body = (f"tls {{ cert_file: {json.dumps(str(pki / 'server.pem'))}, key_file: "
            f"{json.dumps(str(pki / 'server.key'))}, ca_file: {json.dumps(str(pki / 'ca.pem'))}, verify: true }}")
    mtls = NatsAuth(tls_ca=str(pki / "ca.pem"), tls_cert=str(pki / "client.pem"), tls_key=str(pki / "client.key"))
    pub = TestPublisher(ctx, topic="kv")
    wid = "tls-w"
    with configured_nats(body) as (url, _):
        url = url.replace("nats://", "tls://")
        async with relay_for(url, {wid: pub}, ctx, auth=mtls) as relay, consumer(url, auth=mtls) as sub, \
                consumer(url, auth=NatsAuth(tls_ca=str(pki / "ca.pem"))) as no_cert:
            sub.add_source(EventSource(wid, ""))
            no_cert.add_source(EventSource(wid, ""))
            for b in workload(6, seed=18):
                await pub.publish(b)
            await sent_until(relay, wid, 5)
            await caught_up(relay, sub, wid)
            assert same_index(relay.feeder, sub.feeder, wid) and len(sub.feeder.index) > 0
            await wait_until(lambda: no_cert.refused is not None, 15)
            assert no_cert.refused.startswith("TLS") and "tls_cert" in no_cert.refused
            assert not no_cert.connected and len(no_cert.feeder.index) == 0
    await pub.close()
