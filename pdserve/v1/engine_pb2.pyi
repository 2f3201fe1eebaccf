from pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "model", "prompt_token_ids", "sampling", "publish_incrementally", "cache_salt", "bypass_store", "priority", "tenant")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_INCREMENTALLY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    BYPASS_STORE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    publish_incrementally: bool
    cache_salt: str
    bypass_store: bool
    priority: int
    tenant: str
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., publish_incrementally: _Optional[bool] = ..., cache_salt: _Optional[str] = ..., bypass_store: _Optional[bool] = ..., priority: _Optional[int] = ..., tenant: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "kv", "cached_tokens", "computed_tokens", "worker_ms", "first_token_is_eos", "first_token_logprobs")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WORKER_MS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_IS_EOS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    kv: _common_pb2.KVHandle
    cached_tokens: int
    computed_tokens: int
    worker_ms: float
    first_token_is_eos: bool
    first_token_logprobs: _common_pb2.OutputLogProbs
    def __init__(self, first_token_id: _Optional[int] = ..., kv: _Optional[_Union[_common_pb2.KVHandle, _Mapping]] = ..., cached_tokens: _Optional[int] = ..., computed_tokens: _Optional[int] = ..., worker_ms: _Optional[float] = ..., first_token_is_eos: _Optional[bool] = ..., first_token_logprobs: _Optional[_Union[_common_pb2.OutputLogProbs, _Mapping]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "model", "prompt_token_ids", "sampling", "kv", "first_token_id", "chunk_wait_ms", "cache_salt", "bypass_store", "priority", "tenant")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    BYPASS_STORE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    kv: _common_pb2.KVHandle
    first_token_id: int
    chunk_wait_ms: int
    cache_salt: str
    bypass_store: bool
    priority: int
    tenant: str
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., kv: _Optional[_Union[_common_pb2.KVHandle, _Mapping]] = ..., first_token_id: _Optional[int] = ..., chunk_wait_ms: _Optional[int] = ..., cache_salt: _Optional[str] = ..., bypass_store: _Optional[bool] = ..., priority: _Optional[int] = ..., tenant: _Optional[str] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "token_times_ms", "loaded_tokens", "recomputed_tokens", "prefix_cached_tokens", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TOKEN_TIMES_MS_FIELD_NUMBER: _ClassVar[int]
    LOADED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: _common_pb2.FinishReason
    token_times_ms: _containers.RepeatedScalarFieldContainer[float]
    loaded_tokens: int
    recomputed_tokens: int
    prefix_cached_tokens: int
    logprobs: _common_pb2.OutputLogProbs
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., token_times_ms: _Optional[_Iterable[float]] = ..., loaded_tokens: _Optional[int] = ..., recomputed_tokens: _Optional[int] = ..., prefix_cached_tokens: _Optional[int] = ..., logprobs: _Optional[_Union[_common_pb2.OutputLogProbs, _Mapping]] = ...) -> None: ...
