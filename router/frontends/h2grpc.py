"""gRPC's server side over HTTP/2 on asyncio protocols: the endpoint picker's port without grpcio's machinery.

Why: a pick is one ext_proc stream of three to six small messages each way, and grpc.aio spends about 0.9 ms of
CPU on such a stream in its own callbacks, completion-queue thread and message plumbing (docs/benchmarks.md),
more than the decision it carries. Here a connection is one ``asyncio.Protocol``: frames are cut from the bytes
as they arrive, messages go to the stream's handler as ``bytes`` for the servicer's own deserializer, and what
the handlers answer within one turn of the event loop leaves in one write.

What it implements (RFC 9113 and gRPC's HTTP/2 mapping, the server's part): the connection preface and SETTINGS,
HPACK through the ``hpack`` library (the peer's dynamic table, Huffman), flow control both ways, PING, RST_STREAM
both ways, GOAWAY for a graceful stop, gRPC's length-prefixed messages, trailers and trailers-only answers,
``grpc-timeout`` (the handler is cancelled and the stream ends DEADLINE_EXCEEDED when it passes; the handler sees
it as ``context.time_remaining()``), SETTINGS_MAX_CONCURRENT_STREAMS (streams past it refused). Handlers are
registered as grpcio's generated code registers them (``add_registered_method_handlers``,
``add_generic_rpc_handlers``), so servicers written for grpc.aio run unchanged: unary-unary and stream-unary
handlers, sync or async, and streaming-response ones that are async generators or coroutines sending with
``context.write`` (grpc_health's asyncio ``Watch``).

What one connection can make it hold, and where each bound comes from (issue 46 tried each as an attacker):

- received data: a stream's window (``RECV_WINDOW``) is credited back while its handler keeps up, and the
  connection's (``CONN_WINDOW``) as the handlers take messages or bytes are discarded, not as they arrive, so
  stalled handlers on any number of streams hold one connection window in all. (A message being assembled for a
  handler that waits on it is credited as it arrives: messages may be larger than the window.)
- data to send: a handler's send waits while its stream has more than ``STREAM_WRITE_QUOTA`` queued (grpc-go's
  write quota), so a peer that opens no window stops the handler, which stops taking messages, which stops the
  credit above. Trailers wait behind the data.
- control answers (PING and SETTINGS acks, RST_STREAM): while the socket is backed up, past
  ``MAX_QUEUED_CONTROL`` of them reading stops until it drains (grpc-go; CVE-2019-9512, CVE-2019-9515), and PINGs
  past grpc-core's ping strikes end the connection with ENHANCE_YOUR_CALM.
- streams: ``MAX_STREAMS`` open at once; a connection that opened ``PREMATURE_RESET_STREAMS`` and reset at
  least half of them before they were answered is closed with ENHANCE_YOUR_CALM (Envoy's premature-reset rule,
  CVE-2023-44487). Headers: ``MAX_HEADER_LIST`` bytes and ``MAX_CONTINUATIONS`` CONTINUATION frames a block
  (nghttp2's, CVE-2024-27316).
- connections: the preface and first SETTINGS within ``handshake_timeout_s`` (grpc-go), GOAWAY and close after
  ``idle_timeout_s`` without an open stream (Envoy's downstream idle timeout), at most ``max_connections`` open
  (past it a new one is closed at once): ``ConnectionLimits``, the ``epp.*`` settings.

Not implemented: TLS (the picker's port is plaintext, as grpc.aio's ``add_insecure_port`` was), message
compression (refused with UNIMPLEMENTED; gRPC clients compress only when told), synchronous streaming handlers
(UNIMPLEMENTED: they would block the loop; grpc_health's synchronous servicer's ``Watch`` is one), server-sent
keepalive PINGs, and a bound on a message being assembled beyond ``max_message_bytes`` per stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import struct
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import grpc
import hpack

log = logging.getLogger("kvrouter.h2grpc")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20
S_HEADER_TABLE_SIZE, S_ENABLE_PUSH, S_MAX_CONCURRENT_STREAMS, S_INITIAL_WINDOW_SIZE, S_MAX_FRAME_SIZE = 1, 2, 3, 4, 5
S_MAX_HEADER_LIST_SIZE = 6
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR, STREAM_CLOSED, FRAME_SIZE_ERROR = 0, 1, 2, 3, 5, 6
REFUSED_STREAM, CANCEL, COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 7, 8, 9, 11

RECV_WINDOW = 4 * 1024 * 1024  # what each stream may send ahead of its handler (grpc-core's BDP ceiling)
CONN_WINDOW = 16 * 1024 * 1024  # what the connection may send ahead of its handlers, all streams together
DEFAULT_WINDOW = 65535  # RFC 9113's initial window, until the peer's SETTINGS say otherwise
MAX_WINDOW = 2**31 - 1
DEFAULT_FRAME = 16384
MAX_HEADER_LIST = 64 * 1024  # decoded request headers per stream (grpc-core's default is 16 KiB)
KNOWN_BLOCKS = 64  # header blocks kept decoded per connection (decode_header_block), each of at most
KNOWN_BLOCK_BYTES = 1024  # bytes (Envoy's for a pick: about 100), so that a connection keeps at most 64 KiB
MAX_STREAMS = 1024  # open streams per connection: with RECV_WINDOW, what one connection can make us hold
STREAM_WRITE_QUOTA = 64 * 1024  # a stream's queued output past which its handler's send waits (grpc-go's
#                                 defaultWriteQuota)
MAX_QUEUED_CONTROL = 50  # control answers queued on a backed-up socket before reading stops (grpc-go's
#                          maxQueuedTransportResponseFrames)
MAX_PING_STRIKES = 2  # PINGs sooner than MIN_PING_INTERVAL_S after the last, with nothing sent between, past
MIN_PING_INTERVAL_S = 300.0  # which the connection gets GOAWAY ENHANCE_YOUR_CALM (grpc-core's
#                              max_ping_strikes and min_recv_ping_interval_without_data)
PREMATURE_RESET_STREAMS = 500  # streams opened before the premature-reset rule applies (Envoy's
#                                overload.premature_reset_total_stream_count)
MAX_CONTINUATIONS = 8  # CONTINUATION frames one header block may take (nghttp2's default max_continuations)
HANDSHAKE_TIMEOUT_S = 120.0  # the preface and first SETTINGS (grpc-go's connection timeout)
IDLE_TIMEOUT_S = 3600.0  # without an open stream (Envoy's downstream idle_timeout)
MAX_CONNECTIONS = 10000  # open at once (the picker's epp.max_connections)

_FRAME = struct.Struct(">IBI")  # length (24 bits) and type, flags, stream id (31 bits)
_PREFIX = struct.Struct(">BI")  # gRPC message: compressed flag, length
_SETTING = struct.Struct(">HI")
_U32 = struct.Struct(">I")

OK, CANCELLED, UNKNOWN, DEADLINE_EXCEEDED, INTERNAL, UNIMPLEMENTED, RESOURCE_EXHAUSTED = 0, 1, 2, 4, 13, 12, 8
_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}


@dataclass(frozen=True)
class ConnectionLimits:
    """How long a connection may take to start and stay idle, and how many may be open (the ``epp.*`` keys)."""

    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S
    idle_timeout_s: float = IDLE_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS


def grpc_timeout(value: str) -> float | None:
    """Seconds of a ``grpc-timeout`` header (gRPC's HTTP/2 mapping: 1 to 8 ASCII digits, then H, M, S, m, u or
    n); None for a malformed one, which grpc-core ignores too."""
    digits, unit = value[:-1], value[-1:]
    if 1 <= len(digits) <= 8 and digits.isascii() and digits.isdigit() and unit in _TIMEOUT_UNITS:
        return int(digits) * _TIMEOUT_UNITS[unit]
    return None


def _frame(ftype: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return _FRAME.pack(len(payload) << 8 | ftype, flags, stream_id) + payload


def _hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """RFC 7541 5.1: an integer with an N-bit prefix (``first``: the bits above the prefix)."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = bytearray([first | limit])
    value -= limit
    while value >= 128:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _literal(name: bytes, value: bytes) -> bytes:
    """A header field as a literal never added to a table (RFC 7541 6.2.2): our encoder keeps no state."""
    return b"\x00" + _hpack_int(len(name), 7) + name + _hpack_int(len(value), 7) + value


