"""Typed configuration, built once in `main` from flags (each with an environment variable).

Every flag `--some-flag` of every command can also be set by `TOKENWIRE_SOME_FLAG`; a flag
given on the command line wins. The environment is read when the parser is built in `main`
(and $CXX, the usual compiler variable, with the model options), never at import time, and
never below `services/`: the engine and the model store take what they need as arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path

from engine.core.engine import EngineConfig
from engine.core.model_options import MOST_GUESSES, SERVED, ModelOptions, least_kv_pages
from services.security import ClientTlsConfig, ServerTlsConfig, check_server_auth, read_token_file
from services.server import ServerOptions

TRUE_WORDS = {"1", "true", "yes", "on"}


def env_name(flag: str) -> str:
    return "TOKENWIRE_" + flag.lstrip("-").replace("-", "_").upper()


def _bounded(kind: type, low: float, high: float | None, wanted: str, low_allowed: bool = True):
    """An argparse type: a `kind` from `low` (inclusive unless `low_allowed` is False) up to
    `high`, or a one-line error naming the value."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}")
        if value < low or (value == low and not low_allowed) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {value}")
        return value

    parse.__name__ = wanted  # what argparse names in its own messages
    return parse


non_negative = _bounded(int, 0, None, "a whole number >= 0")  # counts, ids, queue sizes
positive = _bounded(int, 1, None, "a whole number >= 1")  # sizes that cannot be empty
port_number = _bounded(int, 0, 65535, "a port in 0..65535")
seconds = _bounded(float, 0.0, None, "a number of seconds >= 0")
milliseconds = _bounded(float, 0.0, None, "a number of milliseconds >= 0")
timeout = _bounded(float, 0.0, None, "a number of seconds > 0", low_allowed=False)
fraction = _bounded(float, 0.0, 1.0, "a fraction in (0, 1]", low_allowed=False)  # a share of a device's memory
guesses = _bounded(int, 1, MOST_GUESSES, f"a whole number in 1..{MOST_GUESSES}")  # --speculative-tokens


def add_flag(parser: argparse.ArgumentParser, flag: str, *, help: str, details: str = "", **kwargs) -> None:
    """Add `--flag` whose default comes from TOKENWIRE_FLAG when set; the help names the variable.
    The variable is parsed here, so a bad value is an error that names the variable. `help` is
    the one line `--help` prints; `details`, the longer explanation that only the configuration
    reference prints (services.config_reference). Both stay on the argparse action, with the
    variable's name, for the reference to read: `summary`, `details`, `env`."""
    env = env_name(flag)
    value = os.environ.get(env)
    if kwargs.get("action") == "store_true":
        kwargs["default"] = value is not None and value.strip().lower() in TRUE_WORDS
    elif value is not None:
        try:
            kwargs["default"] = _env_value(value, kwargs)
        except (ValueError, argparse.ArgumentTypeError) as e:
            parser.error(f"{env}={value!r}: {e}")
        kwargs.pop("required", None)
    shown = kwargs.get("default")
    suffix = f" [env {env}" + (f"; default {shown}" if not (shown is None or shown is False or shown in ([], "")) else "") + "]"
    action = parser.add_argument(flag, help=help + suffix, **kwargs)
    action.summary, action.details, action.env = help, details, env


def _env_value(text: str, kwargs: dict):
    """A variable's text as its flag's value (a comma-separated list for a repeatable flag),
    through the flag's type and choices; raises ValueError or ArgumentTypeError."""
    repeated = kwargs.get("action") == "append"
    parts = [part for part in text.split(",") if part.strip()] if repeated else [text]
    values = [kwargs.get("type", str)(part) for part in parts]
    choices = kwargs.get("choices")
    if choices is not None and any(v not in choices for v in values):
        raise ValueError(f"choose from {', '.join(map(str, choices))}")
    return values if repeated else values[0]


def token(a: argparse.Namespace, prefix: str = "") -> str | None:
    """--{prefix}auth-token, or the text of --{prefix}auth-token-file (a compose or Kubernetes
    secret, kept out of `ps`); None when neither is set, ValueError when both are."""
    flag = f"{prefix}auth_token"
    value, path = getattr(a, flag, None), getattr(a, f"{flag}_file", None)
    dashed = "--" + flag.replace("_", "-")
    if value and path:
        raise ValueError(f"{dashed} and {dashed}-file give the same token two ways: set one")
    if path:
        return read_token_file(path, f"{dashed}-file")
    return value or None


def server_security(a: argparse.Namespace) -> tuple[ServerTlsConfig | None, str | None]:
    """A server's TLS and bearer token from its flags, refused (check_server_auth) when a token
    would travel in plaintext off the loopback interface."""
    tls = ServerTlsConfig.from_paths(a.tls_cert, a.tls_key, a.tls_client_ca)
    auth_token = token(a)
    check_server_auth(auth_token, tls, a.host)
    return tls, auth_token


