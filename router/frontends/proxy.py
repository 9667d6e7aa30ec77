"""``kvrouter serve``: a standalone OpenAI-compatible proxy in front of the workers.

Per request: read the body once, tokenize (chat through the model's template) off the event loop, key the
blocks, ask the routing core, forward the body unchanged (except a ``cache_salt`` set from a trusted tenant
header) and stream the answer back chunk by chunk. A connection error or a 5xx before any byte reached the
client is retried on the next-best worker; nothing is retried once the client has bytes, and a worker that
fails after that ends the client's response as an error (an SSE error event, then the connection cut),
never as a clean end. Where a request goes is decided here alone: client headers naming a destination are
ignored and never forwarded, and the router keys its accounting by an id of its own (the client's
``x-request-id`` is passed along, never trusted). Only the OpenAI API paths are served
(router/frontends/api_paths.py): completions, chat, embeddings, the Responses API (streamed or not), models,
and ``/tokenize`` / ``/detokenize``, which the router answers from its own tokenizer without a worker.

Batches: a non-streamed completions batch (``prompt`` a list of strings or of token-id lists) is served as
one request per prompt: each is decided, dispatched and forwarded (with its own retries) on its own, so each
prompt's prefix picks its worker, and the answers are merged in order into one response (choices re-indexed
``prompt_index * n + choice index`` as vLLM does, usage and cached tokens summed; ``x-kvrouter-worker`` lists
each prompt's worker). If any prompt cannot be served, the client gets that prompt's error (named
``prompt[i]``), as vLLM fails a whole batch. A streamed batch, and every embeddings batch, is sent as one
request to one worker, routed on the prompts' longest shared prefix, and passed through unchanged.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from router.config import RouterConfig
from router.frontends import http1
from router.frontends.admin import FleetAdmin, admin_guard
from router.frontends.api_paths import GENERATE_PATHS, TOKENIZER_PATHS
from router.frontends.fleet import fleet_from_config
from router.frontends.flow_gate import FlowGate
from router.frontends.http1 import Request, Response, UpstreamError, UpstreamPool, UpstreamResponse, json_response
from router.frontends.metrics import RouterMetrics
from router.frontends.openai import (
    BadRequest,
    ParsedRequest,
    RequestParser,
    SaltRule,
    client_text,
    merge_completions,
    model_not_found,
    new_request_id,
    request_objective,
    salt_rule,
)
from router.frontends.openai import error_response as admin_error
from router.frontends.processes import ProcessSlot, start_shared_load
from router.scheduling import Decision, Dispatch, RouteRequest, RoutingCore
from router.scheduling.core import SATURATED_REASON
from router.scheduling.disagg import PrefillPlan
from router.scheduling.slo import NO_OBJECTIVE, ServiceObjective, flow_id
from router.tokenizer import PromptTokenizer, load_tokenizer

log = logging.getLogger("kvrouter.proxy")

DESTINATION_HEADERS = {"x-gateway-destination-endpoint", "x-gateway-destination-endpoint-subset"}
# never forwarded either way (RFC 9110 7.6.1), nor the framing the proxy sets itself; and ``expect``: the proxy
# answers the client's 100-continue itself, and sends the worker a whole body (forwarded, the worker's own 100
# came back as an answer)
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
              "transfer-encoding", "upgrade", "host", "content-length", "expect", "proxy-connection"}
USAGE_TAIL_BYTES = 8192
MAX_JSON_TAIL_BYTES = 4 * 1024 * 1024  # a non-streamed answer longer than this is relayed, not parsed for usage
WHOLE_BODY_BYTES = 1024 * 1024  # a non-streamed answer up to this long is read whole and sent in one write
MAX_MERGED_BYTES = 64 * 1024 * 1024  # one prompt's answer in a batch is read whole (to merge): at most this
RESPONSES_FIRST_TOKEN = b"response.output_text.delta"  # a Responses stream opens with events before any token
MAX_UPSTREAM_URLS = 4096  # parsed worker URLs kept (cleared past this)
_decode_json = msgspec.json.Decoder().decode
# the API port's routes: path -> method -> handler name (HEAD is served wherever GET is)
_ROUTES: dict[str, dict[str, str]] = {
    **{path: {"POST": "generate"} for path in GENERATE_PATHS},
    **{path: {"POST": "tokenize"} for path in TOKENIZER_PATHS},
    "/v1/models": {"GET": "models"}, "/health": {"GET": "health"}, "/metrics": {"GET": "prometheus"},
}


def error(status: int, message: str, kind: str = "BadRequestError", headers: dict[str, str] | None = None
          ) -> Response:
    """An error in vLLM's OpenAI shape, on the API port."""
    return json_response(http1.error_body(status, message, kind), status, headers)


def _json_loads(data: bytes) -> Any:
    """A worker's JSON answer: msgspec (several times json's speed, and this runs per answer), with json's
    reading where msgspec refuses what json accepts (NaN, integers past 64 bits), so nothing reads differently."""
    try:
        return _decode_json(data)
    except ValueError:
        return json.loads(data)


