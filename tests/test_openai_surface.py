"""The OpenAI surface beyond one prompt (issue 16): completions batches, /v1/embeddings, /v1/responses and the
router's own /tokenize and /detokenize, through the real proxy and through Envoy + the picker, on real
simulated workers.

Decisions checked here (router/frontends/proxy.py, docs/configuration.md): a non-streamed completions batch
is routed prompt by prompt and merged in order; a streamed batch, an embeddings batch and any batch through
Envoy go to one worker, on the prompts' longest shared prefix; /tokenize and /detokenize never reach a worker.
"""

import json

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.discovery import WorkerSpec
from router.frontends.openai import BadRequest, detokenize_body, parse_body, tokenize_body
from router.tokenizer import MAX_BATCH, load_tokenizer
from tests.envoy_helpers import gateway
from tests.sim_helpers import start_worker
from tests.test_fuzz import (
    FUZZ,
    INTS,
    JSON_VALUES,
    MESSAGES,
    PROMPTS,
    ROLES,
    SCALARS,
    TEXT,
    TOKEN_LISTS,
    encode_members,
)
from tests.test_fuzz import tokenizer_for as fuzz_tokenizer_for
from tests.test_proxy import SYSTEM, post, proxy, spec_of
from tests.zmq_helpers import wait_until
from workers.sim.server import EMBED_DIM

pytestmark = pytest.mark.sockets
OTHER = "an entirely different preamble about the weather report and the tides of the northern sea " * 12
INSTRUCTIONS = "you are a careful reviewer; follow the house style guide, which is long and detailed " * 12
TOK = load_tokenizer()


async def three_workers():
    return [await start_worker(time_scale=0.0, topic=f"w{i}") for i in range(3)]


async def stop_all(ws) -> None:
    for w in ws:
        await w.stop()


