"""The proxy's HTTP/1.1 port against RFC 9110 / RFC 9112 (issue 46's conformance tier, the HTTP/1 half).

Why: ``kvrouter serve`` answers clients on its own HTTP/1.1 server (router/frontends/http1.py, asyncio protocols
over llhttp), not a library's. Whatever a client sends, the server must give the RFC's required answer (a status,
then the connection closed or kept), hold a bounded amount of state, and go on serving everyone else. Each case
runs against the real proxy (``ProxyServer`` in front of a simulated worker, every timeout 0.5 s); the
protocol-level cases run against a plain aiohttp server too (the proxy has no aiohttp mode any more; aiohttp
still serves the admin port and the workers), so an answer of ours that differs from a mature server's shows.
Where aiohttp's differs from the RFC's, its measured outcome is accepted by name (``Case.aiohttp``).

Clients: h11 (python-hyper's HTTP/1.1 state machine) reads every answer, as a client would frame it; requests are
written as raw bytes (what no library would send), and real curl sends the >1 MB body with ``Expect``. A
well-behaved client is served during and after each case, on a connection of its own. Every wait is on an event
(an answer, the socket's EOF, a state the server reports) under a generous bound; no sleep synchronises, no
timing is asserted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import h11
import pytest
from aiohttp import web

from router.frontends import http1
from router.frontends.proxy import ProxyServer
from tests.sim_helpers import RunningWorker, start_worker
from tests.test_http1 import raw_worker
from tests.test_proxy import proxy, spec_of
from tests.zmq_helpers import wait_until

pytestmark = [pytest.mark.conformance, pytest.mark.sockets]

BOUND_S = 20.0  # generous: each wait is for an event a correct server brings at once, or after a 0.5 s timeout
SHORT_S = 0.5  # every timeout of the servers under test
TIMEOUTS = {"http.header_read_timeout_s": SHORT_S, "http.body_read_timeout_s": SHORT_S,
            "http.keepalive_timeout_s": SHORT_S}
SERVERS = ["kvrouter", "aiohttp"]
COMPLETION = json.dumps({"prompt": "hello conformance", "max_tokens": 2}).encode()
HEALTH = b"GET /health HTTP/1.1\r\nhost: h\r\n\r\n"


def post(body: bytes = COMPLETION, extra: bytes = b"", path: bytes = b"/v1/completions") -> bytes:
    """A completions request's head (``extra``: more header lines) and body."""
    return (b"POST %b HTTP/1.1\r\nhost: h\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%b\r\n"
            % (path, len(body), extra)) + body


# ---- the servers ----------------------------------------------------------------------------------------------
@dataclass
class Served:
    kind: str
    port: int
    proxy: ProxyServer | None = None  # the kvrouter proxy's own state (connections, load, metrics)
    worker: RunningWorker | None = None


async def _aiohttp_app() -> web.Application:
    """The same paths as the proxy's, answered by aiohttp itself."""
    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": []})

    async def completions(request: web.Request) -> web.Response:
        body = await request.read()
        return web.json_response({"object": "text_completion", "choices": [{"index": 0, "text": "ok"}],
                                  "request_bytes": len(body)})

    app = web.Application(client_max_size=32 * 1024 * 1024)
    app.add_routes([web.get("/health", health), web.get("/v1/models", models),
                    web.post("/v1/completions", completions)])
    return app


