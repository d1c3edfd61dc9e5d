"""What a chat template does with tools: the format it writes tool calls in, and whether it shows
the tools to the model itself.

A model family is trained on one way of writing tool calls, and its chat template is where that
way is written down: the template renders an assistant turn's `tool_calls` the way the model was
taught to write them. So the format is read by rendering, not by pattern-matching the template's
source: `read` renders the template with a probe conversation (an assistant turn calling a probe
function, then its result) and looks at what came out:

  * `qwen`: `<tool_call>` blocks holding one JSON object `{"name", "arguments"}` each (Qwen2.5,
    Qwen3, Hermes-style templates);
  * `smollm2`: one `<tool_call>` block holding a JSON list of such objects;
  * `llama3`: a bare JSON object `{"name", "parameters"}` (Llama 3.1, 3.2 and 3.3);
  * None: the probe call is not in the output in any of these shapes (the template has no tool
    section, as SmolLM2's shipped one, or one in another format, or it refused the probe).

`renders_tools` says whether the probe tool's description appears in a conversation rendered
with `tools`: then the template's own words show the tools (Qwen's `# Tools` system section,
Llama's tool list in the first user turn), which is what the model was trained on.

Templates are rendered as transformers renders them (tokenizer_svc.chat). One that raises on
the probe, or writes nothing for it, is "no format", never an error: reading the format must not
stop a model from loading.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass

from tokenizer_svc.chat import ChatTemplate

QWEN, SMOLLM2, LLAMA3 = "qwen", "smollm2", "llama3"

_NAME = "tokenwire_probe_function"
_DESCRIPTION = "tokenwire probe description"
_ARGUMENTS = {"probe_argument": "probe value"}
PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": _NAME,
        "description": _DESCRIPTION,
        "parameters": {"type": "object", "properties": {"probe_argument": {"type": "string"}}, "required": ["probe_argument"]},
    },
}
# Arguments as an object, as transformers' callers pass them: Qwen2.5's and Llama's templates
# write `arguments | tojson`, which would quote a string a second time.
_CALL = {"id": "call_probe", "type": "function", "function": {"name": _NAME, "arguments": _ARGUMENTS}}
# Tried in order; the first that renders with the probe call in it decides. The first is the
# whole round trip; the second suits templates that refuse a system or tool turn.
_CONVERSATIONS = (
    [
        {"role": "system", "content": "probe system"},
        {"role": "user", "content": "probe question"},
        {"role": "assistant", "content": "", "tool_calls": [_CALL]},
        {"role": "tool", "tool_call_id": "call_probe", "content": "probe result"},
    ],
    [{"role": "user", "content": "probe question"}, {"role": "assistant", "content": "", "tool_calls": [_CALL]}],
)
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_OBJECT = re.compile(r'\{\s*"name"\s*:')


@dataclass(frozen=True)
class TemplateTools:
    format: str | None  # QWEN, SMOLLM2, LLAMA3, or None when the template writes no tool calls we know
    renders_tools: bool  # the template shows a `tools` list to the model itself


NO_TOOLS = TemplateTools(None, False)


def _is_probe(value: object, arguments_key: str) -> bool:
    """`value` is the probe call, written as {"name": ..., arguments_key: {...}} and nothing else."""
    return isinstance(value, dict) and value.keys() == {"name", arguments_key} and value["name"] == _NAME


def format_of(text: str) -> str | None:
    """The tool format of rendered text that holds the probe call, or None."""
    for block in _BLOCK.finditer(text):
        try:
            body = json.loads(block.group(1))
        except ValueError:
            continue
        if _is_probe(body, "arguments"):
            return QWEN
        if isinstance(body, list) and any(_is_probe(item, "arguments") for item in body):
            return SMOLLM2
    decoder = json.JSONDecoder()
    for start in _OBJECT.finditer(text):
        try:
            value, _ = decoder.raw_decode(text, start.start())
        except ValueError:
            continue
        if _is_probe(value, "parameters"):
            return LLAMA3
    return None


def _rendered(template: ChatTemplate, messages: list[dict], tools: list[dict] | None) -> str | None:
    """The template's text for the probe, or None when it fails in any way: a template that
    cannot render the probe has no format we can read, and must not stop the model loading."""
    try:
        return template.render_values(messages=messages, tools=tools, add_generation_prompt=True)
    except Exception:  # ChatTemplateError, and whatever else a template raises
        return None


def read(template: str | ChatTemplate) -> TemplateTools:
    """The tool format a chat template (its source text, or compiled) writes, and whether it shows
    the tools itself. A template that does not compile raises ChatTemplateError."""
    if isinstance(template, str):
        template = ChatTemplate(template)
    fmt = None
    # Without tools first (a tool list shown holds the probe's name too, though never in a call's
    # shape); with them for templates that need a list (Hermes's iterates `tools` unguarded).
    for messages, tools in itertools.product(_CONVERSATIONS, (None, [PROBE_TOOL])):
        text = _rendered(template, messages, tools)
        fmt = format_of(text) if text is not None and _NAME in text else None
        if fmt is not None:
            break
    shown = _rendered(template, [{"role": "user", "content": "probe question"}], [PROBE_TOOL])
    return TemplateTools(fmt, shown is not None and _DESCRIPTION in shown)