async def warm(s, worker, server, wid: str, prompt: str) -> None:
    """``prompt`` cached on ``worker`` (sent to it directly), and the router's index knows it."""
    st, _, _ = await post(s, worker.url + "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert st == 200
    await wait_until(lambda: sum(server.core.index.blocks_held(wid).values()) > 0)


async def decisions(s, admin: str, n: int) -> list[dict]:
    async with s.get(admin + f"/debug/decision?n={n}") as r:
        return (await r.json())["decisions"]


async def sse_events(response) -> list[dict]:
    """The JSON of every ``data:`` line of a Responses (or completions) stream."""
    out = []
    async for line in response.content:
        if line.startswith(b"data: {"):
            out.append(json.loads(line[6:]))
    return out


# ---- completions batches through the proxy -------------------------------------------------------------
async def test_a_batch_is_routed_prompt_by_prompt_and_merged_in_order():
    ws = await three_workers()
    try:
        async with proxy([spec_of(w, f"w{i}") for i, w in enumerate(ws)]) as (server, url, admin), \
                aiohttp.ClientSession() as s:
            await warm(s, ws[0], server, "w0", SYSTEM + "warm")
            await warm(s, ws[1], server, "w1", OTHER + "warm")
            prompts = [SYSTEM + "question one", OTHER + "question one", SYSTEM + "question two",
                       OTHER + "question two"]
            st, body, h = await post(s, url + "/v1/completions", {"prompt": prompts, "max_tokens": 3})
            assert st == 200, body
            assert h["x-kvrouter-worker"] == "w0,w1,w0,w1"  # each prompt went where its prefix is
            logged = await decisions(s, admin, 4)
            assert [d["batch_index"] for d in logged] == [0, 1, 2, 3]
            assert [d["ranked"][0] for d in logged] == ["w0", "w1", "w0", "w1"]
            assert [d["prompt_tokens"] for d in logged] == [len(TOK.encode(p)) for p in prompts]
            assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
            # in order: each choice is what that prompt alone gets (the sim's output is a function of the prompt)
            alone = [(await post(s, ws[0].url + "/v1/completions", {"prompt": p, "max_tokens": 3}))[1]
                     for p in prompts]
            assert [c["text"] for c in body["choices"]] == [a["choices"][0]["text"] for a in alone]
            usage = body["usage"]
            assert usage["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
            assert usage["completion_tokens"] == 12 and usage["total_tokens"] == usage["prompt_tokens"] + 12
            # every prompt hit its prefix: the workers' own counts, summed
            assert usage["prompt_tokens_details"]["cached_tokens"] >= 4 * 400  # prefixes of 493 and 589 tokens
            # n samples per prompt: index = prompt_index * n + j, as vLLM numbers them
            st, body, h = await post(s, url + "/v1/completions", {"prompt": prompts[:2], "max_tokens": 2, "n": 2})
            assert st == 200 and h["x-kvrouter-worker"] == "w0,w1"
            assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
            texts = [c["text"] for c in body["choices"]]
            assert texts[0] == texts[1] != texts[2] == texts[3]
            await wait_until(lambda: not server.core.load.inflight)  # every sub-request's dispatch ended
    finally:
        await stop_all(ws)


async def test_a_batch_of_token_id_lists_is_routed_and_answered():
    ws = await three_workers()
    try:
        async with proxy([spec_of(w, f"w{i}") for i, w in enumerate(ws)]) as (server, url, _), \
                aiohttp.ClientSession() as s:
            await warm(s, ws[2], server, "w2", SYSTEM + "warm")
            ids = [TOK.encode(SYSTEM + "first"), TOK.encode("short and cold"), TOK.encode(SYSTEM + "second")]
            st, body, h = await post(s, url + "/v1/completions", {"prompt": ids, "max_tokens": 2})
            assert st == 200, body
            workers = h["x-kvrouter-worker"].split(",")
            assert len(workers) == 3 and workers[0] == workers[2] == "w2"
            assert len(body["choices"]) == 3 and body["usage"]["prompt_tokens"] == sum(map(len, ids))
            # a batch of one is a lone prompt: forwarded as sent
            st, body, h = await post(s, url + "/v1/completions", {"prompt": [ids[0]], "max_tokens": 2})
            assert st == 200 and h["x-kvrouter-worker"] == "w2" and len(body["choices"]) == 1
    finally:
        await stop_all(ws)


async def test_every_member_of_a_batch_is_checked_and_the_batch_is_bounded():
    w = await start_worker(time_scale=0.0)
    try:
        async with proxy([spec_of(w, "w0")], max_model_len=256) as (server, url, admin), \
                aiohttp.ClientSession() as s:
            refused = [
                ({"prompt": ["fine", "x " * 5000], "max_tokens": 1}, "prompt[1]"),  # over the bound, untokenized
                ({"prompt": ["fine", "also fine", "a b " * 200], "max_tokens": 1}, "prompt[2]"),  # over the context
                ({"prompt": ["fine", "fine", "fine"], "max_tokens": 300}, "prompt[0]"),  # prompt + output too long
                ({"prompt": [[1, 2], [3, TOK.vocab_size]]}, "prompt[1]"),  # an id out of the vocabulary
                ({"prompt": [[1, 2], [True, 3]]}, "prompt[1]"),
                ({"prompt": [[1, 2], []]}, "prompt[1]"),
                ({"prompt": ["text", ""]}, "prompt[1]"),
                ({"prompt": ["text", [1, 2]]}, "not a mix"),
                ({"prompt": ["p"] * (MAX_BATCH + 1)}, f"at most {MAX_BATCH}"),
                ({"prompt": []}, "'prompt'"),
            ]
            for body, named in refused:
                st, out, _ = await post(s, url + "/v1/completions", body)
                assert st == 400 and named in out["message"], (body, out)
            assert w.worker.engine.stats.finished == 0 and await decisions(s, admin, 10) == []  # nothing routed
            # the bound itself is served: MAX_BATCH prompts, MAX_BATCH choices, in order
            batch = [f"prompt number {i}" for i in range(MAX_BATCH)]
            st, out, _ = await post(s, url + "/v1/completions", {"prompt": batch, "max_tokens": 1})
            assert st == 200, out
            assert [c["index"] for c in out["choices"]] == list(range(MAX_BATCH))
            assert out["usage"]["prompt_tokens"] == sum(len(TOK.encode(p)) for p in batch)
            assert w.worker.engine.stats.finished == MAX_BATCH
            await wait_until(lambda: not server.core.load.inflight)
    finally:
        await w.stop()


async def test_a_worker_error_for_one_prompt_fails_the_batch_naming_it():
    w = await start_worker(time_scale=0.0, max_model_len=512)
    try:
        # the router allows more context than this worker has: the worker itself refuses the long prompt
        async with proxy([spec_of(w, "w0")], max_model_len=32768) as (server, url, _), aiohttp.ClientSession() as s:
            prompts = ["short one", "word " * 600, "short two"]
            st, out, h = await post(s, url + "/v1/completions", {"prompt": prompts, "max_tokens": 4})
            assert st == 400 and out["message"].startswith("prompt[1]: "), out
            assert h["x-kvrouter-worker"] == "w0,w0,w0"
            assert w.worker.engine.stats.finished == 2  # the others were served; the client gets the error
            await wait_until(lambda: not server.core.load.inflight)
    finally:
        await w.stop()


async def test_a_streamed_batch_goes_to_one_worker_on_its_shared_prefix():
    ws = await three_workers()
    try:
        async with proxy([spec_of(w, f"w{i}") for i, w in enumerate(ws)]) as (server, url, admin), \
                aiohttp.ClientSession() as s:
            await warm(s, ws[1], server, "w1", SYSTEM + "warm")
            prompts = [SYSTEM + "question a", SYSTEM + "question b", SYSTEM + "question c"]
            body = {"prompt": prompts, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200 and r.headers["x-kvrouter-worker"] == "w1"
                chunks = await sse_events(r)
            (logged,) = await decisions(s, admin, 1)
            assert "batch_index" not in logged and logged["ranked"][0] == "w1"  # one decision for the batch
            assert logged["prompt_tokens"] == sum(len(TOK.encode(p)) for p in prompts)  # with all its work
            texts = [c["choices"][0] for c in chunks if c["choices"]]
            assert sorted({c["index"] for c in texts}) == [0, 1, 2] and len(texts) == 9
            usage = chunks[-1]["usage"]
            assert usage["prompt_tokens"] == logged["prompt_tokens"]
            assert usage["prompt_tokens_details"]["cached_tokens"] > 3 * 100  # each prompt hit the shared prefix
            assert ws[1].worker.engine.stats.finished == 1 + 3
    finally:
        await stop_all(ws)


# ---- /v1/embeddings and /v1/responses through the proxy ------------------------------------------------
async def test_embeddings_are_routed_on_their_prefix_and_answered_per_input():
    ws = await three_workers()
    try:
        async with proxy([spec_of(w, f"w{i}") for i, w in enumerate(ws)]) as (server, url, admin), \
                aiohttp.ClientSession() as s:
            await warm(s, ws[2], server, "w2", SYSTEM + "warm")
            inputs = [SYSTEM + "document one", SYSTEM + "document two", SYSTEM + "document three"]
            st, body, h = await post(s, url + "/v1/embeddings", {"input": inputs, "model": "sim-model"})
            assert st == 200, body
            assert h["x-kvrouter-worker"] == "w2"  # one decision, on the inputs' shared prefix
            (logged,) = await decisions(s, admin, 1)
            assert logged["candidates"] and max(c["matched_gpu"] for c in logged["candidates"]) > 0
            assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1, 2]
            assert all(len(d["embedding"]) == EMBED_DIM for d in body["data"])
            assert body["usage"]["prompt_tokens"] == sum(len(TOK.encode(t)) for t in inputs)
            # the same input, the same vector; one string is one vector; token ids work too
            st, one, _ = await post(s, url + "/v1/embeddings", {"input": inputs[1]})
            assert st == 200 and one["data"][0]["embedding"] == body["data"][1]["embedding"]
            st, ids, _ = await post(s, url + "/v1/embeddings", {"input": [TOK.encode(inputs[0])]})
            assert st == 200 and ids["data"][0]["embedding"] == body["data"][0]["embedding"]
            st, out, _ = await post(s, url + "/v1/embeddings", {"input": ["x", 5]})
            assert st == 400 and "'input'" in out["message"]
            st, out, _ = await post(s, url + "/v1/embeddings", {"input": [[1], [TOK.vocab_size]]})
            assert st == 400 and "input[1]" in out["message"]
    finally:
        await stop_all(ws)


async def test_responses_non_streamed_and_streamed_follow_the_instructions_prefix():
    ws = await three_workers()
    try:
        async with proxy([spec_of(w, f"w{i}") for i, w in enumerate(ws)]) as (server, url, _), \
                aiohttp.ClientSession() as s:
            first = {"instructions": INSTRUCTIONS, "input": "review this paragraph", "max_output_tokens": 4}
            st, body, h = await post(s, url + "/v1/responses", first)
            assert st == 200, body
            holder = h["x-kvrouter-worker"]
            assert body["object"] == "response" and body["status"] == "completed"
            (item,) = body["output"]
            assert item["type"] == "message" and item["content"][0]["type"] == "output_text"
            messages = [{"role": "system", "content": INSTRUCTIONS},
                        {"role": "user", "content": "review this paragraph"}]
            assert body["usage"]["input_tokens"] == len(TOK.encode_chat(messages))
            await wait_until(lambda: sum(server.core.index.blocks_held(holder).values()) > 0)
            # streamed, the input as message items with typed parts: the same instructions, the same worker
            second = {"instructions": INSTRUCTIONS, "max_output_tokens": 5, "stream": True, "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "and this "},
                                             {"type": "input_text", "text": "one"}]}]}
            async with s.post(url + "/v1/responses", json=second) as r:
                assert r.status == 200 and r.headers["x-kvrouter-worker"] == holder
                assert r.headers["Content-Type"].startswith("text/event-stream")
                events = await sse_events(r)
            kinds = [e["type"] for e in events]
            assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
            assert kinds.count("response.output_text.delta") == 5
            assert [e["sequence_number"] for e in events] == list(range(len(events)))
            deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
            done = next(e for e in events if e["type"] == "response.output_text.done")
            assert done["text"] == deltas == events[-1]["response"]["output"][0]["content"][0]["text"]
            usage = events[-1]["response"]["usage"]
            assert usage["output_tokens"] == 5 and usage["input_tokens_details"]["cached_tokens"] > 100
            # a third, non-streamed: the cached prefix again, and the router read the hit from the usage
            third = {"instructions": INSTRUCTIONS, "input": [{"type": "message", "role": "user", "content": "more"}]}
            st, body, h = await post(s, url + "/v1/responses", third)
            assert st == 200 and h["x-kvrouter-worker"] == holder
            assert body["usage"]["input_tokens_details"]["cached_tokens"] > 100
            assert server.metrics.hit_reported._value.get() >= 200
            st, out, _ = await post(s, url + "/v1/responses", {"input": [{"role": "user", "content": 5}]})
            assert st == 400 and "content" in out["message"]
            st, out, _ = await post(s, url + "/v1/responses", {"instructions": "only this"})
            assert st == 400 and "'input'" in out["message"]
            await wait_until(lambda: not server.core.load.inflight)
    finally:
        await stop_all(ws)


