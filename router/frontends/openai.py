"""Parse an OpenAI-style request body once, for every frontend (proxy and endpoint picker).

Turns the body into what routing needs: token ids through the model's own tokenizer and chat template,
block keys (with the LoRA name and the tenant's ``cache_salt``), the requested output length and model.
Bad input raises ``BadRequest`` with a message meant for the client: no client input may end in a 5xx.

Parsing is bounded before it is paid for (prompts that cannot fit the largest served context are refused
from their length alone) and runs off the event loop (``RequestParser``): one huge prompt must not stall
the health checks and every other request of the router.

Endpoints (``PATH_KINDS``): completions, chat, embeddings and the Responses API (``instructions`` + ``input``
rendered through the chat template, so a long shared ``instructions`` is a cached prefix like a chat system
prompt). Batches: a completions ``prompt`` or an embeddings ``input`` may hold up to ``MAX_BATCH`` (256)
prompts, every one of them checked as a lone prompt is (length bound before tokenizing, ids inside the
vocabulary, the context limit), a refused one named by its index. A batch parses to one ``ParsedRequest``
holding every prompt's ids, routed as one on the prompts' longest shared prefix (``token_ids``) with the
work of all of them; the proxy ``split``s a non-streamed completions batch instead, one routed request per
prompt, and merges the answers (``merge_completions``): see router/frontends/proxy.py.

``/tokenize`` and ``/detokenize`` (``tokenize_body``, ``detokenize_body``) are answered from the router's own
tokenizer, in vLLM's shapes, bounded and checked the same way.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from router.frontends.api_paths import api_path
from router.frontends.http1 import error_body
from router.keys import request_keys
from router.scheduling import RouteRequest
from router.scheduling.slo import (
    NO_OBJECTIVE,
    OBJECTIVE_HEADER_NAMES,
    ObjectiveError,
    ObjectiveForbidden,
    ServiceObjective,
    SloConfig,
    objective_for,
)
from router.tokenizer import PromptError, PromptTokenizer, context_error

ERROR_KINDS = {403: "PermissionDeniedError", 404: "NotFoundError", 413: "RequestEntityTooLarge",
               429: "TooManyRequests"}
TENANT_MISSING_MODES = ("reject", "no_salt")
DEFAULT_MAX_N = 128  # choices per prompt (config max_n): vLLM sets no bound; the router's work per request needs one
# max_tokens where no context bounds it (every live front end knows one): past any model's context, and small enough
# that a request's work (max_tokens x n x prompts) stays a machine integer
MAX_TOKENS_BOUND = 2**31 - 1
ECHO_CHARS = 256  # a client's string echoed in an answer or a log line is cut to this (a 5 MB model name was echoed)
_json_decode = msgspec.json.Decoder().decode
_json_encode = msgspec.json.Encoder().encode
# what a request body is, by its endpoint (router/tokenizer.py KINDS)
PATH_KINDS = {"/v1/completions": "completions", "/v1/chat/completions": "chat", "/v1/embeddings": "embeddings",
              "/v1/responses": "responses"}


class _RequestIds:
    """Ids the router keys a request's accounting by: 32 hex characters (as ``uuid4().hex``), a random 64-bit
    prefix per process and a counter. A uuid4 per request cost the proxy 1% of its CPU (a ``getrandom`` call and
    a UUID object each); uniqueness across processes and replicas needs only the prefix to differ."""

    def __init__(self) -> None:
        self.reset()
        os.register_at_fork(after_in_child=self.reset)  # a forked child must not repeat its parent's ids

    def reset(self) -> None:
        self._prefix = os.urandom(8).hex()
        self._counter = itertools.count()

    def new(self) -> str:
        return f"{self._prefix}{next(self._counter):016x}"


new_request_id = _RequestIds().new


def request_kind(path: str) -> str:
    """The kind of body ``path`` takes (any other path: chat if it ends so, else completions)."""
    p = api_path(path)
    return PATH_KINDS.get(p) or ("chat" if p.endswith("chat/completions") else "completions")


def error_response(status: int, message: str, kind: str = "BadRequestError",
                   headers: dict[str, str] | None = None) -> web.Response:
    """An error as vLLM's OpenAI server shapes it (the proxy and the simulated worker both answer so)."""
    return web.json_response(error_body(status, message, kind), status=status, headers=headers)


