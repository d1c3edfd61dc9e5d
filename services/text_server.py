"""The text service process: a tokenizer, a channel to the decode service, a grpc.aio server."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

from engine.model import ModelInfo
from protos.decode.v1 import decode_pb2, decode_pb2_grpc
from protos.text.v1 import text_pb2, text_pb2_grpc
from services.server import RunningServer, start_server
from services.text_service import TextGenerationServicer, TokenizerServicer, remote_decode
from tokenizer_svc.tokenizer import TextTokenizer

log = logging.getLogger("tokenwire.text")

TOKENIZER_SERVICE = text_pb2.DESCRIPTOR.services_by_name["Tokenizer"].full_name
TEXT_GENERATION_SERVICE = text_pb2.DESCRIPTOR.services_by_name["TextGeneration"].full_name


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

    @property
    def port(self) -> int:
        return self.running.port

    async def stop(self, grace_s: float | None = None) -> None:
        await self.running.set_serving([TOKENIZER_SERVICE, TEXT_GENERATION_SERVICE], False)
        await self.running.server.stop(grace_s)
        await self.channel.close()


async def start_text_server(
    tokenizer: TextTokenizer, decoder_target: str, host: str = "127.0.0.1", port: int = 0, connect_timeout_s: float = 60.0
) -> TextServer:
    """Connect to the decoder, check that it serves this tokenizer's model, then serve.
    Raises ModelMismatch, or grpc.aio.AioRpcError when the decoder cannot be reached in time."""
    channel = grpc.aio.insecure_channel(decoder_target)
    try:
        decoder = decode_pb2_grpc.DecoderStub(channel)
        info = model_info_from_pb(
            await decoder.GetModelInfo(decode_pb2.GetModelInfoRequest(), wait_for_ready=True, timeout=connect_timeout_s)
        )
        check_tokenizer_matches(tokenizer, info)
    except BaseException:
        await channel.close()
        raise

    def add(server: grpc.aio.Server) -> None:
        text_pb2_grpc.add_TokenizerServicer_to_server(TokenizerServicer(tokenizer), server)
        text_pb2_grpc.add_TextGenerationServicer_to_server(TextGenerationServicer(tokenizer, remote_decode(decoder), info), server)

    running = await start_server(add, [TOKENIZER_SERVICE, TEXT_GENERATION_SERVICE], host, port)
    log.info("text service on %s:%d, decoder %s serving %s", host, running.port, decoder_target, info.model_id)
    return TextServer(running, channel, info)
