"""router/frontends/h2grpc.py, the picker's gRPC server, against grpcio's own client (a real peer: its HTTP/2,
flow control and status handling) and raw sockets for what no well-behaved client sends."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
import hpack
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from router.frontends import h2grpc
from router.frontends.h2grpc import PREFACE, ConnectionLimits, GrpcServer

pytestmark = pytest.mark.sockets


def body_request(data: bytes) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data))


def body_of(resp: pb.ProcessingResponse) -> bytes:
    return resp.request_body.response.body_mutation.body


class Echo(pb_grpc.ExternalProcessorServicer):
    """Answers every message with its body; a body of b"abort" / b"raise" / b"wait" aborts, raises, or waits
    until cancelled, and b"remaining" is answered with ``context.time_remaining()`` (``ended`` records how each
    stream's handler ended)."""

    def __init__(self) -> None:
        self.ended: list[str] = []
        self.waiting = asyncio.Event()

    async def Process(self, it: AsyncIterator[pb.ProcessingRequest], ctx: Any) -> AsyncIterator[pb.ProcessingResponse]:
        how = "finished"
        try:
            async for req in it:
                data = req.request_body.body
                if data == b"abort":
                    await ctx.abort(grpc.StatusCode.PERMISSION_DENIED, "no: 100% 'refused' ü")
                if data == b"raise":
                    raise RuntimeError("a bug")
                if data == b"wait":
                    self.waiting.set()
                    await asyncio.Event().wait()
                if data == b"remaining":
                    data = repr(ctx.time_remaining()).encode()
                yield pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
                    body_mutation=pb.BodyMutation(body=data))))
        except asyncio.CancelledError:
            how = "cancelled"
            raise
        finally:
            self.ended.append(how)