@contextlib.asynccontextmanager
async def serving(kind: str, time_scale: float = 0.0, **overrides: object) -> AsyncIterator[Served]:
    """``kind``'s server on a loopback port, every timeout ``SHORT_S`` (``overrides``: more config keys)."""
    if kind == "aiohttp":
        runner = web.AppRunner(await _aiohttp_app(), access_log=None, keepalive_timeout=SHORT_S)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            yield Served(kind, site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
        finally:
            await runner.cleanup()
        return
    w = await start_worker(time_scale=time_scale)
    try:
        async with proxy([spec_of(w, "w0")], **{**TIMEOUTS, **overrides}) as (server, url, _admin):
            await wait_until(lambda: "w0" in server.fleet.context_lens, BOUND_S)  # probed: routable
            yield Served(kind, int(url.rsplit(":", 1)[1]), server, w)
    finally:
        await w.stop()


@pytest.fixture(params=SERVERS)
async def served(request: pytest.FixtureRequest) -> AsyncIterator[Served]:
    async with serving(request.param) as s:
        yield s


@pytest.fixture
async def kv() -> AsyncIterator[Served]:
    """The proxy alone: for the cases about the proxy itself (its worker, its timeouts, its limits)."""
    async with serving("kvrouter") as s:
        yield s


# ---- a raw client, its answers read by h11 ------------------------------------------------------------------
@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    interim: list[int] = field(default_factory=list)  # the 1xx answers before it
    keep_alive: bool = True  # h11's reading: the connection may carry another request


class Wire:
    """One client connection: bytes written as given; each answer read by h11's client state machine, told of a
    request that stands for what was written (never sent), so the answer is framed as a client would frame it."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=1 << 20)

    @classmethod
    async def open(cls, port: int) -> Wire:
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def answer(self, method: str = "GET") -> Answer:
        """The next answer, whole (its 1xx before it in ``interim``); AssertionError if the server closes first."""
        conn = self.h11
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()
        conn.send(h11.Request(method=method, target="/", headers=[("host", "h")]))
        conn.send(h11.EndOfMessage())
        interim: list[int] = []
        head: h11.Response | None = None
        body = bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await asyncio.wait_for(self.reader.read(1 << 16), BOUND_S))
            elif isinstance(event, h11.InformationalResponse):
                interim.append(event.status_code)
            elif isinstance(event, h11.Response):
                head = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                assert head is not None
                return Answer(head.status_code, {k.decode(): v.decode("latin-1") for k, v in head.headers},
                              bytes(body), interim, conn.their_state is h11.DONE)
            else:
                raise AssertionError(f"the server closed before its answer ended: {event!r}")

    async def closed(self) -> None:
        """Return once the server has closed the connection (its EOF, or a reset); time out past ``BOUND_S``."""
        with contextlib.suppress(ConnectionError):
            while await asyncio.wait_for(self.reader.read(1 << 16), BOUND_S):
                pass

    def close(self) -> None:
        self.writer.close()


async def health_served(port: int) -> None:
    """A well-behaved client, on its own connection, gets its answer."""
    wire = await Wire.open(port)
    try:
        wire.send(HEALTH)
        assert (await wire.answer()).status == 200
    finally:
        wire.close()


async def check_kept(wire: Wire, answer: Answer) -> None:
    """A connection the answer keeps alive carries another request."""
    assert answer.keep_alive, answer
    wire.send(HEALTH)
    assert (await wire.answer()).status == 200


# ---- the held cases, table-driven ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    name: str
    data: bytes
    statuses: tuple[int, ...]  # the answers the RFC allows
    closed: bool | None  # True: closed after the answer; False: kept alive and usable; None: either
    rfc: str
    absent: bytes = b""  # must not be in the answer
    aiohttp: tuple[tuple[int, ...], bool | None] | None = None  # aiohttp's measured outcome where it is not the RFC's


CHUNKED = (b"POST /v1/completions HTTP/1.1\r\nhost: h\r\ncontent-type: application/json\r\n"
           b"transfer-encoding: chunked\r\n")
CASES = [
    Case("cl-and-te", b"POST /v1/completions HTTP/1.1\r\nhost: h\r\ncontent-length: 5\r\ntransfer-encoding: chunked"
         b"\r\n\r\n0\r\n\r\nGET /health HTTP/1.1\r\nhost: h\r\n\r\n", (400,), True,
         "RFC 9112 6.3 (3); request smuggling, CVE-2019-18277 class"),
    Case("two-content-lengths", b"POST /v1/completions HTTP/1.1\r\nhost: h\r\ncontent-length: 5\r\n"
         b"content-length: 6\r\n\r\n123456", (400,), True, "RFC 9112 6.3 (5)"),
    Case("obs-fold", b"GET /health HTTP/1.1\r\nhost: h\r\nx-folded: a\r\n  b\r\n\r\n", (400,), True,
         "RFC 9112 5.2: reject with 400 or unfold"),
    Case("bad-chunk-size", CHUNKED + b"\r\nzz\r\n{}\r\n0\r\n\r\n", (400,), True, "RFC 9112 7.1"),
    Case("chunk-size-overflow", CHUNKED + b"\r\nfffffffffffffffffff\r\n{}\r\n0\r\n\r\n", (400, 413), True,
         "RFC 9112 7.1; integer overflow"),
    Case("te-xchunked", b"POST /v1/completions HTTP/1.1\r\nhost: h\r\ntransfer-encoding: xchunked\r\n\r\n"
         b"2\r\n{}\r\n0\r\n\r\n", (400, 501), True, "RFC 9112 6.3 (4): chunked not final, 400 and close"),
    Case("100kb-of-headers", b"GET /health HTTP/1.1\r\nhost: h\r\nx-big: " + b"y" * 100_000 + b"\r\n\r\n",
         (431,), True, "RFC 6585 5", aiohttp=((400,), True)),
    Case("10000-headers", b"GET /health HTTP/1.1\r\nhost: h\r\n" + b"".join(b"x-%d: 1\r\n" % i for i in range(10_000))
         + b"\r\n", (431,), True, "RFC 6585 5", aiohttp=((400,), True)),
    Case("non-utf8-path", b"GET /he\xff\xfelth HTTP/1.1\r\nhost: h\r\n\r\n", (400, 404), None,
         "RFC 9112 3.2; RFC 3986 2"),
    Case("connect", b"CONNECT example.com:443 HTTP/1.1\r\nhost: example.com:443\r\n\r\n", (400, 405, 501), True,
         "RFC 9110 9.3.6: an origin server need not tunnel",
         aiohttp=((404,), False)),  # aiohttp routes it as a path, no tunnel: a 404, kept alive
    Case("trace", b"TRACE /health HTTP/1.1\r\nhost: h\r\nx-secret: s3cret\r\n\r\n", (405, 501), None,
         "RFC 9110 9.3.8; cross-site tracing", absent=b"s3cret"),
    Case("dot-segments", b"GET /v1/../../health HTTP/1.1\r\nhost: h\r\n\r\n", (200, 400, 404), None,
         "RFC 3986 5.2.4: removed, or refused"),
    Case("absolute-form", b"GET http://elsewhere.example/health HTTP/1.1\r\nhost: h\r\n\r\n", (200,), False,
         "RFC 9112 3.2.2: a server MUST accept it"),
    Case("http10", b"GET /health HTTP/1.0\r\n\r\n", (200,), True, "RFC 9112 9.3: 1.0 is not kept alive"),
    Case("expect-other", post(extra=b"expect: tea-please\r\n"), (417,), None, "RFC 9110 10.1.1"),
    Case("expect-http10-ignored", post(extra=b"expect: 100-continue\r\n").replace(b"HTTP/1.1", b"HTTP/1.0", 1),
         (200,), True, "RFC 9110 10.1.1: a 1.0 request's 100-continue MUST be ignored"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
async def test_held_cases(served: Served, case: Case) -> None:
    statuses, closed = case.aiohttp if served.kind == "aiohttp" and case.aiohttp else (case.statuses, case.closed)
    wire = await Wire.open(served.port)
    try:
        wire.send(case.data)
        answer = await wire.answer(case.data.split(b" ", 1)[0].decode("latin-1"))
        await health_served(served.port)  # served while the case's connection is open
        assert answer.status in statuses, (answer, case.rfc)
        assert not answer.interim or case.name != "expect-http10-ignored", answer
        if case.absent:
            assert case.absent not in answer.body
        if closed or (closed is None and not answer.keep_alive):
            await wire.closed()
        elif closed is False or answer.keep_alive:
            await check_kept(wire, answer)
    finally:
        wire.close()
    await health_served(served.port)


async def test_pipelined_requests_are_answered_in_order(served: Served) -> None:
    """RFC 9112 9.3.2: answers in the order of the requests, on the one connection."""
    wire = await Wire.open(served.port)
    try:
        wire.send(post() + HEALTH + b"GET /v1/models HTTP/1.1\r\nhost: h\r\n\r\n" + HEALTH)
        answers = [await wire.answer() for _ in range(4)]
    finally:
        wire.close()
    assert [a.status for a in answers] == [200] * 4
    first, health, models, again = (json.loads(a.body) for a in answers)
    assert "choices" in first and health["status"] == "ok" and models["object"] == "list" and again == health


async def test_an_idle_kept_alive_connection_is_closed(served: Served) -> None:
    """The keep-alive timeout (RFC 9112 9.6 lets a server close an idle connection): closed, without an answer."""
    wire = await Wire.open(served.port)
    try:
        wire.send(HEALTH)
        assert (await wire.answer()).status == 200
        await wire.closed()
        assert wire.h11.their_state is h11.DONE  # nothing more came: a close, not an answer
    finally:
        wire.close()
    await health_served(served.port)


async def test_expect_100_continue_waits_for_the_100_then_gets_the_answer(served: Served) -> None:
    """RFC 9110 10.1.1: the client holds its body until the 100; then the final answer, which through the proxy is
    the worker's (the worker never sees ``expect``, and its own 100 would not be taken as the answer)."""
    wire = await Wire.open(served.port)
    try:
        head, body = post(extra=b"expect: 100-continue\r\n").split(b"\r\n\r\n", 1)
        wire.send(head + b"\r\n\r\n")
        interim = await asyncio.wait_for(wire.reader.readuntil(b"\r\n\r\n"), BOUND_S)
        assert interim.startswith(b"HTTP/1.1 100 ")
        wire.send(body)
        answer = await wire.answer("POST")
        assert answer.status == 200 and "choices" in json.loads(answer.body) and not answer.interim
        await check_kept(wire, answer)
    finally:
        wire.close()


# ---- the proxy's own: Expect through it, its timeouts, its limits, its worker --------------------------------
async def test_curl_posting_over_1mb_gets_the_workers_answer(kv: Served, tmp_path: Path) -> None:
    """curl sends ``Expect: 100-continue`` for a body over 1 MB and waits for the 100 (told to wait long here):
    the proxy's 100, then the worker's completion, and curl exits cleanly (it hung before)."""
    body = tmp_path / "big.json"
    body.write_text(json.dumps({"prompt": "hello", "max_tokens": 2, "user": "u" * 1_200_000}))
    curl = await asyncio.create_subprocess_exec(
        "/usr/bin/curl", "-sS", "-v", "--expect100-timeout", str(BOUND_S), "-m", str(BOUND_S),
        "-o", str(tmp_path / "answer.json"), "-w", "%{http_code}", "-H", "content-type: application/json",
        "--data-binary", f"@{body}", f"http://127.0.0.1:{kv.port}/v1/completions",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(curl.communicate(), BOUND_S * 2)
    assert curl.returncode == 0, err.decode(errors="replace")[-2000:]
    assert b"> Expect: 100-continue" in err and b"< HTTP/1.1 100 Continue" in err  # the case is the one meant
    assert out == b"200" and "choices" in json.loads((tmp_path / "answer.json").read_text())


async def test_the_pool_skips_a_workers_interim_answers() -> None:
    """RFC 9110 15.2: a 1xx (not 101) is interim; the answer is the final one after it."""
    async def interim_first(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>; rel=preload\r\n\r\n"
                     b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\nx-final: yes\r\n\r\n2\r\nok\r\n0\r\n\r\n")
        await writer.drain()
        await reader.read()

    pool = http1.UpstreamPool()
    try:
        async with raw_worker(interim_first) as (port, _):
            r = await pool.request("POST", "127.0.0.1", port, "/x", [], b"{}", BOUND_S)
            assert (r.status, await r.read()) == (200, b"ok")
            assert r.headers.get("x-final") == "yes" and "link" not in r.headers
            r.release()
    finally:
        pool.close()


async def test_a_pipelined_100_continue_waits_for_the_answer_before_it() -> None:
    """The 100 owed to a pipelined request is sent once the answer before it (a stream) has ended: written at
    once, it landed inside that stream's chunked body."""
    async with serving("kvrouter", time_scale=2.0) as s:
        wire = await Wire.open(s.port)
        try:
            stream = json.dumps({"prompt": "a long stream", "max_tokens": 60, "stream": True}).encode()
            wire.send(post(stream))
            conn = wire.h11  # read the stream's head, then pipeline the next request's head behind it
            conn.send(h11.Request(method="POST", target="/", headers=[("host", "h")]))
            conn.send(h11.EndOfMessage())
            while not isinstance(event := conn.next_event(), h11.Response):
                assert event is h11.NEED_DATA
                conn.receive_data(await asyncio.wait_for(wire.reader.read(1 << 16), BOUND_S))
            head, body = post(extra=b"expect: 100-continue\r\n").split(b"\r\n\r\n", 1)
            wire.send(head + b"\r\n\r\n")
            data = bytearray()
            while not isinstance(event := conn.next_event(), h11.EndOfMessage):  # the stream, parsed cleanly
                if event is h11.NEED_DATA:
                    conn.receive_data(await asyncio.wait_for(wire.reader.read(1 << 16), BOUND_S))
                elif isinstance(event, h11.Data):
                    data += event.data
            assert data.rstrip().endswith(b"data: [DONE]")
            conn.start_next_cycle()
            conn.send(h11.Request(method="POST", target="/", headers=[("host", "h")]))
            conn.send(h11.EndOfMessage())
            while (event := conn.next_event()) is h11.NEED_DATA:
                conn.receive_data(await asyncio.wait_for(wire.reader.read(1 << 16), BOUND_S))
            assert isinstance(event, h11.InformationalResponse) and event.status_code == 100
            wire.send(body)
            rest = bytearray()
            while not isinstance(event := conn.next_event(), h11.EndOfMessage):
                if event is h11.NEED_DATA:
                    conn.receive_data(await asyncio.wait_for(wire.reader.read(1 << 16), BOUND_S))
                elif isinstance(event, h11.Response):
                    assert event.status_code == 200
                elif isinstance(event, h11.Data):
                    rest += event.data
            assert "choices" in json.loads(rest)
        finally:
            wire.close()


def _error_of(answer: Answer, status: int) -> None:
    """``answer`` is ``status`` in vLLM's OpenAI error shape, and says it closes."""
    assert answer.status == status and not answer.keep_alive, answer
    body = json.loads(answer.body)
    assert body["object"] == "error" and body["code"] == status and body["message"], body


@pytest.mark.parametrize("partial", [b"POST /v1/completions HTTP/1.1\r\nhost: h\r\nx-slow", post()[:-1]],
                         ids=["half-the-headers", "the-headers-and-all-but-one-body-byte"])
async def test_a_slowloris_connection_gets_a_408_and_is_closed(kv: Served, partial: bytes) -> None:
    """nginx's client_header_timeout / client_body_timeout (RFC 9110 15.5.9: 408, then the close). aiohttp has
    neither (measured, keep-alive 0.5 s): half the headers are closed at its keep-alive timeout without an answer;
    the headers and all but one body byte were still open 5 s on."""
    wire = await Wire.open(kv.port)
    try:
        wire.send(partial)
        await health_served(kv.port)
        _error_of(await wire.answer(), 408)
        await wire.closed()
    finally:
        wire.close()
    await health_served(kv.port)


async def test_two_hundred_slowloris_connections_are_all_closed(kv: Served) -> None:
    """Many at once: each is closed by the header timeout, and what they held is let go (the server's own count
    of open connections and buffered request bytes, not a timing)."""
    assert kv.proxy is not None
    connections = kv.proxy.connections
    partial = b"POST /v1/completions HTTP/1.1\r\nhost: h\r\nx-slow: "
    wires = [await Wire.open(kv.port) for _ in range(200)]
    try:
        for wire in wires:
            wire.send(partial)
        await wait_until(lambda: connections.buffered_bytes() >= 200 * (len(partial) - 40), BOUND_S)
        assert len(connections.open) >= 200 and connections.buffered_bytes() <= 200 * len(partial)
        await health_served(kv.port)
        answers = await asyncio.gather(*(w.answer() for w in wires))
        for answer in answers:
            _error_of(answer, 408)
        await asyncio.gather(*(w.closed() for w in wires))
    finally:
        for wire in wires:
            wire.close()
    await wait_until(lambda: not connections.open, BOUND_S)
    assert connections.buffered_bytes() == 0
    await health_served(kv.port)


async def test_connections_past_max_connections_get_a_503() -> None:
    """``http.max_connections``: the next connection is answered 503 and closed (counted as a 503 request); a
    connection let go makes room again."""
    async with serving("kvrouter", **{"http.max_connections": 4, "http.header_read_timeout_s": BOUND_S * 3,
                                      "http.keepalive_timeout_s": BOUND_S * 3}) as s:
        assert s.proxy is not None
        held = [await Wire.open(s.port) for _ in range(4)]
        try:
            await wait_until(lambda: len(s.proxy.connections.open) == 4, BOUND_S)
            over = await Wire.open(s.port)
            over.send(HEALTH)
            _error_of(await over.answer(), 503)
            await over.closed()
            over.close()
            assert len(s.proxy.connections.open) == 4
            assert re.search(rb'kvrouter_requests_total\{status="503"\} 1\.0', s.proxy.metrics.exposition())
            held[0].send(HEALTH)  # the held ones are served
            assert (await held[0].answer()).status == 200
            held.pop(0).close()
            await wait_until(lambda: len(s.proxy.connections.open) == 3, BOUND_S)
            await health_served(s.port)
        finally:
            for wire in held:
                wire.close()


async def test_the_timeouts_do_not_run_while_a_stream_is_answered() -> None:
    """A stream lasting many times every timeout is not idle: it ends whole, and its connection then carries
    the next request."""
    async with serving("kvrouter", time_scale=2.0) as s:
        wire = await Wire.open(s.port)
        try:
            wire.send(post(json.dumps({"prompt": "a long stream", "max_tokens": 120, "stream": True}).encode()))
            answer = await wire.answer("POST")
            assert answer.status == 200 and answer.body.rstrip().endswith(b"data: [DONE]")
            assert answer.body.count(b"data: {") >= 100
            await check_kept(wire, answer)
        finally:
            wire.close()


async def test_a_client_leaving_mid_stream_cancels_the_workers_request_and_its_load() -> None:
    """The client closes mid-SSE: the proxy drops the worker's connection (the simulated worker aborts the request,
    its engine holds nothing), and the router's in-flight load for the worker returns to zero."""
    async with serving("kvrouter", time_scale=2.0) as s:
        assert s.proxy is not None and s.worker is not None
        engine, load = s.worker.worker.engine, s.proxy.core.load
        wire = await Wire.open(s.port)
        wire.send(post(json.dumps({"prompt": "a stream left", "max_tokens": 2000, "stream": True}).encode()))
        head = await asyncio.wait_for(wire.reader.readuntil(b"data: {"), BOUND_S)  # a token has come
        assert head.startswith(b"HTTP/1.1 200 ")
        assert load.workers["w0"].requests == 1 and engine.running
        wire.close()
        await wait_until(lambda: not engine.running and not engine.waiting and not s.worker.worker._queues, BOUND_S)
        await wait_until(lambda: load.workers["w0"].requests == 0, BOUND_S)
        assert engine.stats.finished == 0  # cancelled, not finished
        await health_served(s.port)
