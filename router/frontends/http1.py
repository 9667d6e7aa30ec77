"""HTTP/1.1 for the proxy's data path: a server protocol for clients and a kept-alive connection pool to workers.

Why not aiohttp here: a pass-through of a short completion through aiohttp's server and client cost 0.26 ms of
CPU a request on the 2-core benchmark box, against 0.065 ms for the same relay on asyncio protocols with
``httptools`` (llhttp, the parser Node.js uses, from uvloop's authors) doing the parsing; at concurrency 1 it
added 0.88 ms to a request against 0.23 (docs/benchmarks.md, "The proxy's HTTP in protocols"). aiohttp still
serves the admin port and the simulated workers, where that does not matter.

What this keeps of a production server: bounded input (header bytes and count, 431; a body over the limit, 413,
refused from its Content-Length before it is read), a malformed request a 400 and the connection closed, an
upgrade request (h2c, websocket) answered as plain HTTP/1.1 and the connection closed after it,
``Expect: 100-continue`` (the 100 sent only when that request is next to be answered, never inside an earlier
answer; any other expectation a 417), nginx's timeouts (a request's headers must arrive within
``header_timeout_s`` of its first byte, each read of its body within ``body_timeout_s`` of the one before: 408
and the connection closed; none runs while an answer is being written, since a long stream is not idle),
keep-alive with an idle timeout, a cap on the connections open at once (past it a 503 and the close), pipelined
requests answered in order (reading pauses past a few queued), write back-pressure (a streaming handler waits
for a slow client), a client that goes away cancelling its request (the proxy then drops the worker connection,
which cancels the work there), and HTTP/1.0 clients answered with the body delimited by the connection's close.

The pool: one kept-alive connection per request in flight to a worker, reused LIFO; a reused connection the
worker closed while idle (the race every keep-alive client has) is retried once on a new one, and only if
not a byte of its answer came back. An interim answer (1xx other than 101: a worker's own ``100 Continue``,
103 Early Hints) is skipped, never taken for the final one (RFC 9110 15.2). A response's body is read as it
arrives, reading paused when the reader lags; a deadline covers the whole exchange, as aiohttp's ``total``
timeout did.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any, NoReturn

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

from router.config import HttpServerSettings

log = logging.getLogger("kvrouter.http")

MAX_HEADER_BYTES = 64 * 1024  # request line and headers together
MAX_HEADERS = 128
MAX_PIPELINED = 8  # requests parsed ahead of the one being answered before reading pauses
_SETTINGS = HttpServerSettings()  # config.http's defaults (nginx's timeouts), the one place they are set
HEADER_TIMEOUT_S = _SETTINGS.header_read_timeout_s  # a request's line and headers, from its first byte: 408
BODY_TIMEOUT_S = _SETTINGS.body_read_timeout_s  # between two reads of a request's body: 408
KEEPALIVE_S = _SETTINGS.keepalive_timeout_s  # an idle client connection is closed after this
MAX_CONNECTIONS = _SETTINGS.max_connections  # client connections open at once, per listening server
LINGER_S = 2.0  # a refused request's connection is read and dropped this long before it is closed
UPSTREAM_HIGH_WATER = 256 * 1024  # a worker's answer buffered unread past this pauses reading it
MAX_IDLE_PER_WORKER = 256
_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}


class UpstreamError(Exception):
    """A worker could not be reached, broke the connection, or answered what is not HTTP."""


HeaderItems = dict[str, str] | list[tuple[str, str]]


def _head(status: int, headers: HeaderItems, extra: bytes) -> bytes:
    """Status line and headers (``headers``: pairs or a mapping of str) with ``extra`` header lines appended."""
    items = headers.items() if isinstance(headers, dict) else headers
    lines = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown"))]
    lines += [f"{k}: {v}\r\n".encode("latin-1", "replace") for k, v in items]
    lines.append(extra)
    lines.append(b"\r\n")
    return b"".join(lines)


class Response:
    """A whole answer, sent as one write (status line, headers, Content-Length and body)."""

    __slots__ = ("body", "headers", "status")

    def __init__(self, status: int = 200, body: bytes = b"", headers: HeaderItems | None = None) -> None:
        self.status, self.body, self.headers = status, body, headers or {}


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(status, json.dumps(data).encode(), {"content-type": "application/json", **(headers or {})})


class Request:
    """One parsed request: method, path (no query), query string, headers (case-insensitive), the whole body."""

    __slots__ = ("_conn", "body", "headers", "http11", "keep_alive", "method", "path", "query")

    def __init__(self, conn: HttpServerProtocol, method: str, path: str, query: str,
                 headers: CIMultiDictProxy[str], body: bytes, http11: bool, keep_alive: bool) -> None:
        self._conn = conn
        self.method, self.path, self.query, self.headers, self.body = method, path, query, headers, body
        self.http11, self.keep_alive = http11, keep_alive

    def stream(self, status: int, headers: HeaderItems) -> StreamWriter:
        """Start a streamed answer (chunked; close-delimited to an HTTP/1.0 client)."""
        return StreamWriter(self._conn, self, status, headers)

    def abort(self) -> None:
        """Close the connection after what was written is flushed: an answer cut short stays visibly cut."""
        self._conn.close()


class StreamWriter:
    __slots__ = ("_chunked", "_conn", "finished")

    def __init__(self, conn: HttpServerProtocol, request: Request, status: int, headers: HeaderItems) -> None:
        self._conn, self._chunked, self.finished = conn, request.http11, False
        conn.streaming = True
        if not request.http11:
            request.keep_alive = False
        framing = b"transfer-encoding: chunked\r\n" if self._chunked else b"connection: close\r\n"
        conn.write(_head(status, headers, framing))

    async def write(self, data: bytes) -> None:
        """Send ``data``, then wait while the client's socket buffer is full; ConnectionResetError once it is gone."""
        if not data:
            return
        self._conn.write(b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data)
        await self._conn.drain()

    async def write_eof(self) -> None:
        if self._chunked:
            self._conn.write(b"0\r\n\r\n")
        self.finished = True
        await self._conn.drain()


