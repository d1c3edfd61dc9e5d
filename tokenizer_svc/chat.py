"""Chat templates: a list of messages -> the prompt text the model was trained on.

Rendering follows HF transformers so that the same model directory gives the same prompt here and
there: a jinja2 `ImmutableSandboxedEnvironment` with `trim_blocks`, `lstrip_blocks` and the
`loopcontrols` extension; `raise_exception(msg)` and `strftime_now(fmt)` as globals; a `tojson`
filter that keeps non-ASCII text as is (json.dumps with ensure_ascii=False); a `namespace` that
refuses underscore-prefixed attributes; and the variables `messages` (a list of {"role", "content"}
dicts), `tools` (the chat's tools as JSON values, or None without any), `documents` (None),
`add_generation_prompt`, and the named special tokens the tokenizer config sets (`bos_token`,
`eos_token`, `unk_token`, ...; unset ones stay undefined).

The template comes from chat_template.jinja if the directory has one (newer transformers save it
there), else from tokenizer_config.json's "chat_template": a string, or a list of
{"name", "template"} of which the one named "default" is used.

Where we differ from transformers: text a user writes (a message's role or content, any string in
a tool) never becomes a special token. transformers renders the template and tokenizes the result, so "<|im_end|>" typed
in a message is the real control token and a user can forge a turn. Here `SpecialTextShield` hands
the template each message with special-token text swapped for private-use stand-ins; the tokenizer
(`TextTokenizer.encode_chat`) turns them back into the same text, encoded as plain text. Messages
without special-token text render and encode exactly as transformers does.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """No template, a template that does not compile, or one that raised while rendering."""


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Unlike jinja2's own tojson, no HTML escaping: templates write JSON into prompts, not pages.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` for templates, refusing dunder/private attributes as transformers does."""

    def __init__(*args: object, **kwargs: object) -> None:  # jinja's signature trick: `self` may be a kwarg
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: object) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"templates cannot set underscore-prefixed attribute {name!r}")


@lru_cache(maxsize=None)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    return env


class ChatTemplate:
    """A compiled template; compiled once at load so a broken template fails at start-up."""

    def __init__(self, source: str) -> None:
        self.source = source
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from exc

    def render(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        special_tokens: Mapping[str, str] | None = None,
        tools: Sequence[object] = (),
    ) -> str:
        """The template's text; any error the template raises becomes ChatTemplateError with its message.

        `special_tokens` maps names such as "bos_token" to token text; they are template variables.
        `tools` (JSON values, OpenAI's {"type": "function", "function": {...}}) are the template's
        `tools` variable; none: None, as transformers passes it."""
        return self.render_values(
            **(special_tokens or {}),
            messages=[{"role": m.role, "content": m.content} for m in messages],
            tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
        )

    def render_values(self, **variables: object) -> str:
        """The template rendered with these variables (`documents` None unless given), errors
        mapped as in `render`. For callers that need messages beyond (role, content), such as
        tokenizer_svc.tool_template's probe of an assistant turn with `tool_calls`."""
        try:
            return self._template.render(**{"documents": None, "tools": None, **variables})
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(str(exc)) from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc


SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def load_chat_template(model_dir: Path, tokenizer_config: dict) -> ChatTemplate | None:
    """chat_template.jinja first, then tokenizer_config.json's "chat_template"; None if neither."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return ChatTemplate(jinja_file.read_text(encoding="utf-8"))
    source = tokenizer_config.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if isinstance(source, str) and source:
        return ChatTemplate(source)
    return None


# Stand-ins come from the private-use planes: no template writes them, and the few a message holds
# (icon fonts use some) are skipped.
_STAND_IN_RANGES = ((0xE000, 0xF8FF), (0xF0000, 0xFFFFD), (0x100000, 0x10FFFD))


class SpecialTextShield:
    """Keeps special-token text that users write in chat messages away from the template.

    `shield` replaces, in each message's role and content, every occurrence of a special token's
    text with a private-use character (one per distinct text replaced); jinja passes such a character through
    every filter and method templates use (strip, trim, split, slicing, upper, tojson) as the
    ordinary character it is, so whatever the template does with the content, the character
    cannot take part in a special token of the rendered text, and only the template's own text
    can. The returned `str.translate` table turns the characters back into the text they stand for.

    Also replaced: a piece of a special token's text at either end of a role or content, or at
    either end after stripping whitespace (templates strip). Template text next to it could
    otherwise complete the token (content "hi <|" followed by a template's "im_end|>"). The
    pieces are restored as plain text, so where no template text completes them their ids are
    the ones they would have had anyway; only the path that encodes them changes.

    The template sees each special token's text as one character: a template that slices or
    reverses a message's content, or measures its length, can give other text than transformers
    (the same as transformers' wherever it does not cut through a special token's text).

    Not covered: a template that deletes or reorders characters inside a message (`replace`,
    `reverse`) and so makes a special token's text out of text that held none. No chat template we
    know of does this.
    """

    def __init__(self, special_texts: Iterable[str]) -> None:
        texts = sorted({t for t in special_texts if t}, key=len, reverse=True)
        self._chars = frozenset("".join(texts))
        # Longest first: at each position the longest special text wins, as in the tokenizer.
        self._pattern = re.compile("|".join(map(re.escape, texts))) if texts else None
        self._prefixes = frozenset(t[:k] for t in texts for k in range(1, len(t)))
        self._suffixes = frozenset(t[k:] for t in texts for k in range(1, len(t)))
        self._longest_piece = max((len(t) for t in texts), default=1) - 1

    def _ranges(self, text: str) -> list[tuple[int, int]]:
        """The spans of `text` to replace, sorted and merged."""
        if self._pattern is None or not text:
            return []
        spans = [m.span() for m in self._pattern.finditer(text)]
        n = len(text)
        for end in {n, len(text.rstrip())}:  # a special token's first characters, last in the text
            for k in range(min(self._longest_piece, end), 0, -1):
                if text[end - k : end] in self._prefixes:
                    spans.append((end - k, end))
                    break
        for start in {0, n - len(text.lstrip())}:  # its last characters, first in the text
            for k in range(min(self._longest_piece, n - start), 0, -1):
                if text[start : start + k] in self._suffixes:
                    spans.append((start, start + k))
                    break
        merged: list[tuple[int, int]] = []
        for start, end in sorted(spans):
            if merged and start < merged[-1][1]:
                merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
            else:
                merged.append((start, end))
        return merged

    def shield(
        self, messages: Sequence[ChatMessage], avoid: str = ""
    ) -> tuple[Sequence[ChatMessage], dict[int, str]]:
        """(messages for the template, table to restore the rendered text with `str.translate`).

        Messages without special-token text come back as they are, and the table is empty when no
        message had any. Stand-in characters are none of those in the messages, in the special
        texts, or in `avoid` (the template's source)."""
        shielded, _, restore = self.shield_chat(messages, (), avoid)
        return shielded, restore

    def shield_chat(
        self, messages: Sequence[ChatMessage], tools: Sequence[object], avoid: str = ""
    ) -> tuple[Sequence[ChatMessage], Sequence[object], dict[int, str]]:
        """`shield` for a chat with tools: (messages, tools, table). Every string in `tools` (JSON
        values: object keys too) is shielded as a message's content is; a template writes tools
        with `tojson`, which leaves the stand-ins as they are. Stand-ins avoid the tools' text too."""
        plans = [(m, self._ranges(m.role), self._ranges(m.content)) for m in messages]
        tool_texts = [text for tool in tools for text in strings_of(tool)]
        tool_plans = {text: spans for text in tool_texts if (spans := self._ranges(text))}
        if not tool_plans and not any(role or content for _, role, content in plans):
            return messages, tools, {}
        taken = set(avoid) | self._chars
        for m in messages:
            taken.update(m.role, m.content)
        for text in tool_texts:
            taken.update(text)
        free = (chr(c) for lo, hi in _STAND_IN_RANGES for c in range(lo, hi + 1) if chr(c) not in taken)
        stand_ins: dict[str, str] = {}  # special text (or piece of one) -> its stand-in

        def replace(text: str, spans: list[tuple[int, int]]) -> str:
            out, pos = [], 0
            for start, end in spans:
                piece = text[start:end]
                if piece not in stand_ins:
                    stand_in = next(free, None)
                    if stand_in is None:
                        raise ChatTemplateError("chat messages use up every private-use character")
                    stand_ins[piece] = stand_in
                out += [text[pos:start], stand_ins[piece]]
                pos = end
            out.append(text[pos:])
            return "".join(out)

        shielded = [
            ChatMessage(replace(m.role, role), replace(m.content, content)) if role or content else m
            for m, role, content in plans
        ]
        shielded_tools = [
            _map_strings(tool, lambda text: replace(text, tool_plans[text]) if text in tool_plans else text) for tool in tools
        ]
        return shielded, shielded_tools, {ord(stand_in): text for text, stand_in in stand_ins.items()}


def strings_of(value: object) -> Iterator[str]:
    """Every string in a JSON value: object keys and string values, at any depth."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from strings_of(key)
            yield from strings_of(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from strings_of(item)


def _map_strings(value: object, fn: Callable[[str], str]) -> object:
    """A JSON value with `fn` applied to each of its strings (object keys too)."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, Mapping):
        return {fn(key) if isinstance(key, str) else key: _map_strings(item, fn) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_map_strings(item, fn) for item in value]
    return value
