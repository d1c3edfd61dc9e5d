"""`tokenwire`: run the services, generate text, prepare models.

Commands:
  decode-server  serve a model's Decoder (JAX engine) over gRPC
  text-server    serve Tokenizer + TextGeneration, in front of a decode-server
  api-server     serve the OpenAI HTTP API (/v1/completions, /v1/chat/completions...), in front of a text-server
  generate       generate text through a text-server, or in-process with --local
  chat           interactive chat through a text-server, or in-process with --local
  health         check a server's gRPC health (exit 0 when SERVING)
  pull           prepare a registered model in the local cache; prints its directory last

The flags are in services/flags.py (docs/configuration.md is generated from them).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import sys
from pathlib import Path

from engine.model_store.registry import ModelDownloadFailed
from services.config import (
    ApiServerConfig,
    DecodeServerConfig,
    ModelOptions,
    ProcessGroup,
    TextServerConfig,
    cache_dir,
    model_options,
    token,
)
from services.flags import build_parser


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _model_dir(name_or_dir: str, cache: Path | None):
    """The model's directory, pulled first when a registered model is not prepared yet (its steps
    and download progress on stderr)."""
    from engine.model_store.registry import resolve_model
    from services.download_progress import DownloadProgress

    return resolve_model(name_or_dir, cache, log=_say, progress=DownloadProgress())


def _require_jax(what: str) -> None:
    """JAX comes with the `cpu`, `cuda12` or `cuda13` extra (or a GPU image's own); the text-side
    install (`tokenwire[text]`) has none.
    Looked up, not imported: the decode server's own process never needs it (its engine process does)."""
    import importlib.util

    if importlib.util.find_spec("jax") is None:
        raise RuntimeError(
            f"{what} runs the model with JAX, which this installation lacks: "
            "pip install 'tokenwire[cpu]' (or 'tokenwire[cuda12]' / 'tokenwire[cuda13]' for an NVIDIA GPU)"
        )


def _load_model(model_dir, max_batch_size: int, options: ModelOptions, group: ProcessGroup | None = None):
    """The model, split over `options.tensor_parallel` devices; in a process group, process 0's
    wrapped to publish its steps and the others' to follow them (engine.jax_backend.multihost)."""
    from engine.jax_backend.jax_model import JaxModel

    if options.compilation_cache:  # before anything compiles
        from engine.jax_backend import compilation_cache
        from engine.model_store.registry import default_cache_dir

        compilation_cache.enable((options.cache_dir or default_cache_dir()) / "xla")
    if group is not None:
        from engine.jax_backend import multihost

        joined = multihost.Group(group.coordinator, group.num_processes, group.process_id, group.timeout_s)
        multihost.initialize(joined, options.tensor_parallel // group.num_processes)
    model = JaxModel.load(model_dir, options, max_batch_size=max_batch_size)
    if group is None:
        return model
    return multihost.Leader(model) if joined.leads else multihost.Follower(model, joined)


SCRIPTED_PREFIX = "scripted:"


def scripted_model(
    model_dir: Path, *, max_batch_size: int, max_context_length: int | None, step_ms: float, kv_cache_tokens: int = 0
):
    """The scripted model (engine.core.scripted_model: the token after t is t + 1) with a fixed
    step time, in place of a real one: a stand-in for an accelerator when measuring the transport
    (`decode-server --model scripted:DIR`, and benchmarks/transport.py in process). Its vocabulary
    size and EOS ids are those of `model_dir`'s tokenizer, so a text service for that model can sit
    in front of it."""
    from engine.core.scripted_model import ScriptedModel
    from engine.model_store.checkpoint import tokenizer_size
    from engine.model_store.model_files import eos_token_ids

    if not (model_dir / "tokenizer.json").is_file():
        raise ValueError(f"--model scripted:DIR takes its vocabulary from DIR/tokenizer.json, and {model_dir} has none")
    return ScriptedModel(
        kv_cache_tokens=kv_cache_tokens,
        vocab_size=tokenizer_size(model_dir, 1 << 31),
        eos_token_ids=eos_token_ids(model_dir),
        max_batch_size=max_batch_size,
        max_context_length=max_context_length or 2048,
        step_delay_s=step_ms / 1000,
        model_id=f"{SCRIPTED_PREFIX}{model_dir.name}",
    )


# -- commands -----------------------------------------------------------------------------


def _serve_metrics(metrics, host: str, port: int | None):
    """Start the metrics endpoint when --metrics-port is set; returns its HTTP server or None."""
    from services.metrics import start_metrics_server

    if port is None:
        return None
    http, bound = start_metrics_server(metrics, host, port)
    logging.getLogger("tokenwire").info("metrics on http://%s:%d/metrics", host, bound)
    return http


async def _decode_follower(config: DecodeServerConfig, spawn_model, log_setup) -> int:
    """A process other than 0 of a group: its engine process follows process 0's steps
    (engine.jax_backend.multihost); this process serves gRPC health only, for probes. Readiness
    goes SERVING once its share of the model is warm. When its engine process ends (the group
    lost a process, or process 0 stopped: either way the group cannot serve), NOT_SERVING, then
    exit 1 for the supervisor, which restarts the group's pods; SIGTERM: exit 0. A model that does
    not load exits as process 0's does (services.decode_server.exit_code)."""
    from engine.core.engine_process import EngineProcess, ModelLoadFailed
    from services.decode_server import exit_code
    from services.metrics import Metrics
    from services.server import start_server, wait_for_signal
    from services.service_names import DECODER_SERVICE

    log = logging.getLogger("tokenwire")
    loop = asyncio.get_running_loop()
    died = asyncio.Event()
    running = await start_server(lambda server: None, [DECODER_SERVICE], config.server, Metrics())
    group = config.group
    log.info("process %d of %d: health on %s:%d; following process 0 at %s",
             group.process_id, group.num_processes, config.server.host, running.port, group.coordinator)
    engine = EngineProcess(spawn_model, config.engine, lambda error: loop.call_soon_threadsafe(died.set), None, log_setup)
    try:
        await asyncio.to_thread(engine.start)
    except ModelLoadFailed as error:
        await running.stop(0)
        return exit_code(error)
    await running.set_ready(True)
    await wait_for_signal(died)
    if died.is_set():
        log.critical("process %d stopped following (a process of the group is gone); exiting", group.process_id)
    await running.stop(0)  # NOT_SERVING first
    await asyncio.to_thread(engine.stop)
    return 1 if died.is_set() else 0


async def _decode_server(config: DecodeServerConfig) -> int:
    from services.decode_server import start_decode_server
    from services.metrics import Metrics, stop_metrics_server

    log = logging.getLogger("tokenwire")
    scripted = config.model.startswith(SCRIPTED_PREFIX)
    if not scripted:
        _require_jax("decode-server")
    model_dir = _model_dir(config.model.removeprefix(SCRIPTED_PREFIX), config.model_options.cache_dir)  # pull before serving
    # Built in the engine process (engine.core.engine_process), so picklable: partials of
    # module-level functions.
    if scripted:
        spawn_model = functools.partial(
            scripted_model, model_dir, max_batch_size=config.max_batch_size,
            max_context_length=config.model_options.max_context_length, step_ms=config.step_ms,
            kv_cache_tokens=config.model_options.kv_cache_tokens,
        )
    else:
        spawn_model = functools.partial(_load_model, model_dir, config.max_batch_size, config.model_options, config.group)
    log_setup = functools.partial(configure_logging, logging.getLevelName(logging.getLogger().level))
    if config.group is not None and config.group.process_id > 0:
        return await _decode_follower(config, spawn_model, log_setup)
    metrics = Metrics()
    server = await start_decode_server(
        engine_config=config.engine,
        options=config.server,
        metrics=metrics,
        stall_timeout_s=config.stall_timeout_s,
        wait_until_ready=False,
        spawn_model=spawn_model,
        log_setup=log_setup,
        tokenizer_json=tokenizer if (tokenizer := model_dir / "tokenizer.json").is_file() else None,
    )
    http = _serve_metrics(metrics, config.server.host, config.metrics_port)
    log.info("decode service listening on %s:%d; loading %s", config.server.host, server.port, model_dir)
    code = await server.serve_until_signal(config.grace_period_s)
    if http is not None:
        stop_metrics_server(http)
    return code


async def _text_server(config: TextServerConfig) -> int:
    import grpc

    from services.metrics import Metrics, stop_metrics_server
    from services.text_server import ModelMismatch, start_text_server
    from tokenizer_svc.tokenizer import TextTokenizer

    tokenizer = TextTokenizer.from_dir(_model_dir(config.model, config.cache_dir))
    metrics = Metrics()
    try:
        server = await start_text_server(
            tokenizer, config.decoder, config.server, metrics,
            connect_timeout_s=config.connect_timeout_s, decoder_tls=config.decoder_tls,
            decoder_token=config.decoder_token, max_input_chars=config.max_input_chars,
            max_detokenize_ids=config.max_detokenize_ids, max_in_flight=config.max_in_flight,
        )
    except ModelMismatch as error:
        print(f"tokenwire text-server: refusing to serve: {error}", file=sys.stderr)
        return 2
    except grpc.aio.AioRpcError as error:
        print(
            f"tokenwire text-server: no decode service at {config.decoder} within {config.connect_timeout_s:.0f} s "
            f"({error.code().name}: {error.details()})",
            file=sys.stderr,
        )
        return 2
    http = _serve_metrics(metrics, config.server.host, config.metrics_port)
    code = await server.serve_until_signal(config.grace_period_s)
    if http is not None:
        stop_metrics_server(http)
    return code


def _generate_kwargs(a: argparse.Namespace) -> dict:
    return dict(
        max_output_tokens=a.max_tokens,
        temperature=a.temperature,
        top_k=a.top_k,
        top_p=a.top_p,
        min_p=a.min_p,
        seed=a.seed,
        stop_token_ids=a.stop_token_id or [],
        ignore_eos=a.ignore_eos,
        keep_special_tokens=a.keep_special_tokens,
        stop_strings=a.stop or [],
        include_stop_string=a.include_stop_string,
    )


def _completion_json(completion) -> str:
    from protos.decode.v1 import decode_pb2

    result = {
        "text": completion.text,
        "token_ids": list(completion.token_ids),
        "reason": decode_pb2.FinishReason.Name(completion.reason).removeprefix("FINISH_REASON_").lower(),
        "usage": {
            "prompt_tokens": completion.usage.prompt_tokens,
            "completion_tokens": completion.usage.completion_tokens,
        },
        "stop_token_id": completion.stop_token_id if completion.HasField("stop_token_id") else None,
        "stop_string": completion.stop_string if completion.HasField("stop_string") else None,
    }
    return json.dumps(result, ensure_ascii=False)


@contextlib.asynccontextmanager
async def _generator(a: argparse.Namespace):
    """Yield a function GenerateRequest -> stream of GenerateResponse: through a text-server, or
    with --local the same text path over an in-process engine (no sockets)."""
    if not a.local:
        from services.client import AsyncTextClient

        from services.security import ClientTlsConfig

        tls = ClientTlsConfig.from_paths(a.tls_ca, a.tls_cert, a.tls_key)
        async with AsyncTextClient(a.server, timeout=a.timeout, tls=tls, token=token(a)) as client:
            yield client.stream
        return

    _require_jax("--local")
    from engine.core.async_engine import AsyncEngine
    from engine.core.constrained import ConstraintCompiler
    from engine.core.engine import Engine
    from services.text_server import check_tokenizer_matches
    from services.text_service import TextGenerationServicer, engine_decode
    from tokenizer_svc.tokenizer import TextTokenizer

    model_dir = _model_dir(a.model, cache_dir(a))
    model = _load_model(model_dir, 1, model_options(a, 1))
    tokenizer = TextTokenizer.from_dir(model_dir)
    check_tokenizer_matches(tokenizer, model.info)
    model.warm_up()
    engine = Engine(model)
    engine.start()
    try:
        constraints = ConstraintCompiler(tokenizer.tokenizer_json, model.info.vocab_size, model.info.eos_token_ids)
        servicer = TextGenerationServicer(tokenizer, engine_decode(AsyncEngine(engine), model.info, constraints), model.info)
        yield lambda request: servicer.generate(request, a.timeout)
    finally:
        engine.stop()


def _failure(command: str, error: Exception) -> int:
    """Print a gRPC or validation error as one line; unexpected errors propagate."""
    import grpc

    from services.errors import status_for

    mapped = (error.code(), error.details()) if isinstance(error, grpc.aio.AioRpcError) else status_for(error)
    if mapped is None:
        raise error
    print(f"tokenwire {command}: {mapped[0].name}: {mapped[1]}", file=sys.stderr)
    return 1


async def _stream_text(responses) -> str:
    """Print deltas as they arrive; return the whole text."""
    text = ""
    async for response in responses:
        if response.HasField("delta"):
            text += response.delta.text
            print(response.delta.text, end="", flush=True)
    print()
    return text


async def _generate(a: argparse.Namespace) -> int:
    from services.client import generate_request
    from services.text_service import collect

    if a.chat:
        turns = ([("system", a.system)] if a.system else []) + [("user", a.prompt)]
        request = generate_request(chat=turns, **_generate_kwargs(a))
    else:
        request = generate_request(a.prompt, **_generate_kwargs(a))
    if a.json_schema is not None and a.regex is not None:
        print("tokenwire generate: --json-schema and --regex cannot both be set: give one constraint", file=sys.stderr)
        return 2
    if a.json_schema is not None:
        try:
            request.constraint.json_schema = Path(a.json_schema).read_text()
        except (OSError, UnicodeDecodeError) as error:
            print(f"tokenwire generate: --json-schema: cannot read {a.json_schema}: {error}", file=sys.stderr)
            return 2
    elif a.regex is not None:
        request.constraint.regex = a.regex
    try:
        async with _generator(a) as generate:
            if a.stream and not a.json:
                await _stream_text(generate(request))
            else:
                completion = await collect(generate(request))
                print(_completion_json(completion) if a.json else completion.text)
    except Exception as error:
        return _failure("generate", error)
    return 0


async def _chat(a: argparse.Namespace) -> int:
    from services.client import generate_request

    turns: list[tuple[str, str]] = [("system", a.system)] if a.system else []
    try:
        async with _generator(a) as generate:
            print("tokenwire chat: type a message; an empty line or Ctrl-D ends.", file=sys.stderr)
            while True:
                try:
                    line = await asyncio.to_thread(input, "you> ")
                except EOFError:
                    break
                if not line.strip():
                    break
                turns.append(("user", line))
                print("assistant> ", end="", flush=True)
                reply = await _stream_text(generate(generate_request(chat=turns, **_generate_kwargs(a))))
                turns.append(("assistant", reply))
    except Exception as error:
        return _failure("chat", error)
    return 0


def _pull(a: argparse.Namespace) -> int:
    from engine.model_store.registry import pull
    from services.download_progress import DownloadProgress

    directory = pull(a.name, cache_dir(a), log=_say, progress=DownloadProgress())
    print(directory)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except ModelDownloadFailed as error:  # no network, an index down: a later try may succeed, so not 2
        if args.log_level == "DEBUG":
            raise
        print(f"tokenwire {args.command}: {error}", file=sys.stderr)
        return 1
    except (ValueError, OSError, RuntimeError) as error:  # bad model dir or name, TLS files, a taken port...
        if args.log_level == "DEBUG":
            raise
        print(f"tokenwire {args.command}: {error} (--log-level DEBUG shows the traceback)", file=sys.stderr)
        return 2


def configure_logging(level: str) -> None:
    """The log format of every tokenwire process (the engine process too)."""
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if level != "DEBUG":
        logging.getLogger("jax").setLevel(logging.WARNING)  # e.g. "Unable to initialize backend 'tpu'" on every start


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop when it is installed (less CPU per streamed message than asyncio's
    own: docs/benchmarks.md, 'Figures behind code comments'), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _serve(main_coroutine) -> int:
    """Run a server's coroutine on `new_event_loop()`."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main_coroutine)


def _run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    if args.command == "decode-server":
        return _serve(_decode_server(DecodeServerConfig.from_args(args)))
    if args.command == "text-server":
        return _serve(_text_server(TextServerConfig.from_args(args)))
    if args.command == "api-server":
        config = ApiServerConfig.from_args(args)
        try:
            from services.openai_api.server import serve
        except ImportError as error:  # fastapi/uvicorn come with the `api` extra
            raise RuntimeError(f"api-server needs the `api` extra ({error.name} is missing): pip install 'tokenwire[api]'") from None
        return serve(config)
    if args.command == "generate":
        return asyncio.run(_generate(args))
    if args.command == "chat":
        return asyncio.run(_chat(args))
    if args.command == "health":
        from services.health_probe import health_check
        from services.security import ClientTlsConfig

        tls = ClientTlsConfig.from_paths(args.tls_ca, args.tls_cert, args.tls_key)
        return health_check(args.server, args.service, args.timeout, args.wait, tls)
    return _pull(args)


if __name__ == "__main__":
    sys.exit(main())
