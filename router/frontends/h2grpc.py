"""gRPC's server side over HTTP/2 on asyncio protocols: the endpoint picker's port without grpcio's machinery.

Why: a pick is one ext_proc stream of three to six small messages each way, and grpc.aio spends about 0.9 ms of
CPU on such a stream in its own callbacks, completion-queue thread and message plumbing (docs/benchmarks.md),
more than the decision it carries. Here a connection is one ``asyncio.Protocol``: frames are cut from the bytes
as they arrive, messages go to the stream's handler as ``bytes`` for the servicer's own deserializer, and what
the handlers answer within one turn of the event loop leaves in one write.

What it implements (RFC 9113 and gRPC's HTTP/2 mapping, the server's part): the connection preface and SETTINGS,
HPACK through the ``hpack`` library (the peer's dynamic table, Huffman), flow control both ways (a stream's
received bytes are credited back while its handler keeps up, so a stalled handler holds at most a window;
sends wait for the peer's window), PING, RST_STREAM both ways, GOAWAY for a graceful stop, gRPC's length-prefixed
messages, trailers and trailers-only answers, SETTINGS_MAX_CONCURRENT_STREAMS (streams past it refused, so one
connection holds a bounded number of windows). Handlers are registered as grpcio's generated code registers them
(``add_registered_method_handlers``, ``add_generic_rpc_handlers``), so servicers written for grpc.aio run
unchanged: unary-unary and stream-unary handlers, sync or async, and streaming-response ones that are async
generators or coroutines sending with ``context.write`` (grpc_health's asyncio ``Watch``). Not implemented: TLS
(the picker's port is plaintext, as grpc.aio's ``add_insecure_port`` was), message compression (refused with
UNIMPLEMENTED; gRPC clients compress only when told), and synchronous streaming handlers (UNIMPLEMENTED: they
would block the loop; grpc_health's synchronous servicer's ``Watch`` is one).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import struct
from collections import deque
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import grpc
import hpack

log = logging.getLogger("kvrouter.h2grpc")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20
S_HEADER_TABLE_SIZE, S_MAX_CONCURRENT_STREAMS, S_INITIAL_WINDOW_SIZE, S_MAX_FRAME_SIZE, S_MAX_HEADER_LIST_SIZE = (
    1, 3, 4, 5, 6)
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR, STREAM_CLOSED, FRAME_SIZE_ERROR = 0, 1, 2, 3, 5, 6
REFUSED_STREAM, CANCEL, COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 7, 8, 9, 11

RECV_WINDOW = 4 * 1024 * 1024  # what each stream may send ahead of its handler (grpc-core's BDP ceiling)
CONN_WINDOW = 16 * 1024 * 1024  # what the connection may send ahead, all streams together
DEFAULT_WINDOW = 65535  # RFC 9113's initial window, until the peer's SETTINGS say otherwise
MAX_WINDOW = 2**31 - 1
DEFAULT_FRAME = 16384
MAX_HEADER_LIST = 64 * 1024  # decoded request headers per stream (grpc-core's default is 16 KiB)
KNOWN_BLOCKS = 64  # header blocks kept decoded per connection (decode_header_block), each of at most
KNOWN_BLOCK_BYTES = 1024  # bytes (Envoy's for a pick: about 100), so that a connection keeps at most 64 KiB
MAX_STREAMS = 1024  # open streams per connection: with RECV_WINDOW, what one connection can make us hold

_FRAME = struct.Struct(">IBI")  # length (24 bits) and type, flags, stream id (31 bits)
_PREFIX = struct.Struct(">BI")  # gRPC message: compressed flag, length
_SETTING = struct.Struct(">HI")
_U32 = struct.Struct(">I")

OK, CANCELLED, UNKNOWN, INTERNAL, UNIMPLEMENTED, RESOURCE_EXHAUSTED = 0, 1, 2, 13, 12, 8


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
        """One response message out (queued: the connection sends it as the peer's window allows)."""
        if self._serialize is None:
            raise RuntimeError("write() is for response-streaming handlers")
        self._stream.conn.send_message(self._stream, self._serialize(message))

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
        return None

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
    __slots__ = ("closed_local", "closed_remote", "conn", "headers", "headers_sent", "id", "inbox", "outq",
                 "partial", "queued", "reset", "send_window", "task", "trailers", "unacked")

    def __init__(self, conn: H2Connection, stream_id: int, headers: list[tuple[str, str]]) -> None:
        self.conn = conn
        self.id = stream_id
        self.headers = headers
        self.inbox: _Inbox | None = None
        self.partial = bytearray()  # received bytes of a message not yet whole
        self.queued = 0  # bytes of whole messages the handler has not taken yet
        self.unacked = 0  # received bytes not yet credited back to the peer
        self.send_window = conn.peer_initial_window
        self.outq: deque[bytes] = deque()  # DATA payloads waiting for the peer's window
        self.trailers: bytes | None = None  # sent once outq is empty
        self.headers_sent = False
        self.closed_local = self.closed_remote = self.reset = False
        self.task: asyncio.Task[None] | None = None

    def consumed(self, nbytes: int) -> None:
        self.queued -= nbytes
        self.conn.credit(self)


Handler = Any  # grpc.RpcMethodHandler: its flags, (de)serializers and one of its four behaviours


class H2Connection(asyncio.Protocol):
    """One client connection (Envoy multiplexes every pick onto a few)."""

    def __init__(self, server: GrpcServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.peername: tuple[str, int] = ("", 0)
        self.buf = bytearray()
        self.preface_seen = False
        self.decoder = hpack.Decoder(max_header_list_size=MAX_HEADER_LIST)
        self.known_blocks: dict[bytes, list[tuple[str, str]]] = {}  # decode_header_block's answers
        self.streams: dict[int, _Stream] = {}
        self.last_stream = 0
        self.peer_initial_window = DEFAULT_WINDOW
        self.peer_max_frame = DEFAULT_FRAME
        self.send_window = DEFAULT_WINDOW
        self.conn_unacked = 0
        self.blocked: set[_Stream] = set()  # streams with data waiting for a window
        self.continuing: tuple[int, int, bytearray] | None = None  # (stream, flags, block) of split HEADERS
        self.out: list[bytes] = []
        self.flush_scheduled = False
        self.write_paused = False
        self.draining = False
        self.closed = False

    # ---- the transport --------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.peername = (str(peer[0]), int(peer[1])) if isinstance(peer, tuple) else ("", 0)
        self.server.connections.add(self)
        settings = b"".join(_SETTING.pack(k, v) for k, v in (
            (S_MAX_CONCURRENT_STREAMS, MAX_STREAMS), (S_INITIAL_WINDOW_SIZE, RECV_WINDOW),
            (S_MAX_FRAME_SIZE, DEFAULT_FRAME), (S_MAX_HEADER_LIST_SIZE, MAX_HEADER_LIST)))
        self.out.append(_frame(SETTINGS, 0, 0, settings))
        self.out.append(_frame(WINDOW_UPDATE, 0, 0, _U32.pack(CONN_WINDOW - DEFAULT_WINDOW)))
        self.flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        for stream in list(self.streams.values()):
            self._cancel(stream)
        self.streams.clear()
        self.server.stream_ended()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        for stream in list(self.blocked):
            self._pump(stream)
        self.flush()

    def write(self, data: bytes) -> None:
        self.out.append(data)
        if not self.flush_scheduled:
            self.flush_scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self.flush_scheduled = False
        if self.out and self.transport is not None and not self.closed:
            data = b"".join(self.out) if len(self.out) > 1 else self.out[0]
            self.out.clear()
            self.transport.write(data)

    def _connection_error(self, code: int, why: str) -> None:
        log.warning("HTTP/2 connection from %s:%s closed: %s", *self.peername, why)
        self.out.append(_frame(GOAWAY, 0, 0, _U32.pack(self.last_stream) + _U32.pack(code) + why.encode()[:200]))
        self.flush()
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    # ---- frames in --------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        buf = self.buf
        buf += data
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
        while end - pos >= 9 and not self.closed:
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
        if ftype == DATA:
            self._data(flags, sid, payload)
        elif ftype == HEADERS:
            self._headers(flags, sid, payload)
        elif ftype == CONTINUATION:
            if self.continuing is None or self.continuing[0] != sid:
                self._connection_error(PROTOCOL_ERROR, "CONTINUATION without HEADERS")
                return
            block = self.continuing[2]
            block += payload
            if len(block) > MAX_HEADER_LIST:
                self._connection_error(ENHANCE_YOUR_CALM, "header block over the limit")
            elif flags & END_HEADERS:
                _, first_flags, _ = self.continuing
                self.continuing = None
                self._header_block(first_flags, sid, bytes(block))
        elif ftype == SETTINGS:
            self._settings(flags, sid, payload)
        elif ftype == WINDOW_UPDATE:
            self._window_update(sid, payload)
        elif ftype == PING:
            if len(payload) != 8 or sid != 0:
                self._connection_error(PROTOCOL_ERROR if sid else FRAME_SIZE_ERROR, "malformed PING")
            elif not flags & ACK:
                self.out.append(_frame(PING, ACK, 0, payload))
        elif ftype == RST_STREAM:
            stream = self.streams.pop(sid, None)
            if stream is not None:
                stream.reset = True
                self._cancel(stream)
                self.server.stream_ended()
        elif ftype == GOAWAY:
            self.draining = True  # the peer opens no more streams here; ours finish
            self._close_if_idle()
        elif ftype == PUSH_PROMISE:
            self._connection_error(PROTOCOL_ERROR, "PUSH_PROMISE from a client")
        # PRIORITY and unknown frame types are ignored (RFC 9113 5.5)

    def _headers(self, flags: int, sid: int, payload: bytes) -> None:
        if sid == 0:
            self._connection_error(PROTOCOL_ERROR, "HEADERS on stream 0")
            return
        start = 0
        if flags & PADDED:
            start, payload = 1, payload[: len(payload) - payload[0]] if payload else b""
        if flags & PRIORITY_FLAG:
            start += 5
        block = payload[start:]
        if flags & END_HEADERS:
            self._header_block(flags, sid, block)
        else:
            self.continuing = (sid, flags, bytearray(block))

    def decode_header_block(self, block: bytes) -> list[tuple[str, str]]:
        """The block's fields. A gateway sends every pick's stream the same block (its fields indexed, its
        ``:path`` a literal kept out of the table), and hpack decodes in Python: a block that left the
        dynamic table as it found it is kept, and answered again while the table stays as it is (any block
        that changes the table forgets them all)."""
        known = self.known_blocks.get(block)
        if known is not None:
            return known
        table = self.decoder.header_table
        before = tuple(table.dynamic_entries)
        fields = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in self.decoder.decode(block, raw=True)]
        if tuple(table.dynamic_entries) != before:
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
            if flags & END_STREAM:
                self._remote_end(stream)
            return
        if sid <= self.last_stream or sid % 2 == 0:
            if sid % 2 == 0:
                self._connection_error(PROTOCOL_ERROR, f"a client stream with an even id {sid}")
            return  # a stream we closed: its late frames are ignored
        self.last_stream = sid
        if self.draining or self.server.stopping or len(self.streams) >= MAX_STREAMS:
            self.out.append(_frame(RST_STREAM, 0, sid, _U32.pack(REFUSED_STREAM)))  # the client retries
            return
        stream = self.streams[sid] = _Stream(self, sid, fields)
        headers = dict(fields)
        handler = self.server.handler_for(headers.get(":path", ""), stream)
        if headers.get(":method") != "POST" or not headers.get("content-type", "").startswith("application/grpc"):
            self._finish(stream, INTERNAL, "gRPC requires POST with content-type application/grpc")
        elif handler is None:
            self._finish(stream, UNIMPLEMENTED, f"unknown method {headers.get(':path', '')[:200]}")
        else:
            stream.inbox = _Inbox(stream, handler.request_deserializer)
            stream.task = asyncio.get_running_loop().create_task(self._run(stream, handler))
        if flags & END_STREAM:
            self._remote_end(stream)

    def _data(self, flags: int, sid: int, payload: bytes) -> None:
        size = len(payload)
        self.conn_unacked += size  # every DATA frame counts against the connection's window, any stream's
        if self.conn_unacked >= CONN_WINDOW // 2:
            self.out.append(_frame(WINDOW_UPDATE, 0, 0, _U32.pack(self.conn_unacked)))
            self.conn_unacked = 0
        stream = self.streams.get(sid)
        if stream is None or stream.closed_remote:
            if sid == 0 or sid > self.last_stream:
                self._connection_error(PROTOCOL_ERROR, f"DATA on idle stream {sid}")
            return  # on a stream already closed: dropped
        if flags & PADDED:
            payload = payload[1 : len(payload) - payload[0]] if payload else b""
        stream.unacked += size
        if stream.inbox is not None:
            part = stream.partial
            part += payload
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
        self.credit(stream)
        if flags & END_STREAM:
            self._remote_end(stream)

    def credit(self, stream: _Stream) -> None:
        """Give the peer back the window of what it sent, while the handler keeps up with it: a stream whose
        handler stalls gets no more than a window ahead."""
        if (stream.unacked >= RECV_WINDOW // 4 and stream.queued <= RECV_WINDOW // 2 and not stream.closed_remote
                and stream.id in self.streams):
            self.write(_frame(WINDOW_UPDATE, 0, stream.id, _U32.pack(stream.unacked)))
            stream.unacked = 0

    def _remote_end(self, stream: _Stream) -> None:
        stream.closed_remote = True
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
            return
        for off in range(0, len(payload), 6):
            key, value = _SETTING.unpack_from(payload, off)
            if key == S_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    self._connection_error(FLOW_CONTROL_ERROR, "SETTINGS_INITIAL_WINDOW_SIZE over 2^31-1")
                    return
                delta, self.peer_initial_window = value - self.peer_initial_window, value
                for stream in self.streams.values():
                    stream.send_window += delta
            elif key == S_MAX_FRAME_SIZE:
                if not DEFAULT_FRAME <= value <= 2**24 - 1:
                    self._connection_error(PROTOCOL_ERROR, "SETTINGS_MAX_FRAME_SIZE out of range")
                    return
                self.peer_max_frame = value
        self.out.append(_frame(SETTINGS, ACK, 0))
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
        if stream is not None:
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
                        self.send_message(stream, serialize(reply))
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
            if stream.reset or self.closed:
                return  # the peer cancelled it, or the connection is gone: nobody to answer
            raise
        except Exception:
            log.exception("gRPC handler for %s failed", dict(stream.headers).get(":path"))
            code, details = UNKNOWN, "Unexpected error in the handler"
        self._finish(stream, code, details)

    def send_message(self, stream: _Stream, message: bytes) -> None:
        """One gRPC message out (the response headers first, once)."""
        if stream.closed_local or self.closed:
            return
        if not stream.headers_sent:
            stream.headers_sent = True
            self.write(_frame(HEADERS, END_HEADERS, stream.id, _RESPONSE_HEADERS))
        stream.outq.append(_PREFIX.pack(0, len(message)) + message)
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
            self._cancel(stream)  # refused by the connection (a limit, a malformed message): its handler stops
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
            self.write(_frame(DATA, 0, stream.id, chunk))
        if q:
            self.blocked.add(stream)
            return
        self.blocked.discard(stream)
        if stream.trailers is not None and not stream.closed_local:
            stream.closed_local = True
            self.write(_frame(HEADERS, END_HEADERS | END_STREAM, stream.id, stream.trailers))
            if not stream.closed_remote:  # answered before the client finished sending: it may stop
                self.write(_frame(RST_STREAM, 0, stream.id, _U32.pack(NO_ERROR)))
                stream.closed_remote = True
            self._maybe_close(stream)

    def _maybe_close(self, stream: _Stream) -> None:
        if stream.closed_local and stream.closed_remote:
            self.streams.pop(stream.id, None)
            self._close_if_idle()
            self.server.stream_ended()

    def _cancel(self, stream: _Stream) -> None:
        self.blocked.discard(stream)
        if stream.task is not None and not stream.task.done():
            stream.task.cancel()

    def _close_if_idle(self) -> None:
        if self.draining and not self.streams and self.transport is not None:
            self.flush()
            self.transport.close()

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

    def __init__(self, max_message_bytes: int = 64 * 1024 * 1024) -> None:
        self.max_message_bytes = max_message_bytes
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
