"""What a model name means across the fleet, and what ``/v1/models`` lists (issue 50, finding 13 and an "Also").

A name one worker serves as its base model and another lists as a LoRA adapter (docs/fleet.md, section 4): the
name means one model fleet-wide, the base model; the adapter is refused on its worker (its other adapters and
models stay), and the conflict is logged, exported (``kvrouter_model_name_conflicts``) and shown in
``/admin/workers``. Before, the adapter won silently: every request went to the adapter's worker, and with it
drained the answer was a 503 though the base model's worker was up.

``/v1/models`` with every worker drained: a 503 from the proxy as from the picker (a drained worker is asked
nothing new; a model listed is one a request may be sent for now), and the proxy lists only the models of the
workers that take new requests."""

from __future__ import annotations

import dataclasses
import logging

import aiohttp
import pytest

from router.discovery import WorkerSpec
from router.frontends.fleet import Fleet
from router.frontends.metrics import RouterMetrics
from router.scheduling import RoutingConfig, RoutingCore
from sim.workload import tokens_for_block
from tests.sim_helpers import start_worker
from tests.test_epp_robustness import Worker, gateway_with, post, recording_workers, start_recording_worker
from tests.test_proxy import proxy
from tests.test_routing_core import request

BASE = WorkerSpec("base", "http://10.0.0.1:8000", models=frozenset({"X"}))
ADAPTER = WorkerSpec("lora", "http://10.0.0.2:8000", models=frozenset({"B"}), loras=frozenset({"X", "other"}))
PROMPT = "a prompt for a name with two meanings " * 20


def conflicts_gauge(metrics: RouterMetrics) -> dict[str, float]:
    lines = [ln for ln in metrics.exposition().decode().splitlines()
             if ln.startswith("kvrouter_model_name_conflicts{")]
    return {ln.split('"')[1]: float(ln.rsplit(" ", 1)[1]) for ln in lines}


@pytest.mark.parametrize("order", [(BASE, ADAPTER), (ADAPTER, BASE)], ids=["base-first", "adapter-first"])
def test_a_name_that_is_a_base_model_and_an_adapter_means_the_base_model(order, caplog):
    core = RoutingCore(RoutingConfig(policy="precise", block_size=16, seed=0))
    fleet = Fleet(core)
    metrics = RouterMetrics(fleet)
    with caplog.at_level(logging.WARNING, logger="router.frontends.fleet"):
        for spec in order:  # one at a time, as a workers file or Kubernetes may list them: the order is no matter
            fleet.add(spec)
    warned = [r.getMessage() for r in caplog.records if "'X'" in r.getMessage()]
    assert warned and "base" in warned[-1] and "lora" in warned[-1]
    assert fleet.name_conflicts == {"lora": frozenset({"X"})}
    assert conflicts_gauge(metrics) == {"base": 0.0, "lora": 1.0}
    assert core.lora_of("X") is None  # keyed as the base model's blocks, never as the adapter's
    tokens = tokens_for_block(1, 256).tolist()
    for i in range(9):
        decision = core.decide(request(tokens, f"r{i}", model="X"), 1000.0)
        assert decision.outcome == "routed" and decision.ranked == ["base"], decision.reason
    assert core.lora_of("other") == "other"  # its other adapter, and its own model, are still its
    assert core.decide(request(tokens, "o", model="other", lora="other"), 1000.0).ranked == ["lora"]
    assert core.decide(request(tokens, "b", model="B"), 1000.0).ranked == ["lora"]
    # the base model drained: the name is not served by the adapter meanwhile (it means another model there)
    fleet.drain("base")
    assert core.decide(request(tokens, "d", model="X"), 1000.0).outcome == "no_endpoint"
    # the base model's worker gone: the adapter is the name's one meaning again
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="router.frontends.fleet"):
        fleet.set_workers([ADAPTER])
    assert any("no model name conflicts" in r.getMessage() for r in caplog.records)
    assert fleet.name_conflicts == {} and core.lora_of("X") == "X"
    assert core.decide(request(tokens, "a", model="X", lora="X"), 1000.0).ranked == ["lora"]
    assert conflicts_gauge(metrics) == {"lora": 0.0}


