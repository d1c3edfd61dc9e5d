"""How a model family writes tool calls: the instructions that show it the tools, how its own
earlier calls and the tools' results are written back into the conversation, the Lark grammar
that forces a call, and reading the calls out of its answer.

Three formats, each the one its family is trained on:
  * `qwen` (Qwen2/2.5/3, Hermes-style): one `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
    block per call, results in a user turn inside `<tool_response>` tags;
  * `smollm2` (SmolLM2's tool template): one `<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>`
    block holding a JSON list of calls, results as Qwen's;
  * `llama3` (Llama 3.1/3.2 JSON tool calling): the answer is one JSON object
    `{"name": ..., "parameters": {...}}`, one call per answer, results in an `ipython` turn.
The format is the one the model's chat template writes: the text service reads it from the
template (tokenizer_svc/tool_template.py, by rendering a probe call) and reports it with
Tokenizer.DescribeChat. A template that writes none of them (SmolLM2's shipped one has no tool
section, nor do the ChatML test checkpoints') gets FALLBACK, `smollm2`. Where the template also
shows a `tools` list in its own words (Qwen's and Llama's do), the tools go to it as Chat.tools
(`template_shows_tools`) instead of this module's `instructions`.

An answer is read as calls only when it starts (after whitespace) with the format's opener and
every call in it parses and names a tool offered; anything else stays text.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from typing import Any

@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # as the client gave it: what the model is shown
    term: str  # its Lark `%json` term (engine.constraints.lark_term: compact, objects closed): what a forced call is held to


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # JSON text of an object


def _signature(tool: Tool) -> str:
    entry = {"type": "function", "function": {"name": tool.name, "description": tool.description, "parameters": tool.parameters}}
    return json.dumps(entry, ensure_ascii=False)


def _call_rules(tools: list[Tool], arguments_key: str) -> str:
    """Lark rules whose `call` is one call to any of `tools`, written compactly as
    {"name":"<name>","<arguments_key>":<arguments>}. Each tool's arguments are their own %json
    term, so a tool schema's `$ref`s still resolve against its own root."""
    names = " | ".join(f"call_{i}" for i in range(len(tools)))
    rules = [f"call: {names}"]
    for i, t in enumerate(tools):
        envelope = json.dumps(f'{{"name":"{t.name}","{arguments_key}":')
        rules += [f'call_{i}: {envelope} args_{i} "}}"', f"args_{i}: {t.term}"]
    return "\n".join(rules) + "\n"


def _call_of(value: Any, arguments_key: str, names: set[str]) -> Call | None:
    if not isinstance(value, dict) or set(value) != {"name", arguments_key}:
        return None
    name, arguments = value["name"], value[arguments_key]
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if name not in names or not isinstance(arguments, dict):
        return None
    return Call(name, json.dumps(arguments, ensure_ascii=False))


class ToolFormat:
    name = ""
    opener = ""  # what an answer that calls starts with
    parallel = True  # whether one answer can hold several calls
    arguments_key = "arguments"
    template_shows_tools = False  # the chat template shows the tools (Chat.tools), not `instructions`

    def shown_by_template(self) -> "ToolFormat":
        """This format, with the offered tools shown by the model's chat template."""
        other = copy.copy(self)
        other.template_shows_tools = True
        return other

    def instructions(self, tools: list[Tool]) -> str:
        raise NotImplementedError

    def render(self, calls: list[Call]) -> str:
        """An assistant turn's calls as the model writes them."""
        raise NotImplementedError

    def result(self, content: str) -> tuple[str, str]:
        """A tool's result as a (role, content) turn."""
        return "user", f"<tool_response>\n{content}\n</tool_response>"

    def grammar(self, tools: list[Tool], parallel: bool) -> str:
        """A Lark grammar (llguidance's dialect) whose sentences are calls to `tools`."""
        raise NotImplementedError

    def calls(self, text: str, names: set[str]) -> list[Call] | None:
        """The calls `text` makes, or None when it is an answer in text."""
        raise NotImplementedError

    def could_open(self, text: str) -> bool:
        """Whether `text` (an answer so far) may still turn out to be calls."""
        head = text.lstrip()
        return head.startswith(self.opener) or self.opener.startswith(head)


