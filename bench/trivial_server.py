"""A trivial OpenAI-shaped HTTP server: the HTTP floor that the benchmarks compare against."""

from __future__ import annotations

import sys

from aiohttp import web

BODY = {"id": "cmpl-0", "object": "text_completion", "created": 0, "model": "sim-model",
        "choices": [{"index": 0, "text": "ok", "logprobs": None, "finish_reason": "length", "stop_reason": None}],
        "usage": {"prompt_tokens": 1, "total_tokens": 2, "completion_tokens": 1,
                  "prompt_tokens_details": {"cached_tokens": 0}}}


async def completions(request: web.Request) -> web.Response:
    await request.read()
    return web.json_response(BODY)


async def health(request: web.Request) -> web.Response:
    return web.Response()


def main() -> None:
    app = web.Application()
    app.add_routes([web.post("/v1/completions", completions), web.get("/health", health)])
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)


if __name__ == "__main__":
    main()
