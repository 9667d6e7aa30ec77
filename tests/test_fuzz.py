"""Fuzz tier (hypothesis): every input a client or an engine controls, at the four places it enters.

- the request parser (``parse_body``): any bytes, and JSON bodies with every field of a wrong type, give a
  ``ParsedRequest`` whose token ids are in the vocabulary, or a ``BadRequest`` with a 4xx: nothing else;
- the chat renderer: hostile ``messages`` give a string (token ids) or a ``PromptError``;
- the event decoder and the feed: any frames, any msgpack, and mutated real vLLM payloads decode or are
  ``MalformedFrame``; whatever decodes never breaks the feed, and each bad event is counted as malformed;
- the ext_proc message handling (``EndpointPicker.Process``, in-process): any sequence of Envoy messages,
  in any order, gives no exception, no 5xx but a routing refusal, and leaves no request in flight.

Thousands of cases in all, in seconds: each test sets its own ``max_examples``. The crash reproducers
found so far are kept as ``@example``s.
"""

from __future__ import annotations

import asyncio
import json
from array import array
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from router.discovery import WorkerSpec
from router.events import codec
from router.events.codec import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventMessage,
    MalformedFrame,
    decode_message,
    decode_payload,
    decode_replay_frames,
    encode_payload,
    token_ids_of,
)
from router.events.feed import Gap, IndexFeeder
from router.events.recording import read_recording
from router.frontends.epp import DEST_HEADER, LB_NAMESPACE, SUBSET_KEY, SUBSET_NAMESPACE, EndpointPicker
from router.frontends.fleet import Fleet
from router.frontends.metrics import RouterMetrics
from router.frontends.openai import BadRequest, ParsedRequest, SaltRule, parse_body, salt_rule
from router.index import KvIndex, Medium
from router.keys import request_keys
from router.scheduling import RouteRequest, RoutingConfig, RoutingCore
from router.tokenizer import PromptError, load_tokenizer
from tests.conftest import FIXTURE

TOK = load_tokenizer()
VOCAB = TOK.vocab_size
KNOWN_MODELS = (None, "m", "lora-a")
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
FUZZ = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large,
                                                     HealthCheck.large_base_example, HealthCheck.filter_too_much]}


def tokenizer_for(model: str | None):  # type: ignore[no-untyped-def]
    """The one test tokenizer for the served models; an unknown model name is a 404."""
    if model not in KNOWN_MODELS:
        raise KeyError(model)
    return TOK


# ---- values a client can put in JSON -----------------------------------------------------------------------

EDGE_INTS = st.sampled_from([0, 1, -1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**100,
                             -(2**63), -(2**64), VOCAB - 1, VOCAB, 10**30])
INTS = st.one_of(st.integers(-3, 64), EDGE_INTS, st.integers())
# lone surrogates included (category Cs): JSON can only carry them as "\ud800" escapes or invalid UTF-8
TEXT = st.one_of(
    st.text(max_size=24),
    st.text(st.characters(categories=("L", "N", "P", "Zs", "Cc", "Cs")), max_size=8),
    st.sampled_from(["", " ", "\x00", "\ud800", "a\udfff", "\ud83d\ude00", "<|user|>", "{{ 7*7 }}", "{% raw %}"]),
)
SCALARS = st.one_of(st.none(), st.booleans(), INTS, st.floats(), TEXT)
JSON_VALUES = st.recursive(
    SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(TEXT, inner, max_size=4)),
    max_leaves=12)
TOKEN = st.one_of(st.integers(0, VOCAB - 1), INTS, st.booleans(), st.floats(), st.none(), TEXT)
TOKEN_LISTS = st.one_of(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40), st.lists(TOKEN, max_size=12))
PROMPTS = st.one_of(TEXT, TOKEN_LISTS, st.lists(TEXT, max_size=2), st.lists(TOKEN_LISTS, max_size=2), JSON_VALUES)
PARTS = st.one_of(
    st.fixed_dictionaries({}, optional={"type": st.one_of(st.sampled_from(["text", "image_url", "TEXT"]), SCALARS),
                                        "text": st.one_of(TEXT, JSON_VALUES)}),
    JSON_VALUES)
ROLES = st.one_of(st.sampled_from(["user", "system", "assistant", "tool", ""]), SCALARS)
MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": ROLES}, optional={
        "content": st.one_of(TEXT, st.none(), st.lists(PARTS, max_size=3), JSON_VALUES), "name": JSON_VALUES}),
    st.fixed_dictionaries({}, optional={"content": TEXT}),
    JSON_VALUES)
MESSAGES = st.one_of(st.lists(MESSAGE, max_size=4), JSON_VALUES)
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "prompt": PROMPTS,
    "messages": MESSAGES,
    "model": st.one_of(st.sampled_from([None, "m", "lora-a", "unknown-model"]), SCALARS),
    "max_tokens": st.one_of(st.integers(1, 80), INTS, SCALARS),
    "max_completion_tokens": st.one_of(st.integers(1, 80), INTS, SCALARS),
    "stream": st.one_of(st.booleans(), SCALARS),
    "cache_salt": st.one_of(st.sampled_from(["tenantA", "evil", ""]), SCALARS),
}
# a body as (key, value) members: keys may repeat, as raw JSON allows
GOOD_PROMPTS = st.one_of(st.text(min_size=1, max_size=80), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=80))
GOOD_MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                                "content": st.text(max_size=40)}), min_size=1, max_size=3)
MEMBERS = st.lists(st.one_of(*(st.tuples(st.just(k), v) for k, v in FIELDS.items()), st.tuples(TEXT, JSON_VALUES)),
                   max_size=5)
DEEP = st.builds(lambda n, opener, tail: opener * n + tail, st.integers(200, 100_000),
                 st.sampled_from([b"[", b'{"a":', b'{"prompt":[', b'{"messages":[{"role":"user","content":[']),
                 st.sampled_from([b"", b"1", b"]", b"}"]))


def dumps(value: Any, ascii_only: bool) -> str:
    return json.dumps(value, ensure_ascii=ascii_only)


def encode_members(members: list[tuple[str, Any]], ascii_only: bool) -> bytes:
    text = "{" + ",".join(f"{dumps(k, ascii_only)}:{dumps(v, ascii_only)}" for k, v in members) + "}"
    return text.encode("utf-8", "surrogatepass")  # a lone surrogate becomes invalid UTF-8, as a client may send


