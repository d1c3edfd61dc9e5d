"""Typed configuration, built once in `main` from flags (each with an environment variable).

Every flag `--some-flag` of every command can also be set by `TOKENWIRE_SOME_FLAG`; a flag
given on the command line wins. The environment is read when the parser is built in `main`,
never at import time.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

TRUE_WORDS = {"1", "true", "yes", "on"}


def env_name(flag: str) -> str:
    return "TOKENWIRE_" + flag.lstrip("-").replace("-", "_").upper()


def add_flag(parser: argparse.ArgumentParser, flag: str, *, help: str, **kwargs) -> None:
    """Add `--flag` whose default comes from TOKENWIRE_FLAG when set; the help names the variable."""
    env = env_name(flag)
    value = os.environ.get(env)
    if kwargs.get("action") == "store_true":
        kwargs["default"] = value.strip().lower() in TRUE_WORDS if value is not None else False
    elif kwargs.get("action") == "append":
        if value is not None:
            kind = kwargs.get("type", str)
            kwargs["default"] = [kind(v) for v in value.split(",") if v.strip()]
    elif value is not None:
        kwargs["default"] = value
        kwargs.pop("required", None)
    shown = kwargs.get("default")
    suffix = f" [env {env}" + (f"; default {shown}" if shown not in (None, False, [], "") else "") + "]"
    parser.add_argument(flag, help=help + suffix, **kwargs)


@dataclass(frozen=True)
class DecodeServerConfig:
    model: str
    host: str
    port: int
    max_batch_size: int
    max_context_length: int | None
    max_queue_size: int
    dtype: str | None
    grace_period_s: float

    @staticmethod
    def from_args(a: argparse.Namespace) -> "DecodeServerConfig":
        return DecodeServerConfig(
            a.model, a.host, a.port, a.max_batch_size, a.max_context_length, a.max_queue_size, a.dtype, a.grace_period
        )


@dataclass(frozen=True)
class TextServerConfig:
    model: str
    decoder: str
    host: str
    port: int
    connect_timeout_s: float
    grace_period_s: float

    @staticmethod
    def from_args(a: argparse.Namespace) -> "TextServerConfig":
        return TextServerConfig(a.model, a.decoder, a.host, a.port, a.connect_timeout, a.grace_period)