# ``:status: 200`` is static index 8; ``content-type`` static index 31, its value a literal
_RESPONSE_HEADERS = b"\x88" + b"\x0f\x10" + _hpack_int(16, 7) + b"application/grpc"


def _trailers(code: int, details: str | None) -> bytes:
    block = _literal(b"grpc-status", str(code).encode())
    if details:
        block += _literal(b"grpc-message", quote(details, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~").encode())
    return block


class _Abort(Exception):
    def __init__(self, code: int, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


def _code_number(code: Any) -> int:
    return code.value[0] if isinstance(code, grpc.StatusCode) else int(code)


class ServicerContext:
    """The part of ``grpc.aio.ServicerContext`` the servicers use: abort, codes, metadata, peer, and ``write``
    for a response-streaming handler written as a coroutine (grpc.aio's other style, grpc_health's ``Watch``)."""

    def __init__(self, stream: _Stream, serialize: Callable[[Any], bytes] | None = None) -> None:
        self._stream = stream
        self._serialize = serialize
        self.code: int | None = None
        self.details: str | None = None

    async def write(self, message: Any) -> None:
        """One response message out: queued, the connection sends it as the peer's window allows, and this
        waits while the stream has more than ``STREAM_WRITE_QUOTA`` queued (grpc.aio's write waits too)."""
        if self._serialize is None:
            raise RuntimeError("write() is for response-streaming handlers")
        await self._stream.conn.send(self._stream, self._serialize(message))

    async def abort(self, code: Any, details: str = "", trailing_metadata: Any = ()) -> None:
        raise _Abort(_code_number(code), details)

    def set_code(self, code: Any) -> None:
        self.code = _code_number(code)

    def set_details(self, details: str) -> None:
        self.details = details

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return tuple((k, v) for k, v in self._stream.headers if not k.startswith(":"))

    def peer(self) -> str:
        host, port = self._stream.conn.peername
        return f"ipv4:{host}:{port}"

    def time_remaining(self) -> float | None:
        """Seconds left of the client's ``grpc-timeout``; None without one."""
        deadline = self._stream.deadline
        return None if deadline is None else max(0.0, deadline - asyncio.get_running_loop().time())

    def cancelled(self) -> bool:
        return self._stream.reset

    def done(self) -> bool:
        return self._stream.closed_local


class _Inbox:
    """A stream's received messages, for the handler's ``async for`` (its request iterator)."""

    __slots__ = ("deserialize", "ended", "items", "stream", "waiter")

    def __init__(self, stream: _Stream, deserialize: Callable[[bytes], Any] | None) -> None:
        self.stream = stream
        self.deserialize = deserialize
        self.items: deque[bytes] = deque()
        self.ended = False
        self.waiter: asyncio.Future[None] | None = None

    def put(self, message: bytes) -> None:
        self.items.append(message)
        self._wake()

    def end(self) -> None:
        self.ended = True
        self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def __aiter__(self) -> _Inbox:
        return self

    async def __anext__(self) -> Any:
        while not self.items:
            if self.ended:
                raise StopAsyncIteration
            self.waiter = asyncio.get_running_loop().create_future()
            self.stream.conn.release(self.stream)  # a message being assembled now has a taker: credit it
            try:
                await self.waiter
            finally:
                self.waiter = None
        message = self.items.popleft()
        self.stream.consumed(len(message) + 5)
        if self.deserialize is None:
            return message
        try:
            return self.deserialize(message)
        except Exception as e:  # a message its own type cannot parse: grpc.aio answers INTERNAL too
            raise _Abort(INTERNAL, f"could not deserialize the request: {e}") from None

    async def single(self) -> Any:
        """A unary method's one message: exactly one before the client's end of stream."""
        first = await self.__anext__()
        try:
            await self.__anext__()
        except StopAsyncIteration:
            return first
        raise _Abort(UNIMPLEMENTED, "a unary method was sent more than one message")


class _Stream:
    __slots__ = ("closed_local", "closed_remote", "conn", "deadline", "headers", "headers_sent", "held", "id",
                 "inbox", "out_bytes", "outq", "partial", "peer_ended", "queued", "reset", "send_window", "task",
                 "timer", "trailers", "unacked", "writable")

    def __init__(self, conn: H2Connection, stream_id: int, headers: list[tuple[str, str]]) -> None:
        self.conn = conn
        self.id = stream_id
        self.headers = headers
        self.inbox: _Inbox | None = None
        self.partial = bytearray()  # received bytes of a message not yet whole
        self.queued = 0  # bytes of whole messages the handler has not taken yet
        self.unacked = 0  # received bytes not yet credited back to the peer's stream window
        self.held = 0  # received bytes not yet credited back to the connection's window (H2Connection.release)
        self.send_window = conn.peer_initial_window
        self.outq: deque[bytes] = deque()  # DATA payloads waiting for the peer's window
        self.out_bytes = 0  # their bytes
        self.writable: asyncio.Future[None] | None = None  # the handler's send, waiting for out_bytes to fall
        self.deadline: float | None = None  # the loop's time at which the client's grpc-timeout passes
        self.timer: asyncio.TimerHandle | None = None  # ... and its call
        self.trailers: bytes | None = None  # sent once outq is empty
        self.headers_sent = False
        self.closed_local = self.closed_remote = self.reset = False
        # the client's END_STREAM came (closed_remote is also set when we reset its sending side after answering,
        # and frames after our RST_STREAM are ignored, RFC 9113 5.1; after its own END_STREAM they are an error)
        self.peer_ended = False
        self.task: asyncio.Task[None] | None = None

    def consumed(self, nbytes: int) -> None:
        self.queued -= nbytes
        self.conn.credit(self)
        self.conn.release(self)


Handler = Any  # grpc.RpcMethodHandler: its flags, (de)serializers and one of its four behaviours


class H2Connection(asyncio.Protocol):
    """One client connection (Envoy multiplexes every pick onto a few)."""

    def __init__(self, server: GrpcServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.peername: tuple[str, int] = ("", 0)
        self.buf = bytearray()
        self.preface_seen = False
        self.settings_seen = False  # the client's first SETTINGS: the handshake is done
        self.decoder = hpack.Decoder(max_header_list_size=MAX_HEADER_LIST)
        self.known_blocks: dict[bytes, list[tuple[str, str]]] = {}  # decode_header_block's answers
        self.streams: dict[int, _Stream] = {}
        self.last_stream = 0
        self.peer_initial_window = DEFAULT_WINDOW
        self.peer_max_frame = DEFAULT_FRAME
        self.send_window = DEFAULT_WINDOW
        self.conn_unacked = 0  # bytes released (consumed or discarded) not yet credited back to the peer
        self.conn_held = 0  # bytes received and held by streams (the sum of their ``held``)
        self.blocked: set[_Stream] = set()  # streams with data waiting for a window
        # (stream, flags, block, CONTINUATION frames so far) of a header block split over frames
        self.continuing: tuple[int, int, bytearray, int] | None = None
        self.out: list[bytes] = []
        self.flush_scheduled = False
        self.write_paused = False
        self.read_paused = False  # by us: too many control answers queued on a backed-up socket
        self.control_queued = 0  # control answers written while the socket is backed up
        self.ping_strikes = 0
        self.last_ping = -MIN_PING_INTERVAL_S  # the loop's time of the last PING, after the last thing we sent
        self.opened = self.premature_resets = 0  # streams, and those the client reset before any answer
        self.idle_since: float | None = None  # the loop's time the last stream closed; None while one is open
        self.timer: asyncio.TimerHandle | None = None  # the handshake's, then the idle timeout's
        self.draining = False
        self.closed = False

    # ---- the transport --------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.peername = (str(peer[0]), int(peer[1])) if isinstance(peer, tuple) else ("", 0)
        limits = self.server.limits
        if len(self.server.connections) >= limits.max_connections:
            self.closed = True
            transport.close()  # before any byte: the client's connect fails, and it backs off as for a refusal
            return
        self.server.connections.add(self)
        loop = asyncio.get_running_loop()
        self.idle_since = loop.time()
        self.timer = loop.call_later(limits.handshake_timeout_s, self._handshake_expired)
        settings = b"".join(_SETTING.pack(k, v) for k, v in (
            (S_MAX_CONCURRENT_STREAMS, MAX_STREAMS), (S_INITIAL_WINDOW_SIZE, RECV_WINDOW),
            (S_MAX_FRAME_SIZE, DEFAULT_FRAME), (S_MAX_HEADER_LIST_SIZE, MAX_HEADER_LIST)))
        self.out.append(_frame(SETTINGS, 0, 0, settings))
        self.out.append(_frame(WINDOW_UPDATE, 0, 0, _U32.pack(CONN_WINDOW - DEFAULT_WINDOW)))
        self.flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
        self.server.connections.discard(self)
        for stream in list(self.streams.values()):
            if stream.timer is not None:
                stream.timer.cancel()
            self._cancel(stream)
        self.streams.clear()
        self.server.stream_ended()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self.control_queued = 0
        for stream in list(self.blocked):
            self._pump(stream)
        self.flush()
        if self.read_paused and not self.closed and self.transport is not None:
            self.read_paused = False
            self.transport.resume_reading()
            self._frames_in()  # what was left unread when reading stopped

    def write(self, data: bytes) -> None:
        self.out.append(data)
        if not self.flush_scheduled:
            self.flush_scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def _control(self, frame: bytes) -> None:
        """An answer the peer's own frames ask for. While the socket is backed up they count, and past
        ``MAX_QUEUED_CONTROL`` reading stops until it drains: a peer that sends and never reads gets no more
        answered than that (grpc-go throttles its reader the same way; CVE-2019-9512, CVE-2019-9515)."""
        self.out.append(frame)
        if len(self.out) > MAX_QUEUED_CONTROL:
            self.flush()  # (so that the transport says it is backed up before a whole read is answered)
        if self.write_paused:
            self.control_queued += 1
            if self.control_queued > MAX_QUEUED_CONTROL and not self.read_paused and self.transport is not None:
                self.read_paused = True
                self.transport.pause_reading()

    def flush(self) -> None:
        self.flush_scheduled = False
        if self.out and self.transport is not None and not self.closed:
            data = b"".join(self.out) if len(self.out) > 1 else self.out[0]
            self.out.clear()
            self.transport.write(data)

    def _hang_up(self) -> None:
        """Close once what was written is sent; a peer that has left it unread is not waited for."""
        self.closed = True
        if self.transport is not None:
            if self.transport.get_write_buffer_size():
                self.transport.abort()
            else:
                self.transport.close()

    def _connection_error(self, code: int, why: str) -> None:
        log.warning("HTTP/2 connection from %s:%s closed: %s", *self.peername, why)
        self.out.append(_frame(GOAWAY, 0, 0, _U32.pack(self.last_stream) + _U32.pack(code) + why.encode()[:200]))
        self.flush()
        self._hang_up()

    def _handshake_expired(self) -> None:
        if not self.settings_seen and not self.closed:
            log.info("HTTP/2 connection from %s:%s closed: no preface and SETTINGS in %ss", *self.peername,
                     self.server.limits.handshake_timeout_s)
            self._hang_up()  # as grpc-go: no GOAWAY for a peer that has not spoken HTTP/2

    def _idle_check(self) -> None:
        """Envoy's idle timeout: a connection without an open stream for ``idle_timeout_s`` gets GOAWAY
        NO_ERROR and is closed. One timer a connection, moved on (not re-armed per stream)."""
        if self.closed:
            return
        loop = asyncio.get_running_loop()
        timeout = self.server.limits.idle_timeout_s
        since = self.idle_since
        if since is None or self.streams:
            self.timer = loop.call_later(timeout, self._idle_check)
        elif loop.time() - since >= timeout:
            log.info("HTTP/2 connection from %s:%s idle for %ss: GOAWAY", *self.peername, timeout)
            self.goaway()  # (no stream is open: it closes at once)
        else:
            self.timer = loop.call_at(since + timeout, self._idle_check)

    # ---- frames in --------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        self.buf += data
        self._frames_in()

    def _frames_in(self) -> None:
        buf = self.buf
        pos = 0
        if not self.preface_seen:
            if len(buf) < len(PREFACE):
                if not PREFACE.startswith(bytes(buf)):
                    self._connection_error(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                return
            if buf[: len(PREFACE)] != PREFACE:
                self._connection_error(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                return
            self.preface_seen = True
            pos = len(PREFACE)
        end = len(buf)
        while end - pos >= 9 and not self.closed and not self.read_paused:
            lt, flags, sid = _FRAME.unpack_from(buf, pos)
            length, ftype = lt >> 8, lt & 0xFF
            if length > DEFAULT_FRAME:
                self._connection_error(FRAME_SIZE_ERROR, f"a {length}-byte frame (SETTINGS_MAX_FRAME_SIZE 16384)")
                return
            if end - pos - 9 < length:
                break
            payload = bytes(buf[pos + 9 : pos + 9 + length])
            pos += 9 + length
            self._frame_in(ftype, flags, sid & 0x7FFFFFFF, payload)
        del buf[:pos]
        self.flush()

    def _frame_in(self, ftype: int, flags: int, sid: int, payload: bytes) -> None:
        if self.continuing is not None and ftype != CONTINUATION:
            self._connection_error(PROTOCOL_ERROR, "a header block interrupted")
            return
        if not self.settings_seen:  # RFC 9113 3.4: the preface is followed by SETTINGS
            if ftype != SETTINGS or flags & ACK:
                self._connection_error(PROTOCOL_ERROR, "the preface is not followed by SETTINGS")
                return
            self.settings_seen = True
            if self.timer is not None:
                self.timer.cancel()
            self.timer = asyncio.get_running_loop().call_later(self.server.limits.idle_timeout_s, self._idle_check)
        if ftype == DATA:
            self._data(flags, sid, payload)
        elif ftype == HEADERS:
            self._headers(flags, sid, payload)
        elif ftype == CONTINUATION:
            self._continuation(flags, sid, payload)
        elif ftype == SETTINGS:
            self._settings(flags, sid, payload)
        elif ftype == WINDOW_UPDATE:
            self._window_update(sid, payload)
        elif ftype == PING:
            self._ping(flags, sid, payload)
        elif ftype == RST_STREAM:
            stream = self.streams.get(sid)
            if stream is not None:
                stream.reset = True
                self._cancel(stream)
                self._forget(stream)
                if not stream.headers_sent:
                    self._premature_reset()
        elif ftype == GOAWAY:
            self.draining = True  # the peer opens no more streams here; ours finish
            self._close_if_idle()
        elif ftype == PUSH_PROMISE:
            self._connection_error(PROTOCOL_ERROR, "PUSH_PROMISE from a client")
        # PRIORITY and unknown frame types are ignored (RFC 9113 5.5)

    def _ping(self, flags: int, sid: int, payload: bytes) -> None:
        """Answered, unless they come faster than grpc-core allows: more than ``MAX_PING_STRIKES`` sooner than
        ``MIN_PING_INTERVAL_S`` after the last with nothing sent between (DATA and trailers clear the strikes)."""
        if len(payload) != 8 or sid != 0:
            self._connection_error(PROTOCOL_ERROR if sid else FRAME_SIZE_ERROR, "malformed PING")
            return
        if flags & ACK:
            return
        now = asyncio.get_running_loop().time()
        if now - self.last_ping < MIN_PING_INTERVAL_S:
            self.ping_strikes += 1
            if self.ping_strikes > MAX_PING_STRIKES:
                self._connection_error(ENHANCE_YOUR_CALM, "too_many_pings")  # grpc-core's debug data
                return
        self.last_ping = now
        self._control(_frame(PING, ACK, 0, payload))

    def _sent_something(self) -> None:
        """grpc-core's: a peer that has been sent DATA or trailers may ping again (the strikes start over)."""
        self.ping_strikes = 0
        self.last_ping = -MIN_PING_INTERVAL_S

    def _premature_reset(self) -> None:
        """Envoy's rule against rapid reset (CVE-2023-44487): once ``PREMATURE_RESET_STREAMS`` streams were
        opened, a connection that reset at least half of them before any answer is closed."""
        self.premature_resets += 1
        if self.opened >= PREMATURE_RESET_STREAMS and self.premature_resets * 2 >= self.opened:
            self._connection_error(ENHANCE_YOUR_CALM, "too_many_premature_resets")

    def _padded(self, payload: bytes, start: int) -> bytes | None:
        """What a PADDED frame carries after ``start`` (its pad length byte and any priority fields), or None
        (and a connection error, RFC 9113 6.1 and 6.2) when the padding leaves no room for it."""
        if not payload or payload[0] > len(payload) - start:
            self._connection_error(PROTOCOL_ERROR, "padding as long as the frame")
            return None
        return payload[start : len(payload) - payload[0]]

    def _headers(self, flags: int, sid: int, payload: bytes) -> None:
        if sid == 0:
            self._connection_error(PROTOCOL_ERROR, "HEADERS on stream 0")
            return
        start = 5 if flags & PRIORITY_FLAG else 0
        if flags & PADDED:
            block = self._padded(payload, start + 1)
            if block is None:
                return
        else:
            block = payload[start:]
        if flags & END_HEADERS:
            self._header_block(flags, sid, block)
        else:
            self.continuing = (sid, flags, bytearray(block), 0)

    def _continuation(self, flags: int, sid: int, payload: bytes) -> None:
        if self.continuing is None or self.continuing[0] != sid:
            self._connection_error(PROTOCOL_ERROR, "CONTINUATION without HEADERS")
            return
        _, first_flags, block, count = self.continuing
        block += payload
        if len(block) > MAX_HEADER_LIST:
            self._connection_error(ENHANCE_YOUR_CALM, "header block over the limit")
        elif flags & END_HEADERS:
            self.continuing = None
            self._header_block(first_flags, sid, bytes(block))
        elif count + 1 >= MAX_CONTINUATIONS:  # (empty ones add nothing to the block: CVE-2024-27316)
            self._connection_error(ENHANCE_YOUR_CALM, f"over {MAX_CONTINUATIONS} CONTINUATION frames a block")
        else:
            self.continuing = (sid, first_flags, block, count + 1)

    def decode_header_block(self, block: bytes) -> list[tuple[str, str]]:
        """The block's fields. A gateway sends every pick's stream the same block (its fields indexed, its
        ``:path`` a literal kept out of the table), and hpack decodes in Python: a block that left the
        dynamic table as it found it (its entries and its size, which a block may change at its start,
        RFC 7541 4.2) is kept, and answered again while the table stays as it is (any block that changes
        the table forgets them all)."""
        known = self.known_blocks.get(block)
        if known is not None:
            return known
        table = self.decoder.header_table
        before = (table.maxsize, tuple(table.dynamic_entries))
        fields = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in self.decoder.decode(block, raw=True)]
        if (table.maxsize, tuple(table.dynamic_entries)) != before:
            self.known_blocks.clear()
        elif len(self.known_blocks) < KNOWN_BLOCKS and len(block) <= KNOWN_BLOCK_BYTES:
            self.known_blocks[block] = fields
        return fields

    def _header_block(self, flags: int, sid: int, block: bytes) -> None:
        try:
            fields = self.decode_header_block(block)
        except hpack.HPACKError as e:  # the table is now out of step with the peer's: the connection is lost
            self._connection_error(COMPRESSION_ERROR, f"header block: {e}")
            return
        stream = self.streams.get(sid)
        if stream is not None:  # the request's trailers
            if stream.peer_ended:  # after its END_STREAM: RFC 9113 5.1, a stream error
                self._reset_stream(stream, STREAM_CLOSED)
            elif flags & END_STREAM:
                self._remote_end(stream)
            return
        if sid <= self.last_stream or sid % 2 == 0:
            if sid % 2 == 0:
                self._connection_error(PROTOCOL_ERROR, f"a client stream with an even id {sid}")
            return  # a stream we closed: its late frames are ignored
        self.last_stream = sid
        if self.draining or self.server.stopping or len(self.streams) >= MAX_STREAMS:
            self._control(_frame(RST_STREAM, 0, sid, _U32.pack(REFUSED_STREAM)))  # the client retries
            return
        stream = self.streams[sid] = _Stream(self, sid, fields)
        self.opened += 1
        self.idle_since = None
        headers = dict(fields)
        handler = self.server.handler_for(headers.get(":path", ""), stream)
        if headers.get(":method") != "POST" or not headers.get("content-type", "").startswith("application/grpc"):
            self._finish(stream, INTERNAL, "gRPC requires POST with content-type application/grpc")
        elif handler is None:
            self._finish(stream, UNIMPLEMENTED, f"unknown method {headers.get(':path', '')[:200]}")
        else:
            loop = asyncio.get_running_loop()
            timeout = headers.get("grpc-timeout")
            seconds = None if timeout is None else grpc_timeout(timeout)
            if seconds is not None:
                stream.deadline = loop.time() + seconds
                stream.timer = loop.call_at(stream.deadline, self._deadline_passed, stream)
            stream.inbox = _Inbox(stream, handler.request_deserializer)
            stream.task = loop.create_task(self._run(stream, handler))
        if flags & END_STREAM:
            self._remote_end(stream)

    def _deadline_passed(self, stream: _Stream) -> None:
        stream.timer = None
        if stream.id in self.streams:
            self._finish(stream, DEADLINE_EXCEEDED, "Deadline Exceeded")  # (and its handler is cancelled)

    def _data(self, flags: int, sid: int, payload: bytes) -> None:
        size = len(payload)  # what counts against the windows, padding included
        if flags & PADDED:
            data = self._padded(payload, 1)
            if data is None:
                return
        else:
            data = payload
        stream = self.streams.get(sid)
        if stream is not None and stream.peer_ended:  # half-closed (remote): RFC 9113 5.1, a stream error
            self._conn_credit(size)
            self._reset_stream(stream, STREAM_CLOSED)
            return
        if stream is None or stream.closed_remote:
            if sid == 0 or sid > self.last_stream:
                self._connection_error(PROTOCOL_ERROR, f"DATA on idle stream {sid}")
                return
            self._conn_credit(size)  # on a stream already closed: dropped
            return
        stream.unacked += size
        if stream.inbox is None or stream.trailers is not None:
            self._conn_credit(size)  # answered already: nobody takes it
        else:
            self._conn_credit(size - len(data))  # the padding
            stream.held += len(data)
            self.conn_held += len(data)
            part = stream.partial
            part += data
            max_message = self.server.max_message_bytes
            while len(part) >= 5:
                compressed, length = _PREFIX.unpack_from(part, 0)
                if compressed:
                    self._finish(stream, UNIMPLEMENTED, "compressed messages are not supported")
                    return
                if length > max_message:
                    self._finish(stream, RESOURCE_EXHAUSTED,
                                 f"a {length}-byte message (the limit is {max_message})")
                    return
                if len(part) < 5 + length:
                    break
                message = bytes(part[5 : 5 + length])
                del part[: 5 + length]
                stream.queued += 5 + length
                stream.inbox.put(message)
            self.release(stream)
        self.credit(stream)
        if flags & END_STREAM:
            self._remote_end(stream)

    def credit(self, stream: _Stream) -> None:
        """Give the peer back the stream window of what it sent, while the handler keeps up with it: a stream
        whose handler stalls gets no more than a window ahead."""
        if (stream.unacked >= RECV_WINDOW // 4 and stream.queued <= RECV_WINDOW // 2 and not stream.closed_remote
                and stream.id in self.streams):
            self.write(_frame(WINDOW_UPDATE, 0, stream.id, _U32.pack(stream.unacked)))
            stream.unacked = 0

    def release(self, stream: _Stream) -> None:
        """Give the connection's window back for what the stream no longer needs to hold: it keeps the whole
        messages its handler has not taken, and a message being assembled unless its handler waits for it (a
        message may be larger than the window). So handlers that stall, on any number of streams, hold at
        most one connection window in all."""
        inbox = stream.inbox
        keep = stream.queued + (0 if inbox is not None and inbox.waiter is not None else len(stream.partial))
        excess = stream.held - keep
        if excess > 0:
            stream.held -= excess
            self.conn_held -= excess
            self._conn_credit(excess)

    def _conn_credit(self, nbytes: int) -> None:
        """Bytes consumed or discarded: credited to the connection's window in batches, sooner while streams
        hold much of it (so that what is left open never waits on a batch)."""
        self.conn_unacked += nbytes
        if self.conn_unacked >= max(DEFAULT_FRAME, (CONN_WINDOW - self.conn_held) // 2):
            self.write(_frame(WINDOW_UPDATE, 0, 0, _U32.pack(self.conn_unacked)))
            self.conn_unacked = 0

    def _remote_end(self, stream: _Stream) -> None:
        stream.closed_remote = stream.peer_ended = True
        if stream.inbox is not None:
            if stream.partial:
                self._finish(stream, INTERNAL, "the stream ended inside a message")
                return
            stream.inbox.end()
        self._maybe_close(stream)

    def _settings(self, flags: int, sid: int, payload: bytes) -> None:
        if sid != 0 or len(payload) % 6:
            self._connection_error(PROTOCOL_ERROR if sid else FRAME_SIZE_ERROR, "malformed SETTINGS")
            return
        if flags & ACK:
            if payload:  # RFC 9113 6.5
                self._connection_error(FRAME_SIZE_ERROR, "a SETTINGS ACK with a payload")
            return
        for off in range(0, len(payload), 6):
            key, value = _SETTING.unpack_from(payload, off)
            if key == S_ENABLE_PUSH and value > 1:  # RFC 9113 6.5.2
                self._connection_error(PROTOCOL_ERROR, "SETTINGS_ENABLE_PUSH other than 0 or 1")
                return
            if key == S_INITIAL_WINDOW_SIZE:
                delta = value - self.peer_initial_window
                if value > MAX_WINDOW or any(s.send_window + delta > MAX_WINDOW for s in self.streams.values()):
                    # RFC 9113 6.5.2 and 6.9.2: a connection error either way
                    self._connection_error(FLOW_CONTROL_ERROR, "SETTINGS_INITIAL_WINDOW_SIZE overflows a window")
                    return
                self.peer_initial_window = value
                for stream in self.streams.values():
                    stream.send_window += delta
            elif key == S_MAX_FRAME_SIZE:
                if not DEFAULT_FRAME <= value <= 2**24 - 1:
                    self._connection_error(PROTOCOL_ERROR, "SETTINGS_MAX_FRAME_SIZE out of range")
                    return
                self.peer_max_frame = value
        self._control(_frame(SETTINGS, ACK, 0))
        for stream in list(self.blocked):
            self._pump(stream)

    def _window_update(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            self._connection_error(FRAME_SIZE_ERROR, "malformed WINDOW_UPDATE")
            return
        inc = _U32.unpack(payload)[0] & 0x7FFFFFFF
        if sid == 0:
            if inc == 0 or self.send_window + inc > MAX_WINDOW:
                self._connection_error(PROTOCOL_ERROR if inc == 0 else FLOW_CONTROL_ERROR, "bad WINDOW_UPDATE")
                return
            self.send_window += inc
            for stream in list(self.blocked):
                self._pump(stream)
            return
        stream = self.streams.get(sid)
        if stream is None:
            if sid > self.last_stream:  # RFC 9113 5.1: only HEADERS and PRIORITY on an idle stream
                self._connection_error(PROTOCOL_ERROR, f"WINDOW_UPDATE on idle stream {sid}")
            return
        if inc == 0:  # RFC 9113 6.9 and 6.9.1: stream errors
            self._reset_stream(stream, PROTOCOL_ERROR)
        elif stream.send_window + inc > MAX_WINDOW:
            self._reset_stream(stream, FLOW_CONTROL_ERROR)
        else:
            stream.send_window += inc
            self._pump(stream)

    # ---- the handler --------------------------------------------------------------------------------
    async def _run(self, stream: _Stream, handler: Handler) -> None:
        inbox = stream.inbox
        assert inbox is not None
        serialize = handler.response_serializer or (lambda m: m)
        ctx = ServicerContext(stream, serialize if handler.response_streaming else None)
        code, details = OK, None
        try:
            if handler.response_streaming:
                method = handler.stream_stream if handler.request_streaming else handler.unary_stream
                if not (inspect.isasyncgenfunction(method) or inspect.iscoroutinefunction(method)):
                    # (a synchronous one would block the loop)
                    raise _Abort(UNIMPLEMENTED, "a synchronous streaming handler (this server runs async ones)")
                request = inbox if handler.request_streaming else await inbox.single()
                if inspect.iscoroutinefunction(method):  # it sends with ``context.write``
                    await method(request, ctx)
                else:
                    async for reply in method(request, ctx):
                        await self.send(stream, serialize(reply))
            else:
                reply = (handler.stream_unary(inbox, ctx) if handler.request_streaming
                         else handler.unary_unary(await inbox.single(), ctx))
                if inspect.isawaitable(reply):
                    reply = await reply
                if ctx.code in (None, OK) and reply is not None:
                    self.send_message(stream, serialize(reply))
            code, details = ctx.code or OK, ctx.details
        except _Abort as e:
            code, details = e.code, e.details
        except asyncio.CancelledError:
            if stream.reset or self.closed or stream.trailers is not None:
                return  # the peer cancelled it, the connection is gone, or it was answered (a limit, a deadline)
            raise
        except Exception:
            log.exception("gRPC handler for %s failed", dict(stream.headers).get(":path"))
            code, details = UNKNOWN, "Unexpected error in the handler"
        self._finish(stream, code, details)

    async def send(self, stream: _Stream, message: bytes) -> None:
        """A streaming handler's message out; waits while the stream has over ``STREAM_WRITE_QUOTA`` queued,
        so a peer that opens no window stops the handler (and with it the credit for what it sends)."""
        self.send_message(stream, message)
        while stream.out_bytes > STREAM_WRITE_QUOTA and stream.id in self.streams and not self.closed:
            stream.writable = asyncio.get_running_loop().create_future()
            try:
                await stream.writable
            finally:
                stream.writable = None

    def send_message(self, stream: _Stream, message: bytes) -> None:
        """One gRPC message out (the response headers first, once)."""
        if stream.closed_local or self.closed:
            return
        if not stream.headers_sent:
            stream.headers_sent = True
            self.write(_frame(HEADERS, END_HEADERS, stream.id, _RESPONSE_HEADERS))
        stream.outq.append(_PREFIX.pack(0, len(message)) + message)
        stream.out_bytes += 5 + len(message)
        self._pump(stream)

    def _finish(self, stream: _Stream, code: int, details: str | None) -> None:
        """The stream's status: trailers after its data (or headers and status at once: trailers-only)."""
        if stream.closed_local or stream.trailers is not None:
            return
        if not stream.headers_sent:
            stream.headers_sent = True
            stream.trailers = _RESPONSE_HEADERS + _trailers(code, details)
        else:
            stream.trailers = _trailers(code, details)
        if stream.task is not None and code != OK and stream.task is not asyncio.current_task():
            self._cancel(stream)  # refused by the connection (a limit, a deadline, a malformed message)
        self._pump(stream)

    def _pump(self, stream: _Stream) -> None:
        """Send what the windows allow of the stream's queued data, then its trailers."""
        q = stream.outq
        while q and not self.write_paused:
            allowed = min(stream.send_window, self.send_window, self.peer_max_frame)
            if allowed <= 0:
                break
            chunk = q[0]
            if len(chunk) > allowed:
                q[0] = chunk[allowed:]
                chunk = chunk[:allowed]
            else:
                q.popleft()
            stream.send_window -= len(chunk)
            self.send_window -= len(chunk)
            stream.out_bytes -= len(chunk)
            self._sent_something()
            self.write(_frame(DATA, 0, stream.id, chunk))
        writable = stream.writable
        if writable is not None and stream.out_bytes <= STREAM_WRITE_QUOTA and not writable.done():
            writable.set_result(None)
        if q:
            self.blocked.add(stream)
            return
        self.blocked.discard(stream)
        if stream.trailers is not None and not stream.closed_local:
            stream.closed_local = True
            self._sent_something()
            self.write(_frame(HEADERS, END_HEADERS | END_STREAM, stream.id, stream.trailers))
            if not stream.closed_remote:  # answered before the client finished sending: it may stop
                self.write(_frame(RST_STREAM, 0, stream.id, _U32.pack(NO_ERROR)))
                stream.closed_remote = True
            self._maybe_close(stream)

    def _maybe_close(self, stream: _Stream) -> None:
        if stream.closed_local and stream.closed_remote:
            self._forget(stream)
            self._close_if_idle()

    def _reset_stream(self, stream: _Stream, code: int) -> None:
        """A stream error (RFC 9113 5.4.2): RST_STREAM, and the stream is gone."""
        self._control(_frame(RST_STREAM, 0, stream.id, _U32.pack(code)))
        stream.reset = stream.closed_local = stream.closed_remote = True
        self._cancel(stream)
        self._forget(stream)

    def _forget(self, stream: _Stream) -> None:
        """A stream closed: its timer, the connection window it held, a send waiting on it."""
        if self.streams.pop(stream.id, None) is None:
            return
        self.blocked.discard(stream)
        if stream.timer is not None:
            stream.timer.cancel()
        if stream.held:
            self.conn_held -= stream.held
            self._conn_credit(stream.held)
            stream.held = 0
        if stream.writable is not None and not stream.writable.done():
            stream.writable.set_result(None)
        if not self.streams:
            self.idle_since = asyncio.get_running_loop().time()
        self.server.stream_ended()

    def _cancel(self, stream: _Stream) -> None:
        self.blocked.discard(stream)
        if stream.task is not None and not stream.task.done():
            stream.task.cancel()

    def _close_if_idle(self) -> None:
        if self.draining and not self.streams and self.transport is not None and not self.closed:
            self.flush()
            self._hang_up()

    def goaway(self) -> None:
        """A graceful stop: no new streams; the open ones finish (the peer opens its next ones elsewhere)."""
        if not self.draining and not self.closed:
            self.draining = True
            self.write(_frame(GOAWAY, 0, 0, _U32.pack(self.last_stream) + _U32.pack(NO_ERROR)))
            self._close_if_idle()


class _CallDetails(grpc.HandlerCallDetails):
    def __init__(self, method: str, invocation_metadata: tuple[tuple[str, str], ...]) -> None:
        self.method = method
        self.invocation_metadata = invocation_metadata


class GrpcServer:
    """gRPC over ``H2Connection``: register servicers with grpcio's generated ``add_*_to_server``."""

    def __init__(self, max_message_bytes: int = 64 * 1024 * 1024, limits: ConnectionLimits | None = None) -> None:
        self.max_message_bytes = max_message_bytes
        self.limits = limits or ConnectionLimits()
        self.methods: dict[str, Handler] = {}
        self.generic: list[Any] = []  # grpc.GenericRpcHandler: asked for methods not registered by name
        self.connections: set[H2Connection] = set()
        self.stopping = False
        self._server: asyncio.Server | None = None
        self._drained: asyncio.Event | None = None  # set once stopping and no stream is left open

    def stream_ended(self) -> None:
        if self._drained is not None and not any(c.streams for c in self.connections):
            self._drained.set()

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        """grpcio's registration; newer generated code also registers each method by name (below)."""
        self.generic.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Handler]) -> None:
        for name, handler in handlers.items():
            self.methods[f"/{service}/{name}"] = handler

    def handler_for(self, path: str, stream: _Stream) -> Handler | None:
        handler = self.methods.get(path)
        if handler is None and self.generic:
            details = _CallDetails(path, ServicerContext(stream).invocation_metadata())
            for generic in self.generic:
                handler = generic.service(details)
                if handler is not None:
                    break
        return handler

    async def start(self, host: str, port: int, reuse_port: bool = False) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: H2Connection(self), host, port,
                                                reuse_port=reuse_port or None)

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self, grace_s: float) -> None:
        """Refuse new streams, let the open ones finish for up to ``grace_s``, then close everything."""
        self.stopping = True
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.goaway()
        self._drained = asyncio.Event()
        self.stream_ended()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._drained.wait(), grace_s)
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.abort()
        tasks = [s.task for c in list(self.connections) for s in c.streams.values() if s.task is not None]
        for t in tasks:
            t.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*tasks, return_exceptions=True)