def top_level_members(raw: bytes) -> list[tuple[str, Any]]:
    """The members of a JSON object exactly as written, repeats included (``json.loads`` keeps the last)."""
    seen: list[list[tuple[str, Any]]] = []
    json.loads(raw, object_pairs_hook=lambda pairs: seen.append(pairs) or dict(pairs))
    return seen[-1]


def requested_output(body: dict[str, Any], chat: bool) -> int | None:
    if chat and body.get("max_completion_tokens") is not None:
        return body["max_completion_tokens"]  # type: ignore[no-any-return]
    return body.get("max_tokens")


TRUST_CLIENT = SaltRule()


def check_parse(raw: bytes, path: str, salt: SaltRule = TRUST_CLIENT, max_model_len: int | None = None
                ) -> ParsedRequest | None:
    """The parser's contract: a usable request, or a client error (never another exception)."""
    try:
        parsed = parse_body(raw, path, tokenizer_for, salt, max_model_len)
    except BadRequest as e:
        event(f"refused {e.status}")
        assert e.status in (400, 404, 413, 429), e.status
        assert str(e)
        if e.status == 404:
            assert msgspec.json.decode(raw).get("model") not in KNOWN_MODELS
        return None
    event("parsed")
    chat = path.split("?", 1)[0].rstrip("/").endswith("chat/completions")
    assert parsed.chat == chat
    prompts = parsed.prompts  # every prompt: one, or a batch's (each checked as a lone prompt is)
    assert prompts and all(isinstance(p, list) and p for p in prompts), prompts
    assert all(type(t) is int and 0 <= t < VOCAB for p in prompts for t in p), prompts
    ids = parsed.token_ids  # what it is routed on: the prompt, or the batch's longest shared prefix
    assert isinstance(ids, list) and all(p[: len(ids)] == ids for p in prompts), ids
    assert len(prompts) == 1 or any(len(p) == len(ids) for p in prompts) or len({p[len(ids)] for p in prompts}) > 1
    assert parsed.model in KNOWN_MODELS
    assert type(parsed.stream) is bool
    assert type(parsed.max_tokens) is int and parsed.max_tokens >= 1
    assert parsed.cache_salt is None or (isinstance(parsed.cache_salt, str) and parsed.cache_salt)
    rreq = parsed.route_request("x", 16)
    assert isinstance(rreq, RouteRequest)
    assert rreq.prompt_tokens == sum(map(len, prompts)) and len(rreq.keys) == len(ids) // 16
    assert rreq.keys == request_keys(ids, 16, cache_salt=parsed.cache_salt)
    if max_model_len is not None:
        asked = requested_output(parsed.body, chat)
        for p in prompts:
            if asked is None:
                assert len(p) < max_model_len
            else:
                assert asked == parsed.max_tokens and len(p) + asked <= max_model_len
    return parsed


PATHS = st.sampled_from([COMPLETIONS, CHAT, COMPLETIONS + "/", CHAT + "?x=1", "/v1/chat/completions/"])
LIMITS = st.sampled_from([None, None, 64, 8, 1, 2**20])
SALTS = st.sampled_from([SaltRule(), SaltRule(False, "tenantA"), SaltRule(False, None)])


# ---- 1. the request parser ---------------------------------------------------------------------------------

JSONISH = st.text(st.sampled_from('{}[]":,0123456789.-+eE tfnrulas\\ud8\n'), max_size=60).map(str.encode)


@settings(max_examples=1500, **FUZZ)
@given(st.one_of(st.binary(max_size=200), JSONISH, DEEP), PATHS, LIMITS)
@example(b"[" * 100_000, COMPLETIONS, None)
@example(b'{"prompt": "\\ud800"}', COMPLETIONS, None)
@example(b'{"prompt": [18446744073709551616, true]}', COMPLETIONS, 64)
def test_parse_body_any_bytes_is_a_request_or_a_client_error(raw, path, limit):
    check_parse(raw, path, max_model_len=limit)


@st.composite
def hostile_bodies(draw: st.DrawFn) -> tuple[list[tuple[str, Any]], str]:
    """A path and a body for it: mostly a usable prompt among hostile members (anywhere, possibly repeated)."""
    path = draw(PATHS)
    members = draw(MEMBERS)
    if draw(st.sampled_from([True, True, True, False])):
        chat = path.split("?", 1)[0].rstrip("/").endswith("chat/completions")
        good = ("messages", draw(GOOD_MESSAGES)) if chat else ("prompt", draw(GOOD_PROMPTS))
        members.insert(draw(st.integers(0, len(members))), good)
    return members, path


@settings(max_examples=1200, **FUZZ)
@given(hostile_bodies(), st.booleans(), SALTS, LIMITS)
@example(([("prompt", [True, 1])], COMPLETIONS), True, SaltRule(), None)
@example(([("prompt", [[1, 2]]), ("max_tokens", 2**64)], COMPLETIONS), True, SaltRule(), 64)
@example(([("messages", [{"role": "user", "content": [{"type": "text", "text": 5}]}])], CHAT), True, SaltRule(), None)
@example(([("messages", [{"role": "user", "content": "\ud800"}])], CHAT), False, SaltRule(False, "tenantA"), None)
@example(([("prompt", "x"), ("model", "unknown-model")], COMPLETIONS), True, SaltRule(), None)
@example(([("prompt", "abc " * 300), ("max_tokens", 10)], COMPLETIONS), True, SaltRule(), 64)
@example(([("prompt", list(range(63)))], COMPLETIONS), True, SaltRule(), 64)
@example(([("prompt", list(range(60))), ("max_tokens", 4)], COMPLETIONS), True, SaltRule(), 64)
def test_parse_body_hostile_json_is_a_request_or_a_client_error(body, ascii_only, salt, limit):
    members, path = body
    check_parse(encode_members(members, ascii_only), path, salt, limit)


@settings(max_examples=300, **FUZZ)
@given(st.one_of(st.text(min_size=1, max_size=300), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=300)),
       st.one_of(st.none(), st.integers(1, 64)), st.booleans())
