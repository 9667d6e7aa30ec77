"""Issue 13 through the real proxy: one bad request must not hurt anyone else (real HTTP and ZeroMQ)."""

import asyncio
import json
import time

import aiohttp
import pytest
import zmq.asyncio

from router.events.codec import BlockStored, EventBatch
from router.events.feed import SLICE_BLOCKS, IndexFeeder
from router.events.subscriber import EventSource, KvEventSubscriber
from router.index import KvIndex, Medium
from router.tokenizer import load_tokenizer
from tests.sim_helpers import spawn_worker, start_worker
from tests.test_proxy import SYSTEM, post, proxy, spec_of
from tests.zmq_helpers import TestPublisher, wait_until

pytestmark = pytest.mark.sockets


async def health_latencies(session: aiohttp.ClientSession, url: str, until: asyncio.Task,
                           statuses: set[int] = frozenset({200})) -> list[float]:
    """GET /health back to back while ``until`` runs; each answer's latency (its status one of ``statuses``)."""
    out = []
    while not until.done():
        t0 = time.monotonic()
        async with session.get(url + "/health") as r:
            assert r.status in statuses
        out.append(time.monotonic() - t0)
        await asyncio.sleep(0.005)
    return out


async def test_a_30mb_prompt_is_refused_while_health_answers(tmp_path):
    w = await start_worker()
    try:
        async with proxy([spec_of(w, "w0")]) as (server, url, _a), aiohttp.ClientSession() as s:
            await wait_until(lambda: "w0" in server.fleet.context_lens)  # learned from /v1/models: 32768
            assert server.fleet.max_model_len() == 32768
            body_file = tmp_path / "big.json"
            body_file.write_bytes(json.dumps({"prompt": "word " * 6_000_000, "max_tokens": 4}).encode())  # 30 MB
            # the big client is another process (curl), as an attacker's would be: this loop serves only the router
            curl = await asyncio.create_subprocess_exec(
                "curl", "-sS", "-o", str(tmp_path / "answer.json"), "-w", "%{http_code}", "-H",
                "content-type: application/json", "--data-binary", f"@{body_file}", url + "/v1/completions",
                stdout=asyncio.subprocess.PIPE)
            task = asyncio.create_task(curl.communicate())
            lat = await health_latencies(s, url, task)
            status = (await task)[0].decode()
            body = json.loads((tmp_path / "answer.json").read_text())
            assert status == "400" and "32768" in body["message"]
            assert lat and max(lat) < 0.1, lat  # the bar: /health within 100 ms meanwhile
            assert w.worker.engine.stats.finished == 0  # nothing reached the worker
    finally:
        await w.stop()


async def test_a_large_prompt_is_tokenized_off_the_event_loop():
    w = spawn_worker()  # its own process: the worker tokenizes the prompt too, on its own loop
    try:
        # a budget this large lets a 1.5M-token prompt through to the tokenizer: it must not stall the loop
        async with proxy([w.spec("w0")], max_model_len=10_000_000) as (_s, url, _a), \
                aiohttp.ClientSession() as s:
            big = json.dumps({"prompt": "hello world " * 200_000, "max_tokens": 4}).encode()
            t0 = time.monotonic()
            task = asyncio.create_task(s.post(url + "/v1/completions", data=big))
            # the worker, tokenizing 1.4M tokens itself, may miss its probes: the router's own /health answers
            lat = await health_latencies(s, url, task, {200, 503})
            r = await task
            took = time.monotonic() - t0
            assert r.status == 400 and r.headers["x-kvrouter-worker"] == "w0"  # tokenized, routed, the worker's 400
            # the loop answered all along: no /health waited more than a fraction of the whole parse (a ratio,
            # so a slow or busy machine does not change the verdict)
            assert len(lat) >= 5 and max(lat) < took / 3, (took, lat)
    finally:
        w.kill()