def client_text(text: object, limit: int = ECHO_CHARS) -> str:
    """A client's string as it may be echoed (in an answer) or logged: at most ``limit`` characters, then an
    ellipsis, and with every control character escaped (a CR LF in a model name forged log lines)."""
    text = str(text)
    cut = len(text) > limit
    text = text[:limit]
    if not text.isprintable():
        text = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
    return text + "..." if cut else text


class BadRequest(ValueError):
    """A request refused for what the client sent (or, with 429, for how much is already being parsed)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message if len(message) <= 4 * ECHO_CHARS else message[: 4 * ECHO_CHARS] + "...")
        self.status = status  # (a message quoting the client is bounded here whatever quoted it)

    @property
    def kind(self) -> str:
        return ERROR_KINDS.get(self.status, "BadRequestError")


@dataclass(frozen=True, slots=True)
class SaltRule:
    """Where a request's ``cache_salt`` comes from. ``trust_client``: the body's own (no tenant header is
    configured); otherwise ``salt`` (derived from the trusted header's value, or None: the body's salt is
    removed). ``tenant``: the trusted header's value (None: no header configured, or none sent)."""

    trust_client: bool = True
    salt: str | None = None
    tenant: str | None = None


def trusted_header(headers: Mapping[str, str], name: str) -> str | None:
    """The value of a header the router decides by (the tenant, the objective, the targets, the fairness id),
    refused when repeated: a gateway that appends its value instead of replacing the client's would otherwise
    let the client's win (the proxy read the first value, the picker the last). ``headers``: a multi-mapping
    (``getall``: the proxy's request headers, the picker's ``_headers_of``); a plain mapping cannot repeat."""
    getall = getattr(headers, "getall", None)
    if getall is None:
        return headers.get(name)
    values = getall(name, ())
    if len(values) > 1:
        raise BadRequest(f"the {name} header was sent {len(values)} times; it must be sent once")
    return values[0] if values else None


