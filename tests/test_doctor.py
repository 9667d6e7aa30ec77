"""Say what is wrong: the diagnosis and its rate-limited log line (pure, explicit ``now``), then the router's log,
/admin/workers, the metric and ``kvrouter doctor`` against a worker whose event socket connects instead of binding."""

import asyncio
import json
import logging
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from bench.load import free_port
from router.discovery import WorkerSpec
from router.events.codec import BlockStored, EventBatch
from router.frontends.diagnosis import ProblemLog, diagnose_worker, engine_block_size
from router.keys import request_keys
from router.scheduling import Endpoint, RouteRequest, RoutingConfig, RoutingCore
from tests.sim_helpers import start_worker
from tests.test_proxy import proxy, spec_of
from tests.zmq_helpers import wait_until

BS = 16
ROOT = Path(__file__).resolve().parents[1]
EVENTS = "tcp://10.0.0.1:5557"


def core_with(*wids: str, events: bool = True, stale_after_s: float = 1.0) -> RoutingCore:
    core = RoutingCore(RoutingConfig(policy="round_robin", block_size=BS, stale_after_s=stale_after_s, seed=1))
    for wid in wids:
        core.upsert_endpoint(Endpoint(wid, f"{wid}:8000", url=f"http://{wid}:8000", events=events))
    return core


def send(core: RoutingCore, wid: str, n: int, now: float) -> None:
    """``n`` requests dispatched to ``wid`` at ``now`` and completed."""
    for i in range(n):
        tokens = list(range(i * 100, i * 100 + 2 * BS))
        req = RouteRequest(f"r{wid}{now}{i}", request_keys(tokens, BS), len(tokens), BS)
        core.dispatch(req, core.decide(req, now), wid, now).complete(now)


def stored(seq: int, block_size: int = BS) -> EventBatch:
    return EventBatch(0.0, [BlockStored([seq * 10 + 1], None, list(range(block_size)), block_size, None, "GPU")])


def spec(wid: str = "w", **kw) -> WorkerSpec:
    return WorkerSpec(wid, f"http://{wid}:8000", **{"events": EVENTS, **kw})


# ---- the diagnosis --------------------------------------------------------------------------------------

def test_never_published_names_the_endpoint_the_router_dials_and_binding():
    core = core_with("w")
    send(core, "w", 3, now=0.0)
    assert diagnose_worker(core, "w", 0.9, spec=spec()).problem is None  # not silent for stale_after_s yet
    d = diagnose_worker(core, "w", 1.5, spec=spec())
    assert d.problem == "never-published"
    assert EVENTS in d.cause and "connects instead of binding" in d.cause and "'*' or '::'" in d.cause
    assert "3 requests" in d.cause
    # fewer than min_requests: too little evidence to call it a problem
    few = core_with("w")
    send(few, "w", 2, now=0.0)
    assert diagnose_worker(few, "w", 5.0, spec=spec()).problem is None
    # a worker without events is routed on load alone by design: no problem
    quiet = core_with("w", events=False)
    send(quiet, "w", 5, now=0.0)
    assert diagnose_worker(quiet, "w", 5.0, spec=spec(events=None)).problem is None


def test_never_published_in_bind_mode_names_the_bound_endpoint_and_stray_topics():
    core = core_with("w")
    assert core.feeder.offer("w-typo", 0, stored(0), 0.0) is None  # events under a name no worker has
    send(core, "w", 4, now=0.0)
    d = diagnose_worker(core, "w", 2.0, spec=spec(events=None), bind="tcp://*:5557",
                        bound_endpoint="tcp://0.0.0.0:5557")
    assert d.problem == "never-published"
    assert "the router binds tcp://0.0.0.0:5557" in d.cause and "w-typo" in d.cause and "topic" in d.cause


def test_stale_after_publishing_and_a_healthy_feed():
    core = core_with("w")
    assert core.feeder.offer("w", 0, stored(0), 0.0) is None
    send(core, "w", 3, now=0.5)
    assert diagnose_worker(core, "w", 1.0, spec=spec()).problem is None
    d = diagnose_worker(core, "w", 2.0, spec=spec())
    assert d.problem == "stale" and "last seq 0" in d.cause
    assert core.feeder.offer("w", 1, stored(1), 2.1) is None  # it publishes again: nothing wrong
    assert diagnose_worker(core, "w", 2.2, spec=spec()).problem is None


def test_block_size_mismatch_says_both_numbers():
    core = core_with("w")
    assert core.feeder.offer("w", 0, stored(0, block_size=32), 0.0) is None
    d = diagnose_worker(core, "w", 0.1, spec=spec(), engine_block_size=32)
    assert d.problem == "block-size-mismatch" and "block_size 32" in d.cause and "routing.block_size is 16" in d.cause
    assert "another size" in diagnose_worker(core, "w", 0.1, spec=spec()).cause  # engine's size unknown


