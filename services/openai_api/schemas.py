"""The OpenAI request bodies this front accepts, as pydantic models: FastAPI validates each body
against them and draws the OpenAPI document from them.

What holds once a body validated:
  * every string is encodable as UTF-8 (a lone surrogate from a JSON escape is refused here, not
    at the protobuf encoder), every number is finite and in the range the text service can take
    (uint32 counts, a seed that fits 64 bits);
  * a field we know but do not support is declared here (so it is not "unknown") and refused by
    `unsupported_fields` when set to anything but its neutral value;
  * a field nobody declared lands in `model_extra`: ignored, and logged by the app.
A validation failure becomes 400 with the OpenAI error shape (services.openai_api.errors).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from engine.core.request import MAX_TOP_LOGPROBS

UINT32_MAX = 2**32 - 1
MAX_N = 8  # choices per request; each is its own generation, so n multiplies the work
MAX_GENERATIONS = 64  # prompts x n of one completions request (a list of prompts: a batch)
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API's limit on `logprobs`


def _utf8(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode text (no lone surrogates)") from None
    return text


Text = Annotated[str, AfterValidator(_utf8)]
TokenCount = Annotated[int, Field(ge=1, le=UINT32_MAX)]
TokenIds = list[Annotated[int, Field(ge=0, le=UINT32_MAX)]]


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool | None = None


class ContentPart(_Body):
    """One part of a message's content; only `text` parts are supported."""

    type: Text
    text: Text | None = None


class ChatMessage(_Body):
    role: Annotated[Text, Field(min_length=1)]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: Any = None  # an assistant's earlier calls: services.openai_api.tools
    tool_call_id: Any = None  # a tool turn's; accepted, unused (results are matched by order)
    function_call: Any = None  # not supported (the deprecated form of tool_calls)


class _Generation(_Body):
    """What completions and chat completions share."""

    model: Text
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**64 - 1)] | None = None
    stop: Text | list[Text] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: Text | None = None  # accepted, unused
    # known, not supported unless neutral
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    logit_bias: dict[str, float] | None = None
    # Extensions that vLLM and SGLang take beside the OpenAI fields (clients send them through
    # the SDK's `extra_body`). Honoured, where the decode contract has the same thing:
    top_k: Annotated[int, Field(ge=-1, le=UINT32_MAX)] | None = None  # -1 or 0: no cut
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    min_tokens: Annotated[int, Field(ge=0, le=UINT32_MAX)] | None = None  # EOS and stop ids held back until then
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None  # false: special tokens' text shown (control tokens never are)
    # known, not supported unless neutral (ignoring them would change the answer without a word)
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None  # neutral: 1
    length_penalty: float | None = None  # neutral: 1
    use_beam_search: bool | None = None
    prompt_logprobs: int | None = None
    guided_json: Any = None  # structured output: response_format, on chat completions
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None


class CompletionRequest(_Generation):
    # a string or its token ids; a list of either: a batch, n choices for each
    prompt: Text | TokenIds | Annotated[list[Text] | list[TokenIds], Field(min_length=1, max_length=MAX_GENERATIONS)]
    max_tokens: TokenCount | None = 16  # the API's default for completions
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    echo: bool | None = None  # not supported when true
    suffix: Text | None = None  # not supported
    best_of: Annotated[int, Field(ge=1)] | None = None  # not supported above 1


class ChatCompletionRequest(_Generation):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: TokenCount | None = None
    max_completion_tokens: TokenCount | None = None  # wins over max_tokens
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: Any = None  # these three: services.openai_api.tools
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    response_format: Any = None  # services.openai_api.structured
    # known, not supported unless neutral
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    # accepted, unused
    store: Any = None
    metadata: Any = None
    service_tier: Any = None
    reasoning_effort: Any = None


class TokenizeRequest(_Body):
    """Passthrough to the text service's Tokenize: a prompt, or messages through the chat template."""

    model: Text | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = False  # for `prompt` only
    add_generation_prompt: bool = True  # for `messages` only


class DetokenizeRequest(_Body):
    model: Text | None = None
    tokens: list[Annotated[int, Field(ge=0, le=UINT32_MAX)]]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every non-2xx body."""

    error: ErrorBody


# What a refusal of these says beyond "is not supported by this server".
_STRUCTURED = "is not supported by this server: structured output is response_format (chat completions)"
REFUSAL_REASONS = {name: _STRUCTURED for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")}


def unsupported_fields(body: _Generation) -> list[str]:
    """The supported-nowhere fields this body sets to something other than their neutral value,
    in declaration order (the app refuses the first with 400 naming it)."""
    out = []
    if body.frequency_penalty:
        out.append("frequency_penalty")
    if body.presence_penalty:
        out.append("presence_penalty")
    if body.logit_bias:
        out.append("logit_bias")
    out += [name for name, neutral in (("repetition_penalty", 1), ("length_penalty", 1)) if getattr(body, name) not in (None, neutral)]
    if body.use_beam_search:
        out.append("use_beam_search")
    out += [name for name in ("prompt_logprobs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
            if getattr(body, name) is not None]
    if isinstance(body, CompletionRequest):
        out += [name for name, on in (("echo", body.echo), ("suffix", body.suffix), ("best_of", (body.best_of or 1) > 1)) if on]
    if isinstance(body, ChatCompletionRequest):
        for name in ("functions", "function_call", "audio", "prediction", "web_search_options"):
            if getattr(body, name) is not None:
                out.append(name)
        if body.modalities is not None and body.modalities != ["text"]:
            out.append("modalities")
    return out