@pytest.mark.sockets
async def test_through_the_proxy_the_name_goes_to_the_base_model_while_the_adapters_worker_is_drained():
    wb, wl = await start_worker(model="X", topic="base"), await start_worker(model="X", topic="lora")
    try:
        specs = [f"{wb.url},id=base,model=X", f"{wl.url},id=lora,model=B,lora=X"]
        async with proxy(specs) as (_server, url, admin), aiohttp.ClientSession() as s:
            body = {"model": "X", "prompt": PROMPT, "max_tokens": 2}
            for _ in range(9):
                async with s.post(url + "/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    assert r.headers["x-kvrouter-worker"] == "base"
            async with s.post(admin + "/admin/drain", params={"worker": "lora"}, json={}) as r:
                assert r.status == 200
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                assert r.headers["x-kvrouter-worker"] == "base"
            async with s.get(admin + "/admin/workers") as r:
                workers = (await r.json())["workers"]
            assert workers["lora"]["refused_loras"] == ["X"] and workers["base"]["refused_loras"] == []
            async with s.get(url + "/metrics") as r:
                assert 'kvrouter_model_name_conflicts{worker="lora"} 1.0' in await r.text()
            assert wl.worker.engine.stats.finished == 0 and wb.worker.engine.stats.finished == 10
    finally:
        await wb.stop()
        await wl.stop()


@dataclasses.dataclass
class LoraWorker(Worker):
    """A recording worker discovery lists with LoRA adapters."""

    loras: frozenset[str] = frozenset()

    def spec(self, wid: str) -> WorkerSpec:
        return dataclasses.replace(super().spec(wid), loras=self.loras)


@pytest.mark.sockets
async def test_through_envoy_the_name_goes_to_the_base_model_while_the_adapters_worker_is_drained(tmp_path):
    started = [await start_recording_worker(topic=f"w{i}", model="X") for i in range(2)]
    base = LoraWorker(*(getattr(started[0], f) for f in ("worker", "runner", "port", "seen")),
                      models=frozenset({"X"}))
    adapter = LoraWorker(*(getattr(started[1], f) for f in ("worker", "runner", "port", "seen")),
                         models=frozenset({"B"}), loras=frozenset({"X"}))
    body = {"model": "X", "prompt": PROMPT, "max_tokens": 2}
    try:
        async with gateway_with([base, adapter], tmp_path) as (url, picker), aiohttp.ClientSession() as s:
            assert picker.fleet.name_conflicts == {"w1": frozenset({"X"})}
            for _ in range(9):
                status, out = await post(s, url + "/v1/completions", body)
                assert status == 200, out
            picker.fleet.drain("w1")
            status, out = await post(s, url + "/v1/completions", body)
            assert status == 200, out
            assert len(base.seen.requests) == 10 and not adapter.seen.requests
    finally:
        for w in (base, adapter):
            await w.stop()


# ---- /v1/models with the fleet drained ----------------------------------------------------------------------

@pytest.mark.sockets
async def test_the_proxys_models_lists_the_workers_taking_requests_and_is_a_503_with_none():
    wa, wb = await start_worker(model="alpha"), await start_worker(model="beta")
    try:
        async with proxy([f"{wa.url},id=a,model=alpha", f"{wb.url},id=b,model=beta"]) as (_server, url, admin), \
                aiohttp.ClientSession() as s:
            async def models() -> tuple[int, dict]:
                async with s.get(url + "/v1/models") as r:
                    return r.status, await r.json()

            status, out = await models()
            assert status == 200 and sorted(m["id"] for m in out["data"]) == ["alpha", "beta"]
            async with s.post(admin + "/admin/drain", params={"worker": "a"}, json={}) as r:
                assert r.status == 200
            status, out = await models()
            assert status == 200 and [m["id"] for m in out["data"]] == ["beta"]  # alpha can't be asked for now
            async with s.post(admin + "/admin/drain", params={"worker": "b"}, json={}) as r:
                assert r.status == 200
            status, out = await models()
            assert status == 503 and out["type"] == "ServiceUnavailableError" and "draining" in out["message"]
            async with s.get(url + "/health") as r:
                assert r.status == 503  # the same verdict as readiness
            async with s.post(admin + "/admin/undrain", params={"worker": "a"}, json={}) as r:
                assert r.status == 200
            status, out = await models()
            assert status == 200 and [m["id"] for m in out["data"]] == ["alpha"]
    finally:
        await wa.stop()
        await wb.stop()


@pytest.mark.sockets
async def test_the_pickers_models_is_a_503_with_every_worker_drained(tmp_path):
    async with recording_workers(2) as ws, gateway_with(ws, tmp_path) as (url, picker), \
            aiohttp.ClientSession() as s:
        async with s.get(url + "/v1/models") as r:
            assert r.status == 200 and (await r.json())["data"][0]["id"] == "sim-model"
        for wid in ("w0", "w1"):
            picker.fleet.drain(wid)
        async with s.get(url + "/v1/models") as r:
            assert r.status == 503, await r.text()
        picker.fleet.drain("w1", draining=False)
        async with s.get(url + "/v1/models") as r:
            assert r.status == 200
