"""A constraint together with stop strings and max_output_tokens through the text service
(docs/constraints.md, "With stop strings, max_output_tokens and the rest"): over gRPC, the
scripted model (engine.core.scripted_model) behind a decode server that compiles constraints
against tiny-llama's real tokenizer.json.

Stop strings are matched on the text as always, inside the constrained output too: a match ends
the text there (STOP, `stop_string` set), so the text is then a prefix of the language, not a
sentence of it. A max_output_tokens cut before the language's end is LENGTH. Each expected text
is cut from the same request's whole output, which the scripted model writes the same every time.
"""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import jsonschema
import pytest
import pytest_asyncio

from engine.core.engine import EngineConfig
from engine.core.scripted_model import ScriptedModel
from protos.decode.v1 import decode_pb2 as dpb
from protos.text.v1 import text_pb2_grpc
from services.client import generate_request
from services.decode_server import start_decode_server
from services.text_server import start_text_server
from tokenizer_svc.tokenizer import TextTokenizer

TINY = Path(__file__).parent / "assets" / "tiny-llama"
STOP, LENGTH = dpb.FINISH_REASON_STOP, dpb.FINISH_REASON_LENGTH
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "color": {"enum": ["red", "green"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["name", "color", "n"],
}
pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def text():
    model = ScriptedModel(vocab_size=512, eos_token_ids=frozenset({0, 2}), max_batch_size=4, max_context_length=256)
    decode = await start_decode_server(model, EngineConfig(max_queue_size=8), tokenizer_json=TINY / "tokenizer.json")
    server = await start_text_server(TextTokenizer.from_dir(TINY), f"127.0.0.1:{decode.port}")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    yield text_pb2_grpc.TextGenerationStub(channel)
    await channel.close()
    await server.stop(None)
    await decode.stop(None)


async def complete(text, stops=(), include=False, n=100):
    request = generate_request("hi", max_output_tokens=n, stop_strings=stops, include_stop_string=include)
    request.constraint.json_schema = json.dumps(SCHEMA)
    return await text.Complete(request)


async def test_without_a_stop_string_the_whole_object(text):
    whole = await complete(text)
    assert whole.reason == STOP and not whole.HasField("stop_string") and not whole.HasField("stop_token_id")
    jsonschema.validate(json.loads(whole.text), SCHEMA)
    never = await complete(text, stops=["zzz", "}}"])  # held back while they could match, then sent
    assert (never.text, never.reason, never.HasField("stop_string")) == (whole.text, STOP, False)


@pytest.mark.parametrize("stop", ['"color"', ',"n":', "}"])
@pytest.mark.parametrize("include", [False, True])
async def test_a_stop_string_inside_the_json_ends_the_text_there(text, stop, include):
    whole = (await complete(text)).text
    cut = await complete(text, stops=["zzz", stop], include=include)
    end = whole.index(stop) + (len(stop) if include else 0)
    assert (cut.text, cut.reason, cut.stop_string) == (whole[:end], STOP, stop)
    assert not cut.HasField("stop_token_id")
    if stop != "}" or not include:
        with pytest.raises(ValueError):
            json.loads(cut.text)  # a prefix of the language: the caller's stop string cut it


@pytest.mark.parametrize("n", [1, 5, 9])
async def test_max_output_tokens_before_the_end_is_length_even_with_stop_strings(text, n):
    whole = await complete(text)
    cut = await complete(text, stops=["zzz"], n=n)
    assert cut.reason == LENGTH and not cut.HasField("stop_string")
    assert list(cut.token_ids) == list(whole.token_ids)[:n] and whole.text.startswith(cut.text)
    with pytest.raises(ValueError):
        json.loads(cut.text)


async def test_a_stop_string_before_the_cap_wins_and_the_whole_object_at_the_cap_is_stop(text):
    whole = await complete(text)
    first = await complete(text, stops=['"color"'], n=len(whole.token_ids) - 1)
    assert (first.reason, first.stop_string) == (STOP, '"color"')
    exact = await complete(text, stops=["zzz"], n=len(whole.token_ids))
    assert (exact.text, exact.reason) == (whole.text, STOP)
