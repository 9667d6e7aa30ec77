"""``kvrouter epp``: an Envoy ext_proc endpoint picker speaking the Gateway API Inference Extension protocol.

Per HTTP request Envoy opens one ``Process`` stream. Request phase: collect the body (FULL_DUPLEX_STREAMED:
answer nothing until its end, then the headers response, then the body re-sent in chunks; BUFFERED: the
headers answered at once, the whole body in one message), parse and tokenize it as the proxy does, decide
with the routing core, and answer with the ``x-gateway-destination-endpoint`` header (always overwriting a
client's) and the ``envoy.lb`` dynamic metadata holding the primary and fallbacks. Response phase: the
served endpoint (``upstream.address``), the first byte, the usage and the end keep the in-flight accounting
right. No eligible endpoint is an ImmediateResponse 503 with the reason; saturation a 429 with Retry-After.

Bad input is answered here, as the proxy answers it: a body over ``max_body_bytes`` is a 413 before it is
all read, a malformed one a 400 with the reason; parsing runs off the event loop; with a trusted tenant
header configured the client's ``cache_salt`` is never used; the in-flight accounting is keyed by an id the
picker makes (the client's ``x-request-id`` reaches the worker untouched, it is not trusted here).

Paths (router/frontends/api_paths.py): completions, chat, embeddings and the Responses API are parsed by the
proxy's parser and routed on their prefix. Envoy sends one request to one endpoint, so a batch (a completions
``prompt`` or an embeddings ``input`` holding several prompts, streamed or not) is routed as one, on its
prompts' longest shared prefix, with the work of all of them. ``/tokenize`` and ``/detokenize`` are answered
here, from the picker's own tokenizer, as an ImmediateResponse 200 with vLLM's JSON (or the 4xx a bad body
gets): no worker is contacted.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from multidict import MultiDict

from router.config import RouterConfig
from router.frontends.admin import FleetAdmin, admin_guard
from router.frontends.api_paths import GENERATE_PATHS, TOKENIZER_PATHS, api_path, is_api_path
from router.frontends.fleet import Fleet, fleet_from_config
from router.frontends.flow_gate import FlowGate
from router.frontends.h2grpc import ConnectionLimits, GrpcServer
from router.frontends.http1 import error_body
from router.frontends.metrics import RouterMetrics
from router.frontends.openai import (
    DEFAULT_MAX_N,
    BadRequest,
    RequestParser,
    model_not_found,
    new_request_id,
    request_objective,
    salt_rule,
)
from router.frontends.processes import ProcessSlot, start_shared_load
from router.frontends.proxy import cached_tokens_of, output_tokens_from, usage_from
from router.scheduling import Decision, Dispatch, RouteRequest, RoutingCore
from router.scheduling.flow import FlowParams
from router.scheduling.slo import OBJECTIVE_HEADER_NAMES, SloConfig, flow_id
from router.tokenizer import PromptTokenizer

log = logging.getLogger("kvrouter.epp")

DEST_HEADER = "x-gateway-destination-endpoint"
PREFILLER_HEADER = "x-prefiller-host-port"  # llm-d's routing sidecar: the prefill pod of a split request
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SERVED_KEY = "x-gateway-destination-endpoint-served"
MAX_CHUNK = 62_000  # as the reference picker: under Envoy's default 64 KiB gRPC frame for body chunks
SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"
FULL_DUPLEX = 4  # ProcessingMode.BodySendMode.FULL_DUPLEX_STREAMED
BODY_NONE = 0  # ProcessingMode.BodySendMode.NONE: the response body does not pass through the picker
SHARED_PORT_MAX_STREAMS = 4  # --processes N: streams per gateway connection to ask for (more connections to spread)


@dataclass
class _Stream:
    """One HTTP request's state across its ext_proc stream."""

    headers: MultiDict[str] = field(default_factory=MultiDict)
    body: bytearray = field(default_factory=bytearray)
    full_duplex: bool = True
    response_bodies: bool = True  # Envoy sends the response body (False: the lighter, headers-only stream)
    responded: bool = False  # the response's headers came
    subset: frozenset[str] | None = None
    handle: Dispatch | None = None  # the request lifecycle, once routed
    prefill: Dispatch | None = None  # the prefill half's, when split (the decode pod's sidecar runs it)
    started: float = 0.0
    first_byte: bool = False
    streamed: bool = False
    tail: bytes = b""
    status: str = "200"
    refused: bool = False  # answered with an ImmediateResponse: nothing more to read from this stream