def server_options(a: argparse.Namespace) -> ServerOptions:
    tls, auth_token = server_security(a)
    return ServerOptions(
        host=a.host,
        port=a.port,
        tls=tls,
        auth_token=auth_token,
        max_message_bytes=a.max_message_bytes,
        max_concurrent_streams=a.max_concurrent_streams,
    )


def cache_dir(a: argparse.Namespace) -> Path | None:
    """--cache (TOKENWIRE_CACHE), expanded; None: the registry's default (~/.cache/tokenwire)."""
    return Path(a.cache).expanduser() if a.cache else None


def model_options(a: argparse.Namespace, max_batch_size: int) -> ModelOptions:
    """How the engine loads the model, from the model flags (whose defaults are SERVED's), for
    `max_batch_size` sequences decoded together; ValueError for a KV cache that cannot serve them."""
    fraction = a.kv_cache_memory_fraction
    if a.kv_cache_tokens and fraction is not None:
        raise ValueError(
            f"--kv-cache-tokens {a.kv_cache_tokens} and --kv-cache-memory-fraction {fraction} both size the KV "
            "cache: give one of them"
        )
    check_kv_cache(a.kv_cache_tokens, SERVED.kv_page_size, max_batch_size)
    if a.weights in ("int8", "fp8") and a.tensor_parallel > 1:
        raise ValueError(f"--weights {a.weights} runs on one device: it cannot be combined with --tensor-parallel {a.tensor_parallel}")
    return ModelOptions(
        max_context_length=a.max_context_length,
        dtype=a.dtype,
        cpu_kernels=a.cpu_kernels == "on",
        cache_dir=cache_dir(a),
        compiler=os.environ.get("CXX") or None,
        max_prefill_chunk=a.max_prefill_chunk,
        kv_cache_tokens=a.kv_cache_tokens,
        kv_cache_memory_fraction=fraction,
        tensor_parallel=a.tensor_parallel,
        compilation_cache=a.compilation_cache == "on",
        weights=a.weights,
        cpu_threads=a.cpu_threads or None,
        memory_limit_bytes=a.memory_limit_bytes or None,
        max_step_tokens=getattr(a, "max_step_tokens", None),  # (generate --local has no such flag)
        max_guesses=speculative_tokens(a),
        max_verify_rows=getattr(a, "speculation_max_batch", 0) if speculation(a) != "off" else 0,
    )


def speculation(a: argparse.Namespace) -> str:
    """The speculation mode: `--speculation`, or "draft" where only `--draft-model` is given
    ("off" for commands without the flags); ValueError for a draft model without a draft mode, or
    the other way round."""
    mode, draft = getattr(a, "speculation", "off"), getattr(a, "draft_model", None)
    if draft is None:
        if mode == "draft":
            raise ValueError("--speculation draft guesses with a draft model: give it with --draft-model NAME|DIR")
        return mode
    if mode not in ("off", "draft"):
        raise ValueError(f"--draft-model {draft} guesses for --speculation draft, not --speculation {mode}: drop one of them")
    return "draft"


def speculative_tokens(a: argparse.Namespace) -> int:
    """The model's `max_guesses` for `--speculation` and `--speculative-tokens` (0: off, and for
    commands without the flags); ValueError for a configuration that cannot speculate."""
    if speculation(a) == "off":
        return 0
    context = a.max_context_length or 2048
    if a.speculative_tokens >= context:
        raise ValueError(f"--speculative-tokens {a.speculative_tokens} must be below --max-context-length ({context})")
    if getattr(a, "coordinator", None) is not None:
        raise ValueError("--speculation runs in one process: it cannot be combined with --coordinator")
    return a.speculative_tokens