def test_well_formed_completions_always_parse_to_the_engines_tokens(prompt, max_tokens, stream):
    body: dict[str, Any] = {"prompt": prompt, "stream": stream}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    parsed = check_parse(json.dumps(body).encode(), COMPLETIONS)
    assert parsed is not None
    assert parsed.token_ids == (TOK.encode(prompt) if isinstance(prompt, str) else prompt)
    assert parsed.max_tokens == (max_tokens or 16) and parsed.stream is stream and parsed.cache_salt is None


SALT_MEMBERS = st.lists(st.tuples(st.just("cache_salt"), st.one_of(st.sampled_from(["tenantA", "evil"]), SCALARS)),
                        max_size=3)


def salted_body(before: list[tuple[str, Any]], after: list[tuple[str, Any]], chat: bool) -> bytes:
    prompt = ("messages", [{"role": "user", "content": "hello there"}]) if chat else ("prompt", "hello there")
    return encode_members([*before, prompt, *after], True)


@settings(max_examples=600, **FUZZ)
@given(SALT_MEMBERS, SALT_MEMBERS, st.booleans(), st.sampled_from(["tenantA", None]))
@example([], [("cache_salt", None)], False, None)  # an explicit null salt is forwarded as written
@example([("cache_salt", "evil")], [("cache_salt", "tenantA")], False, "tenantA")  # a repeated key is forwarded
@example([("cache_salt", "evil")], [("cache_salt", None)], False, None)
def test_trusted_tenant_salt_replaces_whatever_the_body_said(before, after, chat, tenant):
    """With a tenant header configured, the forwarded bytes carry the tenant's salt and no other: every
    ``cache_salt`` member, not only the last one a last-wins JSON parser would keep."""
    raw = salted_body(before, after, chat)
    parsed = check_parse(raw, CHAT if chat else COMPLETIONS, SaltRule(False, tenant))
    if parsed is None:  # the body's salt, whatever it is, is not the client's to get wrong: only bad JSON is refused
        with pytest.raises(msgspec.DecodeError):
            msgspec.json.decode(raw)
        return
    assert parsed.cache_salt == tenant
    forwarded = json.loads(parsed.raw)
    if tenant is None:
        assert "cache_salt" not in forwarded, parsed.raw
    else:
        assert forwarded["cache_salt"] == tenant
    salts = [v for k, v in top_level_members(parsed.raw) if k == "cache_salt"]
    assert (not salts) if tenant is None else set(salts) == {tenant}, parsed.raw
    assert parsed.route_request("x", 16).keys == request_keys(parsed.token_ids, 16, cache_salt=tenant)


@settings(max_examples=300, **FUZZ)
@given(SALT_MEMBERS, st.booleans())
def test_a_trusted_client_salt_is_used_as_sent(members, chat):
    raw = salted_body(members, [], chat)
    parsed = check_parse(raw, CHAT if chat else COMPLETIONS)
    if parsed is None:  # refused: not JSON (a lone surrogate), or the last salt (the one that counts) is no string
        try:
            last = msgspec.json.decode(raw).get("cache_salt")
        except msgspec.DecodeError:
            return
        assert last is not None and not (isinstance(last, str) and last)
        return
    assert parsed.raw is raw  # forwarded untouched
    assert parsed.cache_salt == json.loads(raw).get("cache_salt")


# ---- 2. the chat renderer ----------------------------------------------------------------------------------

@settings(max_examples=800, **FUZZ)
@given(MESSAGES, st.sampled_from([None, 1, 8, 64, 4096]), st.booleans())
@example([{"role": "user", "content": [{"type": "text", "text": 5}]}], None, True)
@example([{"role": "user", "content": [{"text": "a"}, {"type": "image_url"}, "x"]}], None, True)
@example([{"role": 5, "content": "x"}], None, True)
@example([{"role": "user", "content": "\ud800"}], None, True)
@example([{"role": "user", "content": "{{ 7*7 }}{% for x in range(10**9) %}{% endfor %}"}], None, True)
@example([{"role": "user", "content": "x" * 10_000}], 8, True)
def test_render_chat_is_text_or_a_prompt_error(messages, budget, generation_prompt):
    try:
        text = TOK.render_chat(messages, add_generation_prompt=generation_prompt, token_budget=budget)
    except PromptError as e:
        assert str(e)
    else:
        assert isinstance(text, str)
    try:
        ids = TOK.encode_chat(messages, token_budget=budget)
    except PromptError as e:
        assert str(e)
    else:
        assert isinstance(ids, list)
        assert all(type(t) is int and 0 <= t < VOCAB for t in ids)


@settings(max_examples=300, **FUZZ)
@given(st.lists(st.tuples(st.sampled_from(["user", "system", "assistant"]),
                          st.one_of(st.text(max_size=40), st.lists(st.text(max_size=10), max_size=3))),
                min_size=1, max_size=4))
def test_well_formed_messages_render_their_text_verbatim(turns):
    messages = [{"role": r, "content": c if isinstance(c, str) else [{"type": "text", "text": t} for t in c]}
                for r, c in turns]
    text = TOK.render_chat(messages)
    pos = 0
    for role, content in turns:
        piece = f"<|{role}|>\n{content if isinstance(content, str) else ''.join(content)}<|end|>"
        found = text.find(piece, pos)
        assert found >= 0, (piece, text)
        pos = found + len(piece)
    assert TOK.encode_chat(messages) == TOK.encode(text)


# ---- 3. the event decoder and the feed ---------------------------------------------------------------------

U64 = st.integers(0, 2**64 - 1)
MP_INTS = st.one_of(st.integers(-3, 64), st.integers(-(2**63), 2**64 - 1),
                    st.sampled_from([2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1, -(2**63), -1]))
MP_SCALARS = st.one_of(st.none(), st.booleans(), MP_INTS, st.floats(), st.text(max_size=8), st.binary(max_size=8),
                       st.builds(msgspec.msgpack.Ext, st.integers(-128, 127), st.binary(max_size=4)))
MP_VALUES = st.recursive(MP_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.one_of(st.text(max_size=6), MP_INTS), inner, max_size=3)),
    max_leaves=10)