# ---- /tokenize, /detokenize, and nothing else --------------------------------------------------------
async def test_tokenize_and_detokenize_are_answered_by_the_router_with_no_worker():
    w = await start_worker(time_scale=0.0)
    await w.stop()  # its port now refuses connections: whatever answers below, it is not a worker
    text = "Hello there, how many tokens is this sentence?"
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]
    async with proxy([spec_of(w, "w0")], max_model_len=4096) as (server, url, _), aiohttp.ClientSession() as s:
        st, _, _ = await post(s, url + "/v1/completions", {"prompt": text, "max_tokens": 1})
        assert st >= 500  # the worker is gone
        st, out, _ = await post(s, url + "/tokenize", {"prompt": text, "model": "sim-model"})
        assert st == 200, out
        assert out == {"count": len(TOK.encode(text)), "max_model_len": 4096, "tokens": TOK.encode(text),
                       "token_strs": None}
        st, out, _ = await post(s, url + "/tokenize", {"messages": messages, "return_token_strs": True})
        assert st == 200 and out["tokens"] == TOK.encode(TOK.render_chat(messages))
        assert len(out["token_strs"]) == out["count"] and all(isinstance(t, str) for t in out["token_strs"])
        st, out, _ = await post(s, url + "/tokenize", {"messages": messages, "add_generation_prompt": False})
        assert st == 200 and out["tokens"] == TOK.encode(TOK.render_chat(messages, add_generation_prompt=False))
        st, out, _ = await post(s, url + "/detokenize", {"tokens": TOK.encode(text)})
        assert st == 200 and out == {"prompt": text}
        st, out, _ = await post(s, url + "/detokenize", {"tokens": []})
        assert st == 200 and out == {"prompt": ""}
        bad = [("/tokenize", {"prompt": 5}), ("/tokenize", {}), ("/tokenize", {"prompt": "x" * 1_000_000}),
               ("/tokenize", {"messages": "not a list"}), ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}),
               ("/detokenize", {"tokens": [1, TOK.vocab_size]}), ("/detokenize", {"tokens": [True]}),
               ("/detokenize", {"tokens": "abc"}), ("/detokenize", {"tokens": [1] * 5000})]
        for path, body in bad:
            st, out, _ = await post(s, url + path, body)
            assert st == 400 and out["object"] == "error", (path, body, out)
        async with s.post(url + "/tokenize", data=b"{nope") as r:
            assert r.status == 400 and "JSON" in (await r.json())["message"]
        # every other path is a 404: the worker control paths above all
        for path in ("/v1/nope", "/reset_prefix_cache", "/fault", "/v1/tokenize", "/v1/completions/x"):
            async with s.post(url + path, json={}) as r:
                assert r.status == 404, path
        assert not server.core.load.inflight