@pytest.mark.parametrize("missing", ["reject", "no_salt"])
async def test_a_request_without_the_tenant_header_never_uses_the_clients_salt(missing):
    w = await start_worker()
    try:
        async with proxy([spec_of(w, "w0")], tenant_header="x-tenant", tenant_missing=missing) as (
                server, url, _a), aiohttp.ClientSession() as s:
            prompt = SYSTEM + "tenant question"
            st, body, _ = await post(s, url + "/v1/completions", {"prompt": prompt, "max_tokens": 1},
                                     {"x-tenant": "tenantA"})
            assert st == 200
            await wait_until(lambda: sum(server.core.index.blocks_held("w0").values()) > 0)
            st, body, _ = await post(s, url + "/v1/completions", {"prompt": prompt, "max_tokens": 1},
                                     {"x-tenant": "tenantA"})
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 400  # tenant A's own hit
            forged = {"prompt": prompt, "max_tokens": 1, "cache_salt": "tenantA"}
            st, body, _ = await post(s, url + "/v1/completions", forged)
            if missing == "reject":
                assert st == 400 and "x-tenant" in body["message"]
            else:
                assert st == 200 and body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            st, body, _ = await post(s, url + "/v1/completions", forged, {"x-tenant": "tenantB"})
            assert st == 200 and body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the header wins
    finally:
        await w.stop()


async def test_a_shared_client_request_id_does_not_defeat_admission():
    w = await start_worker(time_scale=3.0)
    try:
        async with proxy([spec_of(w, "w0")], **{"routing.max_inflight_requests": 3}) as (server, url, admin), \
                aiohttp.ClientSession() as s:
            body = {"prompt": SYSTEM, "max_tokens": 60, "stream": True}

            async def one() -> int:
                async with s.post(url + "/v1/completions", json=body, headers={"x-request-id": "same"}) as r:
                    await r.read()
                    return r.status

            statuses = await asyncio.gather(*(one() for _ in range(30)))
            assert statuses.count(200) == 3 and statuses.count(429) == 27
            async with s.get(admin + "/debug/decision?n=30") as r:
                decisions = (await r.json())["decisions"]
            assert {d["client_request_id"] for d in decisions} == {"same"}
            assert len({d["request_id"] for d in decisions}) == 30  # the router's own ids
            assert not server.core.load.inflight
    finally:
        await w.stop()


async def test_a_worker_dying_mid_stream_ends_the_clients_stream_as_an_error():
    proc = spawn_worker("--time-scale", "3.0")
    try:
        async with proxy([proc.spec("w0")]) as (server, url, _a), aiohttp.ClientSession() as s:
            lines = []
            with pytest.raises(aiohttp.ClientPayloadError):
                async with s.post(url + "/v1/completions",
                                  json={"prompt": SYSTEM, "max_tokens": 400, "stream": True}) as r:
                    assert r.status == 200
                    async for line in r.content:
                        if line.startswith(b"data: "):
                            lines.append(line)
                            if len(lines) == 2:
                                proc.kill()  # kill -9 with the answer half streamed
            assert lines[-1].strip() != b"data: [DONE]"
            err = json.loads(lines[-1][6:])["error"]
            assert err["code"] == 502 and "w0" in err["message"]
            assert server.metrics.truncated._value.get() == 1
            assert not server.core.load.inflight
    finally:
        if proc.proc.poll() is None:
            proc.kill()


async def test_a_worker_dying_mid_body_cuts_a_non_streamed_answer():
    proc = spawn_worker("--time-scale", "3.0")
    try:
        async with proxy([proc.spec("w0")]) as (server, url, _a):
            # curl reports a transfer cut before its end (18) where a clean end would be exit 0
            curl = await asyncio.create_subprocess_exec(
                "curl", "-sS", "-N", "-o", "/dev/null", "-H", "content-type: application/json", "-d",
                json.dumps({"prompt": SYSTEM, "max_tokens": 400, "stream": True}), url + "/v1/completions")
            await wait_until(lambda: server.core.load.inflight and any(
                r.first_token_at is not None for r in server.core.load.inflight.values()), timeout=10)
            proc.kill()
            assert await curl.wait() == 18
    finally:
        if proc.proc.poll() is None:
            proc.kill()


