"""The simulated worker: vLLM's OpenAI API surface and KV events around the shared engine model.

The engine loop runs ``EngineModel.step`` on the wall clock, sleeping each step's modelled duration
times ``time_scale`` (0: no sleeping, as fast as the CPU allows), publishes the step's KV events and
hands produced tokens to the waiting HTTP handlers. Responses, SSE framing, usage (with
``prompt_tokens_details.cached_tokens``), errors and metric names follow vLLM 0.32.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import HistogramMetricFamily

from router.frontends.openai import error_response as error
from router.tokenizer import PromptError, PromptTokenizer
from workers.engine import EngineModel, EngineRequest, TokenOutput
from workers.engine.metrics import engine_metric_families
from workers.sim.publisher import KvEventPublisher

log = logging.getLogger(__name__)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
MAX_BODY = 64 * 1024 * 1024


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
            web.post("/tokenize", self.tokenize),
            web.get("/metrics", self.metrics),
            web.post("/reset_prefix_cache", self.reset_prefix_cache),
            web.post("/fault", self.fault),
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
        try:
            prompt = self.tokenizer.prompt_ids(body, chat)
        except PromptError as e:
            return error(400, str(e))
        max_tokens = body.get("max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens")
        if max_tokens is None:
            max_tokens = 16
        if type(max_tokens) is not int or max_tokens < 1:
            return error(400, "max_tokens must be a positive integer")
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            return error(400, "cache_salt must be a non-empty string")
        if body.get("stream") not in (None, True, False):
            return error(400, "stream must be true or false")
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:16]
        req = EngineRequest(rid, prompt, max_tokens, cache_salt=salt, arrival=time.monotonic())
        try:
            self.engine.add_request(req)
        except ValueError as e:
            return error(400, str(e))
        queue: asyncio.Queue[TokenOutput | None] = asyncio.Queue()
        self._queues[req] = queue
        self._wake.set()
        stream = bool(body.get("stream"))
        opts = body.get("stream_options") or {}
        include_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
        try:
            if stream:
                return await self._stream(request, req, queue, chat, include_usage)
            return await self._complete(req, queue, chat)
        finally:
            self._queues.pop(req, None)
            if req.finished_at is None:
                self.engine.abort(req)  # client went away: free its blocks

    def _usage(self, req: EngineRequest) -> dict[str, Any]:
        n_out = len(req.output)
        return {
            "prompt_tokens": len(req.prompt),
            "total_tokens": len(req.prompt) + n_out,
            "completion_tokens": n_out,
            "prompt_tokens_details": {"cached_tokens": req.num_cached_tokens or 0},
        }

    def _record_ttft(self, req: EngineRequest) -> None:
        ttft = time.monotonic() - req.arrival
        self.ttft_sum += ttft
        for i, bound in enumerate(TTFT_BUCKETS):
            if ttft <= bound:
                self.ttft_counts[i] += 1
                return
        self.ttft_counts[-1] += 1

    async def _complete(
        self, req: EngineRequest, queue: asyncio.Queue[TokenOutput | None], chat: bool
    ) -> web.Response:
        tokens: list[int] = []
        while True:
            out = await queue.get()
            if out is None:
                return error(503, "the engine stopped serving this request", "ServiceUnavailableError")
            if out.first:
                self._record_ttft(req)
            tokens.append(out.token)
            if out.finished:
                break
        text = self.tokenizer.decode(tokens)
        choice: dict[str, Any]
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None,
                                              "tool_calls": []},
                      "logprobs": None, "finish_reason": "length", "stop_reason": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length", "stop_reason": None,
                      "prompt_logprobs": None}
        return web.json_response({
            "id": req.request_id, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": self.model, "choices": [choice],
            "usage": self._usage(req), "kv_transfer_params": None,
        })

    async def _stream(self, request: web.Request, req: EngineRequest, queue: asyncio.Queue[TokenOutput | None],
                      chat: bool, include_usage: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choice: dict[str, Any] | None, usage: dict[str, Any] | None = None) -> bytes:
            data: dict[str, Any] = {"id": req.request_id, "object": obj, "created": created, "model": self.model,
                                    "choices": [choice] if choice is not None else []}
            if usage is not None:
                data["usage"] = usage
            return b"data: " + json.dumps(data, separators=(", ", ": ")).encode() + b"\n\n"

        if chat:
            await resp.write(chunk({"index": 0, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}))
        while True:
            out = await queue.get()
            if out is None:  # engine restarted mid-stream: cut the connection, as a dying engine would
                resp.force_close()
                return resp
            if out.first:
                self._record_ttft(req)
            text = self.tokenizer.decode([out.token])
            finish = "length" if out.finished else None
            if chat:
                choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
            await resp.write(chunk(choice))
            if out.finished:
                break
        if include_usage:
            await resp.write(chunk(None, self._usage(req)))
        await resp.write(b"data: [DONE]\n\n")
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
