"""vLLM's KV-event wire format (vLLM 0.32/0.33; SGLang 0.5 variant), decode and encode.

Live message: ``[topic, seq (8 bytes big-endian), payload]``; payload = msgpack array
``[ts, events, data_parallel_rank]``; events are maps tagged by ``"type"`` (current vLLM) or arrays with
the tag first (before vLLM PR #42892). Replay reply: ``[b"", topic, seq, payload]`` (older: no topic),
ended by ``[b"", b"", 0xFF*8, ...]``.

Decoding takes msgspec's typed fast path for the current shape and falls back to a tolerant generic
decode for the older and SGLang shapes. Unknown fields are ignored; anything else is ``MalformedFrame``.
The router's own ingest decodes with ``raw_tokens``: a BlockStored's token ids stay the msgpack array they
came in (``RawBlockStored``) until the feed reads them into uint32s (``token_ids_of``), which it only hashes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from router.index import Medium

SEQ_BYTES = 8
END_OF_REPLAY = b"\xff" * SEQ_BYTES

BlockHash = int | bytes


class MalformedFrame(ValueError):
    """A frame or payload that is not a valid KV-event message."""


class BlockStored(msgspec.Struct, tag_field="type", tag=True, gc=False):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    cache_salt: str | None = None  # SGLang sends the salt as its own field


class RawBlockStored(BlockStored, tag="BlockStored"):
    """A BlockStored as the router's ingest decodes it: ``token_ids`` left as the msgpack bytes of their array
    (a ``msgspec.Raw`` into the frame), read by ``token_ids_of``. Decoding 256 ids to a list made an int object
    of each, three quarters of the cost of decoding a batch; encoding writes the bytes back as they came."""

    token_ids: msgspec.Raw  # type: ignore[assignment]


class BlockRemoved(msgspec.Struct, tag_field="type", tag=True, gc=False):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag_field="type", tag=True, gc=False):
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[KvEvent]
    data_parallel_rank: int | None = None


class _IngestBatch(EventBatch):
    """An ``EventBatch`` whose BlockStored events are ``RawBlockStored`` (``decode_payload(raw_tokens=True)``)."""

    events: list[RawBlockStored | BlockRemoved | AllBlocksCleared]  # type: ignore[assignment]


@dataclass(frozen=True, slots=True)
class EventMessage:
    topic: str
    seq: int
    batch: EventBatch


# vLLM/SGLang medium names -> our tiers. None: engines before media were reported (GPU).
_MEDIA: dict[str | None, Medium] = {
    None: Medium.GPU,
    "GPU": Medium.GPU,
    "CPU": Medium.CPU,
    "CPU_PINNED": Medium.CPU,
    "STORAGE": Medium.STORAGE,
    "DISK": Medium.STORAGE,
    "EXTERNAL": Medium.STORAGE,
}


def medium_of(name: str | None) -> Medium:
    medium = _MEDIA.get(name)  # the exact spelling first: one dict lookup per event
    if medium is not None:
        return medium
    try:
        return _MEDIA[name.upper() if name else None]
    except KeyError:
        raise MalformedFrame(f"unknown medium {name!r}") from None


_typed = msgspec.msgpack.Decoder(EventBatch)
_typed_raw_tokens = msgspec.msgpack.Decoder(_IngestBatch)
_token_list = msgspec.msgpack.Decoder(list[int])
_generic = msgspec.msgpack.Decoder()
_encoder = msgspec.msgpack.Encoder()
_EVENT_TYPES: dict[str, type[msgspec.Struct]] = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}


def decode_payload(payload: bytes, raw_tokens: bool = False) -> EventBatch:
    """A payload's batch. ``raw_tokens``: the typed path leaves BlockStored token ids undecoded (the router's
    ingest; ``token_ids_of`` reads them), so a bad token list fails that one event, not the batch."""
    try:
        return (_typed_raw_tokens if raw_tokens else _typed).decode(payload)
    except (msgspec.ValidationError, msgspec.DecodeError):
        pass
    except RecursionError:
        raise MalformedFrame("payload nested too deeply") from None
    try:
        raw = _generic.decode(payload)
    except msgspec.DecodeError as e:
        raise MalformedFrame(f"payload is not msgpack: {e}") from None
    except RecursionError:
        raise MalformedFrame("payload nested too deeply") from None
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise MalformedFrame("payload is not an [ts, events, dp_rank] array")
    ts, events = raw[0], raw[1]
    rank = raw[2] if len(raw) > 2 else None
    if not isinstance(ts, int | float) or not (rank is None or isinstance(rank, int)):
        raise MalformedFrame("bad ts or data_parallel_rank")
    decoded = [_event_from_raw(e) for e in events]
    # Event types from newer engines that we do not know are skipped, not fatal to the batch.
    return EventBatch(float(ts), [e for e in decoded if e is not None], rank)


def _event_from_raw(raw: Any) -> KvEvent | None:
    """One event in any known shape: a map with ``type`` or an array with the tag first."""
    if isinstance(raw, dict):
        tag = raw.get("type")
        if not isinstance(tag, str):
            raise MalformedFrame("event map without a string 'type'")
        fields = raw
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag = raw[0]
        fields = None
    else:
        raise MalformedFrame("event is neither a map nor a tagged array")
    cls = _EVENT_TYPES.get(tag)
    if cls is None:
        return None
    if fields is None:
        fields = dict(zip(cls.__struct_fields__, raw[1:], strict=False))
    known = {k: v for k, v in fields.items() if k in cls.__struct_fields__}
    try:
        return msgspec.convert(known, cls)
    except msgspec.ValidationError as e:
        raise MalformedFrame(f"bad {tag}: {e}") from None
    except RecursionError:
        raise MalformedFrame(f"bad {tag}: nested too deeply") from None


try:  # router/events/_fasttokens.c: the common case, uint32 ids, read in place
    from router.events._fasttokens import uint32_array as _uint32_array
except ImportError:  # built without a C compiler
    _uint32_array = None


def token_ids_of(tokens: Sequence[int] | msgspec.Raw) -> Sequence[int]:
    """A BlockStored's token ids as the index hashes them: a ``RawBlockStored``'s read from their msgpack bytes,
    as an array('I') when every id is a uint32 (router/events/_fasttokens.c), else (or without the compiled
    reader) as the list a full decode gives, so that an id out of range fails where a decoded list's does; any
    other form as it is.
    ``MalformedFrame`` when the bytes are not a list of ints."""
    if type(tokens) is not msgspec.Raw:
        return tokens
    if _uint32_array is not None:
        ids = _uint32_array(tokens)
        if ids is not None:
            return ids  # type: ignore[no-any-return]
    try:
        listed = _token_list.decode(tokens)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise MalformedFrame(f"bad token_ids: {e}") from None
    except RecursionError:
        raise MalformedFrame("token_ids nested too deeply") from None
    return listed


def decode_seq(frame: bytes) -> int:
    if len(frame) != SEQ_BYTES:
        raise MalformedFrame(f"seq frame must be {SEQ_BYTES} bytes, got {len(frame)}")
    return int.from_bytes(frame, "big")


def decode_message(frames: list[bytes], raw_tokens: bool = False) -> EventMessage:
    """A live PUB message ``[topic, seq, payload]``; ``raw_tokens`` as for ``decode_payload``."""
    if len(frames) != 3:
        raise MalformedFrame(f"expected 3 frames, got {len(frames)}")
    try:
        topic = bytes(frames[0]).decode()
    except UnicodeDecodeError:
        raise MalformedFrame("topic is not utf-8") from None
    return EventMessage(topic, decode_seq(frames[1]), decode_payload(frames[2], raw_tokens))


def decode_replay_frames(frames: list[bytes], raw_tokens: bool = False) -> EventMessage | None:
    """One replay reply; ``None`` for the end marker. Accepts the older form without a topic."""
    if frames and frames[0] == b"":
        frames = frames[1:]  # DEALER delimiter
    if len(frames) >= 2 and frames[0] == b"" and frames[1] == END_OF_REPLAY:
        return None
    if len(frames) == 3:
        return decode_message(frames, raw_tokens)
    if len(frames) == 2:
        return EventMessage("", decode_seq(frames[0]), decode_payload(frames[1], raw_tokens))
    raise MalformedFrame(f"replay reply with {len(frames)} frames")


# Field order of vLLM 0.32's map-shaped events (checked against the real recording by the tests).
_VLLM_FIELDS: dict[type, tuple[str, ...]] = {
    BlockStored: (
        "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
        "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
    ),
    BlockRemoved: ("block_hashes", "medium", "group_idx"),
    AllBlocksCleared: (),
}
_VLLM_FIELDS[RawBlockStored] = _VLLM_FIELDS[BlockStored]


def vllm_event_map(event: KvEvent) -> dict[str, Any]:
    """An event as vLLM frames it: ``type`` first, then its fields in vLLM's order."""
    out: dict[str, Any] = {"type": type(event).__struct_config__.tag}
    for name in _VLLM_FIELDS[type(event)]:
        out[name] = getattr(event, name)
    if isinstance(event, BlockStored) and not isinstance(event.token_ids, list | msgspec.Raw):
        out["token_ids"] = list(event.token_ids)  # in-process producers may hold an array('I')
    return out


def encode_payload(batch: EventBatch) -> bytes:
    return _encoder.encode([batch.ts, [vllm_event_map(e) for e in batch.events], batch.data_parallel_rank])


def encode_message(topic: str, seq: int, batch: EventBatch) -> list[bytes]:
    return [topic.encode(), seq.to_bytes(SEQ_BYTES, "big"), encode_payload(batch)]
