"""The configuration reference, docs/configuration.md, written from the command line's own parser.

    python -m services.config_reference > docs/configuration.md

Per command: every flag with its environment variable, its default, its one-line help and,
where the flag has them (services.flags), the longer details. tests/test_cli.py compares the
committed file with what this writes, so the reference cannot drift from the parser.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Iterator

from services.config import TRUE_WORDS

HEADER = """\
# Configuration reference

<!-- Generated from the parser (services/flags.py) by `python -m services.config_reference >
docs/configuration.md`; tests/test_cli.py fails when this file differs from what the parser gives. -->

Every flag `--some-flag` can also be set with the environment variable `TOKENWIRE_SOME_FLAG`; a flag
given on the command line wins. A repeatable flag's variable takes a comma-separated list; a switch's
variable turns it on with any of {words}. A value that the flag would refuse is refused in the variable
too, naming the variable. `tokenwire COMMAND --help` prints each flag's one-line help; this page adds
the longer explanations.

A configuration that can never work (a flag's value out of range, flags that do not go together, a
model that does not fit in memory, a tensor-parallel size the model or the host refuses, a missing
extra) ends the command with exit status 2 and one line naming what to change, printed last; a
failure that a restart may cure (a crash, an engine that died, a download that failed) exits 1.
"""


@contextlib.contextmanager
def _without_tokenwire_variables() -> Iterator[None]:
    """The parser takes its defaults from TOKENWIRE_* variables: hide them, so the reference
    shows the built-in defaults whatever this shell has set."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("TOKENWIRE_")}
    try:
        yield
    finally:
        os.environ.update(saved)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    if isinstance(action, argparse._StoreTrueAction):
        return "off"
    if action.default is None:
        return "unset"
    if action.default == "":
        return '`""`'
    return f"`{action.default}`"


def _summary(action: argparse.Action) -> str:
    text = getattr(action, "summary", None) or action.help or ""
    if action.choices:
        text += f" (one of {', '.join(f'`{c}`' for c in action.choices)})"
    return text


def _rows(command: str, parser: argparse.ArgumentParser, explained: dict[tuple, str]) -> tuple[list[str], list[str]]:
    """The table rows of `parser`'s flags and positional arguments, and the details section's
    lines. A flag whose details an earlier command already gave links there instead."""
    rows, details = [], []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or isinstance(action, argparse._SubParsersAction):
            continue
        name = action.option_strings[-1] if action.option_strings else action.metavar or action.dest
        variable = f"`{action.env}`" if getattr(action, "env", None) else "—"
        label = f"`{name}`"
        if text := getattr(action, "details", ""):
            key = (name, _summary(action), text)
            if key not in explained:
                explained[key] = f"{command}-{name.lstrip('-').lower()}"
                details += [f'<a id="{explained[key]}"></a>', f"#### `{name}`", "", text, ""]
            label = f"[{label}](#{explained[key]})"
        rows.append(f"| {label} | {variable} | {_default(action)} | {_cell(_summary(action))} |")
    return rows, details


def reference() -> str:
    """docs/configuration.md's text, from the parser as built with no TOKENWIRE_* variable set."""
    from services.flags import build_parser

    with _without_tokenwire_variables():
        parser = build_parser()
    lines = [HEADER.format(words=", ".join(f"`{w}`" for w in sorted(TRUE_WORDS)))]
    explained: dict[tuple, str] = {}
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    commands = [("tokenwire", "Flags given before the command; they apply to every command.", parser)]
    commands += [(f"tokenwire {name}", sub.description, sub) for name, sub in subparsers.choices.items()]
    for title, description, sub in commands:
        rows, details = _rows(title.removeprefix("tokenwire").strip() or "tokenwire", sub, explained)
        lines += [f"## `{title}`", "", description, "", "| Flag | Variable | Default | What it sets |", "|---|---|---|---|", *rows, ""]
        if details:
            lines += ["### Details", "", *details]
    return "\n".join(lines).rstrip("\n") + "\n"


if __name__ == "__main__":
    sys.stdout.write(reference())
