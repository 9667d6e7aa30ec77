"""The simulated worker over real HTTP and ZeroMQ sockets."""

import asyncio
import json

import aiohttp
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.events.codec import decode_message
from router.events.feed import IndexFeeder
from router.events.recording import read_recording
from router.events.subscriber import EventSource, KvEventSubscriber
from router.index import KvIndex
from router.keys import request_keys
from router.tokenizer import load_tokenizer
from tests.sim_helpers import start_worker
from tests.zmq_helpers import wait_until

pytestmark = pytest.mark.sockets
PROMPT = "the system document of the user question and the answer " * 20


async def post(session, url, body):
    async with session.post(url, json=body) as r:
        return r.status, await r.json()


async def test_completions_report_cached_tokens_on_a_repeated_prefix():
    w = await start_worker()
    try:
        async with aiohttp.ClientSession() as s:
            st, first = await post(s, w.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
            assert st == 200 and first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            n = first["usage"]["prompt_tokens"]
            st, again = await post(s, w.url + "/v1/completions", {"prompt": PROMPT + " more words", "max_tokens": 4})
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16 > 0
            assert again["choices"][0]["finish_reason"] == "length" and again["usage"]["completion_tokens"] == 4
            st, chat = await post(s, w.url + "/v1/chat/completions",
                                  {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3})
            assert st == 200 and chat["object"] == "chat.completion"
            assert chat["choices"][0]["message"]["role"] == "assistant"
            st, salted = await post(s, w.url + "/v1/completions",
                                    {"prompt": PROMPT, "max_tokens": 1, "cache_salt": "tenant-x"})
            assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # other tenant: no reuse
    finally:
        await w.stop()


async def test_streaming_is_sse_framed_as_vllm_with_usage():
    w = await start_worker(time_scale=0.2)
    try:
        async with aiohttp.ClientSession() as s:
            body = {"prompt": PROMPT, "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}
            async with s.post(w.url + "/v1/completions", json=body) as r:
                assert r.headers["Content-Type"].startswith("text/event-stream")
                raw = (await r.read()).decode()
            events = [e for e in raw.split("\n\n") if e]
            assert all(e.startswith("data: ") for e in events)
            assert events[-1] == "data: [DONE]"
            chunks = [json.loads(e[6:]) for e in events[:-1]]
            assert [c["choices"][0]["finish_reason"] for c in chunks[:5]] == [None] * 4 + ["length"]
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
            async with s.post(w.url + "/v1/chat/completions", json=chat) as r:
                raw = (await r.read()).decode()
            first = json.loads(raw.split("\n\n")[0][6:])
            assert first["object"] == "chat.completion.chunk"
            assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    finally:
        await w.stop()


async def test_bad_requests_get_4xx_with_a_message():
    w = await start_worker(max_model_len=64)
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(w.url + "/v1/completions", data=b"{not json") as r:
                assert r.status == 400 and "JSON" in (await r.json())["message"]
            st, body = await post(s, w.url + "/v1/completions", {"model": "nope", "prompt": "x"})
            assert st == 404 and "nope" in body["message"]
            st, body = await post(s, w.url + "/v1/completions", {"prompt": PROMPT})
            assert st == 400 and "max_model_len" in body["message"]
            st, body = await post(s, w.url + "/v1/completions", {"prompt": 42})
            assert st == 400 and "prompt" in body["message"]
            st, body = await post(s, w.url + "/v1/chat/completions", {"messages": "hi"})
            assert st == 400 and "messages" in body["message"]
    finally:
        await w.stop()


async def test_metrics_parse_with_vllm_names_and_tokenize_matches():
    w = await start_worker()
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(2):
                await post(s, w.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
            async with s.get(w.url + "/metrics") as r:
                text = await r.text()
            _st, tok = await post(s, w.url + "/tokenize", {"prompt": PROMPT})
            assert tok["tokens"] == load_tokenizer().encode(PROMPT) and tok["count"] == len(tok["tokens"])
            async with s.get(w.url + "/health") as r:
                assert r.status == 200
    finally:
        await w.stop()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:time_to_first_token_seconds",
                 "vllm:cache_config_info", "vllm:num_preemptions"):
        assert name in fams, name
    hits = fams["vllm:prefix_cache_hits"].samples[0]
    assert hits.name == "vllm:prefix_cache_hits_total" and hits.value > 0
    assert hits.labels == {"model_name": "sim-model", "engine": "0"}
    count = [s for s in fams["vllm:time_to_first_token_seconds"].samples if s.name.endswith("_count")]
    assert count[0].value == 2


def _shape(obj):
    """Field names, order and value types of an event, as msgpack carries them."""
    if isinstance(obj, dict):
        return [(k, type(v).__name__) for k, v in obj.items()]
    return type(obj).__name__


async def test_sim_frames_have_the_real_engine_shape_and_decode_with_one_decoder(fixture_path):
    real = {}
    for rec in read_recording(fixture_path):
        if rec.kind == "pub":
            raw = msgspec.msgpack.decode(rec.frames[2])
            assert len(rec.frames) == 3 and len(rec.frames[1]) == 8
            for ev in raw[1]:
                real.setdefault(ev["type"], _shape(ev))
            real_batch = [type(x).__name__ for x in raw]
    w = await start_worker(topic="kv", block_size=32)
    ctx_frames = []
    try:
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(w.publisher.endpoint)
        await asyncio.sleep(0.3)
        async with aiohttp.ClientSession() as s:
            await post(s, w.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
            async with s.post(w.url + "/reset_prefix_cache") as r:
                assert r.status == 200
        while len(ctx_frames) < 2:
            ctx_frames.append(await sub.recv_multipart())
        sub.close()
    finally:
        await w.stop()
    sim = {}
    for frames in ctx_frames:
        msg = decode_message(frames)  # the same decoder as for the real engine
        assert msg.topic == "kv"
        raw = msgspec.msgpack.decode(frames[2])
        assert [type(x).__name__ for x in raw] == real_batch
        for ev in raw[1]:
            sim.setdefault(ev["type"], _shape(ev))
    assert set(sim) == {"BlockStored", "AllBlocksCleared"}
    for kind, shape in sim.items():
        assert shape == real[kind], kind


async def test_index_follows_the_worker_through_events_and_replay():
    w = await start_worker(topic="w0")
    feeder = IndexFeeder(KvIndex(), block_size=16)
    sub = KvEventSubscriber(feeder)
    sub.add_source(EventSource("w0", w.publisher.endpoint, w.publisher.replay_endpoint))
    try:
        await asyncio.sleep(0.3)
        tok = load_tokenizer()
        async with aiohttp.ClientSession() as s:
            await post(s, w.url + "/fault", {"drop_every": 2})
            prompts = [f"tenant {i} " + PROMPT for i in range(6)]
            for p in prompts:
                await post(s, w.url + "/v1/completions", {"prompt": p, "max_tokens": 1})
            # a dropped batch is only noticed when a later one arrives: send one more, undropped
            await post(s, w.url + "/fault", {"drop_every": 0})
            await post(s, w.url + "/v1/completions", {"prompt": "one more " + PROMPT, "max_tokens": 1})
            await wait_until(lambda: feeder.feeds.get("w0") is not None
                             and feeder.feeds["w0"].last_seq == w.publisher.seq - 1)
        assert w.publisher.dropped >= 2 and feeder.feeds["w0"].gaps_filled >= 1
        assert feeder.index.engine_hashes("w0")[0] == set(w.worker.engine.pool.cached)
        for p in prompts:
            keys = request_keys(tok.encode(p), 16)
            assert feeder.index.match(keys)["w0"].gpu == len(keys)
    finally:
        await sub.stop()
        await w.stop()


async def ttft(session, url, body) -> float:
    t0 = asyncio.get_running_loop().time()
    async with session.post(url, json={**body, "stream": True}) as r:
        await r.content.readline()  # the first SSE line carries the first token
        t1 = asyncio.get_running_loop().time()
        await r.read()
    return t1 - t0


async def test_ttft_falls_with_the_cached_prefix_in_proportion_to_the_timing_model():
    scale = 4.0  # stretch modelled times well past HTTP overhead
    w = await start_worker(time_scale=scale)
    timing = w.worker.engine.timing
    base = "the system document of the user question and the answer " * 300
    savings, n = [], 0
    try:
        async with aiohttp.ClientSession() as s:
            for i in range(3):  # three fresh prompts; the median saving is steady on a busy box
                prompt = f"variant {i} " + base
                n = len(load_tokenizer().encode(prompt))
                cold = await ttft(s, w.url + "/v1/completions", {"prompt": prompt, "max_tokens": 1})
                warm = await ttft(s, w.url + "/v1/completions", {"prompt": prompt, "max_tokens": 1})
                savings.append(cold - warm)
    finally:
        await w.stop()
    model_cold = timing.prefill_ms(n) / 1000 * scale
    model_warm = timing.prefill_ms(n - (n - 1) // 16 * 16) / 1000 * scale
    assert min(savings) > 0
    # the saving measured over HTTP is the saving the model predicts (overheads cancel out)
    assert sorted(savings)[1] == pytest.approx(model_cold - model_warm, rel=0.3)


async def test_fault_switches():
    w = await start_worker(topic="w0")
    feeder = IndexFeeder(KvIndex(), block_size=16)
    sub = KvEventSubscriber(feeder)
    sub.add_source(EventSource("w0", w.publisher.endpoint, w.publisher.replay_endpoint))
    await asyncio.sleep(0.3)
    try:
        async with aiohttp.ClientSession() as s:
            await post(s, w.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 1})
            await wait_until(lambda: feeder.feeds.get("w0") is not None)
            # events stop, serving goes on
            await post(s, w.url + "/fault", {"events": "stop"})
            st, _ = await post(s, w.url + "/v1/completions", {"prompt": "other " + PROMPT, "max_tokens": 1})
            assert st == 200 and w.publisher.discarded == 1
            await post(s, w.url + "/fault", {"events": "resume", "health": 503})
            async with s.get(w.url + "/health") as r:
                assert r.status == 503
            # restart: seq back to 0, cache empty; the subscriber sees the drop and clears
            await post(s, w.url + "/fault", {"restart": True, "health": 200})
            assert w.publisher.seq == 0 and not w.worker.engine.pool.cached
            st, body = await post(s, w.url + "/v1/completions", {"prompt": "fresh " + PROMPT, "max_tokens": 1})
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            await wait_until(lambda: feeder.feeds["w0"].resets == 1)
            assert feeder.index.engine_hashes("w0")[0] == set(w.worker.engine.pool.cached)
            # slowdown multiplies step times
            await post(s, w.url + "/fault", {"slowdown": 3.0})
            assert w.worker.faults.slowdown == 3.0
    finally:
        await sub.stop()
        await w.stop()


def test_die_switch_ends_the_worker_process():
    import urllib.request

    from tests.sim_helpers import spawn_worker

    w = spawn_worker("--time-scale", "0")
    try:
        req = urllib.request.Request(w.url + "/fault", data=b'{"die": true}', method="POST")
        urllib.request.urlopen(req, timeout=5)
        assert w.proc.wait(timeout=10) == 1
    finally:
        w.proc.kill()