def tenant_salt(secret: bytes, tenant: str) -> str:
    """The ``cache_salt`` of a tenant's requests: HMAC-SHA256 of its name under the router's secret, hex. The
    tenant's name as sent was guessable, and with it whoever could query a worker's cache by salt could probe
    another tenant's prompts block by block; only the router (and replicas given the same secret) can compute
    this one."""
    return hmac.new(secret, tenant.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()


_PROCESS_SECRET = os.urandom(32)  # salts where no secret is given (a RouterConfig built without load_config)


def salt_rule(headers: Mapping[str, str], tenant_header: str | None, missing: str = "reject",
              secret: str | bytes | None = None) -> SaltRule:
    """With a trusted tenant header configured the client's ``cache_salt`` is never used: the tenant's derived
    salt (``tenant_salt`` under ``secret``; None: this process's random one) is, and a request without the header
    is refused (``missing="reject"``) or served with no salt at all. A repeated tenant header is refused."""
    if not tenant_header:
        return SaltRule()
    tenant = trusted_header(headers, tenant_header)
    if tenant:
        key = _PROCESS_SECRET if secret is None else secret.encode() if isinstance(secret, str) else secret
        return SaltRule(False, tenant_salt(key, tenant), tenant)
    if missing == "no_salt":
        return SaltRule(False, None)
    raise BadRequest(f"the {tenant_header} header is required")


def request_objective(headers: Mapping[str, str], slo: SloConfig, model: str | None,
                      tenant: str | None) -> ServiceObjective:
    """The request's service objective (router/scheduling/slo.py: llm-d's target headers, GIE's objective header,
    the config's defaults); a malformed one is a 400 naming the header, a repeated one a 400, an objective above
    the one config gives the request a 403. ``tenant``: the trusted tenant header's value, or None (a client's own
    claim of a tenant is never read)."""
    for name in OBJECTIVE_HEADER_NAMES:
        trusted_header(headers, name)
    try:
        return objective_for(headers, slo, model, tenant)
    except ObjectiveForbidden as e:
        raise BadRequest(str(e), 403) from None
    except ObjectiveError as e:
        raise BadRequest(str(e)) from None


@dataclass(slots=True)
class ParsedRequest:
    body: dict[str, Any]
    raw: bytes  # what to forward: the client's bytes, or the body re-encoded when the salt was changed
    chat: bool
    model: str | None
    stream: bool
    max_tokens: int
    cache_salt: str | None
    token_ids: list[int]  # what it is routed on: its prompt, or a batch's longest shared prefix
    kind: str = "completions"  # completions | chat | embeddings | responses
    prompts: list[list[int]] = field(default_factory=list)  # every prompt's ids: one, or a batch's in order
    n: int = 1  # choices per prompt

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts)) if self.prompts else len(self.token_ids)

    @property
    def batch(self) -> bool:
        return len(self.prompts) > 1

    @property
    def splittable(self) -> bool:
        """One completion or chat prompt, one sample: what a prefill/decode split can serve (vLLM's handoff
        carries one request's KV)."""
        return self.kind in ("completions", "chat") and self.n == 1 and not self.batch

    def route_request(self, request_id: str, block_size: int, lora: str | None = None,
                      session: str | None = None, subset: frozenset[str] | None = None,
                      objective: ServiceObjective = NO_OBJECTIVE) -> RouteRequest:
        """Keyed on ``token_ids``; the work is every prompt's (a batch sent as one costs all of it)."""
        keys = request_keys(self.token_ids, block_size, lora_name=lora, cache_salt=self.cache_salt)
        outputs = self.max_tokens * self.n * max(1, len(self.prompts))
        return RouteRequest(request_id, keys, self.prompt_tokens, block_size, outputs, self.model, lora,
                            session, subset, objective=objective)

    def with_fields(self, **fields: Any) -> bytes:
        """The body to forward with ``fields`` set (None: removed), re-encoded."""
        body = dict(self.body)
        for k, v in fields.items():
            if v is None:
                body.pop(k, None)
            else:
                body[k] = v
        return _json_encode(body)

    def split(self) -> list[ParsedRequest]:
        """A completions batch as one request per prompt: the body as parsed (salt rule applied) with that
        prompt alone, re-encoded."""
        members = self.body["prompt"]
        out = []
        for member, ids in zip(members, self.prompts, strict=True):
            body = {**self.body, "prompt": member}
            out.append(ParsedRequest(body, _json_encode(body), self.chat, self.model, self.stream, self.max_tokens,
                                     self.cache_salt, ids, self.kind, [ids], self.n))
        return out


def shared_prefix(prompts: list[list[int]]) -> list[int]:
    """The longest prefix every prompt starts with (slice comparisons, a binary search per prompt)."""
    first = prompts[0]
    n = len(first)
    for p in prompts[1:]:
        hi = min(n, len(p))
        if p[:hi] == first[:hi]:
            n = hi
            continue
        lo, hi = 0, hi - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if p[:mid] == first[:mid]:
                lo = mid
            else:
                hi = mid - 1
        n = lo
    return first[:n]


