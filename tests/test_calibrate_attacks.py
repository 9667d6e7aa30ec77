"""``kvrouter calibrate`` against misbehaving engines (issue 50, finding 11): real HTTP servers on loopback that send
an endless ``/metrics``, a stream with no newline or no end, nothing at all, one byte at a time, malformed or
mistyped answers, or a block size that would size a 4M-token prompt. Each run is the real command in a subprocess:
it must end with exit 2 and one line on stderr naming the engine, the probe and what was wrong (for a cap: the cap
it hit, so the read was bounded), and never a traceback."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp import web

from router.cli import main as cli_main

pytestmark = pytest.mark.sockets

ROOT = Path(__file__).resolve().parents[1]
PROBE_TOKENS = 4  # the stand-in engine's block size: the whole sweep stays tiny
METRICS_OK = ('vllm:cache_config_info{block_size="4",num_gpu_blocks="1000"} 1.0\n'
              "# TYPE vllm:time_to_first_token_seconds histogram\n"
              'vllm:time_to_first_token_seconds_bucket{le="+Inf"} 0\n'
              "vllm:time_to_first_token_seconds_count COUNT\nvllm:time_to_first_token_seconds_sum SUM\n")


def metrics_text(template: str, completions: int) -> str:
    """The page with its TTFT histogram after ``completions`` requests of 1 ms each."""
    return template.replace("COUNT", str(completions)).replace("SUM", str(0.001 * completions))


MODELS_OK = {"object": "list", "data": [{"id": "m", "max_model_len": 4096}]}


def argv(url: str, *flags: str) -> list[str]:
    return ["calibrate", "--worker", url, "--max-prompt", "40", "--repeats", "1", *flags]


async def calibrate(url: str, *flags: str) -> tuple[int, str]:
    """``kvrouter calibrate --worker URL`` as a user runs it, in its own process (its memory, what it logs at
    exit): (exit code, stderr)."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "router.cli", *argv(url, *flags), cwd=ROOT,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return proc.returncode, err.decode()


async def calibrate_here(capsys: pytest.CaptureFixture[str], url: str, *flags: str) -> tuple[int, str]:
    """The same command through the CLI's main function, in a thread beside the server (the many malformed
    answers: a process each would only add start-up time)."""
    rc = await asyncio.to_thread(cli_main, argv(url, *flags))
    return rc, capsys.readouterr().err


def assert_one_line(rc: int, stderr: str, url: str, *parts: str) -> str:
    """Exit 2, and stderr's last line (before it only the progress lines of probes that passed) is the error:
    it names the engine and each of ``parts``; no traceback anywhere."""
    assert rc == 2, stderr
    assert "Traceback" not in stderr and "exception was never retrieved" not in stderr, stderr
    lines = stderr.rstrip().splitlines()
    assert all(line.startswith("  ") for line in lines[:-1]), stderr  # progress bars only
    last = lines[-1]
    assert last.startswith(f"kvrouter calibrate: {url}: "), stderr
    for part in parts:
        assert part in last, (part, last)
    return last