def usage_from(tail: bytes, streamed: bool) -> dict[str, Any] | None:
    """The ``usage`` object of a JSON body or of the last SSE chunks (a worker's answer is input too: anything
    malformed is None, never an error)."""
    try:
        if not streamed:
            return _usage(_json_loads(tail))
        for line in reversed(tail.split(b"\n")):
            if line.startswith(b"data: {") and b'"usage"' in line:
                return _usage(_json_loads(line[6:]))
    except (ValueError, RecursionError):
        return None
    return None


def _usage(answer: Any) -> dict[str, Any] | None:
    if isinstance(answer, dict) and answer.get("type") == "response.completed":  # a Responses stream's last event
        answer = answer.get("response")
    usage = answer.get("usage") if isinstance(answer, dict) else None
    return usage if isinstance(usage, dict) else None


def _count(value: Any) -> int | None:
    return value if type(value) is int and value >= 0 else None


def cached_tokens_of(usage: dict[str, Any] | None) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens``; None unless it is there as a non-negative integer."""
    # the Responses API says input_tokens_details
    details = None if usage is None else usage.get("prompt_tokens_details", usage.get("input_tokens_details"))
    return _count(details.get("cached_tokens")) if isinstance(details, dict) else None


def output_tokens_from(usage: dict[str, Any] | None) -> int | None:
    """``usage.completion_tokens`` (the Responses API's ``output_tokens``), where it is a non-negative integer."""
    return None if usage is None else _count(usage.get("completion_tokens", usage.get("output_tokens")))


class _LoggedDecision:
    """One entry of ``/debug/decision``, rendered when it is read: building its dict (every candidate's report)
    for every request cost the proxy 1.5% of its CPU, for a log read now and then. ``freeze`` renders it at
    once, before anything changes the decision (a prefill/decode split re-credits its chosen candidate)."""

    __slots__ = ("_frozen", "batch_index", "client_rid", "decision", "prompt_tokens", "rid", "time")

    def __init__(self, rid: str, client_rid: str | None, prompt_tokens: int, decision: Decision,
                 batch_index: int | None) -> None:
        self.rid, self.client_rid, self.prompt_tokens = rid, client_rid, prompt_tokens
        self.time = time.time()
        self.decision, self.batch_index = decision, batch_index
        self._frozen: dict[str, Any] | None = None

    def freeze(self) -> None:
        if self._frozen is None:
            self._frozen = self.as_dict()

    def set_disagg(self, disagg: dict[str, Any]) -> None:
        """The split considered for it (set on the decision after it was logged)."""
        self.freeze()
        assert self._frozen is not None
        self._frozen["disagg"] = disagg

    def as_dict(self) -> dict[str, Any]:
        if self._frozen is not None:
            return self._frozen
        entry = {"request_id": self.rid, "client_request_id": self.client_rid, "time": self.time,
                 "prompt_tokens": self.prompt_tokens, **self.decision.as_dict()}
        if self.batch_index is not None:  # one prompt of a batch, routed on its own
            entry["batch_index"] = self.batch_index
        return entry


@dataclass(slots=True)
class _Answer:
    """One prompt's answer in a batch."""

    status: int
    worker: str
    body: dict[str, Any] | None = None  # the worker's JSON answer: a completion (200), else its error, if JSON
    message: str = ""  # why, where there is no usable body


class ProxyServer:
    def __init__(self, config: RouterConfig, core: RoutingCore | None = None) -> None:
        self.config = config
        self.core = core or RoutingCore(config.routing)
        self.fleet = fleet_from_config(self.core, config)
        self.metrics = RouterMetrics(self.fleet)
        self.decisions: collections.deque[_LoggedDecision] = collections.deque(maxlen=config.decision_log_size)
        self.parser = RequestParser(self.tokenizer_for)
        self.gate = FlowGate(self.core, config.flow_control)  # flow control (docs/slo.md); off unless enabled
        self.metrics.watch_flow(self.gate, {0, *(o.priority for o in config.slo.objectives.values())})
        self.connections = http1.Connections(config.http.max_connections)  # the API port's client connections
        self.stopping = False  # draining (``drain``): not ready, every answer its connection's last
        self._active: set[Request] = set()  # the API requests being answered (a stream until its last byte)
        self._idle = asyncio.Event()  # set, while stopping, once none is
        self._pool: UpstreamPool | None = None
        self._urls: dict[str, tuple[str, int, str, bool]] = {}  # worker URL: host, port, path prefix, TLS
        # the client headers never forwarded: with a trusted tenant header (salt.salt set), that one too
        tenant = config.tenant_header.lower() if config.tenant_header else None
        self._drop_headers = {False: frozenset(HOP_BY_HOP | DESTINATION_HEADERS),
                              True: frozenset(HOP_BY_HOP | DESTINATION_HEADERS | ({tenant} if tenant else set()))}

    # ---- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        # a worker's answer is relayed as sent (no decompression) and its cookies never kept: a Set-Cookie
        # belongs to the client it answered
        self._pool = UpstreamPool(connect_timeout_s=2.0)
        await self.fleet.start()

    async def stop(self) -> None:
        await self.fleet.stop()
        if self._pool is not None:
            self._pool.close()
        self.parser.close()

    async def drain(self, api: asyncio.Server | None, grace_s: float) -> None:
        """A graceful stop (SIGTERM): not ready (``/health`` 503), no new connections (the listener is closed),
        the requests flow control holds answered 429 with Retry-After (``FlowGate.close``: and so is any that
        would wait from now on), and those in flight, streams included, given up to ``grace_s`` to finish. Each
        connection closes after its answer: a request that arrives meanwhile on one still open is served, and its
        answer is that connection's last, so its client's next request opens a connection to a router that
        stays. What is still open at the end (idle connections; requests past the grace) is closed. Cancelled (a
        second signal): closed at once."""
        self.stopping = True
        if api is not None:
            api.close()
        self.gate.close()
        for request in self._active:
            request.keep_alive = False
        deadline = time.monotonic() + grace_s
        try:
            while self._active and (left := deadline - time.monotonic()) > 0:
                self._idle.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._idle.wait(), left)
        finally:
            if self._active:
                log.warning("kvrouter serve: %d requests still in flight at the end of the drain: cut",
                            len(self._active))
            for conn in list(self.connections.open):
                conn.close()

    async def serve_api(self, host: str, port: int, reuse_port: bool = False) -> asyncio.Server:
        """Listen for the API (router/frontends/http1.py: the request path on asyncio protocols)."""
        return await http1.serve(self.handle, host, port, self.config.max_body_bytes, reuse_port,
                                 refused=lambda status: self.metrics.count_request(str(status)),
                                 settings=self.config.http, connections=self.connections)

    async def handle(self, request: Request) -> Response | None:
        """The API port: only the API paths (router/frontends/api_paths.py); 404 for any other, 405 for a
        method a path does not take."""
        methods = _ROUTES.get(request.path)
        if methods is None:
            return error(404, f"no such path: {request.path}", "NotFoundError")
        name = methods.get("GET" if request.method == "HEAD" else request.method)
        if name is None:
            return error(405, f"{request.method} is not served on {request.path}", "MethodNotAllowed",
                         {"allow": ", ".join(methods)})
        handler = getattr(self, name)
        if self.stopping:
            request.keep_alive = False  # draining: its answer is the connection's last (the next goes elsewhere)
        active = self._active
        active.add(request)
        try:
            return await handler(request)
        finally:
            active.discard(request)
            if not active and self.stopping:
                self._idle.set()

    def admin_app(self) -> web.Application:
        app = web.Application(middlewares=[admin_guard(self.config.admin.host)])  # what no web page can send
        app.add_routes([
            web.get("/debug/decision", self.debug_decisions),
            *FleetAdmin(self.core, self.fleet).routes(),
            web.get("/metrics", self.admin_prometheus),
        ])
        return app

    def tokenizer_for(self, model: str | None) -> PromptTokenizer:
        path = self.config.tokenizers.get(model or "", self.config.tokenizer)
        return load_tokenizer(path)

    # ---- the request path ------------------------------------------------------------------------
    async def generate(self, request: Request) -> Response | None:
        started = time.monotonic()
        raw = request.body  # whole, within max_body_bytes (a longer one was a 413 before it was read)
        try:
            # the trusted tenant (salt.tenant: the tenant_header's one value, or none at all) and its derived salt
            salt = salt_rule(request.headers, self.config.tenant_header, self.config.tenant_missing,
                             self.config.salt_secret)
            parsed = await self.parser.parse(raw, request.path, salt, self.fleet.max_model_len(), self.config.max_n)
            objective = request_objective(request.headers, self.config.slo, parsed.model, salt.tenant)
        except BadRequest as e:
            self.metrics.count_request(e.status)
            return error(e.status, str(e), e.kind)
        if parsed.batch and parsed.kind == "completions" and not parsed.stream:
            return await self._generate_batch(request, parsed, salt, started, objective)
        rid = new_request_id()  # ours: a client's x-request-id is forwarded, never used as a key
        lora = self.core.lora_of(parsed.model)
        rreq = await self.parser.route_request(parsed, rid, self.config.routing.block_size, lora=lora,
                                               session=request.headers.get(self.config.session_header),
                                               objective=objective)
        decision = self._decide(rreq, request, started)
        # while the fleet is saturated the request waits here; a client that leaves is cancelled out of the queue
        decision = await self.gate.admit(rreq, decision, lambda now: self.core.decide(rreq, now),
                                         flow_id(request.headers, salt.tenant))
        if decision.outcome != "routed":
            return self._refusal(decision, objective=objective, request=rreq)
        headers = self._upstream_headers(request, salt)
        body = parsed.raw
        if parsed.splittable:
            logged = self.decisions[-1] if self.decisions else None
            if logged is not None and self.core.state.prefill_only:
                logged.freeze()  # as decided: a split re-credits the chosen candidate
            plan = self.core.plan_prefill(rreq, decision, time.monotonic())
            if decision.disagg is not None and logged is not None:
                logged.set_disagg(decision.disagg)  # the split, in /debug/decision
            if plan is not None:
                body = await self._prefill_elsewhere(request.path, parsed, plan, headers)
            elif decision.disagg is not None:
                self.metrics.disagg.labels("local").inc()
        return await self._forward(request, rreq, parsed, decision, body, headers, started)

    async def _prefill_elsewhere(self, path: str, parsed: ParsedRequest, plan: PrefillPlan,
                                 headers: dict[str, str]) -> bytes:
        """The prefill half of a split request, vLLM's NixlConnector convention (as llm-d's sidecar runs it): the
        prompt with ``max_tokens: 1``, not streamed, ``kv_transfer_params.do_remote_decode``; its answer's
        ``kv_transfer_params`` go into the decode request (a connector handing the KV over out of band, such as
        vLLM's shared-storage ExampleConnector, answers none: the decode request goes as the client sent it).
        Returns the decode request's body; if the prefill failed (unreachable, an error, a timeout), the client's
        own: the decode worker then prefills it itself (aggregated), and the client sees no difference but the
        time."""
        ep = self.core.endpoints.get(plan.worker_id)
        handle = self.core.dispatch(plan.request, plan.decision, plan.worker_id, time.monotonic())
        one = {"max_completion_tokens": 1} if parsed.chat and "max_completion_tokens" in parsed.body else {}
        body = parsed.with_fields(max_tokens=1, **one, stream=False, stream_options=None, n=None,
                                  kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False,
                                                      "remote_engine_id": None, "remote_block_ids": None,
                                                      "remote_host": None, "remote_port": None})
        params: Any = None
        ok = False
        why = ""
        try:
            if ep is None:
                raise UpstreamError(f"prefill worker {plan.worker_id} is gone")
            up = await self._send("POST", ep.url, path, headers, body, self.config.prefill_timeout_s)
            try:
                answer = await up.read()
            finally:
                up.release()
            why = f"answered {up.status}"
            ok = up.status == 200
            if ok:
                params = _json_loads(answer).get("kv_transfer_params")
        except (UpstreamError, TimeoutError, ValueError, AttributeError) as e:
            ok, why = False, repr(e)
            self.fleet.mark_failure(plan.worker_id)
        except asyncio.CancelledError:
            handle.fail(time.monotonic())
            raise
        now = time.monotonic()
        if ok:
            handle.first_token(now, learn=False)
            handle.complete(now)
            self.metrics.disagg.labels("split").inc()
            if isinstance(params, dict):
                return parsed.with_fields(kv_transfer_params=params)
            # no params: a connector that hands the KV over out of band (vLLM's ExampleConnector: shared storage)
            return parsed.raw
        handle.fail(now)
        plan.fall_back()
        log.warning("prefill on %s failed (%s): %s prefilled where it decodes", plan.worker_id, why,
                    plan.request.request_id)
        self.metrics.disagg.labels("fallback").inc()
        return parsed.raw

    def _decide(self, rreq: RouteRequest, request: Request, started: float,
                batch_index: int | None = None) -> Decision:
        decision = self.core.decide(rreq, time.monotonic())
        self.metrics.decision_seconds.observe(time.monotonic() - started)
        self.metrics.count_decision(decision)
        self._log_decision(rreq.request_id, request.headers.get("x-request-id"), rreq.prompt_tokens, decision,
                           batch_index)
        return decision

    def _refusal(self, decision: Decision, prefix: str = "", objective: ServiceObjective = NO_OBJECTIVE,
                 request: RouteRequest | None = None) -> Response:
        if decision.outcome == "no_endpoint" and request is not None and self.core.serves_nobody(request):
            self.metrics.count_request("404")  # a model no worker serves: vLLM's own answer for an unknown model
            return error(404, model_not_found(request.lora or request.model), "NotFoundError")
        if decision.outcome == "shed":
            self.metrics.count_request("429")
            self.metrics.count_objective(objective, None, None, shed=True)
            why = "all workers are saturated" if decision.reason == SATURATED_REASON else decision.reason
            return error(429, f"{prefix}{why}; retry later", "TooManyRequests",
                         {"Retry-After": str(max(1, round(decision.retry_after_s)))})
        self.metrics.count_request("503")
        return error(503, prefix + decision.reason, "ServiceUnavailableError")

    def _upstream_headers(self, request: Request, salt: SaltRule) -> list[tuple[str, str]]:
        drop = self._drop_headers[bool(salt.salt)]
        named = request.headers.get("connection")
        if named:  # the headers a Connection header names are this hop's too (RFC 9110 7.6.1)
            drop = drop | {n.strip().lower() for n in named.split(",")}
        return [(k, v) for k, v in request.headers.items() if k.lower() not in drop]

    async def _send(self, method: str, base: str, path: str, headers: list[tuple[str, str]], body: bytes,
                    timeout_s: float) -> UpstreamResponse:
        """``method`` on the worker at ``base`` (its URL, parsed once), answered up to its headers."""
        assert self._pool is not None
        where = self._urls.get(base)
        if where is None:
            parts = urllib.parse.urlsplit(base)
            tls = parts.scheme == "https"
            if parts.hostname is None:
                raise UpstreamError(f"worker URL {base!r} names no host")
            if len(self._urls) >= MAX_UPSTREAM_URLS:
                self._urls.clear()
            where = self._urls[base] = (parts.hostname, parts.port or (443 if tls else 80), parts.path.rstrip("/"), tls)
        host, port, prefix, tls = where
        return await self._pool.request(method, host, port, prefix + path, headers, body, timeout_s, tls=tls)

    async def _forward(self, request: Request, rreq: RouteRequest, parsed: ParsedRequest, decision: Decision,
                       body: bytes, headers: list[tuple[str, str]], started: float) -> Response | None:
        """Send to the best worker (``_connect``) and relay its answer."""
        handle, upstream, whole, last_error = await self._connect(
            request.path, rreq, decision, body, headers, read_whole=not parsed.stream)
        if upstream is None:
            if handle is not None:
                handle.fail(time.monotonic())
            self.metrics.count_request("502")
            return error(502, f"no worker could serve the request: {last_error}", "BadGatewayError")
        assert handle is not None
        if whole is not None:
            return self._send_whole(handle, upstream, whole, started)
        return await self._relay(request, handle, parsed, upstream, started)

    async def _connect(self, path: str, rreq: RouteRequest, decision: Decision, body: bytes,
                       headers: list[tuple[str, str]], handle: Dispatch | None = None, read_whole: bool = False
                       ) -> tuple[Dispatch | None, UpstreamResponse | None, bytes | None, str]:
        """The best worker's response, its headers read; on a connection error or a 5xx before any byte, the
        next-best (the dispatch moves with it, and what the abandoned choice recorded is taken back). No
        response (None) and the last error when no worker answered; the handle is the caller's to end.

        With ``read_whole`` (a non-streamed answer), a body of known length up to WHOLE_BODY_BYTES is read here
        too and returned: a worker dying before its end has sent the client nothing, so the next-best gets the
        request, as after a connection error (an engine killed mid-answer costs a retry, not a 502)."""
        last_error = "no worker answered"
        attempts = decision.ranked[: self.config.max_attempts]
        for attempt, wid in enumerate(attempts):
            ep = self.core.endpoints.get(wid)
            if ep is None:
                continue
            if handle is None:
                handle = self.core.dispatch(rreq, decision, wid, time.monotonic())
            else:
                handle.reassign(wid, time.monotonic())
            try:
                upstream = await self._send("POST", ep.url, path, headers, body, self.config.upstream_timeout_s)
            except (UpstreamError, TimeoutError) as e:
                last_error = f"worker {wid} unreachable: {e!r}"
                self._failed(wid, attempt, len(attempts))
                continue
            except asyncio.CancelledError:  # the client went away while the worker had it
                handle.complete(time.monotonic())
                raise
            if upstream.status >= 500 and attempt + 1 < len(attempts):
                last_error = f"worker {wid} answered {upstream.status}"
                upstream.release()
                self._failed(wid, attempt, len(attempts))
                continue
            if not read_whole or upstream.content_length is None or upstream.content_length > WHOLE_BODY_BYTES:
                return handle, upstream, None, last_error
            try:
                return handle, upstream, await upstream.read(), last_error
            except (UpstreamError, TimeoutError) as e:
                log.warning("worker %s failed mid-response for %s: %r", wid, rreq.request_id, e)
                last_error = f"worker {wid} failed mid-response: {e!r}"
                upstream.close()
                self._failed(wid, attempt, len(attempts))
                continue
            except asyncio.CancelledError:
                upstream.close()
                handle.complete(time.monotonic())
                raise
        return handle, None, None, last_error

    # ---- a completions batch, one routed request per prompt ------------------------------------------
    async def _generate_batch(self, request: Request, parsed: ParsedRequest, salt: SaltRule,
                              started: float, objective: ServiceObjective = NO_OBJECTIVE) -> Response:
        """Each prompt decided and dispatched in turn (so the next one's decision sees where the previous went:
        its load, its speculative prefix), before any is sent; then all forwarded at once, each with its own
        retries; the answers merged in prompt order. Any prompt refused at its decision refuses the batch
        before anything is sent. Each prompt is routed to the request's ``objective``.

        Flow control admits the batch as one unit, before any of its prompts is dispatched: its first prompt's
        decision is what it waits on (decided again when the fleet has room), and its flow is charged every
        prompt's tokens. One unit, not one per prompt: the client gets nothing until every prompt is answered,
        so a prompt sent ahead of the others would only hold a worker's room (its dispatch counts there) while
        the rest wait; and one place in the queue per client request keeps ``max_queued`` and a client that
        leaves the same as for a lone request."""
        subs = parsed.split()
        lora = self.core.lora_of(parsed.model)
        session = request.headers.get(self.config.session_header)
        rreqs = [await self.parser.route_request(sub, new_request_id(), self.config.routing.block_size, lora=lora,
                                                 session=session, objective=objective) for sub in subs]
        first = rreqs[0]
        decision = self._decide(first, request, started, batch_index=0)
        if decision.outcome != "routed":
            return self._refusal(decision, "prompt[0]: ", objective)
        decision = await self.gate.admit(first, decision, lambda now: self.core.decide(first, now),
                                         flow_id(request.headers, salt.tenant),
                                         cost_tokens=sum(r.prompt_tokens + r.max_tokens for r in rreqs))
        if decision.outcome != "routed":
            return self._refusal(decision, "", objective)
        plans: list[tuple[ParsedRequest, RouteRequest, Decision, Dispatch]] = []
        try:  # (no await until every prompt is dispatched: the gate's next release sees their load)
            for i, (sub, rreq) in enumerate(zip(subs, rreqs, strict=True)):
                if i:
                    decision = self._decide(rreq, request, started, batch_index=i)
                if decision.outcome != "routed":
                    now = time.monotonic()
                    for *_, handle in plans:
                        handle.fail(now)
                    return self._refusal(decision, f"prompt[{i}]: ", objective)
                plans.append((sub, rreq, decision, self.core.dispatch(rreq, decision, decision.ranked[0],
                                                                      time.monotonic())))
        except BaseException:
            now = time.monotonic()
            for *_, handle in plans:
                handle.fail(now)
            raise
        headers = [(k, v) for k, v in self._upstream_headers(request, salt) if k.lower() != "accept-encoding"]
        headers.append(("Accept-Encoding", "identity"))  # each answer is read and merged here: not compressed
        try:
            answers = await asyncio.gather(*(self._answer(request.path, sub, rreq, decision, handle, headers)
                                             for sub, rreq, decision, handle in plans))
        except BaseException:  # cancelled (the client went away): a prompt whose task never ran ends here
            now = time.monotonic()
            for *_, handle in plans:
                handle.complete(now)
            raise
        workers = {"x-kvrouter-worker": ",".join(a.worker for a in answers)}
        for i, a in enumerate(answers):
            if a.status != 200:  # the batch fails with its first failed prompt, as vLLM fails a whole batch
                self.metrics.count_request(a.status)
                if a.body is not None and isinstance(a.body.get("message"), str):
                    return json_response({**a.body, "message": f"prompt[{i}]: {a.body['message']}"},
                                         status=a.status, headers=workers)
                kind = {502: "BadGatewayError", 503: "ServiceUnavailableError"}.get(a.status, "BadRequestError")
                return error(a.status, f"prompt[{i}]: {a.message}", kind, workers)
        merged = merge_completions([a.body for a in answers if a.body is not None], parsed.n)
        self.metrics.ttft.observe(time.monotonic() - started)
        self.metrics.count_request("200")
        return json_response(merged, headers=workers)

    async def _answer(self, path: str, sub: ParsedRequest, rreq: RouteRequest, decision: Decision,
                      handle: Dispatch, headers: list[tuple[str, str]]) -> _Answer:
        """One prompt of a batch: forwarded with the retries of a lone request, its answer read whole."""
        _, upstream, whole, last_error = await self._connect(path, rreq, decision, sub.raw, headers, handle,
                                                             read_whole=True)
        if upstream is None:
            handle.fail(time.monotonic())
            return _Answer(502, handle.worker_id, message=f"no worker could serve the request: {last_error}")
        wid = handle.worker_id
        data = bytearray() if whole is None else whole
        if whole is None:  # a chunked or long answer, which _connect leaves unread: read here, bounded
            try:
                async for chunk in upstream.chunks():
                    data += chunk
                    if len(data) > MAX_MERGED_BYTES:
                        upstream.close()
                        handle.complete(time.monotonic())
                        return _Answer(502, wid, message=f"worker {wid} answered over {MAX_MERGED_BYTES} bytes")
            except asyncio.CancelledError:
                upstream.close()
                handle.complete(time.monotonic())
                raise
            except (UpstreamError, TimeoutError) as e:  # the worker died mid-answer
                log.warning("worker %s failed mid-response for %s: %r", wid, rreq.request_id, e)
                upstream.close()
                self.fleet.mark_failure(wid)
                handle.complete(time.monotonic())
                return _Answer(502, wid, message=f"worker {wid} failed: {e!r}")
        now = time.monotonic()
        handle.first_token(now, learn=False)
        handle.complete(now, served=upstream.status < 400)
        upstream.release()
        try:
            body = _json_loads(data)
        except (ValueError, RecursionError):
            body = None
        if not isinstance(body, dict):
            return _Answer(502 if upstream.status == 200 else upstream.status, wid,
                           message=f"worker {wid} answered {upstream.status} with no JSON object")
        if upstream.status != 200:
            return _Answer(upstream.status, wid, body)
        if not isinstance(body.get("choices"), list):
            return _Answer(502, wid, message=f"worker {wid} answered a completion without choices")
        reported = cached_tokens_of(_usage(body))
        self.metrics.hit_estimated.inc(handle.expected_hit_tokens)
        if reported is not None:
            self.metrics.hit_reported.inc(reported)
            handle.observed_cached(reported, now)
        self.metrics.prompt_tokens.inc(rreq.prompt_tokens)
        return _Answer(200, wid, body)

    # ---- /tokenize, /detokenize: the router's own tokenizer, no worker -------------------------------
    async def tokenize(self, request: Request) -> Response:
        try:
            answer = await self.parser.tokenizer_path(request.body, request.path, self.fleet.max_model_len())
        except BadRequest as e:
            self.metrics.count_request(e.status)
            return error(e.status, str(e), e.kind)
        self.metrics.count_request("200")
        return json_response(answer)

    def _failed(self, wid: str, attempt: int, attempts: int) -> None:
        self.fleet.mark_failure(wid)
        if attempt + 1 < attempts:
            self.metrics.retries.inc()

    @staticmethod
    def _answer_headers(upstream: UpstreamResponse, worker_id: str) -> list[tuple[str, str]]:
        headers = [(k, v) for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP]
        headers.append(("x-kvrouter-worker", worker_id))
        return headers

    async def _relay(self, request: Request, handle: Dispatch, parsed: ParsedRequest,
                     upstream: UpstreamResponse, started: float) -> Response | None:
        wid, rid = handle.worker_id, handle.request.request_id
        resp: http1.StreamWriter | None = None
        tail = b""
        first = True
        streamed = parsed.stream
        # a Responses stream opens with events sent before any token: its first token is its first delta
        marker = RESPONSES_FIRST_TOKEN if streamed and parsed.kind == "responses" else b""
        last = b""
        try:
            resp = request.stream(upstream.status, self._answer_headers(upstream, wid))
            async for chunk in upstream.chunks():
                if first and (not marker or marker in last[-len(marker):] + chunk):
                    first = False
                    now = time.monotonic()
                    if streamed and upstream.status == 200:
                        handle.first_token(now)
                        self.metrics.ttft.observe(now - started)
                last = chunk
                await resp.write(chunk)
                # the usage is in the last SSE chunks, or in the (bounded) JSON body
                tail = (tail + chunk)[-USAGE_TAIL_BYTES:] if streamed else (tail + chunk)[:MAX_JSON_TAIL_BYTES]
            await resp.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            # the client went away: dropping the upstream connection cancels the request on the worker
            upstream.close()
            handle.complete(time.monotonic())
            self.metrics.count_request("499")
            raise
        except (UpstreamError, TimeoutError) as e:  # the worker died mid-response: nothing can be retried
            log.warning("worker %s failed mid-response for %s: %r", wid, rid, e)
            upstream.close()
            self.fleet.mark_failure(wid)
            handle.complete(time.monotonic())
            self.metrics.count_request("502")
            self.metrics.truncated.inc()
            assert resp is not None  # it is made before the first read of the body
            await self._abort(request, resp, streamed and upstream.status == 200, f"worker {wid} failed: {e!r}")
            return None
        self._answered(handle, upstream, tail, streamed, started)
        return None

    def _send_whole(self, handle: Dispatch, upstream: UpstreamResponse, body: bytes, started: float) -> Response:
        """A non-streamed answer of known, bounded length, read whole by ``_connect``, sent as one response:
        headers and body leave in one write, without chunked framing (relayed, they take three: headers, chunk,
        last chunk)."""
        self._answered(handle, upstream, body, False, started)
        return Response(upstream.status, body, self._answer_headers(upstream, handle.worker_id))

    def _answered(self, handle: Dispatch, upstream: UpstreamResponse, tail: bytes, streamed: bool,
                  started: float) -> None:
        """The worker's answer is complete: end the lifecycle, count it, and read its usage (``tail``: the last
        SSE chunks, or the JSON body)."""
        now = time.monotonic()
        if not streamed:
            handle.first_token(now, learn=False)  # only a stream tells when the first token came
            self.metrics.ttft.observe(now - started)
        handle.complete(now, served=upstream.status < 400)
        upstream.release()
        self.metrics.count_request(upstream.status)
        if upstream.status == 200:
            usage = usage_from(tail, streamed)
            reported = cached_tokens_of(usage)
            self.metrics.observe_request(handle, started, now, output_tokens_from(usage), streamed)
            self.metrics.hit_estimated.inc(handle.expected_hit_tokens)
            if reported is not None:
                self.metrics.hit_reported.inc(reported)
                handle.observed_cached(reported, now)
            self.metrics.prompt_tokens.inc(handle.request.prompt_tokens)

    @staticmethod
    async def _abort(request: Request, resp: http1.StreamWriter, sse: bool, message: str) -> None:
        """End a response the client already has bytes of as a failure it can see: a stream gets an SSE error
        event (what vLLM sends, and what the OpenAI SDK raises on), then the connection is cut before the
        terminating chunk, so no client reads a truncated answer as a finished one."""
        if sse:
            event = {"error": {"message": message, "type": "BadGatewayError", "param": None, "code": 502}}
            with contextlib.suppress(ConnectionError):
                await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        request.abort()  # flushes what was written, then closes: chunked encoding left unfinished

    def _log_decision(self, rid: str, client_rid: str | None, prompt_tokens: int, decision: Decision,
                      batch_index: int | None = None) -> None:
        self.decisions.append(_LoggedDecision(rid, client_rid, prompt_tokens, decision, batch_index))
        # the reason may quote the client (a model name): escaped and bounded, so a CR LF cannot forge a log line
        log.info("route %s -> %s (%s; %s)", rid, decision.chosen, decision.outcome, client_text(decision.reason, 4096))

    # ---- other endpoints ---------------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        """The models of the workers that take new requests, merged; a 503 while none does (every worker
        drained or unhealthy), as ``/health`` and the picker answer: a drained worker is asked nothing new, and
        a model listed here is one a request may be sent for now (docs/fleet.md, section 2)."""
        ready = [ep for ep in self.core.endpoints.values() if ep.healthy and not ep.draining]
        if not ready:
            self.metrics.count_request("503")
            return error(503, "no worker takes new requests (every worker is draining or unhealthy)",
                         "ServiceUnavailableError")
        seen: dict[str, dict[str, Any]] = {}
        for ep in ready:
            try:
                up = await self._send("GET", ep.url, "/v1/models", [("accept", "application/json")], b"", 2.0)
                try:
                    data = _json_loads(await up.read())
                finally:
                    up.release()
                for m in data.get("data", []):
                    seen.setdefault(m.get("id"), m)
            except (UpstreamError, TimeoutError, ValueError, AttributeError, TypeError):
                continue
        return json_response({"object": "list", "data": list(seen.values())})

    async def health(self, request: Request) -> Response:
        if self.stopping:  # not ready: a load balancer sends nothing new here
            return json_response({"status": "shutting down"}, status=503)
        ready = any(ep.healthy and not ep.draining for ep in self.core.endpoints.values())
        return json_response({"status": "ok" if ready else "no healthy workers"}, status=200 if ready else 503)

    async def prometheus(self, request: Request) -> Response:
        return Response(200, self.metrics.exposition(), {"content-type": "text/plain; charset=utf-8"})

    async def admin_prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.exposition(), content_type="text/plain", charset="utf-8")

    async def debug_decisions(self, request: web.Request) -> web.Response:
        try:
            n = int(request.query.get("n", "20"))
        except ValueError:
            return admin_error(400, "n must be an integer")
        if n < 0:
            return admin_error(400, "n must not be negative")
        return web.json_response({"decisions": self.recent_decisions(n)})

    def recent_decisions(self, n: int | None = None) -> list[dict[str, Any]]:
        """The last ``n`` decisions logged (all that are kept: None), oldest first, as ``/debug/decision`` shows
        them."""
        if n == 0:
            return []
        entries = list(self.decisions)
        return [d.as_dict() for d in (entries if n is None else entries[-n:])]


async def run_proxy(config: RouterConfig, slot: ProcessSlot | None = None) -> None:
    """Serve until cancelled, then drain (``ProxyServer.drain``, ``config.http.grace_s``; a second cancellation
    cuts it short): the proxy on ``listen``, admin and debug on ``admin`` (localhost by default). ``slot``: one of
    ``--processes N`` (router/frontends/processes.py): the port is shared (SO_REUSEPORT), the load too, and admin
    is served by process 0 only."""
    server = ProxyServer(config)
    await server.start()
    shared = start_shared_load(server.fleet, config, slot)
    if shared is not None:
        await shared.start()
    runners = []
    api: asyncio.Server | None = None
    try:
        api = await server.serve_api(config.listen.host, config.listen.port, reuse_port=slot is not None)
        if slot is None or slot.serves_admin:
            runner = web.AppRunner(server.admin_app(), access_log=None)
            await runner.setup()
            await web.TCPSite(runner, config.admin.host, config.admin.port, reuse_port=slot is not None).start()
            runners.append(runner)
        log.info("kvrouter serve: proxy on %s:%d, admin on %s:%d, policy %s", config.listen.host,
                 config.listen.port, config.admin.host, config.admin.port, config.routing.policy)
        await asyncio.Event().wait()
    finally:
        try:
            await server.drain(api, config.http.grace_s)
        finally:
            for runner in runners:
                await runner.cleanup()
            if shared is not None:
                await shared.stop()
            await server.stop()
