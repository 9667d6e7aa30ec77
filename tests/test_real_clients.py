"""The official OpenAI Python SDK against `kvrouter serve` (issue 16, item 6): a real client, not hand-built JSON.

AsyncOpenAI, its base_url on the proxy, in front of simulated workers over real HTTP and ZeroMQ: every surface
the SDK would call (chat, completions streamed and batched, embeddings with the SDK's default base64 encoding,
the Responses API streamed and not, models) parses into the SDK's own types, and the router's refusals come
out as the SDK's own exceptions (BadRequestError, RateLimitError, an APIError when a worker dies mid-stream).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import openai
import pytest
from openai import AsyncOpenAI

from router.frontends.proxy import ProxyServer
from router.tokenizer import load_tokenizer
from tests.sim_helpers import RunningWorker, spawn_worker, start_worker
from tests.test_proxy import SYSTEM, proxy, spec_of
from tests.zmq_helpers import wait_until
from workers.sim.server import EMBED_DIM

pytestmark = pytest.mark.sockets
MODEL = "sim-model"
TOK = load_tokenizer()


@dataclass
class Fleet:
    server: ProxyServer
    url: str
    admin: str
    workers: list[RunningWorker]
    client: AsyncOpenAI

    def held(self, wid: str) -> int:
        return sum(self.server.core.index.blocks_held(wid).values())


def sdk(url: str) -> AsyncOpenAI:
    # max_retries=0: a 429 or a cut stream reaches the test as the SDK raises it, not hidden by its retries
    return AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)


@contextlib.asynccontextmanager
async def fleet(n: int = 2, *, worker_kw: dict | None = None, **overrides) -> AsyncIterator[Fleet]:
    ws = [await start_worker(topic=f"w{i}", **(worker_kw or {})) for i in range(n)]
    try:
        async with proxy([spec_of(w, f"w{i}") for i, w in enumerate(ws)], **overrides) as (server, url, admin):
            # the workers' context lengths are learned from their /v1/models before the first request
            await wait_until(lambda: len(server.fleet.context_lens) == n, timeout=5)
            async with sdk(url) as client:
                yield Fleet(server, url, admin, ws, client)
    finally:
        for w in ws:
            await w.stop()


async def test_chat_and_completion_parse_and_a_repeated_system_prompt_hits_the_holders_cache():
    async with fleet() as f:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "what is the answer?"}]
        raw = await f.client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=4)
        holder = raw.headers["x-kvrouter-worker"]
        chat = raw.parse()
        assert isinstance(chat, openai.types.chat.ChatCompletion)
        assert chat.id and chat.object == "chat.completion" and chat.model == MODEL
        (choice,) = chat.choices
        assert choice.index == 0 and choice.message.role == "assistant" and choice.message.content
        assert choice.finish_reason == "length"
        assert chat.usage.prompt_tokens == len(TOK.encode_chat(messages))
        assert chat.usage.completion_tokens == 4
        assert chat.usage.total_tokens == chat.usage.prompt_tokens + 4
        await wait_until(lambda: f.held(holder) > 0)  # the holder's KV events reached the router's index
        # the same long system prompt, another question: the router sends it to the holder, whose cache hits
        messages[1]["content"] = "and what was the question?"
        raw = await f.client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=4)
        again = raw.parse()
        assert raw.headers["x-kvrouter-worker"] == holder
        assert again.id != chat.id
        cached = again.usage.prompt_tokens_details.cached_tokens
        assert cached > len(TOK.encode(SYSTEM)) // 2, again.usage

        # /v1/completions: the legacy surface, one prompt
        done = await f.client.completions.create(model=MODEL, prompt="once upon a time", max_tokens=3)
        assert isinstance(done, openai.types.Completion)
        assert done.id and done.object == "text_completion" and done.model == MODEL
        assert done.choices[0].text and done.choices[0].index == 0 and done.choices[0].finish_reason == "length"
        assert done.usage.prompt_tokens == len(TOK.encode("once upon a time")) and done.usage.completion_tokens == 3


async def test_a_streamed_chat_ends_with_its_usage_and_cached_tokens():
    async with fleet() as f:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "stream it"}]
        whole = await f.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6)
        await wait_until(lambda: f.held("w0") + f.held("w1") > 0)
        stream = await f.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, stream=True,
                                                        stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        assert all(isinstance(c, openai.types.chat.ChatCompletionChunk) for c in chunks)
        assert all(c.object == "chat.completion.chunk" for c in chunks)
        assert len({c.id for c in chunks}) == 1  # one id for the whole stream
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content  # the sim's output is a function of the prompt
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finishes == ["length"]
        # include_usage: the last chunk has no choices and carries the usage, cached tokens included
        last = chunks[-1]
        assert last.choices == [] and last.usage is not None
        assert all(c.usage is None for c in chunks[:-1])
        assert last.usage.prompt_tokens == whole.usage.prompt_tokens and last.usage.completion_tokens == 6
        assert last.usage.prompt_tokens_details.cached_tokens > len(TOK.encode(SYSTEM)) // 2


async def test_a_batched_completion_answers_each_prompt_in_order():
    async with fleet() as f:
        prompts = [SYSTEM + "first question", "a short cold prompt", SYSTEM + "second question"]
        raw = await f.client.completions.with_raw_response.create(model=MODEL, prompt=prompts, max_tokens=2)
        batch = raw.parse()
        assert len(raw.headers["x-kvrouter-worker"].split(",")) == 3  # routed prompt by prompt
        assert [c.index for c in batch.choices] == [0, 1, 2]
        alone = [await f.client.completions.create(model=MODEL, prompt=p, max_tokens=2) for p in prompts]
        assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]
        assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
        assert batch.usage.completion_tokens == 6
        # token-id prompts, as the SDK types them (list[list[int]])
        ids = [TOK.encode(p) for p in prompts[:2]]
        by_ids = await f.client.completions.create(model=MODEL, prompt=ids, max_tokens=2)
        assert [c.text for c in by_ids.choices] == [c.text for c in batch.choices[:2]]


async def test_embeddings_in_the_sdks_default_base64_and_as_floats():
    async with fleet() as f:
        inputs = [SYSTEM + "document one", SYSTEM + "document two"]
        # with no encoding_format the SDK asks for base64 and decodes it to floats itself
        out = await f.client.embeddings.create(model=MODEL, input=inputs)
        assert out.object == "list" and [d.index for d in out.data] == [0, 1]
        assert all(len(d.embedding) == EMBED_DIM and isinstance(d.embedding[0], float) for d in out.data)
        assert out.usage.prompt_tokens == sum(len(TOK.encode(t)) for t in inputs)
        floats = await f.client.embeddings.create(model=MODEL, input=inputs, encoding_format="float")
        for a, b in zip(out.data, floats.data, strict=True):
            assert a.embedding == pytest.approx(b.embedding, rel=1e-6, abs=1e-6)
        one = await f.client.embeddings.create(model=MODEL, input=inputs[1], encoding_format="float")
        assert one.data[0].embedding == floats.data[1].embedding


async def test_the_responses_api_streamed_and_not():
    async with fleet() as f:
        instructions = "you review prose; follow the house style guide, which is long and detailed " * 10
        resp = await f.client.responses.create(model=MODEL, instructions=instructions, input="review this",
                                               max_output_tokens=4)
        assert isinstance(resp, openai.types.responses.Response)
        assert resp.id and resp.object == "response" and resp.status == "completed"
        assert resp.output_text and resp.output[0].type == "message"
        messages = [{"role": "system", "content": instructions}, {"role": "user", "content": "review this"}]
        assert resp.usage.input_tokens == len(TOK.encode_chat(messages)) and resp.usage.output_tokens == 4
        await wait_until(lambda: f.held("w0") + f.held("w1") > 0)
        stream = await f.client.responses.create(model=MODEL, instructions=instructions, max_output_tokens=5,
                                                 input=[{"role": "user", "content": "and this one"}], stream=True)
        events = [e async for e in stream]
        kinds = [e.type for e in events]
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        assert kinds.count("response.output_text.delta") == 5
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        final = events[-1].response
        assert final.status == "completed" and final.output_text == deltas
        assert final.usage.output_tokens == 5
        assert final.usage.input_tokens_details.cached_tokens > 100  # the instructions' prefix hit


async def test_models_list():
    async with fleet() as f:
        models = [m async for m in f.client.models.list()]
        assert [m.id for m in models] == [MODEL]  # two workers of one model: listed once
        assert models[0].object == "model"


async def test_malformed_and_too_long_requests_raise_bad_request_with_the_routers_message():
    async with fleet(worker_kw={"max_model_len": 512}) as f:
        with pytest.raises(openai.BadRequestError) as err:
            await f.client.completions.create(model=MODEL, prompt="hi", max_tokens=-1)
        assert err.value.status_code == 400 and "max_tokens" in err.value.message
        assert err.value.body["type"] == "BadRequestError"
        with pytest.raises(openai.BadRequestError) as err:
            await f.client.chat.completions.create(model=MODEL, max_tokens=4,
                                                   messages=[{"role": "user", "content": "word " * 600}])
        assert "maximum context length is 512" in err.value.message
        assert err.value.body["message"].startswith("This model's maximum context length is 512 tokens")
        # refused by the router: no worker saw either request
        assert [w.worker.engine.stats.finished for w in f.workers] == [0, 0]


async def test_a_saturated_fleet_raises_rate_limit_error():
    async with fleet(worker_kw={"time_scale": 3.0}, **{"routing.max_inflight_requests": 1}) as f:
        # the bound is per worker: one slow request on each fills the fleet
        slow = [asyncio.create_task(f.client.completions.create(model=MODEL, prompt=SYSTEM + f"n{i}", max_tokens=30))
                for i in range(2)]
        await wait_until(lambda: len(f.server.core.load.inflight) == 2, timeout=5)
        with pytest.raises(openai.RateLimitError) as err:
            await f.client.chat.completions.create(model=MODEL, max_tokens=1,
                                                   messages=[{"role": "user", "content": "hi"}])
        assert err.value.status_code == 429 and "saturated" in err.value.message
        assert int(err.value.response.headers["retry-after"]) >= 1
        # the ones admitted are served in full, one on each worker
        assert [r.usage.completion_tokens for r in await asyncio.gather(*slow)] == [30, 30]
        assert [w.worker.engine.stats.finished for w in f.workers] == [1, 1]


async def test_a_worker_killed_mid_stream_makes_the_sdks_iteration_raise():
    proc = spawn_worker("--time-scale", "3.0")
    try:
        async with proxy([proc.spec("w0")]) as (server, url, _a), sdk(url) as client:
            got: list[openai.types.Completion] = []
            stream = await client.completions.create(model=MODEL, prompt=SYSTEM, max_tokens=400, stream=True)
            with pytest.raises(openai.APIError) as err:
                async for chunk in stream:
                    got.append(chunk)
                    if len(got) == 2:
                        proc.kill()  # kill -9 with the answer half streamed
            # the router's SSE error event, as the SDK raises it: not a stream that ends as if finished
            assert "w0" in err.value.message, err.value
            assert 2 <= len(got) < 400 and not any(c.choices[0].finish_reason for c in got)
            assert server.metrics.truncated._value.get() == 1
            await wait_until(lambda: not server.core.load.inflight)
    finally:
        if proc.proc.poll() is None:
            proc.kill()
