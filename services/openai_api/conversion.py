"""OpenAI bodies -> the text service's GenerateRequests, and its results -> OpenAI JSON.

One request with `n` choices becomes n GenerateRequests (`generate_requests`), each its own
generation; with a seed, choice i samples with seed + i, so the choices differ and a request
repeats exactly. A completions body's list of prompts is a batch: n choices for each prompt, in
the prompts' order. Sampling follows the API's defaults: temperature 1, no nucleus cut; top_p 0
(the limit of a vanishing nucleus) is greedy. The extensions vLLM and SGLang take (`top_k`,
`min_p`, `min_tokens`, `stop_token_ids`, `ignore_eos`, `include_stop_str_in_output`,
`skip_special_tokens`) map onto the decode contract's fields of the same meaning.

Results: finish reasons are `stop` or `length` (the text service's two), or `tool_calls` for an
answer read as calls (services.openai_api.tools); usage counts the prompt once and every
choice's completion tokens; logprob entries carry each token's text as the detokenizer produced
it, so the entries' texts joined equal the content unless a stop string cut it
(protos/text/v1/text.proto TokenLogprob).
"""

from __future__ import annotations

from protos.decode.v1 import decode_pb2
from protos.text.v1 import text_pb2
from services.openai_api import tools
from services.openai_api.errors import ApiError, not_supported
from services.openai_api.schemas import MAX_GENERATIONS, ChatCompletionRequest, ChatMessage, CompletionRequest
from services.openai_api.structured import constraint_of
from services.openai_api.tool_formats import ToolFormat
from services.openai_api.tools import ToolPlan

_REASONS = {decode_pb2.FINISH_REASON_STOP: "stop", decode_pb2.FINISH_REASON_LENGTH: "length"}  # `tool_calls`: tools.py
# Roles the OpenAI API has that a chat template may not: "developer" is the newer name of "system".
_ROLE_ALIASES = {"developer": "system"}


def finish_reason(reason: int) -> str:
    return _REASONS[reason]