def test_malformed_unsynced_and_unhealthy():
    core = core_with("m", "u", "h")
    core.feeder.mark_malformed("m")
    assert diagnose_worker(core, "m", 0.0).problem == "malformed"
    # a first contact at seq 5 that the replay cannot fill: unsynced
    gap = core.feeder.offer("u", 5, stored(5), 0.0)
    assert gap is not None and not core.feeder.fill_gap(gap, [], stored(5), 0.0)
    d = diagnose_worker(core, "u", 0.1, spec=spec("u"))
    assert d.problem == "unsynced" and "no replay endpoint" in d.cause
    d = diagnose_worker(core, "u", 0.1, spec=spec("u", replay="tcp://10.0.0.1:5558"))
    assert "tcp://10.0.0.1:5558" in d.cause
    # a router following the event bus never dials the replay socket: the cause names the bus, not the endpoint
    d = diagnose_worker(core, "u", 0.1, spec=spec("u", replay="tcp://10.0.0.1:5558"), events_bus="nats://bus:4222")
    assert d.problem == "unsynced" and "nats://bus:4222" in d.cause and "tcp://10.0.0.1:5558" not in d.cause
    core.set_healthy("h", False)
    d = diagnose_worker(core, "h", 0.0, failures=2)
    assert d.problem == "unhealthy" and "http://h:8000/health" in d.cause
    assert diagnose_worker(core, "gone", 0.0).problem is None


def test_engine_block_size_from_metrics():
    text = ('# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{block_size="32",enable_prefix_caching='
            '"True",num_gpu_blocks="100"} 1.0\n')
    assert engine_block_size(text) == 32
    assert engine_block_size("vllm:num_requests_waiting 0\n") is None


# ---- the rate-limited log line --------------------------------------------------------------------------

def test_problem_log_once_per_change_and_at_most_once_per_30_s():
    from router.frontends.diagnosis import Diagnosis

    def d(problem: str | None) -> dict[str, Diagnosis]:
        return {"w": Diagnosis("w", problem, f"because {problem}" if problem else None),
                "ok": Diagnosis("ok", None, None)}

    pl = ProblemLog(min_interval_s=30.0)
    assert pl.update(d(None), 0.0) == []
    lines = pl.update(d("never-published"), 1.0)
    assert lines == [(logging.WARNING, "worker w: never-published: because never-published")]
    assert all(pl.update(d("never-published"), t) == [] for t in (1.2, 1.4, 2.0, 20.0))  # many probes, one line
    assert pl.update(d(None), 5.0) == []  # flapping: folded while within 30 s of the last line
    assert pl.update(d("never-published"), 10.0) == []  # back where the last line said: nothing to say
    assert pl.update(d("stale"), 25.0) == []  # a change within 30 s waits...
    lines = pl.update(d("stale"), 31.0)  # ...and is said once the interval has passed
    assert lines == [(logging.WARNING, "worker w: stale (was never-published): because stale")]
    assert pl.update(d(None), 40.0) == []
    assert pl.update(d(None), 61.0) == [(logging.INFO, "worker w: recovered from stale")]
    assert pl.update({}, 62.0) == [] and "w" not in pl.reported  # a removed worker is forgotten
    assert pl.update(d("stale"), 63.0)[0][0] == logging.WARNING  # a re-added one starts afresh


# ---- live: router and doctor ----------------------------------------------------------------------------