class QwenFormat(ToolFormat):
    name = "qwen"
    opener = "<tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def instructions(self, tools: list[Tool]) -> str:
        lines = "\n".join(_signature(t) for t in tools)
        return (
            "# Tools\n\nYou can call the functions whose signatures are listed inside <tools></tools>:\n"
            f"<tools>\n{lines}\n</tools>\n\n"
            "To call one, write a JSON object with its name and arguments inside <tool_call></tool_call> tags, "
            'one block per call:\n<tool_call>\n{"name": <function name>, "arguments": <arguments object>}\n</tool_call>'
        )

    def render(self, calls: list[Call]) -> str:
        return "\n".join(
            "<tool_call>\n" + json.dumps({"name": c.name, "arguments": json.loads(c.arguments)}, ensure_ascii=False) + "\n</tool_call>"
            for c in calls
        )

    def grammar(self, tools: list[Tool], parallel: bool) -> str:
        repeat = ' ("\\n" block)*' if parallel else ""
        return f'start: block{repeat}\nblock: "<tool_call>\\n" call "\\n</tool_call>"\n' + _call_rules(tools, "arguments")

    def calls(self, text: str, names: set[str]) -> list[Call] | None:
        text = text.strip()
        if not text.startswith(self.opener):
            return None
        blocks = list(self._BLOCK.finditer(text))
        if not blocks or self._BLOCK.sub("", text).strip():  # text beside the blocks: an answer in text
            return None
        found = []
        for block in blocks:
            try:
                call = _call_of(json.loads(block.group(1)), "arguments", names)
            except ValueError:
                return None
            if call is None:
                return None
            found.append(call)
        return found


class SmolLM2Format(ToolFormat):
    name = "smollm2"
    opener = "<tool_call>["

    def instructions(self, tools: list[Tool]) -> str:
        return (
            "You can call the functions whose signatures are listed inside <tools></tools>.\n"
            f"<tools>[{', '.join(_signature(t) for t in tools)}]</tools>\n"
            "To call them, answer with nothing but a JSON list of calls inside <tool_call></tool_call> tags:\n"
            '<tool_call>[{"name": <function name>, "arguments": <arguments object>}, ...]</tool_call>'
        )

    def render(self, calls: list[Call]) -> str:
        body = [{"name": c.name, "arguments": json.loads(c.arguments)} for c in calls]
        return "<tool_call>" + json.dumps(body, ensure_ascii=False) + "</tool_call>"

    def grammar(self, tools: list[Tool], parallel: bool) -> str:
        repeat = ' ("," call)*' if parallel else ""
        return f'start: "<tool_call>[" call{repeat} "]</tool_call>"\n' + _call_rules(tools, "arguments")

    def calls(self, text: str, names: set[str]) -> list[Call] | None:
        text = text.strip()
        if not (text.startswith(self.opener) and text.endswith("</tool_call>")):
            return None
        try:
            body = json.loads(text[len("<tool_call>"):-len("</tool_call>")])
        except ValueError:
            return None
        if not isinstance(body, list) or not body:
            return None
        found = [_call_of(item, "arguments", names) for item in body]
        return None if any(c is None for c in found) else found


class Llama3Format(ToolFormat):
    name = "llama3"
    opener = "{"
    parallel = False
    arguments_key = "parameters"

    def instructions(self, tools: list[Tool]) -> str:
        return (
            "When a function below helps to answer, reply with nothing but a JSON object that calls it, "
            'in the form {"name": <function name>, "parameters": <arguments object>}.\n\n'
            + "\n\n".join(_signature(t) for t in tools)
        )

    def render(self, calls: list[Call]) -> str:
        return json.dumps({"name": calls[0].name, "parameters": json.loads(calls[0].arguments)}, ensure_ascii=False)

    def result(self, content: str) -> tuple[str, str]:
        return "ipython", content

    def grammar(self, tools: list[Tool], parallel: bool) -> str:
        return "start: call\n" + _call_rules(tools, "parameters")

    def calls(self, text: str, names: set[str]) -> list[Call] | None:
        try:
            call = _call_of(json.loads(text), "parameters", names)
        except ValueError:
            return None
        return None if call is None else [call]


FORMATS = {f.name: f for f in (QwenFormat(), SmolLM2Format(), Llama3Format())}
FALLBACK = "smollm2"  # for a template that writes no tool calls we know