# _header_mutation and _lb_metadata are cached (a few endpoints, so a few distinct answers): building the messages was
# 1.5% of the picker's CPU per pick. What they return is only ever copied into a response (protobuf constructors
# copy), never changed.
@functools.lru_cache(maxsize=4096)
def _header_mutation(address: str, prefiller: str | None = None) -> pb.HeaderMutation:
    """The destination (always overwritten), and the prefill worker of a split request in llm-d's sidecar header;
    without one, a client's own ``x-prefiller-host-port`` is removed: it would have the decode pod's sidecar
    prefill on a host the client names."""
    overwrite = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    headers = [base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=DEST_HEADER, raw_value=address.encode()),
                                          append_action=overwrite)]
    if prefiller is None:
        return pb.HeaderMutation(set_headers=headers, remove_headers=[PREFILLER_HEADER])
    headers.append(base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=PREFILLER_HEADER, raw_value=prefiller.encode()), append_action=overwrite))
    return pb.HeaderMutation(set_headers=headers)


@functools.lru_cache(maxsize=4096)
def _lb_metadata(addresses: tuple[str, ...]) -> struct_pb2.Struct:
    md = struct_pb2.Struct()
    md.get_or_create_struct(LB_NAMESPACE)[DEST_HEADER] = ",".join(addresses)
    return md


def _destination(address: str, prefiller: str | None) -> pb.CommonResponse:
    """The pick's mutation of the request: its destination (and prefill worker), the route recomputed."""
    return pb.CommonResponse(header_mutation=_header_mutation(address, prefiller), clear_route_cache=True)


@functools.lru_cache(maxsize=4096)
def _routed(addresses: tuple[str, ...], prefiller: str | None = None) -> pb.ProcessingResponse:
    """The request headers' answer to a pick of ``addresses`` (the endpoint, then its fallbacks): the same
    message for every pick of them, so built once and shared (a message here is only ever serialized)."""
    return pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=_destination(addresses[0], prefiller)),
                                 dynamic_metadata=_lb_metadata(addresses))


# the answers that carry nothing, shared like ``_routed``'s
_REQUEST_HEADERS_GO_ON = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
_REQUEST_TRAILERS_GO_ON = pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
_RESPONSE_HEADERS_GO_ON = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
_RESPONSE_TRAILERS_GO_ON = pb.ProcessingResponse(response_trailers=pb.TrailersResponse())


def _immediate(status: int, message: str, retry_after: int | None = None) -> pb.ProcessingResponse:
    body = json.dumps({"object": "error", "message": message, "code": status}).encode()
    return _immediate_json(status, body, message[:200], retry_after)


def _immediate_json(status: int, body: bytes, details: str, retry_after: int | None = None) -> pb.ProcessingResponse:
    """The picker answers the client itself, with a JSON body."""
    headers = [base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key="content-type",
                                                                      raw_value=b"application/json"))]
    if retry_after is not None:
        headers.append(base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(
            key="retry-after", raw_value=str(retry_after).encode())))
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status), headers=pb.HeaderMutation(set_headers=headers),
        body=body, details=details))


def _headers_of(msg: pb.HttpHeaders, names: frozenset[str]) -> MultiDict[str]:
    """The headers of ``names`` (lower-case) the message carries: only those values are decoded (the picker
    reads three of a request's dozen headers, one of a response's). Every value of a repeated header is kept, in
    order (``get``: the first, as the proxy reads): the headers the router decides by must come once
    (router/frontends/openai.py ``trusted_header``), and Envoy passes a repeated one as separate entries."""
    out: MultiDict[str] = MultiDict()
    for h in msg.headers.headers:
        key = h.key.lower()
        if key in names:
            out.add(key, h.raw_value.decode("latin-1") if h.raw_value else h.value)
    return out


_RESPONSE_HEADERS_READ = frozenset({":status"})


