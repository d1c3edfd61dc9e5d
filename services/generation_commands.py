"""`tokenwire generate` and `tokenwire chat`: a prompt or a conversation through a text-server, or
with --local the same text path over an engine in this process (no sockets)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from pathlib import Path

from services.config import cache_dir, model_options, token
from services.model_loading import find_model_dir, load_model, require_jax


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

    require_jax("--local")
    from engine.core.async_engine import AsyncEngine
    from engine.core.constrained import ConstraintCompiler
    from engine.core.engine import Engine
    from services.text_server import check_tokenizer_matches
    from services.text_service import TextGenerationServicer, engine_decode
    from tokenizer_svc.tokenizer import TextTokenizer

    model_dir = find_model_dir(a.model, cache_dir(a))
    model = load_model(model_dir, 1, model_options(a, 1))
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


async def generate(a: argparse.Namespace) -> int:
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


async def chat(a: argparse.Namespace) -> int:
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