class HalfAnsweringWorker:
    """A real HTTP server that answers every POST with a 200's headers and a fragment of its promised body, then
    closes: an engine killed between its answer's headers and its body. GETs (the probes) answer 200 ``{}``, so
    the worker stays a candidate and the failure is seen only by requests."""

    def __init__(self) -> None:
        self.posts = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                if head.startswith(b"POST"):
                    self.posts += 1
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                 b"content-length: 400\r\n\r\n{\"id\": \"cmpl-")
                    await writer.drain()
                    return
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


@pytest.mark.parametrize("batch", [False, True], ids=["lone", "batch"])
async def test_a_worker_dying_between_headers_and_body_costs_a_retry_not_a_502(batch):
    """A non-streamed answer reaches the client only whole, so a worker failing after its headers has sent the
    client nothing: the request goes to the next-ranked worker (what vLLM killed mid-answer did, once in a CI)."""
    bad, good = HalfAnsweringWorker(), await start_worker()
    bad_url = await bad.start()
    try:
        async with proxy([f"{bad_url},id=w0", spec_of(good, "w1")], **{"routing.policy": "round_robin"}) as (
                server, url, _a), aiohttp.ClientSession() as s:
            prompts = [SYSTEM + f"n{i}" for i in range(2)]  # round robin ranks w0 first for one of the two
            bodies = [{"prompt": prompts, "max_tokens": 3}] if batch else [{"prompt": p, "max_tokens": 3}
                                                                             for p in prompts]
            for body in bodies:
                st, answer, h = await post(s, url + "/v1/completions", body)
                assert st == 200, answer
                assert set(h["x-kvrouter-worker"].split(",")) == {"w1"}
                assert len(answer["choices"]) == (len(prompts) if batch else 1)
            assert bad.posts >= 1
            assert server.metrics.retries._value.get() == bad.posts
            assert server.metrics.truncated._value.get() == 0
            assert not server.core.load.inflight
    finally:
        await bad.stop()
        await good.stop()


MALFORMED = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "text"),
    ("/v1/completions", {"prompt": [1, 2, 2**32]}, "token id"),
    ("/v1/completions", {"prompt": [1, 2, 2**70]}, "token id"),
    ("/v1/completions", {"prompt": [True, False]}, "integers"),
    ("/v1/completions", {"prompt": [1, 2, 3], "stream": "false"}, "stream"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "a" * 10, "model": 5}, "model"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
]