class EndpointPicker(pb_grpc.ExternalProcessorServicer):
    def __init__(self, core: RoutingCore, fleet: Fleet, tokenizer_for: Callable[[str | None], PromptTokenizer],
                 block_size: int, metrics: RouterMetrics, tenant_header: str | None = None,
                 fallbacks: int = 2, *, tenant_missing: str = "reject", session_header: str = "x-session-id",
                 max_body_bytes: int = 32 * 1024 * 1024, slo: SloConfig | None = None,
                 flow: FlowParams | None = None, salt_secret: str | None = None,
                 max_n: int = DEFAULT_MAX_N) -> None:
        self.core = core
        self.fleet = fleet
        self.tokenizer_for = tokenizer_for
        self.block_size = block_size
        self.metrics = metrics
        self.tenant_header = tenant_header.lower() if tenant_header else None
        self.tenant_missing = tenant_missing
        self.salt_secret = salt_secret  # the tenants' salts' key (config salt_secret; None: this process's own)
        self.max_n = max_n
        self.session_header = session_header.lower()
        self.headers_read = frozenset({":path", self.session_header, *OBJECTIVE_HEADER_NAMES,
                                       *((self.tenant_header,) if tenant_header else ())})
        self.slo = slo or SloConfig()
        self.gate = FlowGate(core, flow or FlowParams())  # flow control (docs/slo.md); off unless enabled
        metrics.watch_flow(self.gate, {0, *(o.priority for o in self.slo.objectives.values())})
        self.max_body_bytes = max_body_bytes
        self.fallbacks = fallbacks
        self.parser = RequestParser(tokenizer_for)

    def _address_to_worker(self, address: str) -> str | None:
        for wid, ep in self.core.endpoints.items():
            if ep.address == address:
                return wid
        return None

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ProcessingResponse]:
        st = _Stream(started=time.monotonic())
        try:
            async for req in request_iterator:
                if st.refused:
                    return  # the client has its answer; Envoy closes the stream
                kind = req.WhichOneof("request")
                if req.HasField("protocol_config"):
                    st.full_duplex = req.protocol_config.request_body_mode == FULL_DUPLEX
                    st.response_bodies = req.protocol_config.response_body_mode != BODY_NONE
                if kind == "request_headers":
                    st.headers = _headers_of(req.request_headers, self.headers_read)
                    st.subset = self._subset(req)
                    if not is_api_path(st.headers.get(":path", "")):  # worker control paths never pass
                        st.refused = True
                        self.metrics.count_request("404")
                        yield _immediate(404, f"no such path: {st.headers.get(':path', '')[:200]}")
                    elif req.request_headers.end_of_stream:  # no body (GET /v1/models): any ready endpoint
                        yield self._route_bodyless(st)
                    elif not st.full_duplex:
                        yield _REQUEST_HEADERS_GO_ON
                elif kind == "request_body":
                    st.body += req.request_body.body
                    if st.handle is not None:  # a body that ends twice: refuse, and end what was dispatched
                        st.handle.fail(time.monotonic())
                        st.refused = True
                        self.metrics.count_request("400")
                        yield _immediate(400, "the request body ended twice")
                    elif len(st.body) > self.max_body_bytes:
                        st.refused = True
                        self.metrics.count_request("413")
                        yield _immediate(413, f"request body over the {self.max_body_bytes}-byte limit")
                    elif req.request_body.end_of_stream:
                        for out in await self._route(st):
                            yield out
                elif kind == "request_trailers":
                    yield _REQUEST_TRAILERS_GO_ON
                elif kind == "response_headers":
                    st.status = _headers_of(req.response_headers, _RESPONSE_HEADERS_READ).get(":status", st.status)
                    st.responded = True
                    self._served(st, req)
                    if not st.response_bodies:  # headers only: the worker has started answering
                        self._prefill_done(st)
                        if st.handle is not None and not st.handle.ended:
                            st.handle.first_token(time.monotonic(), learn=False)  # the headers precede the token
                    if req.response_headers.end_of_stream:
                        self._finish(st)
                    yield _RESPONSE_HEADERS_GO_ON
                elif kind == "response_body":
                    chunk = req.response_body.body
                    if not st.first_byte and chunk:
                        st.first_byte = True
                        self._prefill_done(st)
                        if st.handle is not None and st.streamed:
                            st.handle.first_token(time.monotonic())
                            self.metrics.ttft.observe(time.monotonic() - st.started)
                    st.tail = (st.tail + chunk)[-8192:] if st.streamed else st.tail + chunk
                    if req.response_body.end_of_stream:
                        self._finish(st)
                    yield pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse(
                        body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                            body=chunk, end_of_stream=req.response_body.end_of_stream)))))
                elif kind == "response_trailers":
                    self._finish(st)
                    yield _RESPONSE_TRAILERS_GO_ON
        finally:
            self._prefill_done(st)
            if st.handle is not None and not st.handle.ended:
                if st.responded and not st.response_bodies:
                    self._finish(st)  # headers only: the stream's close is the response's end
                else:
                    st.handle.complete(time.monotonic())  # client or Envoy went away

    # ---- request phase ---------------------------------------------------------------------------
    def _subset(self, req: pb.ProcessingRequest) -> frozenset[str] | None:
        fm = req.metadata_context.filter_metadata
        if SUBSET_NAMESPACE not in fm:
            return None
        value = fm[SUBSET_NAMESPACE].fields.get(SUBSET_KEY)
        if value is None:
            return None
        if value.HasField("list_value"):
            return frozenset(v.string_value for v in value.list_value.values)
        return frozenset(x.strip() for x in value.string_value.split(",") if x.strip())

    def _route_bodyless(self, st: _Stream) -> pb.ProcessingResponse:
        if api_path(st.headers.get(":path", "")) in TOKENIZER_PATHS:  # answered here, never by a worker
            st.refused = True
            self.metrics.count_request("400")
            return _immediate(400, "request body must be a JSON object")
        rreq = RouteRequest(new_request_id(), [], 0, self.block_size, 1, subset=st.subset)
        decision = self.core.decide(rreq, time.monotonic())
        if decision.outcome != "routed":
            return self._refusal(decision)
        return _routed(self._addresses(decision))

    async def _route(self, st: _Stream) -> list[pb.ProcessingResponse]:
        path = st.headers.get(":path", "").split("?")[0]
        body = bytes(st.body)
        if not is_api_path(path):  # a body before any headers names no path at all
            st.refused = True
            self.metrics.count_request("404")
            return [_immediate(404, f"no such path: {path[:200]!r}")]
        if api_path(path) in TOKENIZER_PATHS:  # the picker's own tokenizer answers: no worker is contacted
            st.refused = True
            try:
                answer = await self.parser.tokenizer_path(body, path, self.fleet.max_model_len())
            except BadRequest as e:
                self.metrics.count_request(e.status)
                return [_immediate(e.status, str(e))]
            self.metrics.count_request("200")
            return [_immediate_json(200, json.dumps(answer).encode(), api_path(path)[1:])]
        tenant: str | None = None  # the trusted tenant header's one value (the flow a waiting request joins, if set)
        if api_path(path) not in GENERATE_PATHS:
            rreq = RouteRequest(new_request_id(), [], 0, self.block_size, 1, subset=st.subset)
        else:
            try:
                salt = salt_rule(st.headers, self.tenant_header, self.tenant_missing, self.salt_secret)
                parsed = await self.parser.parse(body, path, salt, self.fleet.max_model_len(), self.max_n)
                tenant = salt.tenant
                objective = request_objective(st.headers, self.slo, parsed.model, tenant)
            except BadRequest as e:
                st.refused = True
                self.metrics.count_request(e.status)
                return [_immediate(e.status, str(e))]
            body = parsed.raw
            lora = self.core.lora_of(parsed.model)
            rreq = await self.parser.route_request(parsed, new_request_id(), self.block_size, lora=lora,
                                                   session=st.headers.get(self.session_header), subset=st.subset,
                                                   objective=objective)
            st.streamed = parsed.stream
        decision = self.core.decide(rreq, time.monotonic())
        self.metrics.decision_seconds.observe(time.monotonic() - st.started)
        # while the fleet is saturated the answer waits here (Envoy's ext_proc message_timeout must cover
        # flow_control.queue_timeout_s); a stream Envoy resets while it waits leaves the queue at once
        decision = await self.gate.admit(rreq, decision, lambda now: self.core.decide(rreq, now),
                                         flow_id(st.headers, tenant))
        self.metrics.count_decision(decision)
        if decision.outcome != "routed":
            st.refused = True
            if decision.outcome == "shed":
                self.metrics.count_objective(rreq.objective, None, None, shed=True)
            return [self._refusal(decision, rreq)]
        prefiller = None
        if api_path(path) in GENERATE_PATHS and parsed.splittable:
            plan = self.core.plan_prefill(rreq, decision, time.monotonic())
            if plan is not None:
                prefiller = self.core.endpoints[plan.worker_id].address
                st.prefill = self.core.dispatch(plan.request, plan.decision, plan.worker_id, time.monotonic())
                self.metrics.disagg.labels("split").inc()
            elif decision.disagg is not None:
                self.metrics.disagg.labels("local").inc()
        addrs = self._addresses(decision)
        st.handle = self.core.dispatch(rreq, decision, decision.ranked[0], time.monotonic())
        if not st.full_duplex:  # BUFFERED: headers already answered; mutate them with the body response
            common = _destination(addrs[0], prefiller)  # its own: the body mutation goes on it
            if body != bytes(st.body):
                common.body_mutation.body = body
            return [pb.ProcessingResponse(request_body=pb.BodyResponse(response=common),
                                          dynamic_metadata=_lb_metadata(addrs))]
        out = [_routed(addrs, prefiller)]
        chunks = [body[i : i + MAX_CHUNK] for i in range(0, len(body), MAX_CHUNK)] or [b""]
        for i, chunk in enumerate(chunks):
            out.append(pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
                body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                    body=chunk, end_of_stream=i == len(chunks) - 1))))))
        return out

    def _addresses(self, decision: Decision) -> tuple[str, ...]:
        endpoints = self.core.endpoints
        return tuple(endpoints[w].address for w in decision.ranked[: 1 + self.fallbacks])

    def _refusal(self, decision: Decision, request: RouteRequest | None = None) -> pb.ProcessingResponse:
        if decision.outcome == "no_endpoint" and request is not None and self.core.serves_nobody(request):
            self.metrics.count_request("404")  # a model no endpoint serves: vLLM's answer for an unknown model
            message = model_not_found(request.lora or request.model)
            return _immediate_json(404, json.dumps(error_body(404, message, "NotFoundError")).encode(), message[:200])
        if decision.outcome == "shed":
            self.metrics.count_request("429")
            return _immediate(429, decision.reason, retry_after=max(1, round(decision.retry_after_s)))
        self.metrics.count_request("503")
        return _immediate(503, decision.reason)

    # ---- response phase --------------------------------------------------------------------------
    def _served(self, st: _Stream, req: pb.ProcessingRequest) -> None:
        """Which endpoint served (it differs from the pick when Envoy fell back): fix the accounting."""
        attrs = req.attributes.get("envoy.filters.http.ext_proc")
        served = None
        if attrs is not None and "upstream.address" in attrs.fields:
            served = attrs.fields["upstream.address"].string_value
        if served is None:
            md = req.metadata_context.filter_metadata.get(LB_NAMESPACE)
            if md is not None and SERVED_KEY in md.fields:
                served = md.fields[SERVED_KEY].string_value
        if not served or st.handle is None:
            return
        wid = self._address_to_worker(served)
        picked = st.handle.worker_id
        if wid is not None and wid != picked:
            log.info("request %s served by %s, not the pick %s", st.handle.request.request_id, wid, picked)
            self.fleet.mark_failure(picked)
            st.handle.reassign(wid, time.monotonic())

    @staticmethod
    def _prefill_done(st: _Stream) -> None:
        """The decode pod answering means its sidecar's prefill is over (the picker never sees it itself)."""
        if st.prefill is not None and not st.prefill.ended:
            now = time.monotonic()
            st.prefill.first_token(now, learn=False)
            st.prefill.complete(now)

    def _finish(self, st: _Stream) -> None:
        self._prefill_done(st)
        handle = st.handle
        if handle is None or handle.ended:
            return
        now = time.monotonic()
        if not st.streamed:
            handle.first_token(now, learn=False)
        handle.complete(now, served=st.status.startswith(("1", "2", "3")))  # a refusal computed nothing
        self.metrics.count_request(st.status)
        if st.status != "200":
            return
        self.metrics.prompt_tokens.inc(handle.request.prompt_tokens)
        if not st.response_bodies:  # headers only: no usage to read
            self.metrics.observe_request(handle, st.started, now, None, False)
            return
        usage = usage_from(st.tail, st.streamed)
        self.metrics.observe_request(handle, st.started, now, output_tokens_from(usage), st.streamed)
        reported = cached_tokens_of(usage)
        if reported is not None:
            self.metrics.hit_reported.inc(reported)
            handle.observed_cached(reported, now)
        self.metrics.hit_estimated.inc(handle.expected_hit_tokens)