Handler = Callable[[Request], Awaitable["Response | None"]]


class Connections:
    """The client connections open on one listening server, against its ``limit``: past it a new connection is
    answered 503 and closed, so a flood of idle or slow connections (each may hold up to ``max_body_bytes`` of a
    request) is bounded. ``open`` and ``buffered_bytes`` are what the server holds now, for tests and operators."""

    __slots__ = ("limit", "open")

    def __init__(self, limit: int = MAX_CONNECTIONS) -> None:
        self.limit = limit
        self.open: set[HttpServerProtocol] = set()

    def buffered_bytes(self) -> int:
        """Request bytes held by all open connections: headers and bodies being read, requests queued."""
        return sum(conn.buffered_bytes for conn in self.open)


# what the connection is reading, for its timer: nothing (between requests), a request's headers, its body
_IDLE, _HEAD, _BODY = 0, 1, 2


class HttpServerProtocol(asyncio.Protocol):
    """One client connection. ``handler`` answers each request with a ``Response``, or streams it (``stream``)
    and returns None. Requests are answered one at a time, in order.

    Timeouts (nginx's ``client_header_timeout``, ``client_body_timeout``, ``keepalive_timeout``): a request's
    headers must be in ``header_timeout_s`` after its first byte, each read of its body must follow the one
    before within ``body_timeout_s`` (else 408, then the close: a slowloris client holds a connection and its
    buffered bytes only that long); a connection with no request begun is closed, without an answer, after
    ``keepalive_s`` (``header_timeout_s`` before its first request, as nginx waits for one). None of them runs
    while an answer is being written: a long stream is not idle, and the next request's clocks start when it
    ends. One timer per connection does it all, never re-armed per request: it fires at least every
    ``min(timeouts)`` and compares the clocks (a timestamp per read, set in ``data_received``)."""

    def __init__(self, handler: Handler, max_body_bytes: int, refused: Callable[[int], None] | None = None, *,
                 header_timeout_s: float = HEADER_TIMEOUT_S, body_timeout_s: float = BODY_TIMEOUT_S,
                 keepalive_s: float = KEEPALIVE_S, connections: Connections | None = None) -> None:
        self._handler, self._max_body, self._refused_hook = handler, max_body_bytes, refused
        self._header_timeout, self._body_timeout, self._keepalive = header_timeout_s, body_timeout_s, keepalive_s
        self._tick_s = max(0.01, min(header_timeout_s, body_timeout_s, keepalive_s))
        self._connections = connections
        self._loop = asyncio.get_running_loop()
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._queue: collections.deque[Request] = collections.deque()
        self._task: asyncio.Task[None] | None = None
        self._paused_reading = False
        self._drain: asyncio.Future[None] | None = None
        self._write_paused = False
        self._closed = False
        self._timer: asyncio.TimerHandle | None = None
        self._phase = _IDLE
        self._since = self._last_read = self._loop.time()  # the idle or header clock's start; the last read
        self._idle_timeout = header_timeout_s  # until the first answer: then keepalive_s
        self.streaming = False
        self._discarding = False  # refused: what else arrives is dropped until the close
        self._reset_message()

    def _reset_message(self) -> None:
        self._url = b""
        self._header_bytes = 0
        self._headers: CIMultiDict[str] = CIMultiDict()
        self._body: list[bytes] = []
        self._body_len = 0
        self._refused = False
        self._continue = False  # a 100 Continue is owed to this request, once it is next to be answered

    @property
    def buffered_bytes(self) -> int:
        """Request bytes this connection holds: the request being read, and those queued to be answered."""
        return self._header_bytes + self._body_len + sum(len(r.body) for r in self._queue)

    # ---- transport events ----------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's are not asyncio.Transport subclasses
        connections = self._connections
        if connections is not None:
            if len(connections.open) >= connections.limit:
                self._reject(503, f"over {connections.limit} connections open", "ServiceUnavailableError")
                return
            connections.open.add(self)
        self._timer = self._loop.call_at(self._since + self._tick_s, self._tick)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        if self._connections is not None:
            self._connections.open.discard(self)
        self._queue.clear()
        if self._timer is not None:
            self._timer.cancel()
        if self._task is not None and not self._task.done():
            self._task.cancel()  # the client went away: its request is abandoned (the worker's connection dropped)
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(ConnectionResetError("the client closed the connection"))

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None

    def data_received(self, data: bytes) -> None:
        if self._discarding:
            return
        self._last_read = self._loop.time()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # answered as plain HTTP/1.1 (no upgrade is served), then closed
            self._transport.pause_reading()  # type: ignore[union-attr]
            if self._queue:
                self._queue[-1].keep_alive = False
            elif self._task is None:
                self.close()
        except httptools.HttpParserError as e:
            if not self._refused:
                self._refuse(400, f"malformed HTTP request: {e}")

    def _tick(self) -> None:
        """The connection's timer: a timeout that has run out answers 408 (a request begun) or closes (none);
        otherwise it fires again at the deadline, or ``_tick_s`` from now, whichever comes first (a request can
        begin meanwhile, whose deadline is that close)."""
        self._timer = None
        if self._closed or self._discarding:
            return
        now = self._loop.time()
        if self._task is not None:
            deadline = now + self._tick_s  # answering: no timeout runs
        elif self._phase == _HEAD:
            deadline = self._since + self._header_timeout
        elif self._phase == _BODY:
            deadline = self._last_read + self._body_timeout
        else:
            deadline = self._since + self._idle_timeout
        if now < deadline:
            self._timer = self._loop.call_at(min(deadline, now + self._tick_s), self._tick)
        elif self._phase == _HEAD:
            self._reject(408, f"the request's headers did not arrive within {self._header_timeout:g} s",
                         "RequestTimeout")
        elif self._phase == _BODY:
            self._reject(408, f"no byte of the request's body in {self._body_timeout:g} s", "RequestTimeout")
        else:
            self.close()  # idle: nothing was asked, nothing to answer (nginx closes so too)

    # ---- parser callbacks ------------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._reset_message()
        self._phase, self._since = _HEAD, self._last_read  # the header clock starts at the request's first byte

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count_header_bytes(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_header_bytes(len(name) + len(value))
        if len(self._headers) >= MAX_HEADERS:
            self._refuse(431, f"more than {MAX_HEADERS} headers")
        self._headers.add(name.decode("latin-1"), value.decode("latin-1"))

    def _count_header_bytes(self, n: int) -> None:
        self._header_bytes += n
        if self._header_bytes > MAX_HEADER_BYTES:
            self._refuse(431, f"request line and headers over {MAX_HEADER_BYTES} bytes")

    def on_headers_complete(self) -> None:
        self._phase = _BODY
        length = self._headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self._max_body:
            self._refuse(413, f"request body over the {self._max_body}-byte limit", "RequestEntityTooLarge")
        expect = self._headers.get("expect")
        # RFC 9110 10.1.1: 100-continue is the one expectation; an HTTP/1.0 request's is ignored
        if expect is not None and self._parser.get_http_version() == "1.1":
            if expect.lower() != "100-continue":
                self._refuse(417, f"unsupported expectation {expect!r}: only 100-continue is",
                             "ExpectationFailed")
            self._continue = True
            self._send_continue()

    def _send_continue(self) -> None:
        """The 100 the request being read is owed, if it is next to be answered: written while an earlier answer
        is in progress it would land inside that answer, so it waits for ``_serve`` to finish them."""
        if self._continue and self._task is None and not self._closed and self._transport is not None:
            self._continue = False
            self._transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._continue = False  # the body is coming anyway: the 100 is moot (RFC 9110 10.1.1 lets it go)
        self._body_len += len(body)
        if self._body_len > self._max_body:
            self._refuse(413, f"request body over the {self._max_body}-byte limit", "RequestEntityTooLarge")
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._phase, self._continue = _IDLE, False
        try:
            url = httptools.parse_url(self._url)
        except httptools.HttpParserInvalidURLError:
            self._refuse(400, "malformed request target")
        if not url.path:
            self._refuse(400, "the request target has no path")
        parser = self._parser
        request = Request(self, parser.get_method().decode("latin-1"), url.path.decode("latin-1"),
                          (url.query or b"").decode("latin-1"), CIMultiDictProxy(self._headers),
                          b"".join(self._body), parser.get_http_version() == "1.1", parser.should_keep_alive())
        self._header_bytes = self._body_len = 0  # the request holds them now (counted in the queue)
        self._queue.append(request)
        if len(self._queue) > MAX_PIPELINED and not self._paused_reading and self._transport is not None:
            self._paused_reading = True
            self._transport.pause_reading()
        if self._task is None:
            self._task = self._loop.create_task(self._serve())

    def _refuse(self, status: int, message: str, kind: str = "BadRequestError") -> NoReturn:
        """``_reject`` from a parser callback: the parser stops there."""
        self._reject(status, message, kind)
        raise httptools.HttpParserCallbackError(message)

    def _reject(self, status: int, message: str, kind: str) -> None:
        """Answer ``status`` now and close: the rest of this connection's bytes cannot be trusted to frame. The
        close lingers: what the client is still sending (a refused body) is read and dropped for a moment, since
        closing on unread bytes resets the connection and the client could lose the answer."""
        self._refused = True
        if self._refused_hook is not None:
            self._refused_hook(status)
        transport = self._transport
        if not self._closed and transport is not None and self._task is None:
            body = json.dumps(error_body(status, message, kind)).encode()
            transport.write(_head(status, {"content-type": "application/json", "connection": "close"},
                                  b"content-length: %d\r\n" % len(body)) + body)
            self._discarding = True
            if transport.can_write_eof():
                transport.write_eof()
            self._loop.call_later(LINGER_S, self.close)
        else:
            self.close()

    # ---- answering ---------------------------------------------------------------------------------------
    async def _serve(self) -> None:
        while self._queue and not self._closed:
            request = self._queue.popleft()
            if self._paused_reading and len(self._queue) <= MAX_PIPELINED // 2 and self._transport is not None:
                self._paused_reading = False
                self._transport.resume_reading()
            self.streaming = False
            try:
                answer = await self._handler(request)
            except asyncio.CancelledError:
                return
            except ConnectionError:
                self.close()
                return
            except Exception:
                log.exception("%s %s failed", request.method, request.path)
                if not self.streaming:
                    answer = Response(500, json.dumps(error_body(500, "internal error", "InternalServerError"))
                                      .encode())
                else:
                    self.close()
                    return
            if answer is not None:
                self._answer(request, answer)
            if not request.keep_alive:
                self.close()
                return
            try:
                await self.drain()
            except ConnectionError:
                return
        self._task = None
        # the clocks start now: the idle one, and those of a request read meanwhile (a pipelining client's)
        self._since = self._last_read = self._loop.time()
        self._idle_timeout = self._keepalive
        self._send_continue()

    def _answer(self, request: Request, answer: Response) -> None:
        extra = b"content-length: %d\r\n" % len(answer.body)
        if not request.keep_alive:
            extra += b"connection: close\r\n"
        body = b"" if request.method == "HEAD" else answer.body
        self.write(_head(answer.status, answer.headers, extra) + body)

    def write(self, data: bytes) -> None:
        if self._closed or self._transport is None:
            raise ConnectionResetError("the client closed the connection")
        self._transport.write(data)

    async def drain(self) -> None:
        if self._closed:
            raise ConnectionResetError("the client closed the connection")
        if self._write_paused:
            if self._drain is None:
                self._drain = self._loop.create_future()
            await self._drain

    def close(self) -> None:
        if self._transport is not None and not self._closed:
            self._transport.close()
        self._closed = True


def error_body(status: int, message: str, kind: str) -> dict[str, Any]:
    """vLLM's OpenAI error shape."""
    return {"object": "error", "message": message, "type": kind, "param": None, "code": status}


async def serve(handler: Handler, host: str, port: int, max_body_bytes: int, reuse_port: bool = False,
                refused: Callable[[int], None] | None = None, settings: HttpServerSettings | None = None,
                connections: Connections | None = None) -> asyncio.Server:
    """Listen on ``host:port``; ``refused(status)`` is told of each request refused before the handler saw it
    (a timeout's 408 and an over-limit connection's 503 included). ``settings``: the timeouts and the connection
    limit (``config.http``; None: the defaults); ``connections``: the open connections' record to keep, for a
    caller that reads it (its limit is ``settings.max_connections`` where it is made here)."""
    settings = settings or _SETTINGS
    if connections is None:
        connections = Connections(settings.max_connections)
    loop = asyncio.get_running_loop()
    return await loop.create_server(
        lambda: HttpServerProtocol(handler, max_body_bytes, refused, header_timeout_s=settings.header_read_timeout_s,
                                   body_timeout_s=settings.body_read_timeout_s,
                                   keepalive_s=settings.keepalive_timeout_s, connections=connections),
        host, port, reuse_port=reuse_port or None)


# ---- the pool of connections to workers ----------------------------------------------------------------

class _UpstreamProtocol(asyncio.Protocol):
    """One kept-alive connection to a worker; ``response`` is the answer being read on it."""

    def __init__(self, pool: UpstreamPool, key: tuple[str, int, bool]) -> None:
        self.pool, self.key = pool, key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: UpstreamResponse | None = None
        self.closed = False
        self.interim = False  # the message being parsed is a 1xx interim answer, skipped

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's are not asyncio.Transport subclasses

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        if self.response is not None:
            self.response.lost(exc)

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:  # bytes nobody asked for: the connection cannot be trusted to frame
            self.abort()
            return
        response.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            response.fail(UpstreamError(f"malformed HTTP answer: {e}"))
            self.abort()

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.response is not None
        self.response.headers.add(name.decode("latin-1"), value.decode("latin-1"))

    def on_headers_complete(self) -> None:
        assert self.response is not None
        status = self.parser.get_status_code()
        if 100 <= status < 200 and status != 101:  # interim (RFC 9110 15.2): the final answer is still to come
            self.interim = True
            self.response.headers.clear()
            return
        self.response.headers_done(status)

    def on_body(self, body: bytes) -> None:
        assert self.response is not None
        self.response.chunk(body)

    def on_message_complete(self) -> None:
        assert self.response is not None
        if self.interim:  # llhttp ends a 1xx as a message of its own, with no body: the next one is the answer
            self.interim = False
            return
        self.response.complete(self.parser.should_keep_alive())

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class UpstreamResponse:
    """A worker's answer: ``status`` and ``headers`` once ``start`` returned; the body by ``chunks`` or ``read``.
    ``release`` hands a finished connection back to the pool (an unfinished one is closed); ``close`` drops it."""

    def __init__(self, conn: _UpstreamProtocol, deadline: float) -> None:
        self._conn = conn
        self._loop = asyncio.get_running_loop()
        self.status = 0
        self.headers: CIMultiDict[str] = CIMultiDict()
        self.content_length: int | None = None
        self.received = False
        self._head: asyncio.Future[None] = self._loop.create_future()
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._done = False
        self._keep_alive = False
        self._error: BaseException | None = None
        self._paused = False
        self._timer = self._loop.call_at(deadline, self._timed_out)

    # ---- from the protocol ----------------------------------------------------------------------------
    def headers_done(self, status: int) -> None:
        self.status = status
        length = self.headers.get("content-length")
        self.content_length = int(length) if length is not None and length.isdigit() else None
        if not self._head.done():
            self._head.set_result(None)

    def chunk(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > UPSTREAM_HIGH_WATER and not self._paused and self._conn.transport is not None:
            self._paused = True
            self._conn.transport.pause_reading()
        self._wake()

    def complete(self, keep_alive: bool) -> None:
        self._done, self._keep_alive = True, keep_alive
        self._timer.cancel()
        self._wake()

    def lost(self, exc: Exception | None) -> None:
        if self._done:
            return
        if self._head.done() and self.content_length is None and "chunked" not in \
                self.headers.get("transfer-encoding", "").lower():
            self.complete(False)  # a body delimited by the connection's close has ended
            return
        self.fail(UpstreamError(f"connection closed by the worker{f': {exc!r}' if exc else ''}"))

    def fail(self, error: BaseException) -> None:
        if self._done or self._error is not None:
            return
        self._error = error
        self._timer.cancel()
        if not self._head.done():
            self._head.set_exception(error)
            self._head.exception()  # retrieved: a caller gone before it would leave it unlogged otherwise
        self._wake()

    def _timed_out(self) -> None:
        self.fail(TimeoutError("the worker did not answer in time"))
        self._conn.abort()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # ---- for the reader ------------------------------------------------------------------------------
    async def start(self) -> None:
        await self._head

    async def chunks(self):  # type: ignore[no-untyped-def]
        """The body as it arrives (the chunked framing removed); UpstreamError or TimeoutError if it breaks off."""
        while True:
            if self._chunks:
                data = self._chunks.popleft()
                self._buffered -= len(data)
                if self._paused and self._buffered < UPSTREAM_HIGH_WATER // 2 and self._conn.transport is not None:
                    self._paused = False
                    self._conn.transport.resume_reading()
                yield data
                continue
            if self._error is not None:
                raise self._error
            if self._done:
                return
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def read(self) -> bytes:
        parts = [chunk async for chunk in self.chunks()]
        return b"".join(parts)

    def release(self) -> None:
        """The exchange is over: a fully read, kept-alive connection goes back to the pool, any other is closed."""
        conn = self._conn
        if conn.response is not self:
            return
        conn.response = None
        self._timer.cancel()
        if self._done and self._keep_alive and not conn.closed and not self._chunks:
            self._conn.pool.give_back(conn)
        else:
            conn.abort()

    def close(self) -> None:
        """Drop the connection (a worker whose client went away sees it close and cancels the request)."""
        self._conn.response = None
        self._timer.cancel()
        self._conn.abort()


class UpstreamPool:
    """Kept-alive connections to the workers, by (host, port)."""

    def __init__(self, connect_timeout_s: float = 2.0) -> None:
        self.connect_timeout_s = connect_timeout_s
        self._idle: dict[tuple[str, int, bool], list[_UpstreamProtocol]] = {}
        self._open: set[_UpstreamProtocol] = set()

    async def request(self, method: str, host: str, port: int, path: str, headers: HeaderItems, body: bytes,
                      timeout_s: float, tls: bool = False) -> UpstreamResponse:
        """Send one request; returns once the answer's status and headers are in. UpstreamError if the worker
        cannot be reached or breaks off before answering; TimeoutError past ``timeout_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        lines = [f"{method} {path} HTTP/1.1\r\nhost: {host}:{port}\r\n".encode("latin-1")]
        items = headers.items() if isinstance(headers, dict) else headers
        lines += [f"{k}: {v}\r\n".encode("latin-1", "replace") for k, v in items]
        lines.append(b"content-length: %d\r\n\r\n" % len(body))
        lines.append(body)
        data = b"".join(lines)
        key = (host, port, tls)
        conn = self._take(key)
        while True:
            reused = conn is not None
            if conn is None:
                conn = await self._connect(host, port, tls, deadline)
            response = UpstreamResponse(conn, deadline)
            conn.response = response
            assert conn.transport is not None
            conn.transport.write(data)
            try:
                await response.start()
                return response
            except UpstreamError:
                if not reused or response.received:
                    raise
                # the worker closed it while it sat idle: once more, on a new connection. Its idle siblings
                # are dropped too: a worker that restarted closed them all, and each would fail the same way
                for idle in self._idle.pop(key, []):
                    idle.abort()
                conn = None
            except BaseException:
                response.close()
                raise

    async def _connect(self, host: str, port: int, tls: bool, deadline: float) -> _UpstreamProtocol:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(min(self.connect_timeout_s, max(0.0, deadline - loop.time()))):
                _, conn = await loop.create_connection(lambda: _UpstreamProtocol(self, (host, port, tls)), host,
                                                       port, ssl=tls or None)
        except TimeoutError as e:
            raise UpstreamError(f"connecting to {host}:{port} timed out") from e
        except OSError as e:
            raise UpstreamError(f"cannot connect to {host}:{port}: {e}") from e
        self._open.add(conn)
        return conn

    def _take(self, key: tuple[str, int, bool]) -> _UpstreamProtocol | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn
        return None

    def give_back(self, conn: _UpstreamProtocol) -> None:
        idle = self._idle.setdefault(conn.key, [])
        if len(idle) >= MAX_IDLE_PER_WORKER:
            conn.abort()
            return
        idle.append(conn)

    def forget(self, conn: _UpstreamProtocol) -> None:
        self._open.discard(conn)
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    def close(self) -> None:
        for conn in list(self._open):
            conn.abort()
        self._idle.clear()
        self._open.clear()


__all__ = ["Connections", "Request", "Response", "StreamWriter", "UpstreamError", "UpstreamPool",
           "UpstreamResponse", "error_body", "json_response", "serve"]