# ---- through Envoy and the picker ----------------------------------------------------------------------
async def test_batches_embeddings_responses_and_tokenize_through_envoy(tmp_path):
    ws = await three_workers()
    specs = [WorkerSpec(f"w{i}", w.url, w.publisher.endpoint, w.publisher.replay_endpoint) for i, w in enumerate(ws)]

    def finished() -> list[int]:
        return [w.worker.engine.stats.finished for w in ws]

    try:
        async with gateway(specs, tmp_path) as (url, picker, _), aiohttp.ClientSession() as s:
            st, out, _ = await post(s, url + "/v1/completions", {"prompt": SYSTEM + "warm", "max_tokens": 1})
            assert st == 200, out
            holder = max(range(3), key=lambda i: len(ws[i].worker.engine.pool.cached))
            await wait_until(lambda: sum(picker.core.index.blocks_held(f"w{holder}").values()) > 0)
            # a batch through Envoy is one request to one endpoint: the holder of the shared prefix
            before = finished()
            batch = [SYSTEM + f"question {i}" for i in range(4)]
            st, out, _ = await post(s, url + "/v1/completions", {"prompt": batch, "max_tokens": 2})
            assert st == 200, out
            assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
            assert out["usage"]["prompt_tokens_details"]["cached_tokens"] > 4 * 100
            assert [a - b for a, b in zip(finished(), before, strict=True)] == [4 * (i == holder) for i in range(3)]
            before = finished()
            st, out, _ = await post(s, url + "/v1/embeddings", {"input": [SYSTEM + "doc a", SYSTEM + "doc b"]})
            assert st == 200 and len(out["data"]) == 2, out
            assert [a - b for a, b in zip(finished(), before, strict=True)] == [2 * (i == holder) for i in range(3)]
            # the Responses API: the second request with the same instructions lands where the first did
            before = finished()
            st, out, _ = await post(s, url + "/v1/responses", {"instructions": INSTRUCTIONS, "input": "first"})
            assert st == 200 and out["status"] == "completed", out
            served = next(i for i in range(3) if finished()[i] > before[i])
            await wait_until(lambda: sum(picker.core.index.blocks_held(f"w{served}").values()) > 0)
            before = finished()
            body = {"instructions": INSTRUCTIONS, "input": "second", "stream": True, "max_output_tokens": 3}
            async with s.post(url + "/v1/responses", json=body) as r:
                assert r.status == 200
                events = await sse_events(r)
            assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed"
            assert events[-1]["response"]["usage"]["input_tokens_details"]["cached_tokens"] > 100
            assert [a - b for a, b in zip(finished(), before, strict=True)] == [int(i == served) for i in range(3)]
            await wait_until(lambda: not picker.core.load.inflight)
            # /tokenize and /detokenize: the picker's own answer; no worker hears of them
            before = finished()
            st, out, h = await post(s, url + "/tokenize", {"prompt": "hello through envoy"})
            assert st == 200 and h["content-type"].startswith("application/json"), out
            assert out["tokens"] == TOK.encode("hello through envoy") and out["count"] == len(out["tokens"])
            st, out, _ = await post(s, url + "/detokenize", {"tokens": TOK.encode("hello through envoy")})
            assert st == 200 and out == {"prompt": "hello through envoy"}
            st, out, _ = await post(s, url + "/tokenize", {"prompt": 5})
            assert st == 400, out
            async with s.post(url + "/tokenize") as r:  # no body at all
                assert r.status == 400
            assert finished() == before and not picker.core.load.inflight
            async with s.post(url + "/v1/nope", json={}) as r:
                assert r.status == 404
    finally:
        await stop_all(ws)