HASHES = st.one_of(U64, st.integers(-(2**63), -1), st.binary(max_size=8))
MEDIA = st.sampled_from([None, "GPU", "cpu", "CPU_PINNED", "STORAGE", "disk", "EXTERNAL", "", "TAPE"])
EVENT_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "block_hashes": st.one_of(st.lists(HASHES, max_size=5), MP_VALUES),
    "parent_block_hash": st.one_of(st.none(), HASHES, MP_VALUES),
    "token_ids": st.one_of(st.lists(st.integers(0, VOCAB - 1), max_size=48), st.lists(MP_INTS, max_size=48),
                           MP_VALUES),
    "block_size": st.one_of(st.sampled_from([16, 16, 0, -16, 1, 2**63 - 1, 2**64 - 1]), MP_INTS, MP_VALUES),
    "lora_id": st.one_of(st.none(), MP_INTS, MP_VALUES),
    "medium": st.one_of(MEDIA, MP_VALUES),
    "lora_name": st.one_of(st.none(), st.text(max_size=5), MP_VALUES),
    "extra_keys": st.one_of(st.none(), st.lists(st.one_of(st.none(), st.lists(st.text(max_size=4), max_size=2),
                                                          MP_VALUES), max_size=4), MP_VALUES),
    "group_idx": st.one_of(st.none(), MP_INTS, MP_VALUES),
    "kv_cache_spec_kind": st.one_of(st.none(), st.text(max_size=5), MP_VALUES),
    "cache_salt": st.one_of(st.none(), st.text(max_size=5), MP_VALUES),
}
TAGS = st.one_of(st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "BlockStored", "Unknown"]),
                 MP_VALUES)
ORDER = {"BlockStored": list(EVENT_FIELDS)[:-1], "BlockRemoved": ["block_hashes", "medium", "group_idx"]}


@st.composite
def wild_events(draw: st.DrawFn) -> Any:
    tag = draw(TAGS)
    names = draw(st.lists(st.sampled_from(list(EVENT_FIELDS)), unique=True, max_size=len(EVENT_FIELDS)))
    if draw(st.booleans()) and isinstance(tag, str) and tag in ORDER:  # every field this type requires
        names = [n for n in ORDER[tag] if n in names or n in ORDER[tag][:4]]
    fields = {n: draw(EVENT_FIELDS[n]) for n in names}
    shape = draw(st.sampled_from(["map", "map", "array", "junk"]))
    if shape == "map":
        return {"type": tag, **fields}
    if shape == "array":  # the tagged-array shape, fields in declaration order
        return [tag, *(fields.get(n) for n in (ORDER.get(tag, names) if isinstance(tag, str) else names))]
    return draw(MP_VALUES)


@st.composite
def wild_payloads(draw: st.DrawFn) -> bytes:
    ts = draw(st.one_of(st.floats(), st.integers(-(2**63), 2**64 - 1), MP_VALUES))
    events = draw(st.one_of(st.lists(wild_events(), max_size=4), MP_VALUES))
    rank = draw(st.one_of(st.none(), st.integers(0, 3), MP_INTS, MP_VALUES))
    outer = draw(st.sampled_from([[ts, events, rank], [ts, events], [ts, events, rank, rank], [events], "junk"]))
    return msgspec.msgpack.encode(draw(MP_VALUES) if outer == "junk" else outer)


def _deep(n: int, where: str) -> bytes:
    """msgpack nested ``n`` arrays deep, at the top, as the events, or inside one event's ``extra_keys``."""
    enc = msgspec.msgpack.encode
    nested = b"\x91" * n + b"\xc0"
    if where == "top":
        return nested
    if where == "events":
        return b"\x93" + enc(0.0) + nested + enc(0)
    event = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": list(range(16)),
             "block_size": 16}
    body = b"".join(enc(k) + enc(v) for k, v in event.items())
    return b"\x93" + enc(0.0) + b"\x91" + bytes([0x80 | len(event) + 1]) + body + enc("extra_keys") + b"\x91" + \
        nested + enc(0)


DEEP_PAYLOADS = st.builds(_deep, st.integers(1, 20_000), st.sampled_from(["top", "events", "extra_keys"]))


def _seed_payloads() -> list[bytes]:
    """Real vLLM 0.32 payloads (../shared, read in place), and a few built here, to mutate."""
    built = [
        EventBatch(1.5, [BlockStored([11, 12], None, list(range(32)), 16, None, "GPU", None, [None, None], 0, None),
                         BlockRemoved([11], "GPU", 0), AllBlocksCleared()], 0),
        EventBatch(2.0, [BlockStored([b"\x01" * 8], 7, list(range(16)), 16, None, "CPU", None, None, 0, None)], None),
    ]
    seeds = [encode_payload(b) for b in built]
    if FIXTURE.exists():
        seeds += [r.frames[2] for r in read_recording(FIXTURE) if r.kind == "pub" and len(r.frames) == 3]
    return seeds


SEEDS = _seed_payloads()


@st.composite
def mutated_payloads(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["flip", "flip", "set", "insert", "delete", "truncate"]))
        i = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and data:
            data[i] = draw(st.sampled_from([0x00, 0x7F, 0x80, 0xC0, 0xC1, 0xCF, 0xD3, 0xDD, 0xDF, 0xFF]))
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=9))
        elif op == "delete":
            del data[i : i + draw(st.integers(1, 8))]
        elif op == "truncate":
            del data[i:]
    return bytes(data)


PAYLOADS = st.one_of(wild_payloads(), mutated_payloads(), st.binary(max_size=64), DEEP_PAYLOADS)


def decoded(payload: bytes, raw_tokens: bool = False) -> EventBatch | None:
    """The decoder's contract: a batch of known events, or ``MalformedFrame`` (nothing else); ``raw_tokens``:
    the router's ingest decode (token ids left raw)."""
    try:
        batch = decode_payload(payload, raw_tokens)
    except MalformedFrame as e:
        assert str(e)
        return None
    assert isinstance(batch, EventBatch)
    assert all(isinstance(e, BlockStored | BlockRemoved | AllBlocksCleared) for e in batch.events)
    return batch


def counted(feeder: IndexFeeder) -> int:
    """Events the feed has accounted for: applied (by type) or malformed."""
    f = feeder.feeds.get("w")
    return 0 if f is None else sum(f.events.values()) + f.malformed


def check_index(feeder: IndexFeeder, probe: list[int]) -> None:
    held = feeder.index.blocks_held("w")
    assert all(n >= 0 for n in held.values())
    feeder.index.match(request_keys(probe, 16))
    feeder.index.clear_worker("w")
    assert sum(feeder.index.blocks_held("w").values()) == 0


