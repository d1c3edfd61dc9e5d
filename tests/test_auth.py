"""Authentication everywhere: the decode service takes a token (and mTLS) like the text service,
the text service authenticates to it, a token never crosses a network in plain text, and tokens
can come from files (secrets) instead of the command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from engine.core.engine import EngineConfig
from engine.core.scripted_model import ScriptedModel
from protos.decode.v1 import decode_pb2_grpc
from protos.text.v1 import text_pb2_grpc
from services.channels import is_loopback_target, open_channel
from services.cli import build_parser
from services.client import decode_request, generate_request
from services.config import DecodeServerConfig, TextServerConfig
from services.decode_server import start_decode_server
from services.security import ClientTlsConfig, ServerTlsConfig, TlsError
from services.server import ServerOptions
from services.text_server import start_text_server
from tokenizer_svc.tokenizer import TextTokenizer

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "assets" / "tiny-llama"
DECODER_TOKEN = "decoder-secret-0123"
TEXT_TOKEN = "text-secret-4567"


def tiny_model() -> ScriptedModel:
    tokenizer = TextTokenizer.from_dir(TINY)
    return ScriptedModel(vocab_size=tokenizer.vocab_size, eos_token_ids=frozenset(tokenizer.eos_token_ids), max_batch_size=2, max_context_length=128)


async def _generate(target: str, tls: ClientTlsConfig | None, token: str | None) -> list:
    async with open_channel(target, tls, token) as channel:
        request = generate_request("hello", max_output_tokens=5, ignore_eos=True)
        return [r async for r in text_pb2_grpc.TextGenerationStub(channel).Generate(request, timeout=10)]


async def _decode_code(target: str, tls: ClientTlsConfig | None, token: str | None) -> grpc.StatusCode:
    async with open_channel(target, tls, token) as channel:
        try:
            async for _ in decode_pb2_grpc.DecoderStub(channel).Decode(decode_request([1, 5], max_output_tokens=2), timeout=10):
                pass
        except grpc.aio.AioRpcError as error:
            return error.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("transport", ["loopback", "tls"])
async def test_the_decoder_refuses_calls_without_its_token_and_serves_the_text_service_that_has_it(transport, pki):
    server_tls = ServerTlsConfig(pki / "server.crt", pki / "server.key") if transport == "tls" else None
    client_tls = ClientTlsConfig(ca=pki / "ca.crt") if transport == "tls" else None
    decode = await start_decode_server(tiny_model(), EngineConfig(max_queue_size=4), ServerOptions(tls=server_tls, auth_token=DECODER_TOKEN))
    target = f"localhost:{decode.port}"
    try:
        assert await _decode_code(target, client_tls, None) == grpc.StatusCode.UNAUTHENTICATED
        assert await _decode_code(target, client_tls, "wrong-token") == grpc.StatusCode.UNAUTHENTICATED
        assert await _decode_code(target, client_tls, DECODER_TOKEN) == grpc.StatusCode.OK
        text = await start_text_server(
            TextTokenizer.from_dir(TINY), target, ServerOptions(tls=server_tls, auth_token=TEXT_TOKEN),
            decoder_tls=client_tls, decoder_token=DECODER_TOKEN, connect_timeout_s=10,
        )
        try:
            text_target = f"localhost:{text.port}"
            responses = await _generate(text_target, client_tls, TEXT_TOKEN)  # through DecodeStream, with the decoder's token
            assert responses[-1].finished.usage.completion_tokens == 5
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await _generate(text_target, client_tls, None)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        finally:
            await text.stop(None)
    finally:
        await decode.stop(None)


async def test_a_text_service_without_the_decoders_token_does_not_start():
    decode = await start_decode_server(tiny_model(), EngineConfig(max_queue_size=4), ServerOptions(auth_token=DECODER_TOKEN))
    try:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await start_text_server(TextTokenizer.from_dir(TINY), f"127.0.0.1:{decode.port}", connect_timeout_s=5)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await decode.stop(None)


async def test_a_token_without_tls_is_refused_on_a_network_address_and_allowed_on_loopback():
    with pytest.raises(TlsError, match="plain text"):
        await start_decode_server(tiny_model(), options=ServerOptions(host="0.0.0.0", auth_token=DECODER_TOKEN))
    with pytest.raises(TlsError, match="loopback"):
        open_channel("decode:50051", None, DECODER_TOKEN)
    assert all(is_loopback_target(t) for t in ("127.0.0.1:1", "localhost:2", "[::1]:3", "ipv4:127.0.0.1:4", "dns:///localhost:5"))
    assert not any(is_loopback_target(t) for t in ("decode:50051", "10.0.0.1:1", "[2001:db8::1]:1", "127.0.0.1:1,10.0.0.2:1"))


def test_the_cli_refuses_a_plaintext_token_on_every_interface_in_one_line():
    result = subprocess.run(
        [sys.executable, "-m", "services.cli", "decode-server", "--model", f"scripted:{TINY}", "--host", "0.0.0.0", "--auth-token", "x"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--auth-token without TLS on 0.0.0.0" in lines[0] and "--tls-cert" in lines[0]


def test_tokens_come_from_files_and_one_token_is_given_one_way(tmp_path):
    secret = tmp_path / "decoder_token"
    secret.write_text(DECODER_TOKEN + "\n")  # as `echo` writes it: the newline is not part of the token
    text_secret = tmp_path / "text_token"
    text_secret.write_text(TEXT_TOKEN)
    parse = build_parser().parse_args
    decode = DecodeServerConfig.from_args(parse(["decode-server", "--model", f"scripted:{TINY}", "--auth-token-file", str(secret)]))
    assert decode.server.auth_token == DECODER_TOKEN
    text = TextServerConfig.from_args(parse([
        "text-server", "--model", str(TINY), "--decoder-auth-token-file", str(secret), "--auth-token-file", str(text_secret),
    ]))
    assert (text.decoder_token, text.server.auth_token) == (DECODER_TOKEN, TEXT_TOKEN)
    with pytest.raises(ValueError, match="--auth-token and --auth-token-file"):
        DecodeServerConfig.from_args(parse(["decode-server", "--model", "x", "--auth-token", "a", "--auth-token-file", str(secret)]))
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(TlsError, match="--auth-token-file"):
        DecodeServerConfig.from_args(parse(["decode-server", "--model", "x", "--auth-token-file", str(empty)]))
    with pytest.raises(TlsError, match="cannot read"):
        DecodeServerConfig.from_args(parse(["decode-server", "--model", "x", "--auth-token-file", str(tmp_path / "missing")]))
