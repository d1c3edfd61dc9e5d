"""The text service process: a tokenizer, a channel to the decode service, a grpc.aio server.

At start it waits for the decoder and refuses to serve a model its tokenizer does not belong
to. Then a monitor keeps `tokenwire.text.v1.TextGeneration` readiness equal to the decoder's
(re-checking the model whenever the decoder comes back); `tokenwire.text.v1.Tokenizer` needs
no decoder and is ready until draining. Generations share one `Decoder.DecodeStream`, on a
blocking channel of its own that a thread reads ahead (services.decode_stream_client), which
the readiness monitor also asks, so readiness follows the connection generations use; start-up
and model checks use a grpc.aio channel. Both reconnect by themselves when the decoder
restarts; while it is down, generation calls fail fast with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.core.model import ModelInfo
from protos.decode.v1 import decode_pb2, decode_pb2_grpc
from protos.text.v1 import text_pb2_grpc
from services.admission import DEFAULT_MAX_IN_FLIGHT, Admission
from services.metrics import Metrics
from services.channels import open_channel
from services.security import ClientTlsConfig
from services.service_names import DECODER_SERVICE, TEXT_GENERATION_SERVICE, TOKENIZER_SERVICE
from services.server import RunningServer, ServerOptions, drain, start_server, wait_for_signal
from services.decode_stream_client import DecodeStreamClient
from services.text_service import TextGenerationServicer, TokenizerServicer
from services.validation import DEFAULT_MAX_DETOKENIZE_IDS, DEFAULT_MAX_INPUT_CHARS
from tokenizer_svc.tokenizer import TextTokenizer

log = logging.getLogger("tokenwire.text")



# Reconnect quickly after the decoder restarts (gRPC's default backoff grows to 120 s).
DECODER_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


class ModelMismatch(Exception):
    """The decode service serves a model this tokenizer does not belong to."""


def check_tokenizer_matches(tokenizer: TextTokenizer, info: ModelInfo) -> None:
    if tokenizer.vocab_size > info.vocab_size:
        raise ModelMismatch(
            f"the tokenizer produces ids up to {tokenizer.vocab_size - 1}, but the decoder's model "
            f"{info.model_id!r} has a vocabulary of {info.vocab_size}: is the text service pointed at another model?"
        )
    if tokenizer.eos_token_ids != info.eos_token_ids:
        raise ModelMismatch(
            f"the tokenizer's EOS ids {sorted(tokenizer.eos_token_ids)} differ from the decoder model "
            f"{info.model_id!r}'s {sorted(info.eos_token_ids)}: is the text service pointed at another model?"
        )


def model_info_from_pb(pb: decode_pb2.ModelInfo) -> ModelInfo:
    return ModelInfo(pb.model_id, pb.vocab_size, pb.max_context_length, pb.max_batch_size, frozenset(pb.eos_token_ids))


@dataclass
class TextServer:
    running: RunningServer
    channel: grpc.aio.Channel
    info: ModelInfo
    admission: Admission
    tokenizer: TextTokenizer
    upstream: DecodeStreamClient
    draining: bool = False

    @property
    def port(self) -> int:
        return self.running.port

    async def _decoder_serving(self, timeout_s: float) -> bool:
        return await asyncio.to_thread(self.upstream.serving, DECODER_SERVICE, timeout_s)

    async def _model_still_matches(self, timeout_s: float) -> bool:
        """After the decoder came back: is it still this tokenizer's model?"""
        stub = decode_pb2_grpc.DecoderStub(self.channel)
        try:
            check_tokenizer_matches(
                self.tokenizer, model_info_from_pb(await stub.GetModelInfo(decode_pb2.GetModelInfoRequest(), timeout=timeout_s))
            )
            return True
        except ModelMismatch as error:
            log.error("the decoder came back with another model: %s", error)
        except grpc.aio.AioRpcError:
            pass
        return False

    async def _monitor(self, interval_s: float) -> None:
        was_serving = True  # checked at start
        while True:
            serving = await self._decoder_serving(interval_s)
            if serving and not was_serving:
                serving = await self._model_still_matches(interval_s)
            if serving != was_serving:
                log.warning("decoder %s", "is back" if serving else "is unavailable")
            was_serving = serving
            await self.running.set_ready(serving and not self.draining, [TEXT_GENERATION_SERVICE])
            await self.running.set_ready(not self.draining, [TOKENIZER_SERVICE])
            await asyncio.sleep(interval_s)

    async def drain(self, grace_s: float) -> bool:
        """Stop taking requests (UNAVAILABLE), go NOT_SERVING, let in-flight ones finish, stop."""
        self.draining = True
        finished = await drain(self.running, self.admission, grace_s)
        await self.stop(0)
        return finished

    async def serve_until_signal(self, grace_s: float) -> int:
        """Serve until SIGTERM/SIGINT, then drain; returns the exit code (0)."""
        await wait_for_signal()
        await self.drain(grace_s)
        return 0

    async def stop(self, grace_s: float | None = None) -> None:
        await self.running.stop(grace_s)
        await self.upstream.close()
        await self.channel.close()