@settings(max_examples=800, **FUZZ)
@given(st.lists(PAYLOADS, min_size=1, max_size=4), st.lists(st.sampled_from([1, 1, 1, 3, 0, -1]), max_size=4),
       st.data())
@example([_deep(5000, "top")], [], None)
@example([_deep(5000, "events")], [], None)
@example([_deep(5000, "extra_keys")], [], None)
def test_any_payload_decodes_or_is_malformed_and_never_breaks_the_feed(payloads, steps, data):
    feeder = IndexFeeder(KvIndex(), block_size=16)
    raw_tokens = data is not None and data.draw(st.booleans(), label="raw_tokens")
    batches = [b for b in (decoded(p, raw_tokens) for p in payloads) if b is not None]
    seq, now = 0, 0.0
    for i, batch in enumerate(batches):
        before = counted(feeder)
        now += 1.0
        gap = feeder.offer("w", seq, batch, now)
        if gap is None:  # applied: each event counted once, as its type or as malformed
            assert counted(feeder) - before == len(batch.events)
        else:
            assert isinstance(gap, Gap) and gap.next_seq == seq
            replayed = [(s, b) for s, b in zip(range(gap.first_missing, gap.next_seq), batches, strict=False)]
            if data is not None and replayed:
                replayed = data.draw(st.lists(st.sampled_from(replayed), unique_by=lambda r: r[0]), label="replay")
            feeder.fill_gap(gap, replayed, batch, now)
            grown = counted(feeder) - before
            assert len(batch.events) <= grown <= len(batch.events) + sum(len(b.events) for _, b in replayed)
        seq = max(0, seq + (steps[i] if i < len(steps) else 1))
    check_index(feeder, list(range(64)))


@settings(max_examples=800, **FUZZ)
@given(st.lists(st.one_of(st.binary(max_size=12), st.sampled_from([b"", b"kv", b"\xff" * 8, bytes(8)]),
                          mutated_payloads()), max_size=5))
@example([b"kv", bytes(8), _deep(5000, "top")])
@example([b"", b"kv", bytes(8), _deep(5000, "extra_keys")])
def test_any_frames_decode_or_are_malformed(frames):
    for decode in (decode_message, decode_replay_frames):
        try:
            msg = decode(frames)
        except MalformedFrame:
            continue
        assert msg is None or (isinstance(msg, EventMessage) and isinstance(msg.batch, EventBatch))
        assert msg is None or 0 <= msg.seq < 2**64


def test_an_event_nested_as_deep_as_the_decoder_accepts_is_counted_not_raised():
    """The deepest ``extra_keys`` that ``decode_payload`` accepts here (found by bisection, as the limit is the
    interpreter's recursion limit less the stack in use) must be applied or counted malformed by the feed."""
    lo, hi = 1, 5000
    while lo < hi:
        mid = (lo + hi + 1) // 2
        try:
            decode_payload(_deep(mid, "extra_keys"))
        except (MalformedFrame, RecursionError):
            hi = mid - 1
        else:
            lo = mid
    batch = decode_payload(_deep(lo, "extra_keys"))
    feeder = IndexFeeder(KvIndex(), block_size=16)
    assert feeder.offer("w", 0, batch, 1.0) is None
    assert counted(feeder) == 1


@settings(max_examples=500, **FUZZ)
@given(st.one_of(st.lists(MP_INTS, max_size=40), st.lists(st.integers(0, 2**32 - 1), min_size=15, max_size=70000),
                 MP_VALUES).map(msgspec.msgpack.encode).flatmap(
    lambda b: st.one_of(st.just(b), st.binary(max_size=4).map(lambda x: b + x), st.just(b[: max(0, len(b) - 1)]))))
def test_raw_token_ids_read_as_a_full_decode_reads_them(raw):
    assert codec._uint32_array is not None, "router.events._fasttokens was not built: is a C compiler installed?"
    """``token_ids_of`` (router/events/_fasttokens.c, then msgspec) on any bytes: the ids a decoded list holds,
    as uint32s when they all are, or ``MalformedFrame``; never anything else."""
    try:
        expected = msgspec.msgpack.decode(raw, type=list[int])
    except (msgspec.ValidationError, msgspec.DecodeError):
        with pytest.raises(MalformedFrame):
            token_ids_of(msgspec.Raw(raw))
        return
    got = token_ids_of(msgspec.Raw(raw))
    assert list(got) == expected
    assert isinstance(got, array) == all(0 <= t < 2**32 for t in expected)


VALID_MEDIA = {"GPU": Medium.GPU, "CPU": Medium.CPU, "CPU_PINNED": Medium.CPU, "STORAGE": Medium.STORAGE,
               "DISK": Medium.STORAGE, "EXTERNAL": Medium.STORAGE}
TOKEN_IDS = st.one_of(st.integers(0, VOCAB - 1), st.integers(0, VOCAB - 1), st.integers(2**32, 2**64 - 1),
                      st.integers(-(2**63), -1), st.just(2**32 - 1))


@st.composite
def shaped_stored(draw: st.DrawFn) -> tuple[dict[str, Any], bool]:
    """A BlockStored with every field of the right type but its shape possibly wrong, and whether it is bad."""
    n = draw(st.integers(0, 4))
    block_size = draw(st.sampled_from([16, 16, 16, 8, 1, 0, -16, 2**63 - 1]))
    hashes = draw(st.lists(st.one_of(U64, st.binary(min_size=1, max_size=8)), min_size=n, max_size=n, unique=True))
    if 0 < block_size <= 32 and draw(st.booleans()):
        tokens = draw(st.lists(TOKEN_IDS, min_size=n * block_size, max_size=n * block_size))
    else:
        tokens = draw(st.lists(TOKEN_IDS, max_size=70))
    medium = draw(MEDIA)
    extras = draw(st.one_of(st.none(), st.lists(st.one_of(st.none(), st.lists(st.text(max_size=3), min_size=1,
                                                                                max_size=2)), max_size=5)))
    event = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": tokens,
             "block_size": block_size, "lora_id": None, "medium": medium, "lora_name": None, "extra_keys": extras}
    bad = (block_size <= 0 or len(tokens) != n * block_size or (bool(medium) and medium.upper() not in VALID_MEDIA)
           or (block_size in (16, 8, 1) and ((extras is not None and len(extras) != n)
                                              or any(not 0 <= t < 2**32 for t in tokens))))
    return event, bad