async def doctor(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router.cli", "doctor", "--wait", "1.5", "--timeout", "1", *args, cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode, out.decode()


@pytest.mark.sockets
async def test_misconfigured_events_are_said_in_the_log_admin_metrics_and_by_doctor(caplog):
    caplog.set_level(logging.INFO, logger="router.frontends.fleet")
    port = free_port()
    # tcp://127.0.0.1:PORT has no '*': the publisher connects, as vLLM's does, and the router dials it too
    bad = await start_worker(events_endpoint=f"tcp://127.0.0.1:{port}")
    good = await start_worker()
    bad_spec = f"{bad.url},id=bad,events=tcp://127.0.0.1:{port},replay={bad.publisher.replay_endpoint}"
    good_spec = spec_of(good, "good")
    stale_after = 1.0

    def lines(wid: str) -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.name == "router.frontends.fleet" and f"worker {wid}:" in r.message]

    try:
        async with proxy([bad_spec, good_spec], **{"routing.stale_after_s": stale_after,
                                                   "routing.policy": "round_robin"}) as (server, url, admin):
            fleet = server.fleet
            await wait_until(lambda: fleet.subscriber.ready >= {"bad", "good"})
            async with aiohttp.ClientSession() as s:
                first = time.monotonic()
                for i in range(8):
                    body = {"prompt": f"request {i} " + "the system document says the answer " * 8, "max_tokens": 2}
                    async with s.post(url + "/v1/completions", json=body) as r:
                        assert r.status == 200
                assert server.core.load.workers["bad"].dispatched_total >= 3
                await wait_until(lambda: lines("bad"), timeout=stale_after + 5 * fleet.probe_interval_s + 3.0)
                said = time.monotonic()
                (rec,) = lines("bad")
                assert rec.levelno == logging.WARNING and "never-published" in rec.message
                assert f"tcp://127.0.0.1:{port}" in rec.message and "bind" in rec.message
                assert said - first >= stale_after  # not before the worker has been silent that long
                # many probe passes later: still exactly one line, and none about the good worker
                passes = fleet.problem_log.updates
                await wait_until(lambda: fleet.problem_log.updates >= passes + 5)
                assert len(lines("bad")) == 1 and lines("good") == []

                async with s.get(admin + "/admin/workers") as r:
                    workers = (await r.json())["workers"]
                assert workers["bad"]["problem"] == "never-published" and "bind" in workers["bad"]["cause"]
                assert workers["good"]["problem"] is None and workers["good"]["cause"] is None
                async with s.get(url + "/metrics") as r:
                    text = await r.text()
                assert 'kvrouter_worker_problem{problem="never-published",worker="bad"} 1.0' in text
                assert 'kvrouter_worker_problem{problem="never-published",worker="good"} 0.0' in text

            # kvrouter doctor, as a separate process, against both workers
            rc, out = await doctor("--worker", bad_spec, "--worker", good_spec)
            assert rc == 1, out
            rows = [line.split(None, 3) for line in out.splitlines()[2:] if line.startswith(("bad ", "good "))]
            verdicts = {(w, c): v for w, c, v, *_ in rows}
            assert verdicts[("bad", "events-socket")] == "FAIL" and verdicts[("bad", "events")] == "FAIL"
            assert all(v == "ok" for (w, _), v in verdicts.items() if w == "good"), out
            assert {c for w, c in verdicts if w == "good"} == {"health", "models", "metrics", "events-socket",
                                                              "events", "replay", "events-block-size"}
            bad_events = next(r[3] for r in rows if r[:2] == ["bad", "events"])
            assert "connects instead of binding" in bad_events and f"tcp://127.0.0.1:{port}" in bad_events
            assert "replay buffer holds" in bad_events  # it does publish: nothing reaches a subscriber
            assert "FAIL:" in out and "bad" in out.splitlines()[-1]

            # the good worker alone: exit 0, every check ok (JSON)
            rc, out = await doctor("--worker", good_spec, "--json")
            assert rc == 0, out
            report = json.loads(out)
            assert report["ok"] and report["block_size"] == BS
            assert {c["verdict"] for c in report["checks"]} == {"ok"}
    finally:
        await bad.stop()
        await good.stop()


def test_doctor_accepts_engine_pages_the_router_re_chunks():
    pytest.importorskip("router.events.rechunk")
    from router.doctor import _rechunked

    assert _rechunked(1, 16) and _rechunked(8, 16)
    assert not _rechunked(32, 16) and not _rechunked(12, 16) and not _rechunked(16, 16)


@pytest.mark.sockets
async def test_doctor_block_size_disagreement_and_a_dead_worker(tmp_path):
    w = await start_worker(block_size=32)
    try:
        rc, out = await doctor("--worker", spec_of(w, "w32"), "--json")
        assert rc == 1, out
        checks = {c["check"]: c for c in json.loads(out)["checks"]}
        assert checks["metrics"]["verdict"] == "FAIL" and "block_size 32" in checks["metrics"]["detail"]
        assert checks["events-block-size"]["verdict"] == "FAIL" and "32" in checks["events-block-size"]["detail"]
        assert checks["health"]["verdict"] == checks["events"]["verdict"] == "ok"
        # the right block size: the same worker passes
        rc, out = await doctor("--worker", spec_of(w, "w32"), "--block-size", "32")
        assert rc == 0, out
    finally:
        await w.stop()
    config = tmp_path / "router.yaml"
    dead = f"http://127.0.0.1:{free_port()}"
    config.write_text(f"routing: {{block_size: 32}}\nworkers:\n  - {{url: '{dead}', id: dead}}\n")
    rc, out = await doctor("--config", str(config))
    assert rc == 1 and "routing.block_size 32" in out, out
    row = next(line for line in out.splitlines() if line.split()[:2] == ["dead", "health"])
    assert "FAIL" in row and "down" in row
    rc, out = await doctor()
    assert rc == 2 and "no workers" in out


@pytest.mark.sockets
async def test_doctor_topic_mismatch_and_an_idle_worker_without_a_test_request():
    w = await start_worker(topic="kv")
    try:
        wrong = f"{w.url},id=w,events={w.publisher.endpoint},replay={w.publisher.replay_endpoint},topic=other"
        rc, out = await doctor("--worker", wrong, "--json")
        assert rc == 1, out
        checks = {c["check"]: c for c in json.loads(out)["checks"]}
        assert checks["events-socket"]["verdict"] == "ok"
        assert checks["events"]["verdict"] == "FAIL" and "topic 'kv'" in checks["events"]["detail"]
        # only listening to an idle worker proves nothing either way: a warning, exit 0
        rc, out = await doctor("--worker", spec_of(w, "w").replace(",replay=", ",topic=kv,replay="), "--no-provoke")
        assert rc == 0, out
        row = next(line for line in out.splitlines() if line.split()[:2] == ["w", "events"])
        assert row.split()[2] == "warn" and "idle" in row
    finally:
        await w.stop()
