"""Issue 46: the picker's HTTP/2 server (router/frontends/h2grpc.py) against what an attacker sends.

Each case is driven over a real socket by the ``h2`` library's client (and raw frames where h2 will not send the
malformed thing), and asserts what RFC 9113 (or the mature server the bound comes from) requires: the GOAWAY or
RST_STREAM and its error code, the server's own buffers bounded (its transport's write buffer, a stream's queued
bytes, its connections), and a grpc.aio client served during and after. Where it is cheap the same input goes to
grpc.aio's server (gRPC's C core) with the same servicer: what it does is recorded (``record_property`` and the
captured output), never asserted, so the test shows where the two differ.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import struct
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, NamedTuple

import grpc
import h2.config
import h2.connection
import h2.errors
import h2.events
import hpack
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.load import free_port, server_process
from router.frontends import h2grpc
from router.frontends.h2grpc import (
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    GOAWAY,
    HEADERS,
    MAX_PING_STRIKES,
    MAX_QUEUED_CONTROL,
    NO_ERROR,
    PADDED,
    PING,
    PREFACE,
    PROTOCOL_ERROR,
    RST_STREAM,
    S_INITIAL_WINDOW_SIZE,
    SETTINGS,
    STREAM_WRITE_QUOTA,
    WINDOW_UPDATE,
    ConnectionLimits,
    GrpcServer,
    H2Connection,
    _frame,
    _hpack_int,
    grpc_timeout,
)
from tests.test_h2grpc import Echo, body_of, body_request, frames, served
from tests.zmq_helpers import wait_until

pytestmark = [pytest.mark.conformance, pytest.mark.sockets]

PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
BOTH = pytest.mark.parametrize("kind", ["kvrouter", "grpcio"])
SHORT = 0.3  # the timeouts under test, in seconds; every wait is on an event, bounded generously
GRPC_CORE_RESOLUTION_S = 0.001  # grpc core's deadlines: whole milliseconds (grpc_core::Timestamp), rounded up
_pings = itertools.count(1)


class Served(NamedTuple):
    port: int
    server: GrpcServer | None  # None: grpc.aio's server
    echo: Echo
    channel: grpc.aio.Channel


@asynccontextmanager
async def served_by(kind: str, limits: ConnectionLimits | None = None) -> AsyncIterator[Served]:
    """tests.test_h2grpc's ``served`` (kvrouter's server), or grpc.aio's with the same servicer and the
    nearest of its options to ``limits`` (the handshake timeout, max_connection_idle)."""
    if kind == "kvrouter":
        async with served(limits=limits) as (server, echo, ch):
            yield Served(server.port, server, echo, ch)
        return
    options = []
    if limits is not None:
        options = [("grpc.server_handshake_timeout_ms", int(limits.handshake_timeout_s * 1000)),
                   ("grpc.max_connection_idle_ms", int(limits.idle_timeout_s * 1000))]
    echo, server = Echo(), grpc.aio.server(options=options)
    pb_grpc.add_ExternalProcessorServicer_to_server(echo, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            yield Served(port, None, echo, ch)
    finally:
        await server.stop(0)


async def still_serves(ch: grpc.aio.Channel) -> None:
    """A grpc.aio client's pick goes through (on its own connection)."""
    got = [body_of(r) async for r in pb_grpc.ExternalProcessorStub(ch).Process(iter([body_request(b"ok")]))]
    assert got == [b"ok"]


def grpc_message(body: bytes) -> bytes:
    message = body_request(body).SerializeToString()
    return struct.pack(">BI", 0, len(message)) + message


