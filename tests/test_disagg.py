"""Prefill/decode disaggregation: the pair decision (pure), the handoff through the proxy between real simulated
prefill and decode workers (vLLM's kv_transfer_params convention), the fallback when the prefill side fails."""

import asyncio

import aiohttp
import pytest

from router.events.codec import BlockStored, EventBatch
from router.keys import request_keys
from router.load import EngineMetrics
from router.scheduling import CostParams, Endpoint, RouteRequest, RoutingConfig, RoutingCore
from router.scheduling.disagg import DisaggParams
from tests.sim_helpers import start_worker
from tests.test_proxy import SYSTEM, proxy, spec_of
from tests.zmq_helpers import wait_until

BS = 16


# ---- the pair decision, pure ----------------------------------------------------------------------------------

def pd_core(mode: str = "conditional", gbit: float = 100.0) -> RoutingCore:
    cost = CostParams(prefill_a=0.0, prefill_b=0.1, prefill_c=0.0, decode_a=0.0, decode_b=0.0, decode_c=10.0,
                      learn=False)
    core = RoutingCore(RoutingConfig(block_size=BS, seed=0, cost=cost, speculative_ttl_s=0,
                                     disaggregation=DisaggParams(mode, kv_bytes_per_token=1000, link_gbit_s=gbit,
                                                                 transfer_setup_s=0.0)))
    core.upsert_endpoint(Endpoint("p0", "10.0.0.1:8000", role="prefill"))
    core.upsert_endpoint(Endpoint("d0", "10.0.0.2:8000", role="decode"))
    return core


def busy(core: RoutingCore, worker: str, running: int) -> None:
    for i in range(running):
        keys = request_keys(list(range(10**6 * (i + 1), 10**6 * (i + 1) + 64)), BS)
        core.load.dispatch(f"run-{worker}-{i}", worker, 64, 0, 100, now=0.0, keys=keys, block_size=BS)
        core.load.first_token(f"run-{worker}-{i}", now=0.0)


def test_disagg_roles_keep_generation_off_prefill_workers_and_prefill_off_decode_ones():
    core = pd_core()
    req = RouteRequest("r", request_keys(list(range(320)), BS), 320, BS)
    d = core.decide(req, 0.0)
    assert d.ranked == ["d0"]  # aggregated or decode: never the prefill-only worker
    assert next(c for c in d.candidates if c.worker_id == "p0").filtered == "role prefill: not a decode worker"
    assert core.decide(RouteRequest("p", req.keys, 320, BS, 1, role="prefill"), 0.0).ranked == ["p0"]


def test_disagg_splits_when_the_prefill_would_stall_the_decodes_and_not_otherwise():
    """Prefill 0.1 ms a token, decode steps 10 ms, KV 1,000 bytes a token over 100 Gbit/s (8 us for 100 tokens).
    A 3,200-token cold prompt: 0.32 s of prefill. On the decode worker with 8 decodes running, they each lose
    0.32 - 0.01 s to it: local 0.32 + 8 x 0.31 = 2.8 s; remote: 0.32 s on the idle prefill worker + 0.026 ms of
    transfer + one 10 ms decode step. Split. With nothing running there, local is 0.32 s: keep it local."""
    core = pd_core()
    prompt = list(range(3200))
    req = RouteRequest("r", request_keys(prompt, BS), len(prompt), BS, max_tokens=8)
    idle = core.decide(req, 0.0)
    assert core.plan_prefill(req, idle, 0.0) is None
    assert idle.disagg["split"] is False and idle.disagg["local_s"] == pytest.approx(0.32)
    busy(core, "d0", 8)
    d = core.decide(req, 0.0)
    plan = core.plan_prefill(req, d, 0.0)
    assert plan is not None and plan.worker_id == "p0"
    assert plan.local_s == pytest.approx(0.32 + 8 * (0.32 - 0.01))
    assert plan.transfer_s == pytest.approx(3200 * 1000 * 8 / 100e9)
    assert plan.remote_s == pytest.approx(0.32 + plan.transfer_s + 0.01)
    assert d.disagg["split"] is True and d.disagg["prefill"] == "p0"
    # the KV comes by transfer: the decode dispatch counts no prefill at the decode worker
    chosen = next(c for c in d.candidates if c.worker_id == "d0")
    assert chosen.matched_gpu == len(req.keys) and d.uncached_tokens == 0
    assert plan.request.role == "prefill" and plan.request.max_tokens == 1
    plan.fall_back()  # the prefill failed: the decode worker prefills it after all
    assert chosen.matched_gpu == 0 and d.uncached_tokens == len(prompt) and d.disagg["fell_back"] is True