@settings(max_examples=500, **FUZZ)
@given(shaped_stored(), st.booleans(), st.booleans())
@example(({"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [2**32] * 16,
           "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": None}, True), False,
         True)
@example(({"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1] * 16,
           "block_size": -16, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": None}, True), True,
         False)
def test_a_malformed_block_stored_is_counted_and_a_good_one_is_indexed(case, as_array, raw_tokens):
    event, bad = case
    shaped = ["BlockStored", *list(event.values())[1:]] if as_array else event
    batch = decoded(msgspec.msgpack.encode([1.0, [shaped], 0]), raw_tokens)
    assert batch is not None and len(batch.events) == 1 and isinstance(batch.events[0], BlockStored)
    feeder = IndexFeeder(KvIndex(), block_size=16)
    assert feeder.offer("w", 0, batch, 1.0) is None
    f = feeder.feeds["w"]
    assert (f.malformed, f.events["BlockStored"]) == ((1, 0) if bad else (0, 1))
    held = feeder.index.blocks_held("w")
    n = len(event["block_hashes"])
    if bad or event["block_size"] not in (16, 8, 1):
        assert sum(held.values()) == 0
        assert f.block_size_mismatch == (0 if bad else n)
    else:  # 8 and 1 tile the router's 16: re-chunked into its blocks (router/events/rechunk.py)
        medium = VALID_MEDIA[event["medium"].upper()] if event["medium"] else Medium.GPU
        assert held[medium] == n * event["block_size"] // 16 and f.block_size_mismatch == 0


# ---- 4. the ext_proc message handling ----------------------------------------------------------------------

ADDRESSES = ("127.0.0.1:1", "127.0.0.1:2")
ALLOWED_REFUSALS = {400, 404, 413, 429, 503}
ROUTING_REFUSALS = ("no eligible endpoint", "no endpoints known", "every eligible worker is saturated")


class StandInContext:
    """Stands in for ``grpc.aio.ServicerContext``: ``Process`` only iterates its requests."""


def build_picker(max_body_bytes: int, max_inflight: int | None, unhealthy: tuple[str, ...]
                 ) -> tuple[RoutingCore, EndpointPicker]:
    """As ``tests/envoy_helpers.start_picker`` builds it, without a server and without starting the fleet
    (nothing is contacted: the addresses are never dialled)."""
    core = RoutingCore(RoutingConfig(policy="precise", block_size=16, seed=0, max_inflight_requests=max_inflight))
    fleet = Fleet(core)
    fleet.add(WorkerSpec("w0", f"http://{ADDRESSES[0]}"))
    fleet.add(WorkerSpec("w1", f"http://{ADDRESSES[1]}", models=frozenset({"m"}), loras=frozenset({"lora-a"})))
    for wid in unhealthy:
        core.endpoints[wid].healthy = False
    picker = EndpointPicker(core, fleet, lambda m: load_tokenizer(), 16, RouterMetrics(fleet),
                            tenant_header="x-tenant", max_body_bytes=max_body_bytes)
    return core, picker


HEADER_TEXT = st.text(max_size=12)  # protobuf strings: no lone surrogates


def header_map(pairs: list[tuple[str, str | bytes]]) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v) if isinstance(v, bytes) else base_pb2.HeaderValue(key=k, value=v)
        for k, v in pairs])


def header_value(text: st.SearchStrategy[str]) -> st.SearchStrategy[str | bytes]:
    return st.one_of(text, text.map(str.encode), st.binary(max_size=8))


API_PATHS = st.one_of(
    st.sampled_from([COMPLETIONS, CHAT, "/v1/models", COMPLETIONS + "?a=b", CHAT + "/", "/reset_prefix_cache",
                     "/v1/completions/../../sleep", "", "/"]),
    HEADER_TEXT)


GOOD_PATHS = st.sampled_from([COMPLETIONS, CHAT, COMPLETIONS + "?a=b", CHAT + "/"])


@st.composite
def request_headers(draw: st.DrawFn, end_of_stream: bool | None = None) -> pb.ProcessingRequest:
    usual = draw(st.sampled_from([True, True, True, False]))  # mostly what Envoy forwards for a client
    path = draw(GOOD_PATHS if usual else header_value(API_PATHS))
    pairs: list[tuple[str, str | bytes]] = [(":path", path),
                                            (":method", draw(st.sampled_from(["POST", "GET", "PUT", ""])))]
    tenant = draw(st.sampled_from(["tenantA", "tenantB"]) if usual else st.none() | header_value(HEADER_TEXT))
    if tenant is not None:
        pairs.append((draw(st.sampled_from(["x-tenant", "X-Tenant"])), tenant))
    names = st.sampled_from(["x-request-id", "x-session-id", "content-type", DEST_HEADER])
    pairs += draw(st.lists(st.tuples(names if usual else names | st.just(":path") | HEADER_TEXT,
                                     header_value(HEADER_TEXT)), max_size=3))
    eos = draw(st.booleans()) if end_of_stream is None else end_of_stream
    msg = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=header_map(pairs), end_of_stream=eos))
    if draw(st.booleans()):
        msg.protocol_config.request_body_mode = draw(st.sampled_from([0, 1, 2, 3, 4, 4]))
    if draw(st.sampled_from([True, False, False, False])):  # a subset hint from an upstream filter
        hint = draw(st.lists(st.sampled_from([*ADDRESSES, "w0", "10.0.0.9:80", ""]) | HEADER_TEXT, max_size=3))
        fields = msg.metadata_context.filter_metadata[SUBSET_NAMESPACE].fields
        shape = draw(st.sampled_from(["list", "string", "number"]))
        if shape == "list":
            fields[SUBSET_KEY].list_value.values.extend(struct_pb2.Value(string_value=h) for h in hint)
        elif shape == "string":
            fields[SUBSET_KEY].string_value = ",".join(hint)
        else:
            fields[SUBSET_KEY].number_value = 1.0
    return msg


