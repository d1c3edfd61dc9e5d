"""Typed configuration, built once in `main` from flags (each with an environment variable).

Every flag `--some-flag` of every command can also be set by `TOKENWIRE_SOME_FLAG`; a flag
given on the command line wins. The environment is read when the parser is built in `main`,
never at import time.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from engine.engine import EngineConfig
from services.security import ClientTlsConfig, ServerTlsConfig
from services.server import ServerOptions

TRUE_WORDS = {"1", "true", "yes", "on"}


def env_name(flag: str) -> str:
    return "TOKENWIRE_" + flag.lstrip("-").replace("-", "_").upper()


def non_negative(text: str) -> int:
    """argparse type for counts and ids: an int >= 0, or a one-line error naming the value."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def add_flag(parser: argparse.ArgumentParser, flag: str, *, help: str, **kwargs) -> None:
    """Add `--flag` whose default comes from TOKENWIRE_FLAG when set; the help names the variable."""
    env = env_name(flag)
    value = os.environ.get(env)
    if kwargs.get("action") == "store_true":
        kwargs["default"] = value.strip().lower() in TRUE_WORDS if value is not None else False
    elif kwargs.get("action") == "append":
        if value is not None:
            kind = kwargs.get("type", str)
            try:
                kwargs["default"] = [kind(v) for v in value.split(",") if v.strip()]
            except (ValueError, argparse.ArgumentTypeError) as e:
                parser.error(f"{env}={value!r}: {e}")
    elif value is not None:
        kwargs["default"] = value
        kwargs.pop("required", None)
    shown = kwargs.get("default")
    suffix = f" [env {env}" + (f"; default {shown}" if shown not in (None, False, [], "") else "") + "]"
    parser.add_argument(flag, help=help + suffix, **kwargs)


def server_options(a: argparse.Namespace) -> ServerOptions:
    return ServerOptions(
        host=a.host,
        port=a.port,
        tls=ServerTlsConfig.from_paths(a.tls_cert, a.tls_key, a.tls_client_ca),
        auth_token=getattr(a, "auth_token", None) or None,
        max_message_bytes=a.max_message_bytes,
        max_concurrent_streams=a.max_concurrent_streams,
    )


@dataclass(frozen=True)
class DecodeServerConfig:
    model: str
    server: ServerOptions
    engine: EngineConfig
    max_batch_size: int
    max_context_length: int | None
    dtype: str | None
    stall_timeout_s: float
    grace_period_s: float
    metrics_port: int | None

    @staticmethod
    def from_args(a: argparse.Namespace) -> "DecodeServerConfig":
        return DecodeServerConfig(
            model=a.model,
            server=server_options(a),
            engine=EngineConfig(max_queue_size=a.max_queue_size),
            max_batch_size=a.max_batch_size,
            max_context_length=a.max_context_length,
            dtype=a.dtype,
            stall_timeout_s=a.stall_timeout,
            grace_period_s=a.grace_period,
            metrics_port=a.metrics_port,
        )


@dataclass(frozen=True)
class TextServerConfig:
    model: str
    decoder: str
    decoder_tls: ClientTlsConfig | None
    server: ServerOptions
    connect_timeout_s: float
    grace_period_s: float
    metrics_port: int | None

    @staticmethod
    def from_args(a: argparse.Namespace) -> "TextServerConfig":
        return TextServerConfig(
            model=a.model,
            decoder=a.decoder,
            decoder_tls=ClientTlsConfig.from_paths(a.decoder_tls_ca, a.decoder_tls_cert, a.decoder_tls_key),
            server=server_options(a),
            connect_timeout_s=a.connect_timeout,
            grace_period_s=a.grace_period,
            metrics_port=a.metrics_port,
        )
