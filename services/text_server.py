"""The text service process: a tokenizer, channels to the decode replicas, a grpc.aio server.

At start it waits for a decoder, asks every replica it can reach for its model and settles on
one model (the one most replicas that fit its tokenizer serve); it refuses to serve when none
fits. Generations share a pool of `Decoder.DecodeStream`s, one per ready replica, on a blocking
channel that gRPC balances round-robin over the replicas that are healthy under the model's own
health name (services.replicas, services.decode_stream_client). A monitor runs the replica
census every interval (each replica's model and readiness, logged as they change; a replica
with another model gets no traffic and an ERROR line names it), keeps the pool in step with it,
and keeps `tokenwire.text.v1.TextGeneration` readiness equal to "at least one replica is ready",
asked through the streams' own channel; `tokenwire.text.v1.Tokenizer` needs no decoder and is
ready until draining. Channels reconnect by themselves when a replica restarts; while none is
ready, generation calls fail fast with UNAVAILABLE.
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
from services.replicas import (
    Address, ReplicaCensus, channel_options, choose_reference, model_info_from_pb, model_service_name,
)
from services.security import ClientTlsConfig
from services.service_names import DECODER_SERVICE, TEXT_GENERATION_SERVICE, TOKENIZER_SERVICE
from services.server import RunningServer, ServerOptions, drain, start_server, wait_for_signal
from services.decode_stream_client import DecodeStreamClient
from services.text_service import TextGenerationServicer, TokenizerServicer
from services.validation import DEFAULT_MAX_DETOKENIZE_IDS, DEFAULT_MAX_INPUT_CHARS
from tokenizer_svc.tokenizer import TextTokenizer

log = logging.getLogger("tokenwire.text")

REPLICA_STATES = ("ready", "not_ready", "refused")


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


@dataclass
class TextServer:
    running: RunningServer
    info: ModelInfo
    admission: Admission
    tokenizer: TextTokenizer
    upstream: DecodeStreamClient
    census: ReplicaCensus
    metrics: Metrics
    draining: bool = False

    @property
    def port(self) -> int:
        return self.running.port

    @property
    def model_service(self) -> str:
        return model_service_name(self.info)

    async def _decoder_serving(self, timeout_s: float) -> bool:
        return await asyncio.to_thread(self.upstream.serving, self.model_service, timeout_s)

    async def _take_census(self) -> None:
        """Ask every replica, then tell the pool and the metrics what changed."""
        await self.census.update()
        self.upstream.replicas_changed(self.census.ready_ids(), self.census.unready_ids(), self.census.names())
        counts = self.census.counts()
        for state in REPLICA_STATES:
            self.metrics.decoder_replicas.labels(state).set(counts.get(state, 0))

    async def _monitor(self, interval_s: float) -> None:
        was_serving = True  # checked at start
        while True:
            try:
                await self._take_census()
            except Exception:  # the census informs; it must never stop readiness from being kept
                log.exception("the decode replica census failed")
            # within the census's time for a replica to answer (two intervals, 0.5-2 s), not one
            # interval: a healthy decoder slowed past 0.5 s by a busy host is not "unavailable"
            serving = await self._decoder_serving(self.census.timeout_s)
            if serving != was_serving:
                log.warning("decoder %s", "is back" if serving else "is unavailable: no replica is ready")
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
        await self.census.close()


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
    """Connect to the decode replicas (`decoder_target`: any gRPC target), settle on the one
    model they serve that fits this tokenizer, then serve. Raises ModelMismatch, or
    grpc.aio.AioRpcError when no decoder can be reached in time.

    Limits: text input (a prompt, Tokenize text, a chat's roles, contents and tools summed) over
    `max_input_chars` characters and a Detokenize over `max_detokenize_ids` ids are
    INVALID_ARGUMENT before any tokenizing; a request that would be one more than
    `max_in_flight` (Generate, Complete, Tokenize, Detokenize together; None: no cap) is
    RESOURCE_EXHAUSTED."""
    metrics = metrics or Metrics()
    channel = open_channel(decoder_target, decoder_tls, decoder_token, options=channel_options(DECODER_SERVICE))
    # a replica that does not answer within two intervals counts as not ready (e.g. frozen)
    census = ReplicaCensus(decoder_target, decoder_tls, decoder_token, timeout_s=min(2.0, max(0.5, 2 * health_interval_s)))
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
        # every replica that answers now (the one above among them, unless it just went away)
        answers = await census.ask_models() or [(Address(decoder_target, decoder_target), None, model_info_from_pb(pb))]
        info, left_out = choose_reference(answers, lambda candidate: check_tokenizer_matches(tokenizer, candidate))
        if info is None:
            raise ModelMismatch("; ".join(left_out))
        census.reference = info  # its first round, before serving, names the replicas left out
        # what a chat with special-token text in a message needs (a private tokenizer copy, slow to
        # make for a large vocabulary: tokenizer_svc.tokenizer): built now, so that no request waits for it
        if tokenizer.chat_template is not None:
            await asyncio.to_thread(tokenizer.prepare_chat_encoding)
    except BaseException:
        await census.close()
        raise
    finally:
        await channel.close()  # start-up only: the pool's channel and the census take over

    admission = Admission(max_in_flight=max_in_flight)
    # generations share a pool of DecodeStreams, one per replica, on a blocking channel of its
    # own (each read ahead by a thread: services.decode_stream_client), balanced by gRPC over
    # the replicas healthy under this model's name
    upstream = DecodeStreamClient(
        open_channel(
            decoder_target, decoder_tls, decoder_token, options=channel_options(model_service_name(info)), asynchronous=False
        ),
        metrics,
    )

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
    server = TextServer(running, info, admission, tokenizer, upstream, census, metrics)
    try:
        await server._take_census()
        await upstream.filled(min(connect_timeout_s, 5.0))  # a stream on each ready replica, if it comes soon
    except BaseException:
        await server.stop(None)
        raise
    await running.set_ready(True)
    server.running.tasks.append(asyncio.create_task(server._monitor(health_interval_s)))
    log.info(
        "text service on %s:%d, decoder %s serving %s (%d ready replica(s))",
        options.host, running.port, decoder_target, info.model_id, len(census.ready_ids()),
    )
    tools = tokenizer.tool_template  # what DescribeChat tells the HTTP front
    log.info("chat template: tool calls %s, tools shown by %s",
             f"in the {tools.format!r} format" if tools.format else "in no format known here",
             "the template" if tools.renders_tools else "the caller")
    return server