async def test_malformed_input_is_a_400_with_a_message():
    w = await start_worker()
    vocab = load_tokenizer().vocab_size
    cases = [*MALFORMED, ("/v1/completions", {"prompt": [1, vocab]}, "vocabulary")]
    raw_cases = [
        (b'{"prompt": "\\ud800 lone surrogate"}', "surrogate"),
        (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested"),
        (b'{"prompt": "x"' + b" " * 10, "JSON"),
    ]
    try:
        async with proxy([spec_of(w, "w0")]) as (_s, url, admin), aiohttp.ClientSession() as s:
            for path, body, word in cases:
                st, answer, _ = await post(s, url + path, body)
                assert st == 400 and word in answer["message"], (body, answer)
            for raw, word in raw_cases:
                async with s.post(url + "/v1/completions", data=raw,
                                  headers={"content-type": "application/json"}) as r:
                    answer = await r.json()
                    assert r.status == 400 and word in answer["message"], (raw[:40], answer)
            for n in ("-1", "x"):
                async with s.get(admin + f"/debug/decision?n={n}") as r:
                    assert r.status == 400
            assert w.worker.engine.stats.finished == 0
    finally:
        await w.stop()


async def test_a_restarted_worker_gets_no_credit_for_its_dead_process_cache():
    ws = [await start_worker(topic=f"w{i}") for i in range(2)]
    try:
        async with proxy([spec_of(w, f"w{i}") for i, w in enumerate(ws)]) as (server, url, admin), \
                aiohttp.ClientSession() as s:
            await wait_until(lambda: server.fleet.subscriber.ready >= {"w0", "w1"})
            _, _, h = await post(s, url + "/v1/completions", {"prompt": SYSTEM + "first", "max_tokens": 1})
            holder = h["x-kvrouter-worker"]
            w = ws[int(holder[1])]
            await wait_until(lambda: server.core.index.blocks_held(holder).get(Medium.GPU, 0) > 20)
            # the engine dies and comes back empty, announcing nothing (as a new vLLM process would)
            await post(s, w.url + "/fault", {"health": 503})
            await wait_until(lambda: not server.core.endpoints[holder].healthy)
            await post(s, w.url + "/fault", {"restart": True, "health": 200})
            await wait_until(lambda: server.core.endpoints[holder].healthy)
            assert server.core.index_state(holder, time.monotonic()) == "unverified"
            _, body, h = await post(s, url + "/v1/completions", {"prompt": SYSTEM + "second", "max_tokens": 1})
            async with s.get(admin + "/debug/decision?n=1") as r:
                last = (await r.json())["decisions"][-1]
            report = next(c for c in last["candidates"] if c["worker_id"] == holder)
            assert not report["prefix_credit"] and report["matched_gpu"] == 0 and report["state"] == "unverified"
            if h["x-kvrouter-worker"] == holder:  # its first batch (seq 0) makes it exact again
                assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
                await wait_until(lambda: server.core.index_state(holder, time.monotonic()) == "synced")
    finally:
        for w in ws:
            await w.stop()


async def test_reading_admin_workers_changes_no_state():
    ws = [await start_worker(topic=f"w{i}") for i in range(2)]
    try:
        async with proxy([spec_of(w, f"w{i}") for i, w in enumerate(ws)]) as (server, url, admin), \
                aiohttp.ClientSession() as s:
            await wait_until(lambda: server.fleet.subscriber.ready >= {"w0", "w1"})
            for _ in range(3):
                async with s.get(admin + "/admin/workers") as r:
                    state = (await r.json())["workers"]
                assert {w["index_state"] for w in state.values()} == {"synced"}
            assert not server.core.feeder.feeds  # nothing published yet: nothing created by reading
            async with s.get(url + "/metrics") as r:
                assert r.status == 200
            assert not server.core.feeder.feeds
    finally:
        for w in ws:
            await w.stop()


async def test_a_huge_event_batch_is_applied_with_the_loop_running_between_slices():
    ctx = zmq.asyncio.Context()
    pub = TestPublisher(ctx, topic="kv")
    feeder = IndexFeeder(KvIndex(), block_size=16)
    sub = KvEventSubscriber(feeder, ctx=ctx)
    n = 50 * SLICE_BLOCKS  # 204,800 blocks in one BlockStored
    ticks = []

    async def ticker() -> None:
        while True:
            ticks.append(feeder.index.blocks_held("w").get(Medium.GPU, 0))
            await asyncio.sleep(0)

    try:
        sub.add_source(EventSource("w", pub.endpoint))
        await pub.wait_subscribed()
        await wait_until(lambda: "w" in sub.ready)
        t = asyncio.create_task(ticker())
        await pub.publish(EventBatch(0.0, [BlockStored(list(range(1, n + 1)), None, [7] * (16 * n), 16, None,
                                                       "GPU")], 0))
        await wait_until(lambda: feeder.index.blocks_held("w").get(Medium.GPU, 0) == n, timeout=60)
        t.cancel()
        partial = {b for b in ticks if 0 < b < n}
        assert len(partial) >= 25  # other tasks ran at many points while the event was being applied
        assert feeder.feeds["w"].malformed == 0
    finally:
        await sub.stop()
        await pub.close()
        ctx.term()