@asynccontextmanager
async def served(max_message_bytes: int = 64 * 1024 * 1024, limits: ConnectionLimits | None = None,
                 ) -> AsyncIterator[tuple[GrpcServer, Echo, grpc.aio.Channel]]:
    server, echo = GrpcServer(max_message_bytes, limits), Echo()
    pb_grpc.add_ExternalProcessorServicer_to_server(echo, server)
    hs = health.HealthServicer(experimental_non_blocking=True)
    hs.set("ready", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    await server.start("127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}",
                                             options=[("grpc.max_receive_message_length", 16 << 20)]) as channel:
            yield server, echo, channel
    finally:
        await server.stop(0)


async def test_unary_check_answers_and_a_set_code_reaches_the_client():
    async with served() as (_, _, ch):
        stub = health_pb2_grpc.HealthStub(ch)
        got = await stub.Check(health_pb2.HealthCheckRequest(service="ready"))
        assert got.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Check(health_pb2.HealthCheckRequest(service="unknown"))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_synchronous_streaming_handler_is_unimplemented_not_run_on_the_loop():
    async with served() as (_, _, ch):
        call = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service="ready"))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call.read()
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_a_coroutine_streaming_handler_writes_with_the_context():
    """grpc.aio's other streaming style (the handler awaits ``context.write``), as grpc_health's asyncio
    ``Watch`` is written: the current status, then each change, until the client cancels."""
    server = GrpcServer()
    hs = health.aio.HealthServicer()
    await hs.set("ready", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    await server.start("127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            call = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service="ready"))
            assert (await call.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            await hs.set("ready", health_pb2.HealthCheckResponse.SERVING)
            assert (await call.read()).status == health_pb2.HealthCheckResponse.SERVING
            call.cancel()
            got = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="ready"))
            assert got.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(0)
    assert not any(c.streams for c in server.connections)  # the cancelled Watch left nothing open


async def test_bidi_stream_carries_messages_larger_than_every_window_both_ways():
    """3 MB and 5 MB messages: over grpcio's 64 KiB initial windows and this server's 4 MiB stream window, so
    both sides' flow control must move (the client's WINDOW_UPDATEs for what this server sends, ours for it)."""
    async with served() as (_, echo, ch):
        sizes = [1, 3_000_000, 70_000, 5_000_000]

        async def requests() -> AsyncIterator[pb.ProcessingRequest]:
            for i, n in enumerate(sizes):
                yield body_request(bytes([65 + i]) * n)

        got = [body_of(r) async for r in pb_grpc.ExternalProcessorStub(ch).Process(requests())]
        assert [len(b) for b in got] == sizes and [b[:1] for b in got] == [b"A", b"B", b"C", b"D"]
        assert echo.ended == ["finished"]


async def test_many_concurrent_streams_on_one_connection_each_get_their_own_answers():
    async with served() as (server, echo, ch):
        stub = pb_grpc.ExternalProcessorStub(ch)

        async def one(i: int) -> list[bytes]:
            async def requests() -> AsyncIterator[pb.ProcessingRequest]:
                for k in range(3):
                    yield body_request(f"{i}-{k}".encode())
            return [body_of(r) async for r in stub.Process(requests())]

        results = await asyncio.gather(*(one(i) for i in range(200)))
        assert all(r == [f"{i}-{k}".encode() for k in range(3)] for i, r in enumerate(results))
        assert len(server.connections) == 1 and echo.ended == ["finished"] * 200


async def test_abort_and_a_handler_bug_become_statuses_and_the_connection_serves_on():
    async with served() as (_, echo, ch):
        stub = pb_grpc.ExternalProcessorStub(ch)
        for data, code, details in ((b"abort", grpc.StatusCode.PERMISSION_DENIED, "no: 100% 'refused' ü"),
                                    (b"raise", grpc.StatusCode.UNKNOWN, "Unexpected error in the handler")):
            call = stub.Process(iter([body_request(b"first"), body_request(data)]))
            assert body_of(await call.read()) == b"first"
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call.read()
            assert e.value.code() == code and e.value.details() == details
        got = [body_of(r) async for r in stub.Process(iter([body_request(b"after")]))]
        assert got == [b"after"] and echo.ended == ["finished"] * 3


async def test_unknown_method_is_unimplemented():
    async with served() as (_, _, ch):
        call = ch.unary_unary("/no.Such/Method")
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call(b"")
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_message_over_the_limit_is_resource_exhausted_and_its_handler_stops():
    async with served(max_message_bytes=1000) as (_, echo, ch):
        stub = pb_grpc.ExternalProcessorStub(ch)
        call = stub.Process(iter([body_request(b"x" * 5000)]))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call.read()
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "1000" in e.value.details()
        assert [body_of(r) async for r in stub.Process(iter([body_request(b"small")]))] == [b"small"]
        assert echo.ended == ["cancelled", "finished"]


async def test_client_cancel_reaches_the_handler_as_cancellation():
    async with served() as (server, echo, ch):
        gone = asyncio.Event()

        async def requests() -> AsyncIterator[pb.ProcessingRequest]:
            yield body_request(b"wait")
            await gone.wait()

        call = pb_grpc.ExternalProcessorStub(ch).Process(requests())
        await echo.waiting.wait()
        call.cancel()
        gone.set()
        while echo.ended != ["cancelled"]:  # the RST_STREAM reaches the server
            await asyncio.sleep(0.01)
        assert not any(c.streams for c in server.connections)


async def test_stop_lets_an_open_stream_finish_and_refuses_new_ones():
    server, echo = GrpcServer(), Echo()
    pb_grpc.add_ExternalProcessorServicer_to_server(echo, server)
    await server.start("127.0.0.1", 0)
    port = server.port
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = pb_grpc.ExternalProcessorStub(ch)
        more = asyncio.Event()

        async def requests() -> AsyncIterator[pb.ProcessingRequest]:
            yield body_request(b"one")
            await more.wait()
            yield body_request(b"two")

        call = stub.Process(requests())
        assert body_of(await call.read()) == b"one"
        stopping = asyncio.create_task(server.stop(10))
        while not server.stopping:
            await asyncio.sleep(0)
        more.set()
        assert body_of(await call.read()) == b"two"
        assert await call.read() is grpc.aio.EOF
        await asyncio.wait_for(stopping, 10)
        assert echo.ended == ["finished"]
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


async def exchange(port: int, data: bytes) -> bytes:
    """What the server sends a connection that sends ``data``, until the server closes it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    got = await asyncio.wait_for(reader.read(), 10)  # until the server closes
    writer.close()
    return got


def frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
    """The whole frames in ``data``: (type, flags, stream id, payload)."""
    out, pos = [], 0
    while pos + 9 <= len(data):
        lt, flags, sid = struct.unpack_from(">IBI", data, pos)
        n = lt >> 8
        out.append((lt & 0xFF, flags, sid, data[pos + 9 : pos + 9 + n]))
        pos += 9 + n
    return out


async def test_not_http2_and_an_oversized_frame_end_the_connection_with_goaway():
    async with served() as (server, _, _):
        got = await exchange(server.port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        goaway = [f for f in frames(got) if f[0] == 7]
        assert goaway and struct.unpack(">I", goaway[0][3][4:8])[0] == 1  # PROTOCOL_ERROR
        settings = struct.pack(">IBI", 0 << 8 | 4, 0, 0)
        huge = struct.pack(">IBI", 20000 << 8 | 0, 0, 1) + b"\0" * 20000
        got = await exchange(server.port, PREFACE + settings + huge)
        goaway = [f for f in frames(got) if f[0] == 7]
        assert goaway and struct.unpack(">I", goaway[0][3][4:8])[0] == 6  # FRAME_SIZE_ERROR


async def test_a_service_registered_only_as_a_generic_handler_is_served():
    async def shout(request: bytes, ctx: Any) -> bytes:
        return request.upper()

    server = GrpcServer()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "demo.Echo", {"Shout": grpc.unary_unary_rpc_method_handler(shout)}),))
    await server.start("127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            assert await ch.unary_unary("/demo.Echo/Shout")(b"hello") == b"HELLO"
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await ch.unary_unary("/demo.Echo/Whisper")(b"")
            assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await server.stop(0)


async def test_a_stream_past_the_advertised_limit_is_refused_and_the_open_one_serves_on(monkeypatch):
    monkeypatch.setattr(h2grpc, "MAX_STREAMS", 1)
    async with served() as (server, _, _):
        enc = hpack.Encoder()

        def headers(sid: int, end_stream: bool) -> bytes:
            block = enc.encode([(":method", "POST"), (":scheme", "http"), (":authority", "x"),
                                (":path", "/envoy.service.ext_proc.v3.ExternalProcessor/Process"),
                                ("content-type", "application/grpc"), ("te", "trailers")])
            return struct.pack(">IBI", len(block) << 8 | 1, 0x4 | (0x1 if end_stream else 0), sid) + block

        message = body_request(b"late").SerializeToString()
        data = struct.pack(">BI", 0, len(message)) + message
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(PREFACE + struct.pack(">IBI", 0 << 8 | 4, 0, 0) + headers(1, False) + headers(3, True))
        got = b""
        while not any(f[0] == 3 and f[2] == 3 for f in frames(got)):  # RST_STREAM on stream 3
            got += await asyncio.wait_for(reader.read(65536), 10)
        settings = next(f for f in frames(got) if f[0] == 4 and not f[1] & 1)[3]
        assert (3, 1) in [struct.unpack_from(">HI", settings, o) for o in range(0, len(settings), 6)]
        rst = next(f for f in frames(got) if f[0] == 3 and f[2] == 3)
        assert struct.unpack(">I", rst[3])[0] == 7  # REFUSED_STREAM: the client may retry it elsewhere
        writer.write(struct.pack(">IBI", len(data) << 8 | 0, 0x1, 1) + data)  # stream 1 is still served
        while not any(f[0] == 1 and f[2] == 1 and f[1] & 0x1 for f in frames(got)):  # its trailers
            got += await asyncio.wait_for(reader.read(65536), 10)
        assert b"late" in b"".join(f[3] for f in frames(got) if f[0] == 0 and f[2] == 1)
        writer.close()


def test_a_header_block_kept_decoded_is_decoded_afresh_once_the_dynamic_table_moves():
    conn = h2grpc.H2Connection(GrpcServer())
    enc = hpack.Encoder()
    first = enc.encode([("x-a", "1")])  # a literal the table keeps: dynamic index 62 is x-a: 1
    assert conn.decode_header_block(first) == [("x-a", "1")]
    by_index = b"\xbe"  # "dynamic index 62": whatever the table holds there now
    assert conn.decode_header_block(by_index) == [("x-a", "1")]
    assert conn.decode_header_block(by_index) == [("x-a", "1")]  # answered as kept: the table did not move
    assert conn.decode_header_block(enc.encode([("x-b", "2")])) == [("x-b", "2")]  # now 62 is x-b: 2
    assert conn.decode_header_block(by_index) == [("x-b", "2")]
    path = b"\x04\x04/s/M"  # :path as Envoy sends it: a literal without indexing (RFC 7541 6.2.2)
    assert conn.decode_header_block(path) == [(":path", "/s/M")]
    assert path in conn.known_blocks and conn.decode_header_block(path) == [(":path", "/s/M")]
    big = b"\x04" + h2grpc._hpack_int(2000, 7) + b"/" * 2000  # decoded, but not kept: memory a block is bounded
    assert conn.decode_header_block(big) == [(":path", "/" * 2000)] and big not in conn.known_blocks
