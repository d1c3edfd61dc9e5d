"""Tool calling on the chat API: `tools`, `tool_choice`, `parallel_tool_calls`, the tool turns
of a conversation, and the calls read back out of the model's answer.

Request side (`plan_of`, `conversation`, `constraint_of`):
  * `tools`: function tools only; each name 1-64 of [A-Za-z0-9_-], unique; `parameters` a JSON
    Schema object (default: no arguments), its objects closed for a forced call as the
    response_format's are (engine.constraints.lark_term). A bad entry is 400 naming it
    (`tools[1].function.name`, `tools[0].function.parameters`); a keyword only the grammar
    compiler refuses (e.g. "not") is found when the text service compiles a forced call's
    grammar: 400 naming `tools`.
  * `tool_choice`: "none" (the tools are not shown; the answer is text), "auto" (the default with
    tools: shown, and the model answers in text or calls), "required" (at least one call) or
    `{"type": "function", "function": {"name"}}` (that function). The last two are forced: the
    decoder holds the answer to a Lark grammar of the format's calls (tool_formats.ToolFormat
    .grammar), so every answer is a call whose arguments match the tool's schema.
  * `parallel_tool_calls` (default true): false allows one call per answer (Llama 3's format
    holds one anyway).
  * the tools are shown by the model's chat template in its own words where it does that
    (`chat_tools`: Chat.tools, when the format is the template's and ToolFormat
    .template_shows_tools), else in the format's words in the system message (appended to the
    first system/developer message, or a new one first); an assistant turn's `tool_calls` are
    written back in the format, and a `tool` turn becomes the format's result turn.
Answer side (`read_calls`, `ToolStream`): an answer that starts with the format's opener and
parses as calls to offered tools becomes `message.tool_calls` (ids `call_<hex>`), content null,
finish_reason `tool_calls`; a `length` cut stays text with `length`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from engine.constraints import ConstraintError, lark_term
from protos.decode.v1 import decode_pb2
from protos.text.v1 import text_pb2
from services.openai_api.errors import ApiError, not_supported
from services.openai_api.tool_formats import Call, Tool, ToolFormat

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_TOOLS = 128
NO_ARGUMENTS = {"type": "object", "properties": {}}


def _invalid(param: str, why: str) -> ApiError:
    return ApiError(400, f"{param} {why}", param=param, code="invalid_value")


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools ask for; None from `plan_of` means no tools in play."""

    tools: tuple[Tool, ...]
    forced: str | None  # None: auto; "": required (any tool); a name: that function
    parallel: bool

    @property
    def names(self) -> set[str]:
        return {t.name for t in self.tools}


def _tool(entry: Any, i: int) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(entry, dict) or entry.get("type") != "function":
        raise _invalid(f"{where}.type", 'must be "function" (the only tool type this server runs)')
    function = entry.get("function")
    if not isinstance(function, dict):
        raise _invalid(f"{where}.function", "must be an object with a `name`")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise _invalid(f"{where}.function.name", "must be 1 to 64 letters, digits, '_' or '-'")
    description = function.get("description") or ""
    if not isinstance(description, str):
        raise _invalid(f"{where}.function.description", "must be a string")
    parameters = function.get("parameters")
    parameters = NO_ARGUMENTS if parameters is None else parameters
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise _invalid(f"{where}.function.parameters", 'must be a JSON Schema of "type": "object"')
    try:
        term = lark_term(json.dumps(parameters))
    except ConstraintError as error:
        raise _invalid(f"{where}.function.parameters", error.reason) from None
    return Tool(name, description, parameters, term)