def merge_completions(answers: list[dict[str, Any]], n: int = 1) -> dict[str, Any]:
    """One completions answer from a batch's per-prompt answers, as vLLM answers a batch: every prompt's
    choices in prompt order, re-indexed ``prompt_index * n + choice index``; usage summed, cached tokens
    included; the rest (id, created, model) from the first answer."""
    choices: list[dict[str, Any]] = []
    totals = {"prompt_tokens": 0, "total_tokens": 0, "completion_tokens": 0}
    cached: int | None = None
    for i, answer in enumerate(answers):
        for c in answer.get("choices") or []:
            if isinstance(c, dict):
                j = c.get("index")
                choices.append({**c, "index": i * n + (j if type(j) is int and j >= 0 else 0)})
        usage = answer.get("usage")
        if not isinstance(usage, dict):
            continue
        for k in totals:
            if type(usage.get(k)) is int:
                totals[k] += usage[k]
        details = usage.get("prompt_tokens_details")
        hit = details.get("cached_tokens") if isinstance(details, dict) else None
        if type(hit) is int and hit >= 0:
            cached = (cached or 0) + hit
    choices.sort(key=lambda c: c["index"])
    usage_out: dict[str, Any] = {**totals, "prompt_tokens_details": None if cached is None else
                                 {"cached_tokens": cached}}
    return {**answers[0], "choices": choices, "usage": usage_out}


def _positive_int(body: dict[str, Any], name: str, most: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if type(value) is not int or value < 1:
        raise BadRequest(f"'{name}' must be a positive integer")
    if value > most:
        raise BadRequest(f"'{name}' must be at most {most}")
    return value


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = _json_decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise BadRequest("request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def _model_tokenizer(body: dict[str, Any], tokenizer_for: Callable[[str | None], PromptTokenizer]
                     ) -> tuple[str | None, PromptTokenizer]:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string")
    try:
        return model, tokenizer_for(model)
    except KeyError:
        raise BadRequest(model_not_found(model), 404) from None


def model_not_found(name: str | None) -> str:
    """vLLM's own words for a model it does not serve (the proxy and the picker answer a 404 with them), the name
    cut to ``ECHO_CHARS`` (the answer to a 5 MB name was 5 MB)."""
    return f"The model `{client_text(name)}` does not exist."


def parse_body(raw: bytes, path: str, tokenizer_for: Callable[[str | None], PromptTokenizer],
               salt: SaltRule = SaltRule(), max_model_len: int | None = None,
               max_n: int = DEFAULT_MAX_N) -> ParsedRequest:
    """``path`` names the endpoint (``request_kind``); ``salt`` says whose ``cache_salt`` counts;
    ``max_model_len`` (the largest context a worker serves) bounds every prompt before it is tokenized, and every
    prompt with the output asked for (at most ``MAX_TOKENS_BOUND`` in any case); ``max_n`` bounds ``n`` (config
    ``max_n``): the router charges a request's work as its output times ``n``, and an unbounded ``n`` (10^13)
    pinned flow control; over either is a 400 naming the field."""
    body = _json_object(raw)
    kind = request_kind(path)
    chat = kind == "chat"
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string")
    stream = False
    if kind != "embeddings":  # an embedding is never streamed (vLLM ignores the field there)
        stream = body.get("stream", False)
        if stream is None:
            stream = False
        if not isinstance(stream, bool):
            raise BadRequest("'stream' must be true or false")
    asked = None
    most = MAX_TOKENS_BOUND  # where a context is known, a prompt and its output are refused past it below
    if chat:
        asked = _positive_int(body, "max_completion_tokens", most)
    elif kind == "responses":
        asked = _positive_int(body, "max_output_tokens", most)
    if asked is None and kind in ("completions", "chat"):
        asked = _positive_int(body, "max_tokens", most)
    n = _positive_int(body, "n", max_n) if kind in ("completions", "chat") else None
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
    # the prefill/decode handoff is the router's to set: a client's would have a decode worker pull KV from a host
    # the client names, or a prefill worker hold blocks for nobody
    reencode = not salt.trust_client or body.pop("kv_transfer_params", None) is not None
    _, tokenizer = _model_tokenizer(body, tokenizer_for)
    try:
        prompts = tokenizer.request_prompts(body, kind, max_model_len)
    except PromptError as e:
        raise BadRequest(str(e)) from None
    if max_model_len is not None:
        name = "input" if kind == "embeddings" else "prompt"
        for i, ids in enumerate(prompts):
            refusal = context_error(len(ids), asked, max_model_len, embedding=kind == "embeddings")
            if refusal:
                raise BadRequest(f"{name}[{i}]: {refusal}" if len(prompts) > 1 else refusal)
    token_ids = prompts[0] if len(prompts) == 1 else shared_prefix(prompts)
    if asked is None:
        asked = 1 if kind == "embeddings" else 16  # an embedding is one forward pass
    return ParsedRequest(body, _json_encode(body) if reencode else raw, chat, model, stream, asked,
                         cache_salt, token_ids, kind, prompts, n or 1)


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be true or false")
    return value


def tokenize_body(raw: bytes, tokenizer_for: Callable[[str | None], PromptTokenizer],
                  max_model_len: int | None = None) -> dict[str, Any]:
    """vLLM's ``POST /tokenize`` from the router's own tokenizer: ``{"prompt": str}`` or ``{"messages": [...]}``
    (``add_generation_prompt``), ``add_special_tokens`` (vLLM's defaults: on for a prompt, off for messages),
    ``return_token_strs``; a text that cannot fit ``max_model_len`` is refused before it is tokenized."""
    body = _json_object(raw)
    _, tokenizer = _model_tokenizer(body, tokenizer_for)
    chat = "messages" in body
    special = _flag(body, "add_special_tokens", not chat)
    strs = _flag(body, "return_token_strs", False)
    try:
        if chat:
            text = tokenizer.render_chat(body["messages"], _flag(body, "add_generation_prompt", True), max_model_len)
        else:
            text = body.get("prompt")
            if not isinstance(text, str):
                raise PromptError("'prompt' (a string) or 'messages' is required")
        ids = tokenizer.encode(text, max_model_len, add_special_tokens=special)
    except PromptError as e:
        raise BadRequest(str(e)) from None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
            "token_strs": tokenizer.token_strs(ids) if strs else None}