class Peer:
    """One client connection: the h2 library's client for what it will send, raw frames beside it for what it
    will not, and every frame the server sends as it arrives (``frames``; ``events`` too when fed to h2)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, feed: bool, read: bool) -> None:
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.reader, self.writer, self.feed = reader, writer, feed
        self.frames: list[tuple[int, int, int, bytes]] = []
        self.events: list[h2.events.Event] = []
        self.eof = False
        self.settings_sent = 0  # SETTINGS frames h2 sent: the server acks each, in order
        self._buf = bytearray()
        self._task = asyncio.create_task(self._read()) if read else None

    @classmethod
    async def open(cls, port: int, *, handshake: bool = True, settings: dict[int, int] | None = None,
                   feed: bool = False, read: bool = True, rcvbuf: int | None = None) -> Peer:
        if rcvbuf is None:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        else:  # a receive buffer set before connecting: a client that never reads backs the server up sooner
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
            reader, writer = await asyncio.open_connection(sock=sock)
        peer = cls(reader, writer, feed, read)
        if handshake:
            peer.h2.initiate_connection()
            peer.settings_sent += 1
            if settings:
                peer.h2.update_settings(settings)
                peer.settings_sent += 1
            peer.send()
        return peer

    @property
    def port(self) -> int:
        return int(self.writer.get_extra_info("sockname")[1])

    def send(self, raw: bytes = b"") -> None:
        self.writer.write(self.h2.data_to_send() + raw)

    def request(self, timeout: str | None = None, end_stream: bool = False) -> int:
        """HEADERS for a Process stream (queued: ``send`` sends it); its stream id."""
        sid = self.h2.get_next_available_stream_id()
        headers = [(":method", "POST"), (":scheme", "http"), (":authority", "x"), (":path", PROCESS),
                   ("content-type", "application/grpc"), ("te", "trailers")]
        if timeout is not None:
            headers.append(("grpc-timeout", timeout))
        self.h2.send_headers(sid, headers, end_stream=end_stream)
        return sid

    async def _read(self) -> None:
        try:
            while chunk := await self.reader.read(65536):
                self._buf += chunk
                got = frames(bytes(self._buf))
                del self._buf[: sum(9 + len(f[3]) for f in got)]
                self.frames += got
                if self.feed:
                    self.events += self.h2.receive_data(chunk)
        except ConnectionError:
            pass
        self.eof = True

    async def until(self, done: Callable[[], bool], timeout: float = 10.0) -> None:
        """Until ``done()`` or the server closes the connection."""
        await wait_until(lambda: self.eof or done(), timeout)

    def ping(self) -> bytes:
        payload = next(_pings).to_bytes(8, "big")
        self.h2.ping(payload)
        return payload

    def acked(self, payload: bytes) -> bool:
        return any(f[0] == PING and f[1] & 1 and f[3] == payload for f in self.frames)

    async def roundtrip(self, raw: bytes = b"") -> None:
        """``raw``, then an empty SETTINGS: once it is acked (or the connection closed) the server has read
        them. (Not a PING: a peer that pings while nothing is sent to it earns grpc-core's ping strikes.)"""
        self.send(raw)
        self.h2.update_settings({})
        self.settings_sent += 1
        self.send()
        await self.until(lambda: self.goaway() is not None or self.settings_acks() >= self.settings_sent)

    def settings_acks(self) -> int:
        return sum(f[0] == SETTINGS and f[1] & 1 for f in self.frames)

    def goaway(self) -> int | None:
        return next((struct.unpack_from(">I", f[3], 4)[0] for f in self.frames if f[0] == GOAWAY), None)

    def reset(self, sid: int) -> int | None:
        return next((struct.unpack(">I", f[3])[0] for f in self.frames if f[0] == RST_STREAM and f[2] == sid), None)

    def ended(self, sid: int) -> bool:
        return any(f[0] == HEADERS and f[2] == sid and f[1] & END_STREAM for f in self.frames)

    def outcome(self, sid: int | None = None) -> str:
        """What the server did, in words (for the record of grpc-core's answers)."""
        code = self.goaway()
        if code is not None:
            return f"GOAWAY {h2.errors.ErrorCodes(code).name}"
        if sid is not None and self.reset(sid) is not None:
            return f"RST_STREAM {h2.errors.ErrorCodes(self.reset(sid)).name}"  # type: ignore[arg-type]
        return "closed without GOAWAY" if self.eof else "no error: served on"

    def close(self) -> None:
        self.writer.transport.abort()
        if self._task is not None:
            self._task.cancel()


def conn_of(server: GrpcServer, peer: Peer) -> H2Connection:
    return next(c for c in server.connections if c.peername[1] == peer.port)


def record(record_property: Callable[[str, Any], None], what: str) -> None:
    record_property("grpc_core", what)
    print(f"grpc-core: {what}")


# ---- 3. control frames from a client that never reads, and PING floods ---------------------------------------
@BOTH
async def test_a_ping_flood_gets_goaway_enhance_your_calm(kind: str, record_property: Any) -> None:
    """grpc-core's ping strikes (CVE-2019-9512): PINGs one after another with nothing sent between are answered
    ``MAX_PING_STRIKES`` + 1 times, then GOAWAY ENHANCE_YOUR_CALM."""
    async with served_by(kind) as s:
        peer = await Peer.open(s.port)
        last = [peer.ping() for _ in range(20)][-1]
        peer.send()
        await peer.until(lambda: peer.goaway() is not None or peer.acked(last))
        await still_serves(s.channel)
        if s.server is None:
            record(record_property, f"20 PINGs: {peer.outcome()}, {sum(f[0] == PING for f in peer.frames)} acks")
        else:
            assert peer.goaway() == ENHANCE_YOUR_CALM
            assert sum(f[0] == PING for f in peer.frames) == MAX_PING_STRIKES + 1
            await peer.until(lambda: False)  # and the connection is closed
        peer.close()


async def test_control_answers_to_a_client_that_never_reads_stop_reading_instead_of_growing_the_buffer() -> None:
    """grpc-go's throttle: a client that sends SETTINGS (each asks for an ACK) and never reads backs the socket
    up; past ``MAX_QUEUED_CONTROL`` answers queued the server stops reading it, so its write buffer stays at the
    transport's high-water mark (on HEAD it held every answer: issue 46's 85 -> 284 MiB)."""
    async with served() as (server, _, ch):
        await still_serves(ch)
        peer = await Peer.open(server.port, read=False, rcvbuf=4096)
        await wait_until(lambda: len(server.connections) == 2)
        conn = conn_of(server, peer)
        assert conn.transport is not None
        conn.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        transport = conn.transport
        peer.send(_frame(SETTINGS, 0, 0) * 400_000)  # 3.6 MB of SETTINGS, each asking for a 9-byte ACK
        bound = transport.get_write_buffer_limits()[1] + 2 * (MAX_QUEUED_CONTROL + 1) * 9
        await wait_until(lambda: not transport.is_reading() or transport.get_write_buffer_size() > bound, 30)
        assert transport.get_write_buffer_size() <= bound and conn.read_paused
        await still_serves(ch)  # served meanwhile
        peer.close()
        await wait_until(lambda: len(server.connections) == 1)  # the flooder's connection is gone
        await still_serves(ch)


# ---- 4. the peer's flow-control window, and the connection's ----------------------------------------------
async def test_a_client_that_opens_no_window_stops_its_handlers_and_their_credit(monkeypatch: Any) -> None:
    """Initial window 0, never a WINDOW_UPDATE, and eight streams of messages the picker echoes: each handler's
    send waits once ``STREAM_WRITE_QUOTA`` is queued, so it stops taking messages; their streams' and the
    connection's windows are then no longer credited, and the connection holds at most one connection window.
    On HEAD every handler took every message and the client pushed all it had (issue 46: 30 MiB)."""
    monkeypatch.setattr(h2grpc, "RECV_WINDOW", 256 * 1024)  # (the same logic, at a size cheap to fill)
    monkeypatch.setattr(h2grpc, "CONN_WINDOW", 1024 * 1024)
    conn_window, total, body = 1024 * 1024, 8 * 1024 * 1024, b"x" * 16000
    async with served() as (server, _, ch):
        peer = await Peer.open(server.port, settings={S_INITIAL_WINDOW_SIZE: 0}, feed=True)
        sids = [peer.request() for _ in range(8)]
        await peer.roundtrip()
        conn = conn_of(server, peer)
        message = grpc_message(body)
        sent = 0
        def room(sid: int) -> bool:  # (the stream's window and the connection's, as the client knows them)
            return peer.h2.local_flow_control_window(sid) >= len(message)

        def stuck() -> bool:  # every handler waits on its send (getattr: HEAD's streams have no ``writable``)
            return all(getattr(conn.streams.get(s), "writable", None) is not None for s in sids)

        for sid in itertools.cycle(sids):
            if sent >= total:
                break
            if not any(room(s) for s in sids):
                await peer.roundtrip()  # what the server credits on arrival has come back by now
                if stuck() and not any(room(s) for s in sids):
                    break  # no window open and no handler that could take a message: nothing more comes
                await wait_until(lambda: any(room(s) for s in sids) or stuck())
            elif room(sid):
                peer.h2.send_data(sid, message)
                peer.send()
                sent += len(message)
        await still_serves(ch)  # served meanwhile
        assert sent < total  # the client could not push all it had
        streams = [conn.streams[s] for s in sids]
        assert all(st.out_bytes <= STREAM_WRITE_QUOTA + len(message) for st in streams)
        held = sum(st.queued + len(st.partial) for st in streams)
        assert held <= conn_window and conn.conn_held <= conn_window
        assert conn.transport is not None and conn.transport.get_write_buffer_size() == 0
        peer.close()
        await wait_until(lambda: len(server.connections) == 1)
        await still_serves(ch)


# ---- 5. timeouts, limits, deadlines, rapid reset, CONTINUATION floods ----------------------------------------
@BOTH
async def test_connections_that_never_finish_the_handshake_are_closed(kind: str, record_property: Any) -> None:
    """grpc-go's handshake timeout: the preface and the client's first SETTINGS within it, or the connection is
    closed; a connection that finished its handshake is not (it was opened before the others)."""
    async with served_by(kind, ConnectionLimits(handshake_timeout_s=SHORT)) as s:
        await still_serves(s.channel)
        done = await Peer.open(s.port)
        await done.roundtrip()
        silent, preface, partial = [await Peer.open(s.port, handshake=False) for _ in range(3)]
        preface.send(PREFACE)
        partial.send(PREFACE + _frame(SETTINGS, 0, 0)[:5])
        await still_serves(s.channel)  # served meanwhile
        laggards = (silent, preface, partial)
        if s.server is None:
            with contextlib.suppress(AssertionError):  # (recorded, whichever it does)
                await wait_until(lambda: all(p.eof for p in laggards), 5)
            record(record_property, f"handshake timeout {SHORT}s: closed {[p.eof for p in laggards]}")
        else:
            await wait_until(lambda: all(p.eof for p in laggards))
            assert not any(p.frames and p.goaway() is not None for p in laggards)  # closed, as grpc-go, no GOAWAY
            assert not done.eof and len(s.server.connections) == 2  # the channel's and ``done``
        await still_serves(s.channel)
        for p in (done, *laggards):
            p.close()


@BOTH
async def test_an_idle_connection_gets_goaway_no_error_and_is_closed(kind: str, record_property: Any) -> None:
    """Envoy's idle timeout: no open stream for ``idle_timeout_s``, GOAWAY NO_ERROR and the connection closed;
    one with a stream open since before the idle one was opened is left alone."""
    async with served_by(kind, ConnectionLimits(idle_timeout_s=SHORT)) as s:
        busy = await Peer.open(s.port)
        sid = busy.request()
        busy.h2.send_data(sid, grpc_message(b"wait"))
        busy.send()
        await wait_until(s.echo.waiting.is_set)
        idle = await Peer.open(s.port)
        await idle.until(lambda: False)  # until the server closes it
        if s.server is None:
            record(record_property, f"max_connection_idle {SHORT}s: idle: {idle.outcome()}; busy: {busy.outcome()}")
        else:
            assert idle.goaway() == NO_ERROR
            assert busy.goaway() is None and not busy.eof and not conn_of(s.server, busy).draining
        await still_serves(s.channel)
        busy.close()
        idle.close()


async def test_past_max_connections_a_new_connection_is_closed_at_once() -> None:
    async with served(limits=ConnectionLimits(max_connections=2)) as (server, _, ch):
        await still_serves(ch)
        first = await Peer.open(server.port)
        await first.roundtrip()
        refused = await Peer.open(server.port)
        await refused.until(lambda: False)
        assert refused.frames == [] and len(server.connections) == 2
        await still_serves(ch)  # the open ones serve on
        first.close()
        await wait_until(lambda: len(server.connections) == 1)
        again = await Peer.open(server.port)
        await again.roundtrip()
        assert again.settings_acks() == again.settings_sent and not again.eof
        again.close()


@pytest.mark.parametrize(("value", "seconds"), [("1H", 3600.0), ("2M", 120.0), ("3S", 3.0), ("300m", 0.3),
                                                ("7u", 7e-6), ("99999999n", 0.099999999), ("123456789S", None),
                                                ("S", None), ("1s", None), ("-1S", None), ("１S", None), ("", None)])
def test_grpc_timeout_values_and_units(value: str, seconds: float | None) -> None:
    """gRPC's HTTP/2 mapping: TimeoutValue is 1 to 8 ASCII digits, TimeoutUnit one of H M S m u n."""
    assert grpc_timeout(value) == pytest.approx(seconds) if seconds is not None else grpc_timeout(value) is None


@BOTH
async def test_grpc_timeout_ends_the_stream_deadline_exceeded_and_cancels_its_handler(kind: str) -> None:
    """The server's own deadline (not the client's): a stream whose handler waits past ``grpc-timeout`` ends
    with grpc-status 4 and its handler is cancelled; the handler saw the deadline as ``time_remaining()``.

    The deadline read back is one the test writes on the wire itself (``30S``), so only the server's clock takes
    part: a grpcio client encodes its ``timeout=30`` against a cached reading of its clock, which can be a tenth of
    a second old (30.0985 s reached the reference server once). The bound allows the reference's own resolution:
    grpc core keeps a deadline in whole milliseconds, rounded up."""
    async with served_by(kind) as s:
        peer = await Peer.open(s.port, feed=True)
        sid = peer.request(timeout="30S")
        peer.h2.send_data(sid, grpc_message(b"remaining"))
        peer.send()
        data = bytearray()

        def message() -> bytes | None:  # the stream's first gRPC message, once whole
            data[:] = b"".join(e.data for e in peer.events if isinstance(e, h2.events.DataReceived)
                               and e.stream_id == sid)
            return bytes(data[5:]) if len(data) >= 5 and len(data) >= 5 + struct.unpack(">I", data[1:5])[0] else None

        await peer.until(lambda: message() is not None)
        answer = message()
        assert answer is not None
        remaining = float(body_of(ext_pb.ProcessingResponse.FromString(answer)))
        assert 0 < remaining <= 30 + (GRPC_CORE_RESOLUTION_S if kind == "grpcio" else 0.0)
        peer.close()
        peer = await Peer.open(s.port, feed=True)
        sid = peer.request(timeout=f"{int(SHORT * 1000)}m")
        peer.h2.send_data(sid, grpc_message(b"wait"))
        peer.send()

        def status() -> str | None:
            return next((dict(e.headers).get("grpc-status") for e in peer.events
                         if isinstance(e, h2.events.ResponseReceived | h2.events.TrailersReceived)
                         and e.stream_id == sid and "grpc-status" in dict(e.headers)), None)

        await peer.until(lambda: status() is not None)
        assert status() == "4"  # DEADLINE_EXCEEDED
        await wait_until(lambda: "cancelled" in s.echo.ended)
        await still_serves(s.channel)
        peer.close()


@BOTH
async def test_rapid_reset_closes_the_connection_with_enhance_your_calm(kind: str, record_property: Any) -> None:
    """Envoy's premature-reset rule (CVE-2023-44487): once 500 streams were opened, a connection that reset at
    least half of them before any answer gets GOAWAY ENHANCE_YOUR_CALM."""
    async with served_by(kind) as s:
        peer = await Peer.open(s.port)
        for _ in range(600):
            peer.h2.reset_stream(peer.request(), h2.errors.ErrorCodes.CANCEL)
        await peer.roundtrip()
        await still_serves(s.channel)
        if s.server is None:
            record(record_property, f"600 HEADERS + RST_STREAM: {peer.outcome()}")
        else:
            assert peer.goaway() == ENHANCE_YOUR_CALM
            last = struct.unpack_from(">I", next(f[3] for f in peer.frames if f[0] == GOAWAY))[0]
            assert last == 2 * h2grpc.PREMATURE_RESET_STREAMS - 1  # the 500th stream
            await peer.until(lambda: False)
            assert len(s.server.connections) == 1
        peer.close()
        await still_serves(s.channel)


@BOTH
async def test_a_run_of_empty_continuation_frames_is_a_connection_error(kind: str, record_property: Any) -> None:
    """CVE-2024-27316: nghttp2 allows 8 CONTINUATION frames a header block; past them, GOAWAY
    ENHANCE_YOUR_CALM (empty ones never reach the size limit)."""
    async with served_by(kind) as s:
        peer = await Peer.open(s.port)
        block = hpack.Encoder().encode([(":method", "POST"), (":scheme", "http"), (":path", PROCESS),
                                        (":authority", "x"), ("content-type", "application/grpc")])
        flood = (_frame(HEADERS, END_STREAM, 1, block) + _frame(CONTINUATION, 0, 1) * 100
                 + _frame(CONTINUATION, END_HEADERS, 1))
        await peer.roundtrip(flood)
        await still_serves(s.channel)
        if s.server is None:
            record(record_property, f"HEADERS + 100 empty CONTINUATION: {peer.outcome(1)}")
        else:
            assert peer.goaway() == ENHANCE_YOUR_CALM and not peer.ended(1)
        peer.close()


# ---- 6. padding, WINDOW_UPDATE, SETTINGS_INITIAL_WINDOW_SIZE, HPACK table size ---------------------------------
@BOTH
@pytest.mark.parametrize("ftype", [DATA, HEADERS])
async def test_padding_as_long_as_its_frame_is_a_connection_protocol_error(
        kind: str, ftype: int, record_property: Any) -> None:
    """RFC 9113 6.1 and 6.2: padding the length of the frame's payload or more is a connection error
    PROTOCOL_ERROR."""
    async with served_by(kind) as s:
        peer = await Peer.open(s.port)
        if ftype == DATA:
            sid = peer.request()
            data = grpc_message(b"padded")
            raw = _frame(DATA, PADDED, sid, bytes([len(data) + 1]) + data)
        else:
            sid = 1
            block = hpack.Encoder().encode([(":method", "POST"), (":path", PROCESS)])
            raw = _frame(HEADERS, PADDED | END_HEADERS | END_STREAM, sid, bytes([len(block) + 1]) + block)
        await peer.roundtrip(raw)
        await still_serves(s.channel)
        if s.server is None:
            record(record_property, f"padded {'DATA' if ftype == DATA else 'HEADERS'}: {peer.outcome(sid)}")
        else:
            assert peer.goaway() == PROTOCOL_ERROR
        peer.close()



async def waiting_stream(s: Any) -> tuple[Peer, int]:
    """A new connection with one stream whose handler waits (its message ``wait`` taken): the stream to break."""
    peer = await Peer.open(s.port)
    sid = peer.request()
    peer.h2.send_data(sid, grpc_message(b"wait"))
    peer.send()
    await wait_until(s.echo.waiting.is_set)
    return peer, sid

@BOTH
@pytest.mark.parametrize(("increment", "code"), [(0, PROTOCOL_ERROR), (2**31 - 1, FLOW_CONTROL_ERROR)])
async def test_a_bad_stream_window_update_is_a_stream_error(
        kind: str, increment: int, code: int, record_property: Any) -> None:
    """RFC 9113 6.9 and 6.9.1: a stream's WINDOW_UPDATE of 0 is a stream error PROTOCOL_ERROR, one that takes its
    window past 2^31-1 a stream error FLOW_CONTROL_ERROR: RST_STREAM, the handler cancelled, the connection
    serving on."""
    async with served_by(kind) as s:
        peer, sid = await waiting_stream(s)
        await peer.roundtrip(_frame(WINDOW_UPDATE, 0, sid, struct.pack(">I", increment)))
        if s.server is None:
            record(record_property, f"stream WINDOW_UPDATE {increment}: {peer.outcome(sid)}")
        else:
            assert peer.reset(sid) == code and peer.goaway() is None
            await wait_until(lambda: s.echo.ended == ["cancelled"])
            assert sid not in conn_of(s.server, peer).streams
            await peer.roundtrip()
            assert not peer.eof
        await still_serves(s.channel)
        peer.close()


@BOTH
async def test_an_initial_window_that_overflows_an_open_stream_is_a_connection_flow_control_error(
        kind: str, record_property: Any) -> None:
    """RFC 9113 6.9.2: a SETTINGS_INITIAL_WINDOW_SIZE that takes an open stream's window past 2^31-1 is a
    connection error FLOW_CONTROL_ERROR."""
    async with served_by(kind) as s:
        peer, sid = await waiting_stream(s)
        to_max = _frame(WINDOW_UPDATE, 0, sid, struct.pack(">I", 2**31 - 1 - 65535))  # now exactly 2^31-1
        one_more = _frame(SETTINGS, 0, 0, struct.pack(">HI", S_INITIAL_WINDOW_SIZE, 65536))
        await peer.roundtrip(to_max + one_more)
        await still_serves(s.channel)
        if s.server is None:
            record(record_property, f"INITIAL_WINDOW_SIZE overflowing a stream: {peer.outcome(sid)}")
        else:
            assert peer.goaway() == FLOW_CONTROL_ERROR
        peer.close()


def test_a_block_that_changes_the_table_size_is_never_answered_from_the_cache() -> None:
    """RFC 7541 4.2: a block may start by changing the dynamic table's size. Kept decoded, it would be answered
    again without the change, and the table would drift from the client's: here the client's table holds x-a
    while (on HEAD) the server's, stuck at size 0, could not, and its index 62 was a COMPRESSION_ERROR."""
    conn = H2Connection(GrpcServer())
    to_4096, to_0 = _hpack_int(4096, 5, 0x20) + b"\x82", b"\x20\x82"  # a size update, then :method GET
    literal = b"\x40\x03x-a\x011"  # x-a: 1, added to the table (RFC 7541 6.2.1)
    reference = hpack.Decoder()  # a decoder that keeps nothing: the client's table
    for block in (to_4096, to_0, to_4096, literal, b"\xbe"):
        expected = [(k.decode(), v.decode()) for k, v in reference.decode(block, raw=True)]
        assert conn.decode_header_block(block) == expected
        assert conn.decoder.header_table.maxsize == reference.header_table.maxsize
    assert to_0 not in conn.known_blocks  # a block that changes the size is not kept


# ---- the picker as a process: its RSS, as issue 46 measured it -------------------------------------------------
def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _flood_without_reading(port: int, frame: bytes, total_bytes: int) -> int:
    """Send ``frame`` over and over on a connection that never reads, up to ``total_bytes`` or until the server
    stops taking them (it stopped reading, or closed); returns the bytes it took."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the server's answers back up at once
    sock.connect(("127.0.0.1", port))
    sock.settimeout(2.0)
    burst = frame * (65536 // len(frame))
    sent = 0
    try:
        sock.sendall(h2grpc.PREFACE + h2grpc._frame(h2grpc.SETTINGS, 0, 0))
        while sent < total_bytes:
            sent += sock.send(burst)
    except (TimeoutError, OSError):  # the server stopped reading (a full send buffer times out) or hung up
        pass
    finally:
        sock.close()
    return sent


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_picker_process_keeps_its_rss_under_floods_from_clients_that_never_read():
    """f990b79: a PING flood from a client that never reads took `kvrouter epp` from 85 to 284 MiB and growing.
    Now a PING flood ends at the third strike, and a SETTINGS flood (every one answered by an ACK) stops being
    read once its answers back up; the process grows by a few MiB, and a gRPC client is served after each."""
    port = free_port()
    args = ["-m", "router.cli", "epp", "--port", str(port), "--health-port", str(port), "--metrics-port",
            str(free_port()), "--worker", "http://127.0.0.1:9,id=w0"]
    with server_process(args, port) as proc:
        def served() -> bool:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                return stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status >= 0

        assert served()
        before = _rss_mib(proc.pid)
        ping = h2grpc._frame(h2grpc.PING, 0, 0, b"12345678")
        taken = _flood_without_reading(port, ping, 64 * 1024 * 1024)
        assert taken < 64 * 1024 * 1024  # it hung up: GOAWAY after the ping strikes
        assert served()
        settings = h2grpc._frame(h2grpc.SETTINGS, 0, 0)
        taken = _flood_without_reading(port, settings, 64 * 1024 * 1024)
        assert taken < 64 * 1024 * 1024  # it stopped reading once its answers backed up
        assert served()
        assert _rss_mib(proc.pid) - before < 32, (before, _rss_mib(proc.pid))
