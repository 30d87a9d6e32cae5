from . import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "seed", "stop_token_ids")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt_token_ids", "adapter", "sampling", "request_id", "newest_adapter")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEWEST_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    adapter: _common_pb2.AdapterRef
    sampling: SamplingParams
    request_id: str
    newest_adapter: bool
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., adapter: _Optional[_Union[_common_pb2.AdapterRef, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., request_id: _Optional[str] = ..., newest_adapter: _Optional[bool] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "served_by", "request_id")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    SERVED_BY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: str
    served_by: _common_pb2.AdapterRef
    request_id: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[str] = ..., served_by: _Optional[_Union[_common_pb2.AdapterRef, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class GenerateManyRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[GenerateRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[GenerateRequest, _Mapping]]] = ...) -> None: ...

class GenerateOutcome(_message.Message):
    __slots__ = ("index", "response", "code", "error")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    index: int
    response: GenerateResponse
    code: int
    error: str
    def __init__(self, index: _Optional[int] = ..., response: _Optional[_Union[GenerateResponse, _Mapping]] = ..., code: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class GenerateManyResponse(_message.Message):
    __slots__ = ("outcomes",)
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedCompositeFieldContainer[GenerateOutcome]
    def __init__(self, outcomes: _Optional[_Iterable[_Union[GenerateOutcome, _Mapping]]] = ...) -> None: ...

class AdapterChunk(_message.Message):
    __slots__ = ("manifest", "data")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    manifest: _common_pb2.AdapterManifest
    data: bytes
    def __init__(self, manifest: _Optional[_Union[_common_pb2.AdapterManifest, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushAdapterResponse(_message.Message):
    __slots__ = ("ref", "loaded", "load_seconds")
    REF_FIELD_NUMBER: _ClassVar[int]
    LOADED_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ref: _common_pb2.AdapterRef
    loaded: bool
    load_seconds: float
    def __init__(self, ref: _Optional[_Union[_common_pb2.AdapterRef, _Mapping]] = ..., loaded: _Optional[bool] = ..., load_seconds: _Optional[float] = ...) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadedAdapter(_message.Message):
    __slots__ = ("ref", "in_flight", "loaded_at")
    REF_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    LOADED_AT_FIELD_NUMBER: _ClassVar[int]
    ref: _common_pb2.AdapterRef
    in_flight: int
    loaded_at: float
    def __init__(self, ref: _Optional[_Union[_common_pb2.AdapterRef, _Mapping]] = ..., in_flight: _Optional[int] = ..., loaded_at: _Optional[float] = ...) -> None: ...

class ListAdaptersResponse(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[LoadedAdapter]
    def __init__(self, adapters: _Optional[_Iterable[_Union[LoadedAdapter, _Mapping]]] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("ref",)
    REF_FIELD_NUMBER: _ClassVar[int]
    ref: _common_pb2.AdapterRef
    def __init__(self, ref: _Optional[_Union[_common_pb2.AdapterRef, _Mapping]] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ("unloaded",)
    UNLOADED_FIELD_NUMBER: _ClassVar[int]
    unloaded: bool
    def __init__(self, unloaded: _Optional[bool] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("base_model", "engine", "replica_id", "max_lora_rank", "lora_slots")
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    LORA_SLOTS_FIELD_NUMBER: _ClassVar[int]
    base_model: str
    engine: str
    replica_id: str
    max_lora_rank: int
    lora_slots: int
    def __init__(self, base_model: _Optional[str] = ..., engine: _Optional[str] = ..., replica_id: _Optional[str] = ..., max_lora_rank: _Optional[int] = ..., lora_slots: _Optional[int] = ...) -> None: ...