def detokenize_body(raw: bytes, tokenizer_for: Callable[[str | None], PromptTokenizer],
                    max_model_len: int | None = None) -> dict[str, Any]:
    """vLLM's ``POST /detokenize``: ``{"tokens": [ids]}`` -> ``{"prompt": text}`` (special tokens kept, as vLLM
    decodes); the ids are checked as a prompt's are (integers inside the vocabulary, at most ``max_model_len``)."""
    body = _json_object(raw)
    _, tokenizer = _model_tokenizer(body, tokenizer_for)
    tokens = body.get("tokens")
    if tokens == []:
        return {"prompt": ""}
    try:
        ids = tokenizer.check_ids(tokens, max_model_len)
    except PromptError as e:
        raise BadRequest(f"'tokens': {e}") from None
    return {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}


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
                    max_model_len: int | None = None, max_n: int = DEFAULT_MAX_N) -> ParsedRequest:
        return await self._run(raw, lambda: parse_body(raw, path, self.tokenizer_for, salt, max_model_len, max_n))

    async def tokenizer_path(self, raw: bytes, path: str, max_model_len: int | None = None) -> dict[str, Any]:
        """The answer to ``/tokenize`` or ``/detokenize`` (``path``), from the router's own tokenizer."""
        fn = detokenize_body if api_path(path) == "/detokenize" else tokenize_body
        return await self._run(raw, lambda: fn(raw, self.tokenizer_for, max_model_len))

    async def _run(self, raw: bytes, work: Callable[[], Any]) -> Any:
        if len(raw) <= self.inline_bytes:
            return work()
        if self.pending >= self.max_pending:
            raise BadRequest(f"{self.pending} large requests are being parsed; retry later", 429)
        self.pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, work)
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
