from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "stopping", "return_logprobs", "top_logprobs", "constraint")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    stopping: StoppingCriteria
    return_logprobs: bool
    top_logprobs: int
    constraint: Constraint
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stopping: _Optional[_Union[StoppingCriteria, _Mapping]] = ..., return_logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("json_schema", "regex", "lark", "json_object")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    LARK_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    regex: str
    lark: str
    json_object: bool
    def __init__(self, json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., lark: _Optional[str] = ..., json_object: _Optional[bool] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class StoppingCriteria(_message.Message):
    __slots__ = ("max_output_tokens", "stop_token_ids", "ignore_eos", "min_output_tokens")
    MAX_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_output_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    min_output_tokens: int
    def __init__(self, max_output_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., min_output_tokens: _Optional[int] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[DecodeEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[DecodeEvent, _Mapping]]] = ...) -> None: ...

class DecodeEvent(_message.Message):
    __slots__ = ("token", "finished")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    token: Token
    finished: Finished
    def __init__(self, token: _Optional[_Union[Token, _Mapping]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ...) -> None: ...

class Token(_message.Message):
    __slots__ = ("id", "logprob", "top_logprobs")
    ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("id", "logprob")
    ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    id: int
    logprob: float
    def __init__(self, id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("reason", "usage", "stop_token_id")
    REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    reason: FinishReason
    usage: Usage
    stop_token_id: int
    def __init__(self, reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., stop_token_id: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class DecodeStreamRequest(_message.Message):
    __slots__ = ("start", "cancel", "batch")
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    start: DecodeStreamStart
    cancel: DecodeStreamCancel
    batch: DecodeStreamBatch
    def __init__(self, start: _Optional[_Union[DecodeStreamStart, _Mapping]] = ..., cancel: _Optional[_Union[DecodeStreamCancel, _Mapping]] = ..., batch: _Optional[_Union[DecodeStreamBatch, _Mapping]] = ...) -> None: ...

class DecodeStreamBatch(_message.Message):
    __slots__ = ("actions",)
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    actions: _containers.RepeatedCompositeFieldContainer[DecodeStreamRequest]
    def __init__(self, actions: _Optional[_Iterable[_Union[DecodeStreamRequest, _Mapping]]] = ...) -> None: ...

class DecodeStreamStart(_message.Message):
    __slots__ = ("key", "request", "packed_tokens")
    KEY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    PACKED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    key: int
    request: DecodeRequest
    packed_tokens: bool
    def __init__(self, key: _Optional[int] = ..., request: _Optional[_Union[DecodeRequest, _Mapping]] = ..., packed_tokens: _Optional[bool] = ...) -> None: ...

class DecodeStreamCancel(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: int
    def __init__(self, key: _Optional[int] = ...) -> None: ...

class DecodeStreamResponse(_message.Message):
    __slots__ = ("requests", "token_keys", "token_ids")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_KEYS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[RequestEvents]
    token_keys: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, requests: _Optional[_Iterable[_Union[RequestEvents, _Mapping]]] = ..., token_keys: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class RequestEvents(_message.Message):
    __slots__ = ("key", "events", "error")
    KEY_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    key: int
    events: _containers.RepeatedCompositeFieldContainer[DecodeEvent]
    error: RequestError
    def __init__(self, key: _Optional[int] = ..., events: _Optional[_Iterable[_Union[DecodeEvent, _Mapping]]] = ..., error: _Optional[_Union[RequestError, _Mapping]] = ...) -> None: ...

class RequestError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_id", "vocab_size", "max_context_length", "eos_token_ids", "max_batch_size")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    vocab_size: int
    max_context_length: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_batch_size: int
    def __init__(self, model_id: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context_length: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_batch_size: _Optional[int] = ...) -> None: ...