def check_kv_cache(kv_cache_tokens: int, page_size: int, max_batch_size: int) -> None:
    """Refuse a --kv-cache-tokens too small for --max-batch-size (engine.core.model_options.
    least_kv_pages: a page kept free for each sequence that may decode, and one to admit with). 0
    (the default, max_batch_size x max_context_length) is always large enough; a memory fraction
    is held to the same least at load, where the device's memory is known."""
    pages, least = -(-kv_cache_tokens // page_size), least_kv_pages(max_batch_size)
    if kv_cache_tokens and pages < least:
        raise ValueError(
            f"--kv-cache-tokens {kv_cache_tokens} is {pages} page{'' if pages == 1 else 's'} of {page_size} tokens; "
            f"--max-batch-size {max_batch_size} needs at least {least} pages ({least * page_size} tokens): one "
            f"kept free for each sequence to grow into, and one to admit a request with"
        )


@dataclass(frozen=True)
class ProcessGroup:
    """Several hosts serving one model (`--coordinator --num-processes --process-id`): process 0
    serves and schedules, the others follow (engine.jax_backend.multihost)."""

    coordinator: str  # HOST:PORT of process 0's jax.distributed coordinator
    num_processes: int
    process_id: int
    timeout_s: float  # start-up, heartbeats, every wait for another process

    @staticmethod
    def from_args(a: argparse.Namespace) -> "ProcessGroup | None":
        given = [a.coordinator is not None, a.num_processes is not None, a.process_id is not None]
        if not any(given):
            return None
        if not all(given):
            raise ValueError("--coordinator, --num-processes and --process-id go together: set all three or none")
        if a.process_id >= a.num_processes:
            raise ValueError(f"--process-id must be below --num-processes ({a.num_processes}), got {a.process_id}")
        if a.tensor_parallel % a.num_processes:
            raise ValueError(
                f"--tensor-parallel {a.tensor_parallel} is every process's devices together: "
                f"a multiple of --num-processes {a.num_processes}"
            )
        if a.model.startswith("scripted:"):
            raise ValueError("--model scripted:DIR runs in one process; it takes no --coordinator")
        return ProcessGroup(a.coordinator, a.num_processes, a.process_id, a.distributed_timeout)


@dataclass(frozen=True)
class DecodeServerConfig:
    model: str
    server: ServerOptions
    engine: EngineConfig
    max_batch_size: int
    model_options: ModelOptions
    stall_timeout_s: float
    grace_period_s: float
    metrics_port: int | None
    step_ms: float = 0.0  # the scripted model's step time (--model scripted:DIR only)
    group: ProcessGroup | None = None  # several hosts; None: this process alone
    draft_model: str | None = None  # --draft-model: the draft for --speculation draft

    @staticmethod
    def from_args(a: argparse.Namespace) -> "DecodeServerConfig":
        if a.step_ms and not a.model.startswith("scripted:"):
            raise ValueError("--step-ms sets the scripted model's step time: it needs --model scripted:DIR")
        if a.kv_cache_memory_fraction is not None and a.model.startswith("scripted:"):
            raise ValueError(
                "--model scripted:DIR has no device memory to take a fraction of: size its KV cache with --kv-cache-tokens"
            )
        if a.draft_model is not None and a.model.startswith("scripted:"):
            raise ValueError("--draft-model guesses for a real model: --model scripted:DIR takes none")
        if a.draft_model is not None and a.tensor_parallel > 1:  # (JaxModel: no verify step under a mesh)
            raise ValueError(f"--draft-model needs the model's verify step, which --tensor-parallel {a.tensor_parallel} "
                             "does not have: serve on one device, or without a draft")
        return DecodeServerConfig(
            model=a.model,
            server=dataclasses.replace(server_options(a), max_connection_age_s=a.max_connection_age),
            engine=EngineConfig(
                max_queue_size=a.max_queue_size, max_step_tokens=a.max_step_tokens, speculation=speculation(a),
                speculative_tokens=a.speculative_tokens, speculation_max_batch=a.speculation_max_batch,
            ),
            max_batch_size=a.max_batch_size,
            model_options=model_options(a, a.max_batch_size),
            stall_timeout_s=a.stall_timeout,
            grace_period_s=a.grace_period,
            metrics_port=a.metrics_port,
            step_ms=a.step_ms,
            group=ProcessGroup.from_args(a),
            draft_model=a.draft_model,
        )


@dataclass(frozen=True)
class TextServerConfig:
    model: str
    cache_dir: Path | None
    decoder: str
    decoder_tls: ClientTlsConfig | None
    decoder_token: str | None  # the decode-server's bearer token
    server: ServerOptions
    connect_timeout_s: float
    grace_period_s: float
    metrics_port: int | None
    max_input_chars: int
    max_detokenize_ids: int
    max_in_flight: int

    @staticmethod
    def from_args(a: argparse.Namespace) -> "TextServerConfig":
        return TextServerConfig(
            model=a.model,
            cache_dir=cache_dir(a),
            decoder=a.decoder,
            decoder_tls=ClientTlsConfig.from_paths(a.decoder_tls_ca, a.decoder_tls_cert, a.decoder_tls_key),
            decoder_token=token(a, "decoder_"),
            server=server_options(a),
            connect_timeout_s=a.connect_timeout,
            grace_period_s=a.grace_period,
            metrics_port=a.metrics_port,
            max_input_chars=a.max_input_chars,
            max_detokenize_ids=a.max_detokenize_ids,
            max_in_flight=a.max_in_flight,
        )


@dataclass(frozen=True)
class ApiServerConfig:
    """`tokenwire api-server`: the OpenAI-compatible HTTP front (services.openai_api)."""

    text: str  # HOST:PORT of the text service
    host: str
    port: int
    served_model_name: str  # the name /v1/models lists and requests must give
    tls: ServerTlsConfig | None
    auth_token: str | None  # the token this front's clients must send
    text_tls: ClientTlsConfig | None
    text_token: str | None  # the text-server's bearer token
    request_timeout_s: float | None
    grace_period_s: float

    @staticmethod
    def from_args(a: argparse.Namespace) -> "ApiServerConfig":
        tls, auth_token = server_security(a)
        return ApiServerConfig(
            text=a.text,
            host=a.host,
            port=a.port,
            served_model_name=a.served_model_name,
            tls=tls,
            auth_token=auth_token,
            text_tls=ClientTlsConfig.from_paths(a.text_tls_ca, a.text_tls_cert, a.text_tls_key),
            text_token=token(a, "text_"),
            request_timeout_s=a.request_timeout,
            grace_period_s=a.grace_period,
        )
