"""``kvrouter epp --processes 2`` behind a real Envoy: both processes on one port, and each one's view of the
pod's in-flight load (its ``kvrouter_worker_inflight_requests`` gauges, from whichever process answers the metrics
port) counts the requests the other picked."""

from __future__ import annotations

import re
from pathlib import Path

import aiohttp
import pytest

from bench.load import free_port, server_process
from router.frontends.envoy_config import bootstrap
from router.frontends.epp import SHARED_PORT_MAX_STREAMS
from tests.envoy_helpers import envoy
from tests.test_processes import REQUESTS, HeldWorker, listeners, until

pytestmark = pytest.mark.sockets
INFLIGHT = re.compile(r'^kvrouter_worker_inflight_requests\{worker="(w\d)"\} (\S+)$', re.M)


async def test_epp_processes_2_share_the_pods_load_behind_envoy(tmp_path: Path):
    workers = [HeldWorker(), HeldWorker()]
    for w in workers:
        await w.start()
    picker_port, metrics_port, listen = free_port(), free_port(), free_port()
    args = ["-m", "router.cli", "epp", "--processes", "2", "--port", str(picker_port), "--health-port",
            str(free_port()), "--metrics-port", str(metrics_port), "--policy", "least_loaded",
            *[a for i, w in enumerate(workers) for a in ("--worker", f"{w.url},id=w{i}")]]
    cfg = bootstrap(listen_port=listen, admin_port=free_port(), picker_port=picker_port,
                    workers=[w.url.removeprefix("http://") for w in workers],
                    picker_streams_per_connection=SHARED_PORT_MAX_STREAMS)
    body = {"model": "sim-model", "prompt": "a prompt for two pickers", "max_tokens": 8, "stream": True}

    async def inflight() -> dict[str, float]:  # a fresh connection: either process may answer
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{metrics_port}/metrics") as r:
            return {w: float(n) for w, n in INFLIGHT.findall(await r.text())}

    with server_process(args, picker_port), envoy(cfg, tmp_path):
        async def both_listening() -> bool:  # else every connection Envoy opens now lands on the first one
            return listeners(picker_port) == 2

        await until(both_listening)
        async with aiohttp.ClientSession() as s:
            answers = [await s.post(f"http://127.0.0.1:{listen}/v1/completions", json=body)
                       for _ in range(REQUESTS)]  # one session, Envoy's connections to the picker: several
            try:
                assert all(r.status == 200 for r in answers)
                for r in answers:
                    await r.content.readline()

                async def counted() -> bool:
                    return sum((await inflight()).values()) == REQUESTS

                await until(counted, 5.0)
                views = [await inflight() for _ in range(10)]
                assert all(sum(v.values()) == REQUESTS for v in views), views
                assert sorted(w.started for w in workers) == sorted(views[-1].values())  # what the workers hold
            finally:
                for w in workers:
                    w.release.set()
                for r in answers:
                    await r.read()
    for w in workers:
        await w.runner.cleanup()  # type: ignore[union-attr]


async def test_the_pickers_admin_drains_a_worker_on_localhost_only_when_asked():
    """``kvrouter epp --admin-port P``: the fleet's admin (router/frontends/admin.py, the proxy's too) on
    127.0.0.1; a drained worker is reported draining, an unknown one is a 404; without the flag, no admin."""
    worker = HeldWorker()
    await worker.start()
    picker_port, admin_port = free_port(), free_port()
    args = ["-m", "router.cli", "epp", "--port", str(picker_port), "--health-port", str(free_port()),
            "--metrics-port", str(free_port()), "--admin-port", str(admin_port), "--worker", f"{worker.url},id=w0"]
    admin = f"http://127.0.0.1:{admin_port}"
    try:
        with server_process(args, admin_port):
            async with aiohttp.ClientSession() as s:
                async with s.post(admin + "/admin/drain", params={"worker": "w0"}, json={}) as r:
                    assert r.status == 200 and await r.json() == {"worker": "w0", "draining": True}
                async with s.get(admin + "/admin/workers") as r:
                    assert (await r.json())["workers"]["w0"]["draining"] is True
                async with s.post(admin + "/admin/undrain", params={"worker": "w0"}, json={}) as r:
                    assert await r.json() == {"worker": "w0", "draining": False}
                async with s.post(admin + "/admin/drain", params={"worker": "nope"}, json={}) as r:
                    assert r.status == 404
        plain = [a for a in args if a not in ("--admin-port", str(admin_port))]
        with server_process(plain, picker_port), pytest.raises(aiohttp.ClientConnectionError):
            async with aiohttp.ClientSession() as s, s.get(admin + "/admin/workers"):
                pass
    finally:
        worker.release.set()
        await worker.runner.cleanup()  # type: ignore[union-attr]