def usage_json(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


# --- requests ----------------------------------------------------------------------------------


def _stop_strings(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _message_text(message: ChatMessage, i: int) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    texts = []
    for j, part in enumerate(message.content):
        if part.type != "text" or part.text is None:
            raise not_supported(f"messages[{i}].content[{j}].type", f"{part.type!r} is not supported (only text parts)")
        texts.append(part.text)
    return "".join(texts)


def chat_pb(
    messages: list[ChatMessage], add_generation_prompt: bool = True, plan: ToolPlan | None = None, fmt: ToolFormat | None = None,
) -> text_pb2.Chat:
    """Messages as the text service's Chat: non-text parts refused; tool turns, earlier calls and
    the offered tools written in the model's tool format `fmt` (services.openai_api.tools),
    refused without one; the offered tools in Chat.tools where the chat template shows them."""
    chat = text_pb2.Chat(add_generation_prompt=add_generation_prompt, tools=tools.chat_tools(plan, fmt))
    for role, content in tools.conversation(messages, plan, fmt, _message_text):
        chat.messages.add(role=_ROLE_ALIASES.get(role, role), content=content)
    return chat


def _base(body: CompletionRequest | ChatCompletionRequest, max_tokens: int | None) -> text_pb2.GenerateRequest:
    temperature = 1.0 if body.temperature is None else body.temperature
    top_p = 1.0 if body.top_p is None else body.top_p
    sampling = decode_pb2.SamplingParams(
        temperature=0.0 if top_p == 0 else temperature, top_p=top_p or 1.0,
        top_k=max(body.top_k or 0, 0), min_p=body.min_p or 0.0,  # (vLLM's top_k -1 is no cut, as 0 is here)
    )
    stopping = decode_pb2.StoppingCriteria(
        max_output_tokens=max_tokens, stop_token_ids=body.stop_token_ids or [], ignore_eos=bool(body.ignore_eos),
        min_output_tokens=body.min_tokens or 0,
    )
    return text_pb2.GenerateRequest(
        sampling=sampling, stopping=stopping, stop_strings=_stop_strings(body.stop),
        include_stop_string=bool(body.include_stop_str_in_output), keep_special_tokens=body.skip_special_tokens is False,
    )


def _prompts(body: CompletionRequest) -> list[str | list[int]]:
    """A completions body's prompts, each a string or its token ids: one, or a list (a batch; n
    choices for each)."""
    one = isinstance(body.prompt, str) or not body.prompt or isinstance(body.prompt[0], int)
    prompts = [body.prompt] if one else list(body.prompt)
    n = body.n or 1
    if len(prompts) * n > MAX_GENERATIONS:
        why = f"{len(prompts)} prompts x {n} choices each is more than {MAX_GENERATIONS} generations"
        raise ApiError(400, f"prompt: {why}", param="prompt")
    return prompts


def generate_requests(
    body: CompletionRequest | ChatCompletionRequest, request_id: str, plan: ToolPlan | None = None, fmt: ToolFormat | None = None,
) -> list[text_pb2.GenerateRequest]:
    """The body's GenerateRequests, choice i's request id `<request_id>-<i>`: n for a chat body or
    one prompt, n per prompt for a list of prompts (prompt p's choice j at index p x n + j, with
    seed + j, so that a prompt's choices are the same alone or in a batch); `plan` and `fmt`
    are the chat body's tools (services.openai_api.tools.plan_of) and the model's tool format."""
    prompts: list[str | list[int] | None] = [None]
    if isinstance(body, ChatCompletionRequest):
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        request = _base(body, max_tokens)
        request.chat.CopyFrom(chat_pb(body.messages, plan=plan, fmt=fmt))
        if body.top_logprobs and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        request.logprobs = bool(body.logprobs)
        request.top_logprobs = body.top_logprobs or 0
        constraint = constraint_of(body.response_format)
        if constraint is not None and plan is not None:
            raise not_supported("response_format", "cannot be combined with tools unless tool_choice is \"none\"")
        constraint = constraint or tools.constraint_of(plan, fmt)
        if constraint is not None:
            request.constraint.CopyFrom(constraint)
    else:
        request = _base(body, body.max_tokens)
        prompts = _prompts(body)
        request.logprobs = body.logprobs is not None
        request.top_logprobs = body.logprobs or 0
    requests = []
    for prompt in prompts:  # (None: a chat body, whose input `request` holds)
        if isinstance(prompt, str):
            request.prompt = prompt
        elif prompt is not None:
            request.prompt_token_ids.ids[:] = prompt
        for j in range(body.n or 1):
            choice = text_pb2.GenerateRequest()
            choice.CopyFrom(request)
            choice.request_id = f"{request_id}-{len(requests)}"
            if body.seed is not None:
                choice.sampling.seed = (body.seed + j) % 2**64
            requests.append(choice)
    return requests


# --- results -----------------------------------------------------------------------------------


def _bytes(data: bytes) -> list[int]:
    return list(data)


def chat_logprobs(entries) -> list[dict]:
    """TokenLogprob messages -> the chat API's `logprobs.content` entries."""
    return [
        {
            "token": e.text,
            "logprob": e.logprob,
            "bytes": _bytes(e.bytes),
            "top_logprobs": [{"token": t.text, "logprob": t.logprob, "bytes": _bytes(t.bytes)} for t in e.top_logprobs],
        }
        for e in entries
    ]


def completion_logprobs(entries, offset: int) -> dict:
    """TokenLogprob messages -> the completions API's `logprobs` object; `offset` is the text
    offset of the first entry in the choice's text."""
    tokens, offsets = [], []
    for e in entries:
        tokens.append(e.text)
        offsets.append(offset)
        offset += len(e.text)
    top = [{t.text: t.logprob for t in e.top_logprobs} for e in entries]
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "top_logprobs": top, "text_offset": offsets}
