"""Parse an OpenAI-style request body once, for every frontend (proxy and endpoint picker).

Turns the body into what routing needs: token ids through the model's own tokenizer and chat template,
block keys (with the LoRA name and the tenant's ``cache_salt``), the requested output length and model.
Bad input raises ``BadRequest`` with a message meant for the client: no client input may end in a 5xx.

Parsing is bounded before it is paid for (prompts that cannot fit the largest served context are refused
from their length alone) and runs off the event loop (``RequestParser``): one huge prompt must not stall
the health checks and every other request of the router.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from router.keys import request_keys
from router.scheduling import RouteRequest
from router.tokenizer import PromptError, PromptTokenizer, context_error

ERROR_KINDS = {404: "NotFoundError", 413: "RequestEntityTooLarge", 429: "TooManyRequests"}
TENANT_MISSING_MODES = ("reject", "no_salt")
_json_decode = msgspec.json.Decoder().decode
_json_encode = msgspec.json.Encoder().encode


def error_response(status: int, message: str, kind: str = "BadRequestError",
                   headers: dict[str, str] | None = None) -> web.Response:
    """An error as vLLM's OpenAI server shapes it (the proxy and the simulated worker both answer so)."""
    body = {"object": "error", "message": message, "type": kind, "param": None, "code": status}
    return web.json_response(body, status=status, headers=headers)


class BadRequest(ValueError):
    """A request refused for what the client sent (or, with 429, for how much is already being parsed)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status

    @property
    def kind(self) -> str:
        return ERROR_KINDS.get(self.status, "BadRequestError")


@dataclass(frozen=True, slots=True)
class SaltRule:
    """Where a request's ``cache_salt`` comes from. ``trust_client``: the body's own (no tenant header is
    configured); otherwise ``salt`` (the trusted header's value, or None: the body's salt is removed)."""

    trust_client: bool = True
    salt: str | None = None


def salt_rule(headers: Mapping[str, str], tenant_header: str | None, missing: str = "reject") -> SaltRule:
    """With a trusted tenant header configured the client's ``cache_salt`` is never used: the header's value
    is, and a request without the header is refused (``missing="reject"``) or served with no salt at all."""
    if not tenant_header:
        return SaltRule()
    tenant = headers.get(tenant_header)
    if tenant:
        return SaltRule(False, tenant)
    if missing == "no_salt":
        return SaltRule(False, None)
    raise BadRequest(f"the {tenant_header} header is required")


@dataclass(slots=True)
class ParsedRequest:
    body: dict[str, Any]
    raw: bytes  # what to forward: the client's bytes, or the body re-encoded when the salt was changed
    chat: bool
    model: str | None
    stream: bool
    max_tokens: int
    cache_salt: str | None
    token_ids: list[int]

    def route_request(self, request_id: str, block_size: int, lora: str | None = None,
                      session: str | None = None, subset: frozenset[str] | None = None) -> RouteRequest:
        keys = request_keys(self.token_ids, block_size, lora_name=lora, cache_salt=self.cache_salt)
        return RouteRequest(request_id, keys, len(self.token_ids), block_size, self.max_tokens, self.model, lora,
                            session, subset)


def _positive_int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if type(value) is not int or value < 1:
        raise BadRequest(f"'{name}' must be a positive integer")
    return value


def parse_body(raw: bytes, path: str, tokenizer_for: Callable[[str | None], PromptTokenizer],
               salt: SaltRule = SaltRule(), max_model_len: int | None = None) -> ParsedRequest:
    """``path`` tells chat from completions; ``salt`` says whose ``cache_salt`` counts; ``max_model_len``
    (the largest context a worker serves) bounds the prompt before it is tokenized."""
    try:
        body = _json_decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise BadRequest("request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    chat = path.split("?", 1)[0].rstrip("/").endswith("chat/completions")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false")
    asked = _positive_int(body, "max_completion_tokens") if chat else None
    if asked is None:
        asked = _positive_int(body, "max_tokens")
    if salt.trust_client:
        cache_salt = body.get("cache_salt")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise BadRequest("'cache_salt' must be a non-empty string")
    else:
        # always re-encoded: the client's bytes may repeat the key, and a parser that keeps the first value
        # (the worker's may) would read the client's salt where ours was meant
        cache_salt = salt.salt
        body.pop("cache_salt", None)
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
    try:
        tokenizer = tokenizer_for(model)
    except KeyError:
        raise BadRequest(f"The model `{model}` does not exist.", 404) from None
    try:
        ids = tokenizer.prompt_ids(body, chat, max_model_len)
    except PromptError as e:
        raise BadRequest(str(e)) from None
    if max_model_len is not None:
        refusal = context_error(len(ids), asked, max_model_len)
        if refusal:
            raise BadRequest(refusal)
    return ParsedRequest(body, raw if salt.trust_client else _json_encode(body), chat, model, stream,
                         asked if asked is not None else 16, cache_salt, ids)


class RequestParser:
    """Runs ``parse_body`` on worker threads, a bounded number at once, so the event loop stays free.

    JSON decoding and tokenizing (which releases the GIL) happen on the threads; bodies up to
    ``inline_bytes`` are parsed inline, where a thread hop would cost more than the work. Past
    ``max_pending`` requests being parsed, new ones are refused with 429 rather than queued without bound.
    """

    def __init__(self, tokenizer_for: Callable[[str | None], PromptTokenizer], threads: int = 2,
                 max_pending: int = 64, inline_bytes: int = 8192) -> None:
        self.tokenizer_for = tokenizer_for
        self.max_pending = max_pending
        self.inline_bytes = inline_bytes
        self.pending = 0
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvrouter-parse")

    async def parse(self, raw: bytes, path: str, salt: SaltRule = SaltRule(),
                    max_model_len: int | None = None) -> ParsedRequest:
        if len(raw) <= self.inline_bytes:
            return parse_body(raw, path, self.tokenizer_for, salt, max_model_len)
        if self.pending >= self.max_pending:
            raise BadRequest(f"{self.pending} large requests are being parsed; retry later", 429)
        self.pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._pool, parse_body, raw, path, self.tokenizer_for, salt, max_model_len)
        finally:
            self.pending -= 1

    async def route_request(self, parsed: ParsedRequest, request_id: str, block_size: int, **kw: Any) -> RouteRequest:
        """``parsed.route_request`` (block keys: a hash per block), on a worker thread for long prompts."""
        if len(parsed.token_ids) <= self.inline_bytes:
            return parsed.route_request(request_id, block_size, **kw)
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, lambda: parsed.route_request(request_id, block_size, **kw))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
