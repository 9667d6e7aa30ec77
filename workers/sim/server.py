"""The simulated worker: vLLM's OpenAI API surface and KV events around the shared engine model.

The engine loop runs ``EngineModel.step`` on the wall clock, sleeping each step's modelled duration
times ``time_scale`` (0: no sleeping, as fast as the CPU allows), publishes the step's KV events and
hands produced tokens to the waiting HTTP handlers. Responses, SSE framing, usage (with
``prompt_tokens_details.cached_tokens``), errors and metric names follow vLLM 0.32.

Served as vLLM serves them: completions batches (``prompt`` a list of strings or token-id lists; ``n``
samples per prompt; choice ``prompt_index * n + j``, usage and cached tokens summed, streamed interleaved),
prefill/decode disaggregation with vLLM's NixlConnector convention (``kv_transfer_params``: a prefill request
with ``do_remote_decode`` answers with the params a decode worker needs; a decode request with
``do_remote_prefill`` pulls the blocks from the prefill worker named there, over HTTP here, in the modelled
transfer time, and admits them into its pool as received, not computed: ``disagg`` in this module's docs below),
``/v1/embeddings`` (a fake unit vector per input of ``EMBED_DIM`` floats, deterministic in its token ids; the
inputs are prefilled by the engine model so their blocks are cached and announced, no cached-token count,
as vLLM), ``/v1/responses`` (``instructions`` + ``input`` through the chat template; the Responses event
stream; usage with ``input_tokens_details.cached_tokens``), ``/tokenize`` and ``/detokenize``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np
import xxhash
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

from router.frontends.openai import error_response as error
from router.scheduling.disagg import DisaggParams
from router.tokenizer import PromptError, PromptTokenizer
from workers.engine import EngineModel, EngineRequest, TokenOutput
from workers.engine.metrics import engine_metric_families
from workers.sim.publisher import KvEventPublisher

log = logging.getLogger(__name__)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
MAX_BODY = 64 * 1024 * 1024
MAX_N = 64  # choices per prompt
EMBED_DIM = 8  # the fake embedding's dimension
KV_HOLD_S = 30.0  # how long a prefill worker holds a finished prefill's blocks for its decode worker to pull


def fake_embedding(ids: list[int], fmt: str = "float") -> list[float] | str:
    """A unit vector deterministic in the token ids (a stand-in for a pooling model's output);
    ``fmt="base64"``: its float32 little-endian bytes, base64 encoded, as vLLM sends them."""
    seed = xxhash.xxh3_64_intdigest(np.asarray(ids, dtype=np.uint32).tobytes())
    v = np.random.default_rng(seed).standard_normal(EMBED_DIM)
    v /= np.linalg.norm(v) or 1.0
    if fmt == "base64":
        return base64.b64encode(v.astype("<f4").tobytes()).decode()
    return [float(x) for x in v]


def _message_item(rid: str, text: str) -> dict[str, Any]:
    """The Responses API's output message holding ``text``."""
    return {"id": "msg_" + rid.removeprefix("resp_"), "type": "message", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


@dataclass
class Faults:
    """Switches for tests and demos (POST /fault)."""

    health_status: int = 200
    slowdown: float = 1.0


class _Metrics:
    """A collector reading the engine at scrape time, under vLLM's metric names."""

    def __init__(self, worker: SimWorker) -> None:
        self.w = worker

    def collect(self):  # type: ignore[no-untyped-def]
        w, e = self.w, self.w.engine
        labels = ["model_name", "engine"]
        lv = [w.model, str(w.dp_rank)]
        yield from engine_metric_families(e, w.model, w.dp_rank)
        h = HistogramMetricFamily("vllm:time_to_first_token_seconds", "Histogram of time to first token.",
                                  labels=labels)
        buckets, acc = [], 0
        for bound, count in zip(TTFT_BUCKETS, w.ttft_counts[:-1], strict=True):
            acc += count
            buckets.append((str(bound), acc))
        buckets.append(("+Inf", acc + w.ttft_counts[-1]))
        h.add_metric(lv, buckets, w.ttft_sum)
        yield h
        # the KV handoff (the simulated worker's own names: vLLM's connectors report in their logs)
        for name, doc, value in (
                ("kvsim:kv_transfer_sent_blocks", "Prompt blocks pulled from this prefill worker.", w.kv_sent_blocks),
                ("kvsim:kv_transfer_received_blocks", "Prompt blocks received from prefill workers.",
                 w.kv_received_blocks),
                ("kvsim:kv_transfer_pull_failures", "Pulls that failed (the prompt was prefilled here).",
                 w.kv_pull_failures),
                ("kvsim:external_computed_tokens", "Prompt tokens admitted as computed elsewhere.",
                 e.stats.external_tokens)):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(lv, value)
            yield c


class SimWorker:
    def __init__(
        self,
        engine: EngineModel,
        tokenizer: PromptTokenizer,
        model: str = "sim-model",
        publisher: KvEventPublisher | None = None,
        time_scale: float = 1.0,
        dp_rank: int = 0,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model = model
        self.publisher = publisher
        self.time_scale = time_scale
        self.dp_rank = dp_rank
        self.faults = Faults()
        self._queues: dict[EngineRequest, asyncio.Queue[TokenOutput | None]] = {}
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self.ttft_counts = [0] * (len(TTFT_BUCKETS) + 1)
        self.ttft_sum = 0.0
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Metrics(self))  # type: ignore[arg-type]
        self.created = int(time.time())
        self.engine_id = uuid.uuid4().hex  # names this engine in the kv_transfer_params it hands out
        self.link = DisaggParams()  # the modelled KV transfer: the router's defaults price the same link
        # finished prefills held for a decode worker: remote_request_id -> (block hashes, held until)
        self._held: dict[str, tuple[list[int], float]] = {}
        self.kv_sent_blocks = 0
        self.kv_received_blocks = 0
        self.kv_pull_failures = 0

    # ---- engine loop ---------------------------------------------------------------------------
    async def start(self) -> None:
        if self.publisher is not None:
            self.publisher.start()
        self._loop_task = asyncio.create_task(self._engine_loop())

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        if self.publisher is not None:
            await self.publisher.close()

    async def _engine_loop(self) -> None:
        while True:
            if not self.engine.has_work:
                self._wake.clear()
                await self._wake.wait()
                continue
            started = time.monotonic()
            try:
                result = self.engine.step(started)
            except Exception:  # a model bug must fail the requests, not hang them
                log.exception("engine step failed; failing in-flight requests")
                for req in list(self.engine.running) + list(self.engine.waiting):
                    self.engine.abort(req)
                    q = self._queues.get(req)
                    if q is not None:
                        q.put_nowait(None)
                continue
            delay = result.duration_s * self.time_scale * self.faults.slowdown
            if delay > 0:
                # sleep what the model says the step took, minus what computing it already cost
                await asyncio.sleep(max(0.0, delay - (time.monotonic() - started)))
            else:
                await asyncio.sleep(0)
            if self.publisher is not None and result.events:
                await self.publisher.publish(result.events, time.time())
            for out in result.outputs:
                q = self._queues.get(out.request)
                if q is not None:
                    q.put_nowait(out)

    async def _publish_idle_events(self) -> None:
        events = self.engine.take_events()
        if self.publisher is not None and events:
            await self.publisher.publish(events, time.time())

    # ---- HTTP ----------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY)
        app.add_routes([
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.get("/v1/models", self.models),
            web.get("/health", self.health),
            web.post("/v1/embeddings", self.embeddings),
            web.post("/v1/responses", self.responses),
            web.post("/tokenize", self.tokenize),
            web.post("/detokenize", self.detokenize),
            web.get("/metrics", self.metrics),
            web.post("/reset_prefix_cache", self.reset_prefix_cache),
            web.post("/fault", self.fault),
            web.post("/kv_transfer/pull", self.kv_pull),
            web.get("/version", self.version),
        ])

        async def on_startup(_: web.Application) -> None:
            await self.start()

        async def on_cleanup(_: web.Application) -> None:
            await self.stop()

        app.on_startup.append(on_startup)
        app.on_cleanup.append(on_cleanup)
        return app

    async def _json(self, request: web.Request) -> dict[str, Any] | web.Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return error(400, f"request body is not valid JSON: {e}")
        if not isinstance(body, dict):
            return error(400, "request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model:
            return error(404, f"The model `{model}` does not exist.", "NotFoundError")
        return body

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await self._json(request)
        if isinstance(body, web.Response):
            return body
        try:  # completions: a prompt or a batch of them (vLLM's four shapes); chat: the messages
            prompts = self.tokenizer.request_prompts(body, "chat" if chat else "completions")
        except PromptError as e:
            return error(400, str(e))
        max_tokens = body.get("max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens")
        if max_tokens is None:
            max_tokens = 16
        if type(max_tokens) is not int or max_tokens < 1:
            return error(400, "max_tokens must be a positive integer")
        n = body.get("n")
        if n is None:
            n = 1
        if type(n) is not int or not 1 <= n <= MAX_N:
            return error(400, f"n must be an integer from 1 to {MAX_N}")
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            return error(400, "cache_salt must be a non-empty string")
        if body.get("stream") not in (None, True, False):
            return error(400, "stream must be true or false")
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:16]
        kv = body.get("kv_transfer_params")
        if kv is not None and (not isinstance(kv, dict) or len(prompts) != 1 or n != 1):
            return error(400, "kv_transfer_params must be an object, for one prompt and n = 1")
        remote_tokens = 0
        if kv and kv.get("do_remote_prefill"):
            remote_tokens = await self._pull_kv(kv, prompts[0], salt)
        # choice i * n + j: prompt i's j-th sample (one engine request each; the copies share the prompt's blocks)
        submitted = self._submit(rid, [ids for ids in prompts for _ in range(n)], max_tokens, salt, remote_tokens)
        if isinstance(submitted, web.Response):
            return submitted
        reqs, queue = submitted
        stream = bool(body.get("stream"))
        opts = body.get("stream_options") or {}
        include_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
        try:
            if stream:
                return await self._stream(request, rid, reqs, queue, chat, include_usage, n)
            handoff = None
            if kv and kv.get("do_remote_decode"):  # a prefill for a decode worker: hold its blocks for the pull
                handoff = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                           "remote_request_id": rid, "remote_host": request.url.host,
                           "remote_port": request.url.port, "tp_size": 1}
            return await self._complete(rid, reqs, queue, chat, n, handoff)
        finally:
            self._release(reqs)

    def _submit(self, rid: str, prompts: list[list[int]], max_tokens: int, salt: str | None,
                remote_kv_tokens: int = 0
                ) -> tuple[list[EngineRequest], asyncio.Queue[TokenOutput | None]] | web.Response:
        """One engine request per prompt, all feeding one queue (outputs name their request)."""
        queue: asyncio.Queue[TokenOutput | None] = asyncio.Queue()
        reqs: list[EngineRequest] = []
        now = time.monotonic()
        for i, ids in enumerate(prompts):
            req = EngineRequest(rid if len(prompts) == 1 else f"{rid}-{i}", ids, max_tokens, cache_salt=salt,
                                arrival=now, remote_kv_tokens=remote_kv_tokens)
            try:
                self.engine.add_request(req)
            except ValueError as e:
                self._release(reqs)
                return error(400, str(e))
            reqs.append(req)
            self._queues[req] = queue
        self._wake.set()
        return reqs, queue

    def _release(self, reqs: list[EngineRequest]) -> None:
        for req in reqs:
            self._queues.pop(req, None)
            if req.finished_at is None:
                self.engine.abort(req)  # client went away: free its blocks

    async def _collect(self, reqs: list[EngineRequest], queue: asyncio.Queue[TokenOutput | None],
                       ttft: bool = True) -> dict[EngineRequest, list[int]] | None:
        """Every request's tokens once all have finished; None if the engine stopped serving them."""
        tokens: dict[EngineRequest, list[int]] = {r: [] for r in reqs}
        left = len(reqs)
        while left:
            out = await queue.get()
            if out is None:
                return None
            if out.first and ttft:
                self._record_ttft(out.request)
            tokens[out.request].append(out.token)
            if out.finished:
                left -= 1
        return tokens

    def _usage(self, reqs: list[EngineRequest], n: int = 1) -> dict[str, Any]:
        """As vLLM sums a request's usage: each prompt counted once (its first sample), every output."""
        firsts = reqs[::n]
        n_in = sum(len(r.prompt) for r in firsts)
        n_out = sum(len(r.output) for r in reqs)
        return {
            "prompt_tokens": n_in,
            "total_tokens": n_in + n_out,
            "completion_tokens": n_out,
            # as vLLM counts them: tokens not computed here, from its cache or received from a prefill worker
            "prompt_tokens_details": {"cached_tokens": sum((r.num_cached_tokens or 0) + r.external_tokens
                                                           for r in firsts)},
        }

    def _record_ttft(self, req: EngineRequest) -> None:
        ttft = time.monotonic() - req.arrival
        self.ttft_sum += ttft
        for i, bound in enumerate(TTFT_BUCKETS):
            if ttft <= bound:
                self.ttft_counts[i] += 1
                return
        self.ttft_counts[-1] += 1

    async def _complete(self, rid: str, reqs: list[EngineRequest], queue: asyncio.Queue[TokenOutput | None],
                        chat: bool, n: int, handoff: dict[str, Any] | None = None) -> web.Response:
        tokens = await self._collect(reqs, queue)
        if tokens is None:
            return error(503, "the engine stopped serving this request", "ServiceUnavailableError")
        if handoff is not None:
            req = reqs[0]
            full = len(req.prompt) // self.engine.config.block_size
            hashes = list(self.engine._hashes_upto(req, full))
            self._hold(rid, hashes)
            handoff["remote_block_ids"] = list(range(len(hashes)))  # positions of the prompt's full blocks
        choices: list[dict[str, Any]] = []
        for i, req in enumerate(reqs):
            text = self.tokenizer.decode(tokens[req])
            if chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": text, "refusal": None,
                                                        "tool_calls": []},
                                "logprobs": None, "finish_reason": "length", "stop_reason": None})
            else:
                choices.append({"index": i, "text": text, "logprobs": None, "finish_reason": "length",
                                "stop_reason": None, "prompt_logprobs": None})
        return web.json_response({
            "id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": self.model, "choices": choices,
            "usage": self._usage(reqs, n), "kv_transfer_params": handoff,
        })

    # ---- disaggregation: the KV handoff -----------------------------------------------------------
    def _hold(self, rid: str, hashes: list[int]) -> None:
        now = time.monotonic()
        for k in [k for k, (_, until) in self._held.items() if until < now]:
            del self._held[k]  # never pulled: released, as vLLM's prefill side times out
        self._held[rid] = (hashes, now + KV_HOLD_S)

    async def kv_pull(self, request: web.Request) -> web.Response:
        """A decode worker pulls a held prefill: the block hashes it computed (the blocks themselves are
        modelled, their transfer time is the decode side's); released once pulled."""
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return error(400, "request body is not valid JSON")
        held = self._held.pop(str(body.get("remote_request_id")) if isinstance(body, dict) else "", None)
        if held is None:
            return error(404, "no such held prefill (never made, already pulled, or expired)", "NotFoundError")
        self.kv_sent_blocks += len(held[0])
        return web.json_response({"engine_id": self.engine_id, "block_hashes": held[0]})

    async def _pull_kv(self, kv: dict[str, Any], prompt: list[int], salt: str | None) -> int:
        """Prompt tokens whose KV the prefill worker sent (0: the pull failed; vLLM's
        ``kv_load_failure_policy: recompute``, the prompt is prefilled here). The received hashes must be this
        prompt's own, block for block: blocks of another prompt are never admitted."""
        host, port, rrid = kv.get("remote_host"), kv.get("remote_port"), kv.get("remote_request_id")
        if not isinstance(host, str) or type(port) is not int or not isinstance(rrid, str):
            self.kv_pull_failures += 1
            return 0
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session, \
                    session.post(f"http://{host}:{port}/kv_transfer/pull", json={"remote_request_id": rrid}) as r:
                got = await r.json() if r.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError):
            got = None
        hashes = got.get("block_hashes") if isinstance(got, dict) else None
        probe = EngineRequest("probe", prompt, 1, cache_salt=salt)
        mine = self.engine._hashes_upto(probe, len(prompt) // self.engine.config.block_size)
        if not isinstance(hashes, list) or not hashes or hashes != mine[: len(hashes)]:
            self.kv_pull_failures += 1
            return 0
        tokens = len(hashes) * self.engine.config.block_size
        delay = self.link.transfer_s(tokens) * self.time_scale
        if delay > 0:
            await asyncio.sleep(delay)
        self.kv_received_blocks += len(hashes)
        return tokens

    async def _stream(self, request: web.Request, rid: str, reqs: list[EngineRequest],
                      queue: asyncio.Queue[TokenOutput | None], chat: bool, include_usage: bool,
                      n: int) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        index = {r: i for i, r in enumerate(reqs)}

        def chunk(choice: dict[str, Any] | None, usage: dict[str, Any] | None = None) -> bytes:
            data: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": self.model,
                                    "choices": [choice] if choice is not None else []}
            if usage is not None:
                data["usage"] = usage
            return b"data: " + json.dumps(data, separators=(", ", ": ")).encode() + b"\n\n"

        if chat:
            for i in range(len(reqs)):
                await resp.write(chunk({"index": i, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}))
        left = len(reqs)
        while left:
            out = await queue.get()
            if out is None:  # engine restarted mid-stream: cut the connection, as a dying engine would
                resp.force_close()
                return resp
            if out.first:
                self._record_ttft(out.request)
            text = self.tokenizer.decode([out.token])
            finish = "length" if out.finished else None
            i = index[out.request]
            if chat:
                choice = {"index": i, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": i, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
            await resp.write(chunk(choice))
            if out.finished:
                left -= 1
        if include_usage:
            await resp.write(chunk(None, self._usage(reqs, n)))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # ---- embeddings ----------------------------------------------------------------------------
    async def embeddings(self, request: web.Request) -> web.Response:
        """vLLM's ``/v1/embeddings``: ``input`` in the four prompt shapes, a fake unit vector per input
        (deterministic in its token ids). Each input is prefilled by the engine model, as a pooling engine
        runs it, so its blocks are cached and announced as KV events; no cached-token count is reported,
        as vLLM reports none for embeddings."""
        body = await self._json(request)
        if isinstance(body, web.Response):
            return body
        try:
            prompts = self.tokenizer.request_prompts(body, "embeddings")
        except PromptError as e:
            return error(400, str(e))
        fmt = body.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            return error(400, "encoding_format must be 'float' or 'base64'")
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            return error(400, "cache_salt must be a non-empty string")
        rid = "embd-" + uuid.uuid4().hex[:16]
        submitted = self._submit(rid, prompts, 1, salt)
        if isinstance(submitted, web.Response):
            return submitted
        reqs, queue = submitted
        try:
            if await self._collect(reqs, queue, ttft=False) is None:
                return error(503, "the engine stopped serving this request", "ServiceUnavailableError")
        finally:
            self._release(reqs)
        data = [{"index": i, "object": "embedding", "embedding": fake_embedding(ids, fmt)}
                for i, ids in enumerate(prompts)]
        n_in = sum(map(len, prompts))
        return web.json_response({
            "id": rid, "object": "list", "created": int(time.time()), "model": self.model, "data": data,
            "usage": {"prompt_tokens": n_in, "total_tokens": n_in, "completion_tokens": 0,
                      "prompt_tokens_details": None},
        })

    # ---- the Responses API ---------------------------------------------------------------------
    async def responses(self, request: web.Request) -> web.StreamResponse:
        """``/v1/responses``: ``instructions`` + ``input`` through the chat template (router/tokenizer.py
        ``responses_messages``), one output message; streamed as the Responses API's typed events."""
        body = await self._json(request)
        if isinstance(body, web.Response):
            return body
        try:
            (prompt,) = self.tokenizer.request_prompts(body, "responses")
        except PromptError as e:
            return error(400, str(e))
        max_tokens = body.get("max_output_tokens")
        if max_tokens is None:
            max_tokens = 16
        if type(max_tokens) is not int or max_tokens < 1:
            return error(400, "max_output_tokens must be a positive integer")
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            return error(400, "cache_salt must be a non-empty string")
        if body.get("stream") not in (None, True, False):
            return error(400, "stream must be true or false")
        rid = "resp_" + uuid.uuid4().hex[:24]
        submitted = self._submit(rid, [prompt], max_tokens, salt)
        if isinstance(submitted, web.Response):
            return submitted
        reqs, queue = submitted
        try:
            if body.get("stream"):
                return await self._stream_response(request, rid, body, reqs[0], queue)
            tokens = await self._collect(reqs, queue)
            if tokens is None:
                return error(503, "the engine stopped serving this request", "ServiceUnavailableError")
            text = self.tokenizer.decode(tokens[reqs[0]])
            return web.json_response(self._response(rid, body, reqs[0], int(time.time()), text))
        finally:
            self._release(reqs)

    def _response(self, rid: str, body: dict[str, Any], req: EngineRequest, created: int,
                  text: str | None) -> dict[str, Any]:
        """The Responses API's response object: in progress (``text`` None: no output, no usage) or completed."""
        done = text is not None
        output = [_message_item(rid, text)] if text is not None else []
        usage = None
        if done:
            n_in, n_out = len(req.prompt), len(req.output)
            usage = {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": req.num_cached_tokens or 0},
                     "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": n_in + n_out}
        return {"id": rid, "object": "response", "created_at": created, "status": "completed" if done else
                "in_progress", "model": self.model, "output": output, "usage": usage, "error": None,
                "incomplete_details": None, "instructions": body.get("instructions"),
                "max_output_tokens": body.get("max_output_tokens"), "parallel_tool_calls": True,
                "tool_choice": "auto", "tools": [], "temperature": body.get("temperature"),
                "top_p": body.get("top_p"), "previous_response_id": None, "text": {"format": {"type": "text"}},
                "metadata": body.get("metadata") or {}}

    async def _stream_response(self, request: web.Request, rid: str, body: dict[str, Any], req: EngineRequest,
                               queue: asyncio.Queue[TokenOutput | None]) -> web.StreamResponse:
        """response.created, response.in_progress, the output item and its text part opened, one
        response.output_text.delta per token, then each closed and response.completed (with the usage)."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        created = int(time.time())
        seq = 0
        item_id = _message_item(rid, "")["id"]
        where = {"item_id": item_id, "output_index": 0, "content_index": 0}

        async def send(kind: str, **fields: Any) -> None:
            nonlocal seq
            data = {"type": kind, "sequence_number": seq, **fields}
            seq += 1
            await resp.write(f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode())

        await send("response.created", response=self._response(rid, body, req, created, None))
        await send("response.in_progress", response=self._response(rid, body, req, created, None))
        await send("response.output_item.added", output_index=0,
                   item={**_message_item(rid, ""), "status": "in_progress", "content": []})
        await send("response.content_part.added", **where, part={"type": "output_text", "text": "",
                                                                 "annotations": []})
        deltas: list[str] = []
        while True:
            out = await queue.get()
            if out is None:  # engine restarted mid-stream: cut the connection, as a dying engine would
                resp.force_close()
                return resp
            if out.first:
                self._record_ttft(req)
            deltas.append(self.tokenizer.decode([out.token]))
            await send("response.output_text.delta", **where, delta=deltas[-1], logprobs=[])
            if out.finished:
                break
        text = "".join(deltas)
        item = _message_item(rid, text)
        await send("response.output_text.done", **where, text=text, logprobs=[])
        await send("response.content_part.done", **where, part=item["content"][0])
        await send("response.output_item.done", output_index=0, item=item)
        await send("response.completed", response=self._response(rid, body, req, created, text))
        await resp.write_eof()
        return resp

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.model, "object": "model", "created": self.created, "owned_by": "vllm", "root": self.model,
            "parent": None, "max_model_len": self.engine.config.max_model_len,
        }]})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.faults.health_status)

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "0.32.0+kvrouter.sim"})

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        if isinstance(body, web.Response):
            return body
        try:
            ids = self.tokenizer.prompt_ids(body, chat="messages" in body)
        except PromptError as e:
            return error(400, str(e))
        return web.json_response({"count": len(ids), "max_model_len": self.engine.config.max_model_len,
                                  "tokens": ids, "token_strs": None})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        if isinstance(body, web.Response):
            return body
        tokens = body.get("tokens")
        try:
            ids = [] if tokens == [] else self.tokenizer.check_ids(tokens, self.engine.config.max_model_len)
        except PromptError as e:
            return error(400, str(e))
        return web.json_response({"prompt": self.tokenizer.decode(ids, skip_special_tokens=False)})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), content_type="text/plain", charset="utf-8")

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        if not self.engine.reset_prefix_cache():
            return error(409, "prefix cache is in use by running requests", "ConflictError")
        await self._publish_idle_events()
        return web.Response(status=200)

    async def fault(self, request: web.Request) -> web.Response:
        """Fault switches: {"events": "stop"|"resume", "drop_every": N, "restart": true, "slowdown": X,
        "health": 503|200, "die": true}."""
        body = await self._json(request)
        if isinstance(body, web.Response):
            return body
        pub = self.publisher
        if "events" in body and pub is not None:
            pub.paused = body["events"] == "stop"
        if "drop_every" in body and pub is not None:
            pub.drop_every = int(body["drop_every"])
        if "slowdown" in body:
            self.faults.slowdown = float(body["slowdown"])
        if "health" in body:
            self.faults.health_status = int(body["health"])
        if body.get("restart"):
            for req in list(self.engine.running) + list(self.engine.waiting):
                self.engine.abort(req)
                q = self._queues.get(req)
                if q is not None:
                    q.put_nowait(None)
            self.engine.reset_prefix_cache()
            self.engine.take_events()  # a restarted engine announces nothing: its seq just starts over
            self.engine.stats = type(self.engine.stats)()  # and its counters start from zero
            if pub is not None:
                pub.restart()
        if body.get("die"):
            asyncio.get_running_loop().call_later(0.05, os._exit, 1)
        return web.json_response({"ok": True, "faults": {
            "events_paused": bool(pub and pub.paused), "drop_every": pub.drop_every if pub else 0,
            "slowdown": self.faults.slowdown, "health": self.faults.health_status}})
