from protos.decode.v1 import decode_pb2 as _decode_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ToolFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOOL_FORMAT_UNSPECIFIED: _ClassVar[ToolFormat]
    TOOL_FORMAT_QWEN: _ClassVar[ToolFormat]
    TOOL_FORMAT_SMOLLM2: _ClassVar[ToolFormat]
    TOOL_FORMAT_LLAMA3: _ClassVar[ToolFormat]
TOOL_FORMAT_UNSPECIFIED: ToolFormat
TOOL_FORMAT_QWEN: ToolFormat
TOOL_FORMAT_SMOLLM2: ToolFormat
TOOL_FORMAT_LLAMA3: ToolFormat

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class Chat(_message.Message):
    __slots__ = ("messages", "add_generation_prompt", "tools")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    tools: _containers.RepeatedCompositeFieldContainer[ChatTool]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ..., tools: _Optional[_Iterable[_Union[ChatTool, _Mapping]]] = ...) -> None: ...

class ChatTool(_message.Message):
    __slots__ = ("name", "description", "parameters")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters: _Optional[str] = ...) -> None: ...

class DescribeChatRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ChatDescription(_message.Message):
    __slots__ = ("has_template", "tool_format", "renders_tools")
    HAS_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    TOOL_FORMAT_FIELD_NUMBER: _ClassVar[int]
    RENDERS_TOOLS_FIELD_NUMBER: _ClassVar[int]
    has_template: bool
    tool_format: ToolFormat
    renders_tools: bool
    def __init__(self, has_template: _Optional[bool] = ..., tool_format: _Optional[_Union[ToolFormat, str]] = ..., renders_tools: _Optional[bool] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "chat", "add_special_tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    chat: Chat
    add_special_tokens: bool
    def __init__(self, text: _Optional[str] = ..., chat: _Optional[_Union[Chat, _Mapping]] = ..., add_special_tokens: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("token_ids", "keep_special_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KEEP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    keep_special_tokens: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., keep_special_tokens: _Optional[bool] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "chat", "prompt_token_ids", "sampling", "stopping", "keep_special_tokens", "stop_strings", "include_stop_string", "logprobs", "top_logprobs", "constraint")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    KEEP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    chat: Chat
    prompt_token_ids: TokenIds
    sampling: _decode_pb2.SamplingParams
    stopping: _decode_pb2.StoppingCriteria
    keep_special_tokens: bool
    stop_strings: _containers.RepeatedScalarFieldContainer[str]
    include_stop_string: bool
    logprobs: bool
    top_logprobs: int
    constraint: _decode_pb2.Constraint
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., chat: _Optional[_Union[Chat, _Mapping]] = ..., prompt_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[_decode_pb2.SamplingParams, _Mapping]] = ..., stopping: _Optional[_Union[_decode_pb2.StoppingCriteria, _Mapping]] = ..., keep_special_tokens: _Optional[bool] = ..., stop_strings: _Optional[_Iterable[str]] = ..., include_stop_string: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., constraint: _Optional[_Union[_decode_pb2.Constraint, _Mapping]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("delta", "finished")
    DELTA_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    delta: TextDelta
    finished: TextFinished
    def __init__(self, delta: _Optional[_Union[TextDelta, _Mapping]] = ..., finished: _Optional[_Union[TextFinished, _Mapping]] = ...) -> None: ...

class TextDelta(_message.Message):
    __slots__ = ("text", "token_ids", "logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("text", "bytes", "logprob", "top_logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    bytes: bytes
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, text: _Optional[str] = ..., bytes: _Optional[bytes] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("id", "text", "bytes", "logprob")
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    id: int
    text: str
    bytes: bytes
    logprob: float
    def __init__(self, id: _Optional[int] = ..., text: _Optional[str] = ..., bytes: _Optional[bytes] = ..., logprob: _Optional[float] = ...) -> None: ...

class TextFinished(_message.Message):
    __slots__ = ("reason", "usage", "stop_token_id", "stop_string")
    REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    reason: _decode_pb2.FinishReason
    usage: _decode_pb2.Usage
    stop_token_id: int
    stop_string: str
    def __init__(self, reason: _Optional[_Union[_decode_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_decode_pb2.Usage, _Mapping]] = ..., stop_token_id: _Optional[int] = ..., stop_string: _Optional[str] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("text", "token_ids", "reason", "usage", "stop_token_id", "stop_string", "logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    reason: _decode_pb2.FinishReason
    usage: _decode_pb2.Usage
    stop_token_id: int
    stop_string: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., reason: _Optional[_Union[_decode_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_decode_pb2.Usage, _Mapping]] = ..., stop_token_id: _Optional[int] = ..., stop_string: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...
