"""Chat templates: a list of messages -> the prompt text the model was trained on.

Rendering follows HF transformers so that the same model directory gives the same prompt here and
there: a jinja2 `ImmutableSandboxedEnvironment` with `trim_blocks`, `lstrip_blocks` and the
`loopcontrols` extension; `raise_exception(msg)` and `strftime_now(fmt)` as globals; a `tojson`
filter that keeps non-ASCII text as is (json.dumps with ensure_ascii=False); a `namespace` that
refuses underscore-prefixed attributes; and the variables `messages` (a list of {"role", "content"}
dicts), `tools` and `documents` (None), `add_generation_prompt`, and the named special tokens the
tokenizer config sets (`bos_token`, `eos_token`, `unk_token`, ...; unset ones stay undefined).

The template comes from chat_template.jinja if the directory has one (newer transformers save it
there), else from tokenizer_config.json's "chat_template": a string, or a list of
{"name", "template"} of which the one named "default" is used.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Mapping, Sequence

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
    ) -> str:
        """The template's text; any error the template raises becomes ChatTemplateError with its message.

        `special_tokens` maps names such as "bos_token" to token text; they are template variables."""
        try:
            return self._template.render(
                **(special_tokens or {}),
                messages=[{"role": m.role, "content": m.content} for m in messages],
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
            )
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