@pytest.mark.parametrize("n", [1, 3])
async def test_the_simulated_worker_serves_batches_as_vllm(n):
    """Direct to the worker: every prompt's choices, usage and cached tokens summed, streamed interleaved."""
    w = await start_worker(time_scale=0.0)
    try:
        async with aiohttp.ClientSession() as s:
            prompts = [SYSTEM + "one", SYSTEM + "two"]
            st, body, _ = await post(s, w.url + "/v1/completions", {"prompt": prompts, "max_tokens": 2, "n": n})
            assert st == 200 and [c["index"] for c in body["choices"]] == list(range(2 * n))
            assert body["usage"]["prompt_tokens"] == sum(len(TOK.encode(p)) for p in prompts)
            assert body["usage"]["completion_tokens"] == 2 * 2 * n
            st, again, _ = await post(s, w.url + "/v1/completions", {"prompt": prompts, "max_tokens": 2, "n": n})
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 2 * 16 * (len(TOK.encode(SYSTEM)) // 16)
            body = {"prompt": prompts, "max_tokens": 2, "n": n, "stream": True,
                    "stream_options": {"include_usage": True}}
            async with s.post(w.url + "/v1/completions", json=body) as r:
                chunks = await sse_events(r)
            assert sorted(c["choices"][0]["index"] for c in chunks if c["choices"]) == sorted(list(range(2 * n)) * 2)
            assert chunks[-1]["usage"]["completion_tokens"] == 2 * 2 * n
            await wait_until(lambda: not w.worker._queues and w.worker.engine.num_running == 0)
    finally:
        await w.stop()


# ---- the new bodies, fuzzed: a request or a client error, nothing else ---------------------------------
RESPONSE_PARTS = st.one_of(
    st.fixed_dictionaries({}, optional={"type": st.one_of(st.sampled_from(["input_text", "output_text", "text",
                                                                           "input_image"]), SCALARS),
                                        "text": st.one_of(TEXT, JSON_VALUES)}),
    JSON_VALUES)
RESPONSE_ITEMS = st.one_of(
    st.fixed_dictionaries({"role": ROLES}, optional={
        "type": st.one_of(st.sampled_from(["message", "function_call_output", "reasoning"]), SCALARS),
        "content": st.one_of(TEXT, st.lists(RESPONSE_PARTS, max_size=3), JSON_VALUES)}),
    JSON_VALUES)
FLAGS = st.one_of(st.booleans(), SCALARS)
NEW_FIELDS = {
    "prompt": PROMPTS, "input": st.one_of(PROMPTS, st.lists(RESPONSE_ITEMS, max_size=4)),
    "instructions": st.one_of(TEXT, JSON_VALUES), "messages": MESSAGES, "tokens": st.one_of(TOKEN_LISTS, JSON_VALUES),
    "max_output_tokens": st.one_of(st.integers(1, 40), INTS, SCALARS), "n": st.one_of(st.integers(1, 4), SCALARS),
    "max_tokens": st.one_of(st.integers(1, 40), SCALARS), "stream": FLAGS, "add_special_tokens": FLAGS,
    "add_generation_prompt": FLAGS, "return_token_strs": FLAGS,
}
NEW_BODIES = st.lists(st.one_of(*(st.tuples(st.just(k), v) for k, v in NEW_FIELDS.items())), max_size=5)
NEW_PATHS = st.sampled_from(["/v1/embeddings", "/v1/responses", "/v1/completions", "/tokenize", "/detokenize"])


@settings(max_examples=800, **FUZZ)
@given(NEW_BODIES, NEW_PATHS, st.sampled_from([None, 64, 8]))
def test_new_bodies_parse_to_a_request_or_a_client_error(members, path, limit):
    raw = encode_members(members, True)
    vocab = TOK.vocab_size
    try:
        if path == "/tokenize":
            out = tokenize_body(raw, fuzz_tokenizer_for, limit)
        elif path == "/detokenize":
            out = detokenize_body(raw, fuzz_tokenizer_for, limit)
        else:
            parsed = parse_body(raw, path, fuzz_tokenizer_for, max_model_len=limit)
    except BadRequest as e:
        assert e.status in (400, 404) and str(e)
        return
    if path == "/tokenize":
        assert out["count"] == len(out["tokens"]) and out["max_model_len"] == limit
        assert all(type(t) is int and 0 <= t < vocab for t in out["tokens"])
        return
    if path == "/detokenize":
        assert isinstance(out["prompt"], str)
        return
    prompts = parsed.prompts
    assert 1 <= len(prompts) <= MAX_BATCH and all(p for p in prompts)
    assert all(type(t) is int and 0 <= t < vocab for p in prompts for t in p)
    assert parsed.kind == path.rsplit("/", 1)[1] and all(p[: len(parsed.token_ids)] == parsed.token_ids
                                                         for p in prompts)
    assert len(prompts) == 1 or parsed.kind != "responses"
    assert parsed.stream is False or parsed.kind != "embeddings"
    rreq = parsed.route_request("x", 16)
    assert rreq.prompt_tokens == sum(map(len, prompts)) and len(rreq.keys) == len(parsed.token_ids) // 16
    if limit is not None:
        for p in prompts:
            if parsed.kind == "embeddings":
                assert len(p) <= limit
            elif parsed.kind == "responses" and parsed.body.get("max_output_tokens") is not None:
                assert len(p) + parsed.max_tokens <= limit
