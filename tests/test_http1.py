"""The proxy's HTTP/1.1 (router/frontends/http1.py) over real sockets: raw clients where framing is the point."""

import asyncio
import contextlib

import pytest

from router.frontends import http1

pytestmark = pytest.mark.sockets


async def echo(request: http1.Request) -> http1.Response | None:
    if request.path == "/stream":
        out = request.stream(200, {"content-type": "text/plain"})
        for part in (b"one ", b"two ", b"three"):
            await out.write(part)
        await out.write_eof()
        return None
    return http1.Response(200, request.method.encode() + b" " + request.path.encode() + b" " + request.body,
                          {"x-query": request.query})


@contextlib.asynccontextmanager
async def server(handler=echo, max_body: int = 1000, refused: list | None = None):
    srv = await http1.serve(handler, "127.0.0.1", 0, max_body, refused=refused.append if refused is not None else None)
    try:
        yield srv.sockets[0].getsockname()[1]
    finally:
        srv.close()


async def exchange(port: int, data: bytes) -> bytes:
    """Send ``data``, read until the server closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    out = await reader.read()
    writer.close()
    return out


async def test_pipelined_requests_are_answered_in_order_on_one_connection():
    async with server() as port:
        out = await exchange(port, b"POST /a?x=1 HTTP/1.1\r\nhost: h\r\ncontent-length: 3\r\n\r\nabc"
                                   b"GET /b HTTP/1.1\r\nhost: h\r\n\r\n"
                                   b"POST /c HTTP/1.1\r\nhost: h\r\ntransfer-encoding: chunked\r\nconnection: close\r\n"
                                   b"\r\n2\r\nde\r\n1\r\nf\r\n0\r\n\r\n")
    answers = out.split(b"HTTP/1.1 200 OK\r\n")[1:]
    assert len(answers) == 3
    assert answers[0].endswith(b"POST /a abc") and b"x-query: x=1" in answers[0]
    assert answers[1].endswith(b"GET /b ")
    assert answers[2].endswith(b"POST /c def") and b"connection: close" in answers[2]


async def test_a_body_over_the_limit_is_a_413_from_its_length_and_the_client_reads_it():
    refused: list = []
    async with server(max_body=10, refused=refused) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /a HTTP/1.1\r\nhost: h\r\ncontent-length: 100000\r\n\r\n" + b"x" * 50000)
        out = await reader.read()  # the server reads and drops the rest before it closes
        writer.close()
    assert out.startswith(b"HTTP/1.1 413 ") and b'"code": 413' in out and b"10-byte limit" in out
    assert refused == [413]


async def test_chunked_body_over_the_limit_is_a_413():
    async with server(max_body=4) as port:
        out = await exchange(port, b"POST /a HTTP/1.1\r\nhost: h\r\ntransfer-encoding: chunked\r\n\r\n"
                                   b"3\r\nabc\r\n3\r\ndef\r\n0\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 413 ")


async def test_oversized_headers_are_a_431_malformed_requests_a_400_and_upgrades_are_not_made():
    async with server() as port:
        big = await exchange(port, b"GET /a HTTP/1.1\r\nhost: h\r\nx-big: " + b"y" * 70000 + b"\r\n\r\n")
        many = await exchange(port, b"GET /a HTTP/1.1\r\n" + b"".join(b"x-%d: 1\r\n" % i for i in range(200)) +
                              b"\r\n")
        junk = await exchange(port, b"NOT HTTP AT ALL\r\n\r\n")
        upgrade = await exchange(port, b"GET /a HTTP/1.1\r\nhost: h\r\nconnection: upgrade\r\n"
                                       b"upgrade: websocket\r\n\r\n")
    assert big.startswith(b"HTTP/1.1 431 ") and many.startswith(b"HTTP/1.1 431 ")
    assert junk.startswith(b"HTTP/1.1 400 ") and b"malformed" in junk
    assert upgrade.startswith(b"HTTP/1.1 200 ") and b"connection: close" in upgrade  # served, never upgraded


async def test_streams_are_chunked_to_http11_and_close_delimited_to_http10():
    async with server() as port:
        v11 = await exchange(port, b"GET /stream HTTP/1.1\r\nhost: h\r\nconnection: close\r\n\r\n")
        v10 = await exchange(port, b"GET /stream HTTP/1.0\r\n\r\n")
    assert b"transfer-encoding: chunked" in v11 and v11.endswith(b"4\r\none \r\n4\r\ntwo \r\n5\r\nthree\r\n0\r\n\r\n")
    assert b"transfer-encoding" not in v10 and b"connection: close" in v10 and v10.endswith(b"\r\n\r\none two three")


async def test_expect_100_continue_is_answered_before_the_body():
    async with server() as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /a HTTP/1.1\r\nhost: h\r\ncontent-length: 2\r\nexpect: 100-continue\r\n\r\n")
        assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"ok")
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ") and await reader.readexactly(10) == b"POST /a ok"
        writer.close()


async def test_a_client_going_away_cancels_its_request():
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def slow(request: http1.Request) -> http1.Response:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        raise AssertionError("unreachable")

    async with server(slow) as port:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /a HTTP/1.1\r\nhost: h\r\n\r\n")
        await started.wait()
        writer.close()
        await asyncio.wait_for(cancelled.wait(), 10)


@contextlib.asynccontextmanager
async def raw_worker(answer):
    """A worker speaking raw bytes: ``answer(reader, writer)`` per connection; yields its port and the
    connections it accepted."""
    accepted: list = []

    async def on_conn(reader, writer):
        accepted.append(writer)
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            await answer(reader, writer)
        writer.close()

    srv = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    try:
        yield srv.sockets[0].getsockname()[1], accepted
    finally:
        srv.close()


async def test_a_connection_the_worker_closed_while_idle_is_retried_on_a_new_one():
    async def once_then_close(reader, writer):  # keeps nothing alive, though its answer says keep-alive
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()

    pool = http1.UpstreamPool()
    async with raw_worker(once_then_close) as (port, accepted):
        for _ in range(3):
            r = await pool.request("GET", "127.0.0.1", port, "/x", [], b"", 5.0)
            assert (r.status, await r.read()) == (200, b"ok")
            r.release()
            await asyncio.sleep(0)  # nothing to wait on: the close may or may not have arrived; both must work
        assert len(accepted) == 3
    pool.close()


async def test_every_idle_connection_dead_at_once_costs_one_retry_on_a_new_connection():
    """A restarted worker leaves every connection kept alive to it dead. The retry takes a new connection, not
    the next dead one from the pool (which once answered 500 "unreachable" in the soak test's worker kill)."""
    async def one_answer_per_connection(reader, writer):  # the next request on it: closed, not a byte back
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        await reader.readuntil(b"\r\n\r\n")

    pool = http1.UpstreamPool()
    async with raw_worker(one_answer_per_connection) as (port, accepted):
        first = await asyncio.gather(*(pool.request("GET", "127.0.0.1", port, "/x", [], b"", 5.0)
                                       for _ in range(3)))
        for r in first:
            assert await r.read() == b"ok"
            r.release()
        assert len(accepted) == 3  # three kept alive, each dead to its next request
        r = await pool.request("GET", "127.0.0.1", port, "/x", [], b"", 5.0)
        assert (r.status, await r.read()) == (200, b"ok") and len(accepted) == 4
        r.release()
    pool.close()


async def test_a_worker_dying_mid_body_is_an_upstream_error_and_a_whole_answer_reuses_the_connection():
    async def half(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")
        await writer.drain()

    async def keep(reader, writer):
        while True:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n")
            await writer.drain()

    pool = http1.UpstreamPool()
    async with raw_worker(half) as (port, _):
        r = await pool.request("POST", "127.0.0.1", port, "/x", {"a": "b"}, b"body", 5.0)
        assert r.status == 200 and r.content_length == 10
        with pytest.raises(http1.UpstreamError):
            await r.read()
        r.release()
    async with raw_worker(keep) as (port, accepted):
        for _ in range(3):
            r = await pool.request("POST", "127.0.0.1", port, "/x", [], b"", 5.0)
            assert await r.read() == b"abc"
            r.release()
        assert len(accepted) == 1
        accepted[0].close()  # the pooled connection dies, and nobody listens there any more
    with pytest.raises(http1.UpstreamError):
        await pool.request("GET", "127.0.0.1", port, "/x", [], b"", 5.0)
    pool.close()


async def test_a_worker_that_does_not_answer_times_out():
    async def silent(reader, writer):
        await reader.read()

    pool = http1.UpstreamPool()
    async with raw_worker(silent) as (port, _):
        with pytest.raises(TimeoutError):
            await pool.request("GET", "127.0.0.1", port, "/x", [], b"", 0.2)
    pool.close()
