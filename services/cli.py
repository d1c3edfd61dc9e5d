"""`tokenwire`: run the services, generate text, prepare models.

Commands:
  decode-server  serve a model's Decoder (JAX engine) over gRPC
  text-server    serve Tokenizer + TextGeneration, in front of a decode-server
  api-server     serve the OpenAI HTTP API (/v1/completions, /v1/chat/completions...), in front of a text-server
  generate       generate text through a text-server, or in-process with --local
  chat           interactive chat through a text-server, or in-process with --local
  health         check a server's gRPC health (exit 0 when SERVING)
  pull           prepare a registered model in the local cache; prints its directory last

The flags are in services/flags.py (docs/configuration.md is generated from them); generate and
chat in services/generation_commands.py; how a command finds and loads its model in
services/model_loading.py.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import sys

from engine.model_store.registry import ModelDownloadFailed
from services.config import ApiServerConfig, DecodeServerConfig, TextServerConfig, cache_dir
from services.flags import build_parser
from services.generation_commands import chat, generate
from services.model_loading import (
    SCRIPTED_PREFIX, check_draft, draft_proposer, find_model_dir, load_model, require_jax, say, scripted_model,
)

_load_model = load_model  # the name tests/test_compilation_cache.py imports it by


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
        require_jax("decode-server")
    model_dir = find_model_dir(config.model.removeprefix(SCRIPTED_PREFIX), config.model_options.cache_dir)  # pull before serving
    # Built in the engine process (engine.core.engine_process), so picklable: partials of
    # module-level functions.
    if scripted:
        spawn_model = functools.partial(
            scripted_model, model_dir, max_batch_size=config.max_batch_size,
            max_context_length=config.model_options.max_context_length, step_ms=config.step_ms,
            kv_cache_tokens=config.model_options.kv_cache_tokens, max_guesses=config.model_options.max_guesses,
        )
    else:
        spawn_model = functools.partial(load_model, model_dir, config.max_batch_size, config.model_options, config.group)
    proposer = None
    if config.draft_model is not None:  # refused here, before anything loads, where it cannot guess for the model
        draft_dir = find_model_dir(config.draft_model, config.model_options.cache_dir)
        check_draft(model_dir, draft_dir, config.model_options.max_context_length)
        proposer = functools.partial(draft_proposer, draft_dir, config.max_batch_size, config.model_options)
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
        proposer=proposer,
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

    tokenizer = TextTokenizer.from_dir(find_model_dir(config.model, config.cache_dir))
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


def _pull(a: argparse.Namespace) -> int:
    from engine.model_store.registry import pull
    from services.download_progress import DownloadProgress

    directory = pull(a.name, cache_dir(a), log=say, progress=DownloadProgress())
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
        return asyncio.run(generate(args))
    if args.command == "chat":
        return asyncio.run(chat(args))
    if args.command == "health":
        from services.health_probe import health_check
        from services.security import ClientTlsConfig

        tls = ClientTlsConfig.from_paths(args.tls_ca, args.tls_cert, args.tls_key)
        return health_check(args.server, args.service, args.timeout, args.wait, tls)
    return _pull(args)


if __name__ == "__main__":
    sys.exit(main())
