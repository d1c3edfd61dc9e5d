"""The decode service under `--tensor-parallel 2` passes the stream-invariant tests of
tests/test_jax_stack.py through gRPC.

Those tests run here again, unchanged (imported), against a real `tokenwire decode-server
--tensor-parallel 2` process (two forced CPU devices in its engine process: the flag asks JAX
for them on a CPU host) with a text service in front. Their reference is this server's own
greedy run, and `test_streaming_equals_unary_equals_local` compares the text service's output
with `tokenwire generate --local` on one device: TP=2 through both services equals TP=1.

Constraints compose with the split (issue 43): the server compiles them against the checkpoint's
tokenizer.json, and the mask is applied to logits gathered from both devices, so tiny-llama's
random weights, which never write JSON on their own, write a valid object greedy and sampled.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import grpc
import jsonschema
import pytest
import pytest_asyncio

from engine.model_store.model_files import eos_token_ids
from protos.decode.v1 import decode_pb2, decode_pb2_grpc
from protos.text.v1 import text_pb2_grpc
from services.client import generate_request
from services.text_server import start_text_server
from tests.test_jax_stack import (  # noqa: F401  (collected here, against this module's stack)
    reference,
    test_concurrent_requests_match_the_reference,
    test_control_token_at_prefill,
    test_control_token_exactly_at_the_cap,
    test_eos_is_never_output,
    test_exactly_n_tokens,
    test_large_n_with_ignore_eos,
    test_stop_token_ids,
    test_streaming_equals_unary_equals_local,
)
from tests.support.health import wait_serving
from tests.support.net import free_port
from tokenizer_svc.tokenizer import TextTokenizer

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "assets" / "tiny-llama"
START_S = 300  # loading and compiling every shape under the mesh, on a shared 2-core machine
CONTEXT = 128  # the server's --max-context-length, which the stack tests read from model.info
pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack():
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="tokenwire-tp-", suffix=".log")[1])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TOKENWIRE_", "JAX_NUM_CPU"))}
    process = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "decode-server", "--model", str(TINY), "--port", str(port),
         "--tensor-parallel", "2", "--max-batch-size", "4", "--max-context-length", str(CONTEXT), "--max-prefill-chunk", "16",
         "--max-queue-size", "16"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log.open("w"),
    )
    try:
        await asyncio.to_thread(wait_serving, port, [process], [log], START_S)
        tokenizer = TextTokenizer.from_dir(TINY)
        text = await start_text_server(tokenizer, f"127.0.0.1:{port}")
        decode_channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        text_channel = grpc.aio.insecure_channel(f"127.0.0.1:{text.port}")
        model = SimpleNamespace(info=SimpleNamespace(eos_token_ids=eos_token_ids(TINY), max_context_length=CONTEXT))  # what the tests read of it
        yield (
            SimpleNamespace(info=model.info, log=log, int8=False),  # float32 weights: the only ones tensor parallelism serves
            decode_pb2_grpc.DecoderStub(decode_channel),
            text_pb2_grpc.TextGenerationStub(text_channel),
            tokenizer,
            text.port,
        )
        await decode_channel.close()
        await text_channel.close()
        await text.stop(None)
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.unlink()


async def test_the_server_runs_split_over_two_devices(stack):
    """The engine process said so: the CPU kernels off, for tensor parallelism over 2 devices."""
    assert "CPU decode kernels off: tensor parallelism over 2 devices" in stack[0].log.read_text()


# bounded strings, integers and arrays: a random model's walk through it ends well within the cap
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 4},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "ok", "n", "tags"],
}


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (1.0, 1), (1.0, 2), (1.0, 3)])
async def test_a_json_schema_holds_under_tensor_parallelism(stack, temperature, seed):
    _, _, text, _, _ = stack
    request = generate_request("The answer:", max_output_tokens=96, temperature=temperature, seed=seed)
    request.constraint.json_schema = json.dumps(SCHEMA)
    completion = await text.Complete(request)
    assert completion.reason == decode_pb2.FINISH_REASON_STOP and not completion.HasField("stop_token_id"), completion
    jsonschema.validate(json.loads(completion.text), SCHEMA)
    free = await text.Complete(generate_request("The answer:", max_output_tokens=16, temperature=temperature, seed=seed))
    assert not free.text.startswith("{")  # the control: the same request without the constraint writes no JSON