def test_disagg_a_short_uncached_part_stays_on_the_decode_worker():
    """The decode worker holds all but the last 32 tokens: prefilling those beside its 8 decodes costs a step;
    the prefill worker would prefill all 3,200 tokens. Local."""
    core = pd_core()
    prompt = list(range(3232))
    n = 3200 // BS
    ev = BlockStored(list(range(1, n + 1)), None, prompt[: n * BS], BS, None, "GPU")
    assert core.feeder.offer("d0", 0, EventBatch(0.0, [ev], 0), 0.0) is None
    busy(core, "d0", 8)
    req = RouteRequest("r", request_keys(prompt, BS), len(prompt), BS, max_tokens=8)
    d = core.decide(req, 0.0)
    assert core.plan_prefill(req, d, 0.0) is None
    assert d.disagg["split"] is False and d.disagg["remote_s"] > d.disagg["local_s"]


def test_disagg_always_splits_and_never_never_does():
    for mode, split in (("always", True), ("never", False)):
        core = pd_core(mode)
        req = RouteRequest("r", request_keys(list(range(320)), BS), 320, BS)
        d = core.decide(req, 0.0)
        assert (core.plan_prefill(req, d, 0.0) is not None) is split


def test_disagg_a_slow_link_keeps_it_local():
    core = pd_core(gbit=0.001)  # 1 Mbit/s: 3,200 tokens x 1,000 bytes take 25 s
    busy(core, "d0", 8)
    req = RouteRequest("r", request_keys(list(range(3200)), BS), 3200, BS)
    d = core.decide(req, 0.0)
    assert core.plan_prefill(req, d, 0.0) is None and d.disagg["transfer_s"] == pytest.approx(25.6)


def test_disagg_the_prefill_worker_is_chosen_by_the_objective():
    core = pd_core("always")
    core.upsert_endpoint(Endpoint("p1", "10.0.0.3:8000", role="prefill"))
    core.load.dispatch("queued", "p0", 5000, 5000, 1, now=0.0)  # p0 has 0.5 s of prefill queued
    req = RouteRequest("r", request_keys(list(range(320)), BS), 320, BS)
    plan = core.plan_prefill(req, core.decide(req, 0.0), 0.0)
    assert plan is not None and plan.worker_id == "p1"
    for w in ("p0", "p1", "d0"):
        core.update_metrics(w, EngineMetrics(0, 0, 0.0, scraped_at=0.0))
    assert core.readiness(0.0)[0]


# ---- through the proxy, real simulated workers ------------------------------------------------------------------

async def _complete(session, url, prompt, stream=False, **extra):
    body = {"prompt": prompt, "max_tokens": 8, "stream": stream, **extra}
    async with session.post(url + "/v1/completions", json=body) as r:
        if not stream:
            return r.status, await r.json(), r.headers
        text, usage = "", None
        async for line in r.content:
            if line.startswith(b"data: {"):
                import json

                chunk = json.loads(line[6:])
                text += "".join(c.get("text", "") for c in chunk["choices"])
                usage = chunk.get("usage") or usage
        return r.status, {"text": text, "usage": usage}, r.headers


