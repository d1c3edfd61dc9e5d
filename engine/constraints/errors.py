"""llguidance's error messages turned into one-line reasons that name the keyword or position.

llguidance reports a grammar it cannot build as text, often several lines long (a regex-crate
report with a caret, a Lark excerpt with a caret). A client wants one line that says what to fix,
so the known shapes are rewritten and anything else is cut to its first line.
"""

from __future__ import annotations

import json
import re

_MAX_REASON = 300
_UNIMPLEMENTED = re.compile(r'Unimplemented keys: \[(.*?)\]')
_UNKNOWN_FORMAT = re.compile(r"Unknown format: (.*)")
_POSITION = re.compile(r"^(?:at )?(\d+)\((\d+)\): ")
_REGEX_REPORT = re.compile(r"regex parse error:\n(?P<line>[^\n]*)\n(?P<caret>[ ]*)\^[^\n]*\nerror: (?P<what>[^\n]*)")


def reason(kind: str, message: str, source: str = "") -> str:
    """The one-line reason for llguidance's `message` about a constraint of `kind` whose text is
    `source`."""
    message = message.strip()
    if m := _UNIMPLEMENTED.search(message):
        keys = [k.strip() for k in m.group(1).split(",") if k.strip()]
        noun = "keyword" if len(keys) == 1 else "keywords"
        return _cut(f"unsupported {noun} {', '.join(keys)}")
    if m := _UNKNOWN_FORMAT.search(message):
        return _cut(f'unsupported "format": "{m.group(1).splitlines()[0].strip()}"')
    if m := _REGEX_REPORT.search(message):
        return _cut(_regex_reason(kind, m, source))
    first = message.splitlines()[0] if message else "rejected by the grammar compiler"
    if first.startswith("Pointer '") or "is not present in a registry" in first:
        first = f'"$ref": {first}'  # a $ref whose target is missing or remote (never fetched)
    if m := _POSITION.match(first):
        first = f"line {m.group(1)}, column {m.group(2)}: {first[m.end():]}"
    return _cut(first)


def _regex_reason(kind: str, m: re.Match, source: str) -> str:
    """The regex crate's report: it quotes the regex, indented four spaces, with a caret under the
    fault. The position counts in the quoted text, so that text is named unless it is the
    caller's own regex (a regex constraint's \\d becomes [0-9], and "/" is escaped, before it compiles)."""
    quoted = m.group("line")[4:]
    where = len(m.group("caret")) - 4
    at = f" at position {where}" if where >= 0 else ""
    if kind == "regex" and quoted == source:
        return f"{m.group('what')}{at}"
    subject = {"json_schema": "a regular expression in the schema", "lark": "a regular expression in the grammar"}
    return f"{subject.get(kind, 'the regular expression')} {json.dumps(quoted)}: {m.group('what')}{at}"


def _cut(text: str) -> str:
    return text if len(text) <= _MAX_REASON else text[: _MAX_REASON - 3] + "..."