async def start_text_server(
    tokenizer: TextTokenizer,
    decoder_target: str,
    options: ServerOptions = ServerOptions(),
    metrics: Metrics | None = None,
    *,
    connect_timeout_s: float = 60.0,
    decoder_tls: ClientTlsConfig | None = None,
    decoder_token: str | None = None,
    health_interval_s: float = 0.5,
    max_input_chars: int = DEFAULT_MAX_INPUT_CHARS,
    max_detokenize_ids: int = DEFAULT_MAX_DETOKENIZE_IDS,
    max_in_flight: int | None = DEFAULT_MAX_IN_FLIGHT,
) -> TextServer:
    """Connect to the decoder, check that it serves this tokenizer's model, then serve.
    Raises ModelMismatch, or grpc.aio.AioRpcError when the decoder cannot be reached in time.

    Limits: text input (a prompt, Tokenize text, a chat's roles and contents summed) over
    `max_input_chars` characters and a Detokenize over `max_detokenize_ids` ids are
    INVALID_ARGUMENT before any tokenizing; a request that would be one more than
    `max_in_flight` (Generate, Complete, Tokenize, Detokenize together; None: no cap) is
    RESOURCE_EXHAUSTED."""
    metrics = metrics or Metrics()
    channel = open_channel(decoder_target, decoder_tls, decoder_token, options=DECODER_CHANNEL_OPTIONS)
    try:
        decoder = decode_pb2_grpc.DecoderStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        await health.Check(health_pb2.HealthCheckRequest(), wait_for_ready=True, timeout=connect_timeout_s)
        deadline = asyncio.get_running_loop().time() + connect_timeout_s
        while True:  # the decoder serves health at once, but its model only once loaded
            try:
                pb = await decoder.GetModelInfo(decode_pb2.GetModelInfoRequest(), timeout=connect_timeout_s)
                break
            except grpc.aio.AioRpcError as error:
                if error.code() != grpc.StatusCode.UNAVAILABLE or asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.5)
        info = model_info_from_pb(pb)
        check_tokenizer_matches(tokenizer, info)
        # what a chat with special-token text in a message needs (a private tokenizer copy, up to
        # ~1.5 s): built now, so that no request waits for it
        if tokenizer.chat_template is not None:
            await asyncio.to_thread(tokenizer.prepare_chat_encoding)
    except BaseException:
        await channel.close()
        raise

    admission = Admission(max_in_flight=max_in_flight)
    # every generation shares one DecodeStream, on a blocking channel of its own (read ahead by
    # a thread: services.decode_stream_client)
    upstream = DecodeStreamClient(open_channel(decoder_target, decoder_tls, decoder_token, options=DECODER_CHANNEL_OPTIONS, asynchronous=False))

    def add(server: grpc.aio.Server) -> None:
        text_pb2_grpc.add_TokenizerServicer_to_server(
            TokenizerServicer(
                tokenizer, admission, max_input_chars=max_input_chars, max_detokenize_ids=max_detokenize_ids
            ),
            server,
        )
        text_pb2_grpc.add_TextGenerationServicer_to_server(
            TextGenerationServicer(
                tokenizer, upstream.decode, info, admission, metrics, max_input_chars=max_input_chars
            ),
            server,
        )

    running = await start_server(add, [TOKENIZER_SERVICE, TEXT_GENERATION_SERVICE], options, metrics)
    await running.set_ready(True)
    server = TextServer(running, channel, info, admission, tokenizer, upstream)
    server.running.tasks.append(asyncio.create_task(server._monitor(health_interval_s)))
    log.info("text service on %s:%d, decoder %s serving %s", options.host, running.port, decoder_target, info.model_id)
    return server