async def test_disagg_handoff_through_the_proxy_stream_and_not():
    """One prefill and one decode worker behind the proxy, always split: the prefill worker computes the prompt,
    the decode worker pulls its blocks (their hashes checked against its own), admits them as received and
    generates; the answer is the one an aggregated worker gives, token for token; the decode worker's events
    tell the router it now holds the prompt."""
    pw = await start_worker(topic="p0")
    dw = await start_worker(topic="d0")
    ref = await start_worker(events=False)
    try:
        specs = [spec_of(pw, "p0") + ",role=prefill", spec_of(dw, "d0") + ",role=decode"]
        async with proxy(specs, **{"routing.disaggregation.mode": "always"}) as (server, url, admin), \
                aiohttp.ClientSession() as s:
            await wait_until(lambda: all(server.core.index_state(w, 0) == "synced" for w in ("p0", "d0")))
            for i, stream in enumerate((False, True)):
                prompt = f"request number {i}: " + SYSTEM  # nothing shared between the two
                external = dw.worker.engine.stats.external_tokens
                st, got, h = await _complete(s, url, prompt, stream, **({"stream_options": {"include_usage": True}}
                                                                       if stream else {}))
                assert st == 200 and h["x-kvrouter-worker"] == "d0"
                st, want, _ = await _complete(s, ref.url, prompt)
                text = got["text"] if stream else got["choices"][0]["text"]
                assert text == want["choices"][0]["text"]  # temperature 0: the same tokens
                n_prompt = got["usage"]["prompt_tokens"]
                full = n_prompt // BS * BS
                assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == full  # all received, not computed
                assert dw.worker.engine.stats.external_tokens == external + full  # every full block came by transfer
            assert pw.worker.kv_sent_blocks > 0 and dw.worker.kv_received_blocks == pw.worker.kv_sent_blocks
            assert dw.worker.kv_pull_failures == 0
            assert dw.worker.engine.stats.external_tokens > 0
            # the decode worker's events put the prompt in its index: the next decision credits it there
            keys = request_keys(server.parser.tokenizer_for(None).encode("request number 1: " + SYSTEM), BS)
            await wait_until(lambda: server.core.index.match(keys).get("d0") is not None)
            async with s.get(admin + "/debug/decision") as r:
                log = (await r.json())["decisions"]
            assert log[-1]["disagg"]["split"] is True and log[-1]["disagg"]["prefill"] == "p0"
            async with s.get(url + "/metrics") as r:
                assert 'kvrouter_disagg_requests_total{outcome="split"} 2.0' in await r.text()
    finally:
        for w in (pw, dw, ref):
            await w.stop()


async def test_disagg_prefill_failure_falls_back_to_the_decode_worker():
    pw = await start_worker(topic="p0")
    dw = await start_worker(topic="d0")
    try:
        specs = [spec_of(pw, "p0") + ",role=prefill", spec_of(dw, "d0") + ",role=decode"]
        async with proxy(specs, **{"routing.disaggregation.mode": "always"}) as (server, url, admin), \
                aiohttp.ClientSession() as s:
            await wait_until(lambda: all(server.core.index_state(w, 0) == "synced" for w in ("p0", "d0")))
            await pw.stop()  # the prefill worker is gone: connection refused
            st, got, h = await _complete(s, url, SYSTEM + " question fallback")
            assert st == 200 and h["x-kvrouter-worker"] == "d0" and got["choices"][0]["text"]
            assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # prefilled where it decodes
            assert dw.worker.kv_received_blocks == 0 and dw.worker.kv_pull_failures == 0
            async with s.get(url + "/metrics") as r:
                assert 'kvrouter_disagg_requests_total{outcome="fallback"} 1.0' in await r.text()
            async with s.get(admin + "/debug/decision") as r:
                assert (await r.json())["decisions"][-1]["disagg"]["fell_back"] is True
            assert not server.core.dispatches  # nothing left in flight
    finally:
        await dw.stop()


