"""kvrouter serve end to end over real sockets: proxy + simulated workers (HTTP + ZeroMQ)."""

import asyncio
import contextlib
import json

import aiohttp
import pytest
from aiohttp import web

from router.config import load_config
from router.discovery import parse_worker_arg
from router.frontends.proxy import ProxyServer
from tests.sim_helpers import spawn_worker, start_worker
from tests.zmq_helpers import wait_until

pytestmark = pytest.mark.sockets
SYSTEM = "you are a helpful assistant and the system document says the answer is in the question " * 12


@contextlib.asynccontextmanager
async def proxy(worker_specs: list[str], **overrides):
    cfg = load_config(None, {"routing.block_size": 16, "probe_interval_s": 0.2, **overrides})
    cfg.workers = [parse_worker_arg(s) for s in worker_specs]
    server = ProxyServer(cfg)
    await server.start()
    api = await server.serve_api("127.0.0.1", 0)
    runner = web.AppRunner(server.admin_app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    admin = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    try:
        yield server, f"http://127.0.0.1:{api.sockets[0].getsockname()[1]}", admin
    finally:
        api.close()
        await runner.cleanup()
        await server.stop()


def spec_of(w, wid: str) -> str:
    return f"{w.url},id={wid},events={w.publisher.endpoint},replay={w.publisher.replay_endpoint}"


async def post(session, url, body, headers=None):
    async with session.post(url, json=body, headers=headers) as r:
        return r.status, await r.json(content_type=None), r.headers


async def test_shared_prefix_requests_land_where_the_prefix_is():
    ws = [await start_worker(time_scale=0.0, topic=f"w{i}") for i in range(3)]
    try:
        async with proxy([spec_of(w, f"w{i}") for i, w in enumerate(ws)]) as (server, url, admin):
            await asyncio.sleep(0.3)  # subscriptions settle
            async with aiohttp.ClientSession() as s:
                st, _, h = await post(s, url + "/v1/completions", {"prompt": SYSTEM + "question zero", "max_tokens": 2})
                assert st == 200
                holder = h["x-kvrouter-worker"]
                await wait_until(lambda: sum(server.core.index.blocks_held(holder).values()) > 0)
                for i in range(1, 6):
                    st, body, h = await post(s, url + "/v1/completions",
                                             {"prompt": SYSTEM + f"question {i}", "max_tokens": 2})
                    assert st == 200 and h["x-kvrouter-worker"] == holder
                    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
                    assert cached >= len(SYSTEM.split()) // 2  # the workers' own count confirms the hit
                # chat goes through the same template as the worker's: its prefix hits too
                msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
                st, _, h1 = await post(s, url + "/v1/chat/completions", {"messages": msgs, "max_tokens": 2})
                msgs[1]["content"] = "hello again"
                st, b, h2 = await post(s, url + "/v1/chat/completions", {"messages": msgs, "max_tokens": 2})
                assert h1["x-kvrouter-worker"] == h2["x-kvrouter-worker"]
                assert b["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
                async with s.get(admin + "/debug/decision?n=3") as r:
                    decisions = (await r.json())["decisions"]
                assert len(decisions) == 3 and decisions[-1]["policy"] == "precise"
                chosen = [c for c in decisions[-1]["candidates"] if c["worker_id"] == decisions[-1]["ranked"][0]]
                assert chosen[0]["matched_gpu"] > 0
                async with s.get(url + "/metrics") as r:
                    text = await r.text()
                assert "kvrouter_prefix_hit_tokens_reported_total" in text
                assert 'kvrouter_decisions_total{credit="true",outcome="routed",policy="precise"}' in text
    finally:
        for w in ws:
            await w.stop()


async def test_streaming_passes_chunk_by_chunk():
    w = await start_worker(time_scale=2.0)
    try:
        async with proxy([spec_of(w, "w0")]) as (_, url, _a), aiohttp.ClientSession() as s:
            body = {"prompt": SYSTEM, "max_tokens": 8, "stream": True}
            lines = []
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
                async for line in r.content:
                    if line.startswith(b"data: "):
                        if not lines:  # the client has its first token while the worker still generates
                            assert w.worker.engine.num_running == 1
                        lines.append(line)
            assert len(lines) == 9 and lines[-1].strip() == b"data: [DONE]"
            assert w.worker.engine.num_running == 0
    finally:
        await w.stop()


async def test_bad_requests_limits_and_shedding():
    w = await start_worker(time_scale=3.0)
    try:
        async with proxy([spec_of(w, "w0")], max_body_bytes=4096, **{"routing.max_inflight_requests": 1}) as (
                _, url, _a), aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/completions", data=b"{nope") as r:
                assert r.status == 400 and "JSON" in (await r.json())["message"]
            st, body, _ = await post(s, url + "/v1/completions", {"prompt": "x" * 10_000})
            assert st == 413 and "limit" in body["message"]
            st, body, _ = await post(s, url + "/v1/completions", {"prompt": 5})
            assert st == 400 and "prompt" in body["message"]
            st, body, _ = await post(s, url + "/v1/completions", {"prompt": "hi", "max_tokens": -1})
            assert st == 400 and "max_tokens" in body["message"]
            slow = asyncio.create_task(post(s, url + "/v1/completions", {"prompt": SYSTEM, "max_tokens": 30}))
            await asyncio.sleep(0.2)
            st, body, headers = await post(s, url + "/v1/completions", {"prompt": "hi", "max_tokens": 1})
            assert st == 429 and int(headers["Retry-After"]) >= 1 and "saturated" in body["message"]
            assert (await slow)[0] == 200
    finally:
        await w.stop()


async def test_client_destination_headers_never_steer_the_proxy():
    ws = [await start_worker(topic=f"w{i}") for i in range(2)]
    try:
        async with proxy([spec_of(w, f"w{i}") for i, w in enumerate(ws)], **{"routing.policy": "round_robin"}) as (
                _, url, _a), aiohttp.ClientSession() as s:
            seen = set()
            for i in range(6):
                hdr = {"x-gateway-destination-endpoint": f"127.0.0.1:{ws[0].port}", "Host": "evil.example:1"}
                st, _, h = await post(s, url + "/v1/completions", {"prompt": f"p{i}", "max_tokens": 1}, hdr)
                assert st == 200
                seen.add(h["x-kvrouter-worker"])
            assert seen == {"w0", "w1"}  # round robin, whatever the header said
            hdr = {"x-gateway-destination-endpoint": "10.9.9.9:80"}  # an endpoint that is not discovered
            st, _, h = await post(s, url + "/v1/completions", {"prompt": "x", "max_tokens": 1}, hdr)
            assert st == 200 and h["x-kvrouter-worker"] in {"w0", "w1"}
    finally:
        for w in ws:
            await w.stop()


async def test_stale_worker_gets_load_only_traffic_and_drain_stops_new_requests():
    ws = [await start_worker(topic=f"w{i}") for i in range(2)]
    try:
        async with proxy([spec_of(w, f"w{i}") for i, w in enumerate(ws)], **{"routing.stale_after_s": 0.5}) as (
                server, url, admin), aiohttp.ClientSession() as s:
            await asyncio.sleep(0.3)
            st, _, h = await post(s, url + "/v1/completions", {"prompt": SYSTEM + "a", "max_tokens": 1})
            holder = h["x-kvrouter-worker"]
            idx = int(holder[1])
            await wait_until(lambda: sum(server.core.index.blocks_held(holder).values()) > 0)
            await post(s, ws[idx].url + "/fault", {"events": "stop"})
            for i in range(3):  # it keeps taking requests with new blocks (which owe events), but publishes nothing
                await post(s, url + "/v1/completions",
                           {"prompt": SYSTEM + f"b{i} " + "fresh words that fill new blocks " * 8, "max_tokens": 1})
            await asyncio.sleep(0.7)
            await post(s, url + "/v1/completions", {"prompt": SYSTEM + "c", "max_tokens": 1})
            async with s.get(admin + "/debug/decision?n=1") as r:
                last = (await r.json())["decisions"][-1]
            rep = {c["worker_id"]: c for c in last["candidates"]}
            assert rep[holder]["state"] == "stale" and not rep[holder]["prefix_credit"]
            assert rep[holder]["matched_gpu"] == 0
            # drain the other worker: new requests avoid it
            other = "w1" if holder == "w0" else "w0"
            async with s.post(admin + f"/admin/drain?worker={other}", json={}) as r:
                assert r.status == 200
            for i in range(4):
                st, _, h = await post(s, url + "/v1/completions", {"prompt": f"d{i}", "max_tokens": 1})
                assert st == 200 and h["x-kvrouter-worker"] == holder
            async with s.get(admin + "/admin/workers") as r:
                state = (await r.json())["workers"]
            assert state[other]["draining"] and state[holder]["index_state"] == "stale"
    finally:
        for w in ws:
            await w.stop()


async def test_a_killed_worker_loses_no_request_that_had_not_started_streaming():
    procs = [spawn_worker("--time-scale", "1.0") for _ in range(3)]
    try:
        async with proxy([p.spec(f"w{i}") for i, p in enumerate(procs)], **{"routing.policy": "round_robin"}) as (
                server, url, _a), aiohttp.ClientSession() as s:
            bodies = [{"prompt": SYSTEM + f"n{i}", "max_tokens": 40} for i in range(12)]
            tasks = [asyncio.create_task(post(s, url + "/v1/completions", b)) for b in bodies]
            await asyncio.sleep(0.15)
            procs[1].kill()  # mid-run, with requests in flight on it
            results = await asyncio.gather(*tasks)
            assert [st for st, _, _ in results] == [200] * 12  # non-streamed: nothing reached the client yet
            assert {h["x-kvrouter-worker"] for _, _, h in results} <= {"w0", "w2"}  # w1's were retried
            assert server.metrics.retries._value.get() >= 1
            await wait_until(lambda: not server.core.endpoints["w1"].healthy, timeout=5)
            for i in range(4):
                st, _, h = await post(s, url + "/v1/completions", {"prompt": f"after {i}", "max_tokens": 1})
                assert st == 200 and h["x-kvrouter-worker"] != "w1"
    finally:
        for p in procs:
            if p.proc.poll() is None:
                p.kill()


async def test_workers_file_is_watched(tmp_path):
    ws = [await start_worker(topic=f"w{i}") for i in range(2)]
    path = tmp_path / "workers.json"
    path.write_text(json.dumps([{"id": "w0", "url": ws[0].url}]))
    try:
        async with proxy([], workers_file=str(path)) as (server, url, _a), aiohttp.ClientSession() as s:
            assert set(server.core.endpoints) == {"w0"}
            path.write_text(json.dumps([{"id": "w1", "url": ws[1].url, "events": ws[1].publisher.endpoint}]))
            server.fleet.file_poll_s = 0.05
            await wait_until(lambda: set(server.core.endpoints) == {"w1"}, timeout=5)
            st, _, h = await post(s, url + "/v1/completions", {"prompt": "x", "max_tokens": 1})
            assert st == 200 and h["x-kvrouter-worker"] == "w1"
            path.write_text("[not json")
            await asyncio.sleep(0.2)
            assert set(server.core.endpoints) == {"w1"}  # a broken edit keeps the last good list
    finally:
        for w in ws:
            await w.stop()
