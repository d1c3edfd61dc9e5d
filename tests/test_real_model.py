"""The real default model, SmolLM2-135M-Instruct, prepared by the same `tokenwire pull` a user
runs (the session's `real_model` fixture, conftest), served by both services: a chat answer ends on the model's EOS (<|im_end|>), which is
never sent as a token, never counted and never shown.

Expected answer (greedy, default system prompt) from shared/NOTES.md, measured with
transformers f32: "The capital of France is Paris." then id 2.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from protos.decode.v1 import decode_pb2 as dpb
from protos.text.v1 import text_pb2 as pb
from protos.text.v1 import text_pb2_grpc
from services.decode_server import start_decode_server
from services.text_server import start_text_server
from support import real_served
from tokenizer_svc.tokenizer import TextTokenizer

pytestmark = pytest.mark.real_model


@pytest.fixture
def model_dir(real_model) -> Path:
    return real_model  # pulled once per run (conftest), as `tokenwire pull` does


async def test_chat_answer_ends_on_eos_with_no_control_token_in_text(model_dir):
    # served weights (int8 from the model's GGUF) and prefix cache, in support.real_served's
    # configuration (test_int8 compiles int8's 8-row decode step too). Off it only where it costs
    # warm-up of the 30-layer model: prompt shapes from 64 instead of the served ladder from 8, and
    # no chunk along with a decode step (each size of one is a decode step of every layer to
    # compile, and no prompt here arrives while another decodes: the requests run one at a time;
    # test_prefill_chunked runs chunks along on this model)
    model = real_served.load(model_dir, min_bucket=64, fused_chunk_tokens=0)
    assert model.int8
    tokenizer = TextTokenizer.from_dir(model_dir)
    decode = await start_decode_server(model)
    text = await start_text_server(tokenizer, f"127.0.0.1:{decode.port}")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{text.port}") as channel:
            stub = text_pb2_grpc.TextGenerationStub(channel)
            chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="What is the capital of France?")])
            for keep in (False, True):
                request = pb.GenerateRequest(chat=chat, keep_special_tokens=keep)
                request.stopping.max_output_tokens = 40
                responses = [r async for r in stub.Generate(request)]
                finished = responses[-1].finished
                ids = [i for r in responses[:-1] for i in r.delta.token_ids]
                answer = "".join(r.delta.text for r in responses[:-1])
                assert answer == "The capital of France is Paris."
                assert (finished.reason, finished.stop_token_id) == (dpb.FINISH_REASON_STOP, 2)
                assert finished.usage.completion_tokens == len(ids) == 7
                assert 2 not in ids and "<|im_end|>" not in answer
                completion = await stub.Complete(request)
                assert completion.text == answer and list(completion.token_ids) == ids
    finally:
        await text.stop(None)
        await decode.stop(None)