def plan_of(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> ToolPlan | None:
    """The body's tool fields checked (400 naming the first wrong one) and planned."""
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise _invalid("parallel_tool_calls", "must be true or false")
    if tools is None or tools == []:
        if tool_choice not in (None, "none"):
            raise _invalid("tool_choice", "needs `tools`")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise _invalid("tools", f"must be a list of at most {MAX_TOOLS} tools")
    parsed = tuple(_tool(entry, i) for i, entry in enumerate(tools))
    seen: set[str] = set()
    for i, t in enumerate(parsed):
        if t.name in seen:
            raise _invalid(f"tools[{i}].function.name", f"{t.name!r} is given twice")
        seen.add(t.name)
    if tool_choice == "none":
        return None
    if tool_choice in (None, "auto"):
        forced = None
    elif tool_choice == "required":
        forced = ""
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and isinstance(tool_choice.get("function"), dict):
        forced = tool_choice["function"].get("name")
        if forced not in seen:
            raise _invalid("tool_choice.function.name", f"must name one of the tools (got {json.dumps(forced)})")
    else:
        raise _invalid("tool_choice", 'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')
    return ToolPlan(parsed, forced, parallel_tool_calls is not False)


def constraint_of(plan: ToolPlan | None, fmt: ToolFormat) -> decode_pb2.Constraint | None:
    """The grammar a forced choice holds the answer to (None for auto: the model may answer in text)."""
    if plan is None or plan.forced is None:
        return None
    tools = [t for t in plan.tools if not plan.forced or t.name == plan.forced]
    return decode_pb2.Constraint(lark=fmt.grammar(tools, plan.parallel and fmt.parallel))


def _history_calls(tool_calls: Any, i: int) -> list[Call]:
    where = f"messages[{i}].tool_calls"
    if not isinstance(tool_calls, list):
        raise _invalid(where, "must be a list")
    calls = []
    for j, entry in enumerate(tool_calls):
        function = entry.get("function") if isinstance(entry, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _invalid(f"{where}[{j}].function.name", "must be a string")
        arguments = function.get("arguments", "{}")
        try:
            if not isinstance(json.loads(arguments), dict):
                raise ValueError
        except (TypeError, ValueError):
            raise _invalid(f"{where}[{j}].function.arguments", "must be a JSON object as text") from None
        calls.append(Call(function["name"], arguments))
    return calls


def conversation(messages: list, plan: ToolPlan | None, fmt: ToolFormat | None, text_of) -> list[tuple[str, str]]:
    """The messages as (role, content) turns with the tool parts written in `fmt`; `text_of(message,
    i)` is a message's text content. Without a format, a tool part is refused (400)."""
    turns: list[tuple[str, str]] = []
    for i, message in enumerate(messages):
        if message.function_call is not None:
            raise not_supported(f"messages[{i}].function_call", "is not supported (use tool_calls)")
        if message.role == "tool" or message.tool_calls is not None:
            if fmt is None:
                raise not_supported(f"messages[{i}].role" if message.role == "tool" else f"messages[{i}].tool_calls")
        if message.role == "tool":
            turns.append(fmt.result(text_of(message, i)))
        elif message.tool_calls:
            calls = _history_calls(message.tool_calls, i)
            text = text_of(message, i)
            turns.append((message.role, (text + "\n" if text else "") + fmt.render(calls)))
        else:
            turns.append((message.role, text_of(message, i)))
    if plan is not None and not fmt.template_shows_tools:
        instructions = fmt.instructions(list(plan.tools))
        if turns and turns[0][0] in ("system", "developer"):
            turns[0] = (turns[0][0], f"{turns[0][1]}\n\n{instructions}" if turns[0][1] else instructions)
        else:
            turns.insert(0, ("system", instructions))
    return turns


def chat_tools(plan: ToolPlan | None, fmt: ToolFormat | None) -> list[text_pb2.ChatTool]:
    """The offered tools for the chat template to show, when it shows them (else none: they are
    in the system message's instructions, `conversation`)."""
    if plan is None or fmt is None or not fmt.template_shows_tools:
        return []
    return [
        text_pb2.ChatTool(name=t.name, description=t.description, parameters=json.dumps(t.parameters, ensure_ascii=False))
        for t in plan.tools
    ]


def call_json(call: Call) -> dict:
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def read_calls(text: str, reason: str, plan: ToolPlan | None, fmt: ToolFormat | None) -> list[Call] | None:
    """The calls a finished answer makes (None: it is text). A cut answer is text."""
    if plan is None or fmt is None or reason != "stop" or not fmt.could_open(text):
        return None
    return fmt.calls(text, plan.names)


class ToolStream:
    """One streamed choice's text (and its logprob entries), held while it may still be calls.

    `feed` returns what can be sent as content now: everything, unless the answer so far may
    still open with the format's opener, in which case it is held (None). Once the answer has
    finished, `read_calls` decides whether the held text is calls or text after all."""

    def __init__(self, plan: ToolPlan | None, fmt: ToolFormat | None) -> None:
        self.plan, self.fmt = plan, fmt
        self.holding = plan is not None and fmt is not None
        self.held, self.entries = "", []

    def feed(self, text: str, entries: list) -> tuple[str, list] | None:
        if not self.holding:
            return text, entries
        self.held += text
        self.entries += entries
        if self.fmt.could_open(self.held):
            return None
        self.holding = False  # it is text: send what was held and stop holding
        out = (self.held, self.entries)
        self.held, self.entries = "", []
        return out