class Engine:
    """A stand-in engine (named so) that answers as vLLM does (models, metrics with a TTFT histogram that counts
    each completion, streams whose repeats report cached tokens) until one of its answers is swapped for a bad
    one: the probes get as far as the bad answer."""

    def __init__(self) -> None:
        self.completions = 0
        self.models: Callable[[web.Request], Awaitable[web.StreamResponse]] = self.good_models
        self.metrics: Callable[[web.Request], Awaitable[web.StreamResponse]] = self.good_metrics
        self.stream: Callable[[web.Request], Awaitable[web.StreamResponse]] = self.good_stream

    async def good_models(self, _: web.Request) -> web.StreamResponse:
        return web.json_response(MODELS_OK)

    async def good_metrics(self, _: web.Request) -> web.StreamResponse:
        return web.Response(text=metrics_text(METRICS_OK, self.completions))

    async def good_stream(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        r = web.StreamResponse()
        await r.prepare(request)
        for _ in range(body["max_tokens"]):
            await r.write(b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n')
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"],
                 "prompt_tokens_details": {"cached_tokens": PROBE_TOKENS}}
        await r.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        await r.write(b"data: [DONE]\n\n")
        self.completions += 1
        return r

    def app(self) -> web.Application:
        async def models(request: web.Request) -> web.StreamResponse:
            return await self.models(request)

        async def metrics(request: web.Request) -> web.StreamResponse:
            return await self.metrics(request)

        async def completions(request: web.Request) -> web.StreamResponse:
            return await self.stream(request)

        app = web.Application()
        app.router.add_get("/v1/models", models)
        app.router.add_get("/metrics", metrics)
        app.router.add_post("/v1/completions", completions)
        return app


@contextlib.asynccontextmanager
async def serving(engine: Engine) -> AsyncIterator[str]:
    runner = web.AppRunner(engine.app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def raw_server(handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
                     ) -> AsyncIterator[str]:
    """A bare TCP server: for what no HTTP framework would send (no answer, a trickle, endless headers)."""
    async def guarded(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            await handle(reader, writer)
        writer.close()

    server = await asyncio.start_server(guarded, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


async def endless(request: web.Request, piece: bytes) -> web.StreamResponse:
    """A 200 whose body never ends: ``piece`` again and again until the client goes away."""
    r = web.StreamResponse()
    await r.prepare(request)
    with contextlib.suppress(ConnectionError):
        while True:
            await r.write(piece)
    return r


# ---- caps: nothing the engine sends is held past a cap ------------------------------------------------------------

async def test_an_endless_metrics_page_ends_at_its_cap():
    engine = Engine()
    engine.metrics = lambda request: endless(request, b"# " + b"x" * 65533 + b"\n")
    async with serving(engine) as url:
        rc, err = await calibrate(url)
    assert_one_line(rc, err, url, "engine check", "GET /metrics", "exceeds the 16 MiB cap")


async def test_a_metrics_page_announcing_too_much_is_refused_before_it_is_read():
    engine = Engine()
    # a Content-Length past the cap: refused from the header, nothing of the body read
    engine.metrics = lambda _: _announce(1 << 30)
    async with serving(engine) as url:
        rc, err = await calibrate(url)
    assert_one_line(rc, err, url, "GET /metrics", "Content-Length 1073741824 exceeds the 16 MiB cap")


async def _announce(length: int) -> web.StreamResponse:
    return web.Response(body=b"", headers={"Content-Length": str(length)})


async def test_a_compressed_metrics_page_is_not_inflated():
    """A gzip bomb (100 MB of zeros in ~100 KB) sent though calibrate asks for no encoding: kept compressed and
    refused as not Prometheus text, never inflated."""
    bomb = gzip.compress(b"\0" * (100 << 20), compresslevel=9)
    engine = Engine()

    async def metrics(_: web.Request) -> web.StreamResponse:
        return web.Response(body=bomb, headers={"Content-Encoding": "gzip", "Content-Type": "text/plain"})

    engine.metrics = metrics
    async with serving(engine) as url:
        rc, err = await calibrate(url)
    assert_one_line(rc, err, url, "GET /metrics", "not Prometheus text")


async def test_a_stream_line_without_a_newline_ends_at_the_line_cap():
    engine = Engine()
    first = True

    async def stream(request: web.Request) -> web.StreamResponse:
        nonlocal first
        first = False
        r = web.StreamResponse()
        await r.prepare(request)
        await r.write(b"data: ")
        with contextlib.suppress(ConnectionError):
            while True:
                await r.write(b"x" * 65536)
        return r

    engine.stream = stream
    async with serving(engine) as url:
        rc, err = await calibrate(url)
    assert not first
    assert_one_line(rc, err, url, "prefix-caching check", "POST /v1/completions",
                    "a stream line exceeds the 1 MiB cap without a newline")


async def test_an_endless_stream_of_events_ends_at_the_stream_cap():
    """Well-formed token events that never stop: the stream's total cap (1 MiB and 16 KiB per token asked for)."""
    engine = Engine()
    engine.stream = lambda request: endless(request, b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n' * 100)
    async with serving(engine) as url:
        rc, err = await calibrate(url)
    assert_one_line(rc, err, url, "prefix-caching check", "the stream exceeds the 1040 KiB cap for 1 tokens")


# ---- time: every request has an idle timeout and a deadline -------------------------------------------------------

async def test_a_server_that_accepts_and_never_answers_ends_at_the_read_timeout():
    async def silent(reader: asyncio.StreamReader, _: asyncio.StreamWriter) -> None:
        await reader.read()  # until the client gives up and closes

    async with raw_server(silent) as url:
        rc, err = await calibrate(url, "--read-timeout", "0.3")
    assert_one_line(rc, err, url, "engine check", "GET /v1/models", "no data for 0.3 s (--read-timeout)")


async def test_a_stream_that_never_starts_ends_at_the_read_timeout():
    engine = Engine()
    never = asyncio.Event()

    async def stalled(request: web.Request) -> web.StreamResponse:
        await never.wait()
        raise AssertionError("unreachable")

    engine.stream = stalled
    async with serving(engine) as url:
        rc, err = await calibrate(url, "--read-timeout", "0.3")
    assert_one_line(rc, err, url, "prefix-caching check", "POST /v1/completions", "no data for 0.3 s")


async def test_a_one_byte_trickle_ends_at_the_request_deadline():
    """A byte every 20 ms keeps the idle timeout from firing: the overall deadline ends it."""
    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        answer = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n" + b" " * 99999
        for byte in answer:
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(0.02)

    async with raw_server(trickle) as url:
        rc, err = await calibrate(url, "--read-timeout", "10", "--request-timeout", "0.5")
    assert_one_line(rc, err, url, "engine check", "GET /v1/models",
                    "no complete answer within 0.5 s (--request-timeout)")


async def test_endless_headers_are_refused():
    async def headers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\n")
        for i in range(100_000):
            writer.write(b"X-%d: %s\r\n" % (i, b"y" * 4000))
            await writer.drain()

    async with raw_server(headers) as url:
        rc, err = await calibrate(url)
    assert_one_line(rc, err, url, "engine check", "GET /v1/models", "Too many headers")


async def test_a_refused_connection_and_a_bad_url_are_one_line():
    async with raw_server(lambda r, w: asyncio.sleep(0)) as url:
        pass  # closed: nothing listens there now
    rc, err = await calibrate(url)
    assert_one_line(rc, err, url, "engine check", "GET /v1/models", "Cannot connect")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router.cli", "calibrate", "--worker", "ftp://example", cwd=ROOT,
        stderr=asyncio.subprocess.PIPE)
    _, raw = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2 and raw.decode().strip().splitlines() == [
        "kvrouter calibrate: --worker ftp://example: not an engine's base URL (http://HOST:PORT)"]


# ---- malformed and mistyped answers ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("body", "said"), [
    (b'{"data": [', "the answer is not JSON"),
    (b"[" * 200_000 + b"]" * 200_000, "the answer is not JSON"),  # nesting past the parser's recursion
    (b'{"data": [{"id": "m", "max_model_len": 1' + b"0" * 5000 + b"}]}", "the answer is not JSON"),
    (b"\xff\xfe{}", "the answer is not JSON"),
    (b'"a string"', 'not an OpenAI model list (no "data" list)'),
    (b'{"data": {"id": "m"}}', 'not an OpenAI model list (no "data" list)'),
    (b'{"data": []}', "lists no model"),
    (b'{"data": ["m"]}', "the first model's id is null"),
    (b'{"data": [{"id": 5}]}', "the first model's id is 5"),
    (b'{"data": [{"id": "m", "max_model_len": "4096"}]}', "max_model_len is \"4096\", not an integer in [1, "),
    (b'{"data": [{"id": "m", "max_model_len": 1e300}]}', "max_model_len is 1e+300, not an integer"),
    (b'{"data": [{"id": "m", "max_model_len": true}]}', "max_model_len is true, not an integer"),
    (b'{"data": [{"id": "m", "max_model_len": -1}]}', "max_model_len is -1, not an integer"),
])
async def test_a_malformed_model_list_is_one_line(capsys: pytest.CaptureFixture[str], body: bytes, said: str):
    engine = Engine()

    async def models(_: web.Request) -> web.StreamResponse:
        return web.Response(body=body, content_type="application/json")

    engine.models = models
    async with serving(engine) as url:
        rc, err = await calibrate_here(capsys, url)
    assert_one_line(rc, err, url, "engine check", "GET /v1/models", said)


BAD_METRICS = [
    # a block size that once sized a 4M-token prompt (584 MB) is refused before any prompt is built
    (METRICS_OK.replace('block_size="4"', 'block_size="1000000"'),
     'block_size is "1000000", not an integer in [1, 65536]'),
    (METRICS_OK.replace('block_size="4"', 'block_size="1e6"'), 'block_size is "1e6", not an integer'),
    (METRICS_OK.replace('block_size="4"', 'block_size="1_000"'), 'block_size is "1_000", not an integer'),
    (METRICS_OK.replace('block_size="4",', ""), "block_size is null, not an integer"),
    (METRICS_OK.replace('num_gpu_blocks="1000"', 'num_gpu_blocks="0"'), 'num_gpu_blocks is "0", not an integer'),
    # in range, but no prefix-hit prompt (eight and a half blocks) fits the context: said before any is sent
    (METRICS_OK.replace('block_size="4"', 'block_size="1024"'), "the probes need 8704 (eight and a half blocks)"),
    (METRICS_OK.replace("_sum SUM", "_sum NaN"), "not finite, non-negative figures"),
    (METRICS_OK + 'broken{le="1" 1\n', "not Prometheus text"),
]


@pytest.mark.parametrize(("metrics", "said"), BAD_METRICS)
async def test_bad_engine_figures_are_refused_before_they_size_anything(capsys: pytest.CaptureFixture[str],
                                                                        metrics: str, said: str):
    engine = Engine()

    async def bad(_: web.Request) -> web.StreamResponse:
        return web.Response(text=metrics_text(metrics, 0))

    engine.metrics = bad
    prompts: list[int] = []

    async def stream(request: web.Request) -> web.StreamResponse:
        prompts.append(len((await request.json())["prompt"]))
        raise web.HTTPInternalServerError()

    engine.stream = stream
    async with serving(engine) as url:
        rc, err = await calibrate_here(capsys, url, "--max-prompt", "8192")
    assert_one_line(rc, err, url, "engine check", said)
    assert prompts == []  # refused on the figures alone: not one prompt was built or sent


@pytest.mark.parametrize(("events", "said"), [
    (b"data: {nope\n\n", "a stream event is not JSON"),
    (b"data: [1, 2]\n\n", "a stream event is list, not a JSON object"),
    (b'data: {"choices": "x"}\n\n', "a stream event's choices is str, not a list"),
    (b'data: {"choices": [], "usage": [1]}\n\n', "usage is not a JSON object of counts"),
    (b'data: {"choices": [], "usage": {"prompt_tokens": "many"}}\n\n',
     "usage.prompt_tokens is \"many\", not an integer"),
    (b'data: {"choices": [{}], "usage": {"prompt_tokens": 16, "prompt_tokens_details": {"cached_tokens": 99}}}\n\n',
     "usage.prompt_tokens_details.cached_tokens is 99, not an integer in [0, 16]"),
    # the engine's own words, on the one line: a newline in them cannot forge a second
    (b'data: {"error": {"message": "boom\\nkvrouter calibrate: forged", "code": 500}}\n\n',
     "the engine streamed an error: boom kvrouter calibrate: forged"),
])
async def test_a_malformed_stream_event_is_one_line(capsys: pytest.CaptureFixture[str], events: bytes, said: str):
    engine = Engine()

    async def stream(request: web.Request) -> web.StreamResponse:
        r = web.StreamResponse()
        await r.prepare(request)
        await r.write(events)
        return r

    engine.stream = stream
    async with serving(engine) as url:
        rc, err = await calibrate_here(capsys, url)
    assert_one_line(rc, err, url, "prefix-caching check", "POST /v1/completions", said)


async def test_an_error_answer_is_one_line_with_a_short_excerpt():
    engine = Engine()

    async def stream(_: web.Request) -> web.StreamResponse:
        return web.Response(status=500, text="line one\nline two\n" + "z" * (10 << 20))

    engine.stream = stream
    async with serving(engine) as url:
        rc, err = await calibrate(url)
    last = assert_one_line(rc, err, url, "prefix-caching check", "POST /v1/completions answered HTTP 500: line one "
                           "line two zzz")
    assert len(last) < 1000


async def test_a_batch_failing_in_the_decode_probe_says_one_error():
    """The engine answers until the decode probe's 16 concurrent streams, then fails every one of them: one error
    naming the probe, the other streams cancelled (none left to log a traceback at exit)."""
    engine = Engine()
    good = engine.stream
    failed = 0

    async def stream(request: web.Request) -> web.StreamResponse:
        nonlocal failed
        if (await request.json())["max_tokens"] > 1:
            failed += 1
            return web.Response(status=503, text="overloaded")
        return await good(request)

    engine.stream = stream
    async with serving(engine) as url:
        rc, err = await calibrate(url)
    assert failed >= 1 and engine.completions > 0  # the earlier probes passed
    assert_one_line(rc, err, url, "decode probe", "POST /v1/completions answered HTTP 503: overloaded")