async def health_servicer(fleet: Fleet) -> health.aio.HealthServicer:
    """grpc_health's asyncio servicer (``Check`` and ``Watch``), on either gRPC server."""
    servicer = health.aio.HealthServicer()
    await servicer.set("liveness", health_pb2.HealthCheckResponse.SERVING)
    await servicer.set("readiness", health_pb2.HealthCheckResponse.NOT_SERVING)
    await servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
    return servicer


async def update_readiness(servicer: health.aio.HealthServicer, core: RoutingCore, now: float) -> bool:
    """Ready when some endpoint is healthy and every healthy one's index is usable and its metrics fresh."""
    ready, _ = core.readiness(now)
    status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
    for service in ("readiness", SERVICE_NAME, ""):
        await servicer.set(service, status)
    return ready


async def run_epp(config: RouterConfig, started: asyncio.Event | None = None,
                  slot: ProcessSlot | None = None) -> None:
    """``kvrouter epp``: the picker, gRPC health, Prometheus metrics on their own port, and with ``epp.admin_port``
    the fleet's admin (``FleetAdmin``: workers, drain, undrain) on ``admin.host`` (localhost by default), with
    ``epp.rank_port`` the Rank service there too. Serves until cancelled, then drains (``serve_epp``). ``slot``:
    one of ``--processes N`` (router/frontends/processes.py): every port shared (SO_REUSEPORT), the in-flight load
    too."""
    from aiohttp import web

    from router.tokenizer import load_tokenizer

    core = RoutingCore(config.routing)
    fleet = fleet_from_config(core, config)
    await fleet.start()
    shared = start_shared_load(fleet, config, slot)
    if shared is not None:
        await shared.start()
    metrics = RouterMetrics(fleet)

    def tokenizer_for(model: str | None) -> PromptTokenizer:
        return load_tokenizer(config.tokenizers.get(model or "", config.tokenizer))

    picker = EndpointPicker(core, fleet, tokenizer_for, config.routing.block_size, metrics, config.tenant_header,
                            config.epp.fallbacks, tenant_missing=config.tenant_missing,
                            session_header=config.session_header, max_body_bytes=config.max_body_bytes,
                            slo=config.slo, flow=config.flow_control, salt_secret=config.salt_secret,
                            max_n=config.max_n)

    async def prometheus(_: web.Request) -> web.Response:
        return web.Response(body=metrics.exposition(), content_type="text/plain", charset="utf-8")

    app = web.Application()
    app.add_routes([web.get("/metrics", prometheus)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, config.epp.metrics_host, config.epp.metrics_port, reuse_port=slot is not None).start()
    runners = [runner]
    if config.epp.admin_port is not None and (slot is None or slot.serves_admin):  # drain, workers: localhost
        admin = web.Application(middlewares=[admin_guard(config.admin.host)])  # what no web page can send
        admin.add_routes(FleetAdmin(core, fleet).routes())
        admin_runner = web.AppRunner(admin, access_log=None)
        await admin_runner.setup()
        await web.TCPSite(admin_runner, config.admin.host, config.epp.admin_port).start()
        runners.append(admin_runner)
    try:
        await serve_epp(core, fleet, picker, config.epp.port, config.epp.health_port, config.epp.host,
                        started=started, grace_s=config.epp.grace_s, reuse_port=slot is not None,
                        grpc_server=config.epp.grpc_server, rank_port=config.epp.rank_port,
                        rank_host=config.admin.host,
                        limits=ConnectionLimits(config.epp.handshake_timeout_s, config.epp.idle_timeout_s,
                                                config.epp.max_connections))
    finally:
        for r in runners:
            await r.cleanup()
        if shared is not None:
            await shared.stop()
        await fleet.stop()


async def serve_epp(core: RoutingCore, fleet: Fleet, picker: EndpointPicker, port: int, health_port: int | None,
                    host: str = "0.0.0.0", max_message_bytes: int = 64 * 1024 * 1024,
                    started: asyncio.Event | None = None, grace_s: float = 10.0, reuse_port: bool = False,
                    grpc_server: str = "kvrouter", limits: ConnectionLimits | None = None,
                    rank_port: int | None = None, rank_host: str = "127.0.0.1") -> None:
    """Serve ext_proc (and gRPC health, on ``health_port`` or the same port) until cancelled, then drain: gRPC
    health NOT_SERVING, the requests flow control holds answered 429 with Retry-After (``FlowGate.close``), the
    listener closed and GOAWAY sent (the gateway opens its next streams on another replica), the open streams
    (each request's, until its response has passed) given up to ``grace_s``, then everything closed; cancelled
    again meanwhile (a second signal), closed at once. ``rank_port``: kvrouter.v1.Picker/Rank on its own
    listener at ``rank_host`` (the admin host), never on the ext_proc port, which the data plane reaches: Rank
    reports the blocks cached for any ``cache_salt`` it is given (None: not served).
    ``grpc_server``: "kvrouter" (router/frontends/h2grpc.py) or "grpcio" (grpc.aio) on the ext_proc port; a
    separate health port is grpc.aio's (``grpc.health.v1``'s ``Check`` and ``Watch`` on either). ``reuse_port``: one
    of several processes on these ports (the kernel spreads connections over them: a gateway multiplexing every
    stream onto one HTTP/2 connection must be told to open several, e.g. Envoy's cluster
    ``max_concurrent_streams`` at ``SHARED_PORT_MAX_STREAMS``; a server-side cap instead would refuse the streams
    that race a closing one). ``limits``: the kvrouter server's connection timeouts and cap (grpcio keeps its
    own)."""
    from router.frontends.rank import RankService
    from router.gen import picker_pb2_grpc

    if grpc_server not in ("kvrouter", "grpcio"):
        raise ValueError(f"epp.grpc_server must be 'kvrouter' or 'grpcio', not {grpc_server!r}")
    hs = await health_servicer(fleet)
    server = _grpc_server(grpc_server, max_message_bytes, reuse_port, limits)
    pb_grpc.add_ExternalProcessorServicer_to_server(picker, server)
    rank_server: GrpcServer | grpc.aio.Server | None = None
    health_server: GrpcServer | grpc.aio.Server | None = None
    try:
        if health_port is None or health_port == port:
            health_pb2_grpc.add_HealthServicer_to_server(hs, server)
        else:  # grpc.aio, whatever serves ext_proc: a probe every few seconds from any client (kubelet's is grpc-go)
            health_server = _grpc_server("grpcio", max_message_bytes, reuse_port)
            health_pb2_grpc.add_HealthServicer_to_server(hs, health_server)
            await _start(health_server, host, health_port, reuse_port)
        await _start(server, host, port, reuse_port)
        if rank_port is not None:  # (after the data plane: a port clash there leaves no Rank listener behind)
            rank_server = _grpc_server(grpc_server, max_message_bytes, reuse_port, limits)
            picker_pb2_grpc.add_PickerServicer_to_server(
                RankService(core, picker.tokenizer_for, picker.block_size, fleet.max_model_len), rank_server)
            await _start(rank_server, rank_host, rank_port, reuse_port)
        if started is not None:
            started.set()
        while True:
            await update_readiness(hs, core, fleet.clock())
            await asyncio.sleep(0.2)
    finally:
        # every step below runs whatever happens in another (a second signal during the drain cuts it short,
        # never leaves a listener open)
        try:
            picker.gate.close()  # held requests: 429, each on its own stream, which then ends
            await hs.enter_graceful_shutdown()  # NOT_SERVING, and it stays so
            await server.stop(grace_s)  # finishes open streams, refuses new ones
        except asyncio.CancelledError:  # cut short
            await server.stop(0)
            raise
        finally:
            for other in (rank_server, health_server):
                if other is not None:
                    await other.stop(0)  # (a Watch on the health port would otherwise hold the stop for the grace)


def _grpc_server(kind: str, max_message_bytes: int, reuse_port: bool,
                 limits: ConnectionLimits | None = None) -> GrpcServer | grpc.aio.Server:
    if kind == "kvrouter":
        return GrpcServer(max_message_bytes, limits)
    options = [("grpc.max_receive_message_length", max_message_bytes),
               ("grpc.max_send_message_length", max_message_bytes)]
    if reuse_port:
        options.append(("grpc.so_reuseport", 1))
    return grpc.aio.server(options=options)


async def _start(server: GrpcServer | grpc.aio.Server, host: str, port: int, reuse_port: bool) -> None:
    if isinstance(server, GrpcServer):
        await server.start(host, port, reuse_port)
    else:
        server.add_insecure_port(f"{host}:{port}")
        await server.start()