def good_body(chat: bool) -> st.SearchStrategy[bytes]:
    return st.builds(
        lambda text, extra: json.dumps(
            {**({"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}), **extra}).encode(),
        st.text(min_size=1, max_size=80),
        st.fixed_dictionaries({}, optional={"max_tokens": st.integers(1, 32), "stream": st.booleans(),
                                            "cache_salt": st.sampled_from(["tenantA", "evil"]),
                                            "model": st.sampled_from(["m", "lora-a", "other"])}))


GOOD_BODIES = st.one_of(good_body(False), good_body(True))
BODIES = st.one_of(GOOD_BODIES, GOOD_BODIES, st.binary(max_size=64), JSONISH,
                   MEMBERS.map(lambda m: encode_members(m, True)), DEEP,
                   GOOD_BODIES.map(lambda b: b[:-1] + b', "pad": "' + b"x" * 9000 + b'"}'))  # parsed off the loop


def request_body(chunk: bytes, eos: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=chunk, end_of_stream=eos))


USAGE = st.builds(
    lambda cached, sse: (b"data: " if sse else b"") + json.dumps(
        {"usage": {"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": cached}}}).encode()
    + (b"\n\ndata: [DONE]\n\n" if sse else b""),
    st.one_of(st.integers(0, 64), st.sampled_from([-1, "7", None, 1.5, 1e308, [1], {"a": 1}, True])), st.booleans())
RESPONSE_CHUNKS = st.one_of(USAGE, st.binary(max_size=32), JSONISH, DEEP, DEEP.map(lambda d: b'data: {"usage": ' + d))


@st.composite
def response_headers(draw: st.DrawFn) -> pb.ProcessingRequest:
    status = draw(header_value(st.sampled_from(["200", "200", "500", "503", "429", "abc", ""])))
    msg = pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=header_map([(":status", status)]),
                                                               end_of_stream=draw(st.sampled_from([True, False, False]))
                                                               ))
    served = draw(st.sampled_from(["none", "attribute", "metadata", "number"]))
    address = draw(st.sampled_from([*ADDRESSES, "10.0.0.9:80", ""]) | HEADER_TEXT)
    if served == "attribute":
        msg.attributes["envoy.filters.http.ext_proc"].fields["upstream.address"].string_value = address
    elif served == "metadata":
        msg.metadata_context.filter_metadata[LB_NAMESPACE].fields["x-gateway-destination-endpoint-served"] \
            .string_value = address
    elif served == "number":
        msg.attributes["envoy.filters.http.ext_proc"].fields["upstream.address"].number_value = 3.0
    return msg


def response_body(chunk: bytes, eos: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk, end_of_stream=eos))


TRAILERS = st.sampled_from([pb.ProcessingRequest(request_trailers=pb.HttpTrailers()),
                            pb.ProcessingRequest(response_trailers=pb.HttpTrailers())])
ANY_MESSAGE = st.one_of(request_headers(), st.builds(request_body, BODIES, st.booleans()), response_headers(),
                        st.builds(response_body, RESPONSE_CHUNKS, st.booleans()), TRAILERS,
                        st.just(pb.ProcessingRequest()))


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


@st.composite
def plausible_stream(draw: st.DrawFn) -> list[pb.ProcessingRequest]:
    """What Envoy sends for one request (headers, body, response), then perturbed: dropped, repeated, swapped."""
    msgs = [draw(request_headers(end_of_stream=False))]
    path = next((h.raw_value or h.value.encode() for h in msgs[0].request_headers.headers.headers
                 if h.key == ":path"), b"")
    usual = draw(st.sampled_from([True, True, False]))
    body = split(draw(good_body(b"chat" in path) if usual else BODIES),
                 draw(st.lists(st.integers(0, 10**6), max_size=3)))
    msgs += [request_body(c, i == len(body) - 1) for i, c in enumerate(body)]
    if draw(st.booleans()):
        msgs.append(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
    msgs.append(draw(response_headers()))
    chunks = draw(st.lists(RESPONSE_CHUNKS, max_size=3))
    msgs += [response_body(c, i == len(chunks) - 1) for i, c in enumerate(chunks)]
    if draw(st.booleans()):
        msgs.append(pb.ProcessingRequest(response_trailers=pb.HttpTrailers()))
    for _ in range(draw(st.sampled_from([0, 0, 1, 2, 3]))):
        op = draw(st.sampled_from(["drop", "repeat", "swap", "insert"]))
        i = draw(st.integers(0, len(msgs) - 1))
        if op == "drop" and len(msgs) > 1:
            del msgs[i]
        elif op == "repeat":
            msgs.insert(i, msgs[i])
        elif op == "swap":
            j = draw(st.integers(0, len(msgs) - 1))
            msgs[i], msgs[j] = msgs[j], msgs[i]
        else:
            msgs.insert(i, draw(ANY_MESSAGE))
    return msgs


STREAMS = st.lists(st.tuples(st.one_of(plausible_stream(), plausible_stream(), plausible_stream(),
                                       st.lists(ANY_MESSAGE, max_size=8)),
                             st.one_of(st.none(), st.integers(0, 4))),
                   min_size=1, max_size=3)


async def _requests(msgs: list[pb.ProcessingRequest]) -> AsyncIterator[pb.ProcessingRequest]:
    for m in msgs:
        await asyncio.sleep(0)  # let concurrent streams interleave
        yield m


async def _run_stream(picker: EndpointPicker, msgs: list[pb.ProcessingRequest], stop_after: int | None
                      ) -> list[pb.ProcessingResponse]:
    """One ext_proc stream; ``stop_after``: Envoy goes away after that many responses."""
    out: list[pb.ProcessingResponse] = []
    responses = picker.Process(_requests(msgs), StandInContext())  # type: ignore[arg-type]
    try:
        async for resp in responses:
            out.append(resp)
            if stop_after is not None and len(out) >= stop_after:
                break
    finally:
        await responses.aclose()  # type: ignore[attr-defined]
    return out


def check_response(resp: pb.ProcessingResponse) -> None:
    kind = resp.WhichOneof("response")
    event(f"response {kind}")
    if kind == "immediate_response":
        code, details = resp.immediate_response.status.code, resp.immediate_response.details
        event(f"refused {code}")
        assert code in ALLOWED_REFUSALS, (code, details)
        if code == 503:
            assert details.startswith(ROUTING_REFUSALS), details
        return
    common = getattr(resp, kind).response if kind in ("request_headers", "request_body") else None
    if common is not None:
        for h in common.header_mutation.set_headers:
            if h.header.key == DEST_HEADER:
                assert h.header.raw_value.decode() in ADDRESSES
    md = resp.dynamic_metadata.fields.get(LB_NAMESPACE)
    if md is not None:
        assert set(md.struct_value.fields[DEST_HEADER].string_value.split(",")) <= set(ADDRESSES)


def check_no_load_left(core: RoutingCore) -> None:
    event(f"dispatched {sum(w.dispatched_total for w in core.load.workers.values())}")
    assert core.dispatches == {}
    assert core.load.inflight == {}
    for wid, w in core.load.workers.items():
        assert (w.requests, w.prompt_tokens, w.pending_prefill_tokens, w.decoding, w.tail_blocks) == (0, 0, 0, 0, 0), \
            (wid, w)
        assert not w.active_keys and not w.request_ids, wid


def _good(prompt: str = "hello world " * 4, stream: bool = False) -> bytes:
    return json.dumps({"prompt": prompt, "max_tokens": 4, "stream": stream}).encode()


def _headers(path: str = COMPLETIONS, tenant: str = "tenantA", eos: bool = False) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders(
        headers=header_map([(":path", path), (":method", "POST"), ("x-tenant", tenant)]), end_of_stream=eos))


