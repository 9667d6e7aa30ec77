"""Parse an OpenAI-style request body once, for every frontend (proxy and endpoint picker).

Turns the body into what routing needs: token ids through the model's own tokenizer and chat template,
block keys (with the LoRA name and the tenant's ``cache_salt``), the requested output length and model.
Bad input raises ``BadRequest`` with a message meant for the client.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from router.keys import request_keys
from router.scheduling import RouteRequest
from router.tokenizer import PromptError, PromptTokenizer


def error_response(status: int, message: str, kind: str = "BadRequestError",
                   headers: dict[str, str] | None = None) -> web.Response:
    """An error as vLLM's OpenAI server shapes it (the proxy and the simulated worker both answer so)."""
    body = {"object": "error", "message": message, "type": kind, "param": None, "code": status}
    return web.json_response(body, status=status, headers=headers)


class BadRequest(ValueError):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(slots=True)
class ParsedRequest:
    body: dict[str, Any]
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


def parse_body(raw: bytes, path: str, tokenizer_for: Callable[[str | None], PromptTokenizer],
               forced_salt: str | None = None) -> ParsedRequest:
    """``path`` tells chat from completions; ``forced_salt`` (from a trusted tenant header) wins over the body."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    chat = path.rstrip("/").endswith("chat/completions")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", 16)) if chat else body.get("max_tokens", 16)
    if max_tokens is None:
        max_tokens = 16
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise BadRequest("'max_tokens' must be a positive integer")
    salt = forced_salt if forced_salt is not None else body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise BadRequest("'cache_salt' must be a non-empty string")
    try:
        tokenizer = tokenizer_for(model)
    except KeyError:
        raise BadRequest(f"The model `{model}` does not exist.", 404) from None
    try:
        ids = tokenizer.prompt_ids(body, chat)
    except PromptError as e:
        raise BadRequest(str(e)) from None
    if forced_salt is not None:
        body["cache_salt"] = forced_salt
    return ParsedRequest(body, chat, model, bool(body.get("stream")), max_tokens, salt, ids)