async def test_disagg_a_clients_kv_transfer_params_are_never_forwarded():
    """A client naming a 'prefill worker' would have the decode worker pull KV from a host of its choosing."""
    w = await start_worker(topic="w0")
    try:
        async with proxy([spec_of(w, "w0")]) as (_, url, _admin), aiohttp.ClientSession() as s:
            forged = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 9,
                      "remote_request_id": "x", "remote_block_ids": [0, 1]}
            st, _, _ = await _complete(s, url, SYSTEM + " forged", kv_transfer_params=forged)
            assert st == 200
            assert w.worker.kv_pull_failures == 0 and w.worker.kv_received_blocks == 0  # never tried a pull
            # sent straight to the worker, the same params make it try (and fail) the pull: the router stopped them
            st, _, _ = await _complete(s, w.url, SYSTEM + " forged", kv_transfer_params=forged)
            assert st == 200 and w.worker.kv_pull_failures == 1
    finally:
        await w.stop()


async def test_disagg_a_decode_worker_checks_the_blocks_it_is_sent_are_its_prompts():
    """A pull answering another prompt's blocks is refused: the decode worker prefills the prompt itself."""
    pw = await start_worker(events=False)
    dw = await start_worker(events=False)
    try:
        async with aiohttp.ClientSession() as s:
            st, pre, _ = await _complete(s, pw.url, "one: " + SYSTEM, max_tokens=1,
                                         kv_transfer_params={"do_remote_decode": True})
            params = pre["kv_transfer_params"]
            assert st == 200 and params["do_remote_prefill"] is True and params["remote_block_ids"]
            st, got, _ = await _complete(s, dw.url, "another prompt: " + SYSTEM, kv_transfer_params=params)
            assert st == 200 and dw.worker.kv_pull_failures == 1 and dw.worker.kv_received_blocks == 0
            assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            await asyncio.sleep(0)
    finally:
        await pw.stop()
        await dw.stop()


# ---- the endpoint picker behind a real Envoy ----------------------------------------------------------------------

async def test_disagg_picker_names_the_prefill_worker_and_overwrites_a_clients_header(tmp_path):
    """Envoy is sent to the decode worker with the prefill worker in ``x-prefiller-host-port`` (llm-d's sidecar
    convention); a client's own value for it never survives: overwritten when split, removed when not."""
    from tests.test_epp_robustness import gateway_with, post, recording_workers

    async with recording_workers(2) as ws:
        ws[0].role, ws[1].role = "prefill", "decode"
        for mode, expect in (("always", f"127.0.0.1:{ws[0].port}"), ("never", None)):
            async with gateway_with(ws, tmp_path, disaggregation=DisaggParams(mode)) as (url, _), \
                    aiohttp.ClientSession() as s:
                before = len(ws[1].seen.generate())
                st, out = await post(s, url + "/v1/completions", {"prompt": SYSTEM + mode, "max_tokens": 4},
                                     headers={"x-prefiller-host-port": "10.6.6.6:1"})
                assert st == 200 and out["choices"][0]["text"], (mode, st, out)
                seen = ws[1].seen.generate()[before:]
                assert len(seen) == 1 and not ws[0].seen.generate()  # Envoy went to the decode worker only
                assert seen[0].get("x-prefiller-host-port") == expect


def test_disagg_a_fleet_without_prefill_workers_never_splits():
    """Ordinary workers (role both) can prefill for a decode worker only in a fleet that has prefill workers."""
    core = RoutingCore(RoutingConfig(block_size=BS, seed=0, disaggregation=DisaggParams("always")))
    for i in range(3):
        core.upsert_endpoint(Endpoint(f"w{i}", f"10.0.0.{i}:8000"))
    req = RouteRequest("r", request_keys(list(range(3200)), BS), 3200, BS)
    d = core.decide(req, 0.0)
    assert core.plan_prefill(req, d, 0.0) is None and d.disagg is None
    core.upsert_endpoint(Endpoint("p0", "10.0.0.9:8000", role="prefill"))
    d = core.decide(req, 0.0)
    assert core.plan_prefill(req, d, 0.0) is not None
