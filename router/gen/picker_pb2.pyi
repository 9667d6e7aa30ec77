from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RankRequest(_message.Message):
    __slots__ = ("text", "token_ids", "chat", "model", "cache_salt", "lora", "max_tokens", "subset", "session")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SUBSET_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    chat: ChatMessages
    model: str
    cache_salt: str
    lora: str
    max_tokens: int
    subset: _containers.RepeatedScalarFieldContainer[str]
    session: str
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., model: _Optional[str] = ..., cache_salt: _Optional[str] = ..., lora: _Optional[str] = ..., max_tokens: _Optional[int] = ..., subset: _Optional[_Iterable[str]] = ..., session: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class RankResponse(_message.Message):
    __slots__ = ("outcome", "reason", "policy", "prompt_tokens", "endpoints")
    class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        ROUTED: _ClassVar[RankResponse.Outcome]
        SHED: _ClassVar[RankResponse.Outcome]
        NO_ENDPOINT: _ClassVar[RankResponse.Outcome]
    ROUTED: RankResponse.Outcome
    SHED: RankResponse.Outcome
    NO_ENDPOINT: RankResponse.Outcome
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    outcome: RankResponse.Outcome
    reason: str
    policy: str
    prompt_tokens: int
    endpoints: _containers.RepeatedCompositeFieldContainer[RankedEndpoint]
    def __init__(self, outcome: _Optional[_Union[RankResponse.Outcome, str]] = ..., reason: _Optional[str] = ..., policy: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., endpoints: _Optional[_Iterable[_Union[RankedEndpoint, _Mapping]]] = ...) -> None: ...

class RankedEndpoint(_message.Message):
    __slots__ = ("worker_id", "address", "filtered", "index_state", "prefix_credit", "matched_gpu_blocks", "matched_cpu_blocks", "matched_storage_blocks", "queue_s", "prefill_s", "estimated_ttft_s", "score")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FILTERED_FIELD_NUMBER: _ClassVar[int]
    INDEX_STATE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CREDIT_FIELD_NUMBER: _ClassVar[int]
    MATCHED_GPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_STORAGE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_TTFT_S_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    filtered: str
    index_state: str
    prefix_credit: bool
    matched_gpu_blocks: int
    matched_cpu_blocks: int
    matched_storage_blocks: int
    queue_s: float
    prefill_s: float
    estimated_ttft_s: float
    score: float
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., filtered: _Optional[str] = ..., index_state: _Optional[str] = ..., prefix_credit: _Optional[bool] = ..., matched_gpu_blocks: _Optional[int] = ..., matched_cpu_blocks: _Optional[int] = ..., matched_storage_blocks: _Optional[int] = ..., queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., estimated_ttft_s: _Optional[float] = ..., score: _Optional[float] = ...) -> None: ...