def _status(code: str = "200") -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=header_map([(":status", code)])))


def _deep_json(n: int = 100_000) -> bytes:
    return b"[" * n


@settings(max_examples=500, **FUZZ)
@given(STREAMS, st.sampled_from([32 * 1024 * 1024, 256]), st.sampled_from([512, 1, None]),
       st.sampled_from([(), (), ("w0",), ("w0", "w1")]))
# the body ended twice: each end routes it again
@example([([_headers(), request_body(_good(), True), request_body(b" ", True)], None)], 32 * 1024 * 1024, 512, ())
# a worker's usage with a negative or non-numeric cached_tokens
@example([([_headers(), request_body(_good(), True), _status(),
            response_body(b'{"usage": {"prompt_tokens_details": {"cached_tokens": -1}}}', True)], None)],
         32 * 1024 * 1024, 512, ())
@example([([_headers(), request_body(_good(), True), _status(),
            response_body(b'{"usage": {"prompt_tokens_details": {"cached_tokens": "7"}}}', True)], None)],
         32 * 1024 * 1024, 512, ())
# a worker's response body nested too deeply for json.loads (streamed: within the 8 KiB tail kept)
@example([([_headers(), request_body(_good(), True), _status(), response_body(_deep_json(), True)], None)],
         32 * 1024 * 1024, 512, ())
@example([([_headers(), request_body(_good(stream=True), True), _status(),
            response_body(b'data: {"usage": ' + _deep_json(8000), False), response_body(b"", True)], None)],
         32 * 1024 * 1024, 512, ())
def test_any_ext_proc_stream_gets_no_5xx_and_leaves_nothing_in_flight(streams, max_body_bytes, max_inflight,
                                                                      unhealthy):
    core, picker = build_picker(max_body_bytes, max_inflight, unhealthy)

    async def main() -> list[list[pb.ProcessingResponse]]:
        return await asyncio.gather(*(_run_stream(picker, msgs, stop) for msgs, stop in streams))

    try:
        outputs = asyncio.run(main())
    finally:
        picker.parser.close()
    for out in outputs:
        for resp in out:
            check_response(resp)
    check_no_load_left(core)


@settings(max_examples=150, **FUZZ)
@given(GOOD_BODIES, st.lists(st.integers(0, 10**6), max_size=3), st.sampled_from(["tenantA", "tenantB"]))
def test_a_well_formed_stream_is_routed_with_the_tenant_salt_and_completed(body, cuts, tenant):
    core, picker = build_picker(32 * 1024 * 1024, 512, ())
    chunks = split(body, cuts)
    head = [_headers(CHAT if b'"messages"' in body else COMPLETIONS, tenant)]
    head += [request_body(c, i == len(chunks) - 1) for i, c in enumerate(chunks)]

    async def main() -> tuple[list[pb.ProcessingResponse], int, list[pb.ProcessingResponse]]:
        responses = picker.Process(_requests([*head, _status(), response_body(b"{}", True)]), StandInContext())
        routed: list[pb.ProcessingResponse] = []
        async for resp in responses:
            routed.append(resp)
            if len(routed) == 2:  # the headers response, then the body re-sent in one chunk
                break
        during = len(core.load.inflight)
        rest = [r async for r in responses]
        return routed, during, rest

    try:
        routed, during, rest = asyncio.run(main())
    finally:
        picker.parser.close()
    for resp in routed + rest:
        check_response(resp)
    model = json.loads(body).get("model")
    first = routed[0]
    assert first.WhichOneof("response") == "request_headers", first
    dest = [h.header.raw_value.decode() for h in first.request_headers.response.header_mutation.set_headers
            if h.header.key == DEST_HEADER]
    assert len(dest) == 1 and dest[0] in ADDRESSES
    if model == "lora-a":
        assert dest == [ADDRESSES[1]]  # only w1 serves the adapter
    assert during == 1  # dispatched, not completed until the response ends
    forwarded = b"".join(r.request_body.response.body_mutation.streamed_response.body for r in routed[1:])
    # the header's tenant's derived salt, whatever the body said
    assert json.loads(forwarded)["cache_salt"] == salt_rule({"x-tenant": tenant}, "x-tenant").salt != tenant
    check_no_load_left(core)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.text(min_size=0, max_size=6000), min_size=1, max_size=4), st.booleans())
@example(["a lone surrogate \ud800", "fine"], False)
@example(["word " * 1000, "<|im_start|>user\nhi<|im_end|>"], True)
def test_every_way_of_encoding_a_prompt_gives_the_ids_encode_gives(texts, special):
    """One text or several, short or long, through the batch call without offsets: the same ids as
    ``Tokenizer.encode`` text by text (a text it refuses is refused, with a client's error)."""
    try:
        want = [TOK.tokenizer.encode(t, add_special_tokens=special).ids for t in texts]
    except Exception:
        with pytest.raises(PromptError):
            TOK._encode_texts(texts, special)
        return
    assert TOK._encode_texts(texts, special) == want
    assert [TOK._encode_texts([t], special)[0] for t in texts] == want
