"""The stream invariants with speculation on, through the real servers (issue 45).

The same stack as tests/test_fuzz.py (scripted model: after t comes t + 1; vocabulary 512, EOS
{0, 2}, a 32-token context; tiny-llama's tokenizer in the text server), with the n-gram proposer
on and a model that verifies 4 guesses, and the fuzz suite's own checks (`check_decode`,
`check_generate`: tokens then one Finished, exactly the ids worked out by hand, no control id,
usage equal to the ids sent, stop strings cut where they first match). The prompts are
copy-heavy: an ascending run of ids that the output will count through, so most steps verify
guesses and most guesses are accepted; caps, stop ids and EOS (a run through 511 wraps to 0 and
2) land inside accepted runs, and a stop string drawn from the output text lands anywhere in a
run's message. Cancels come at random points (the fuzz's plans), mid-run included.
"""

from __future__ import annotations

import functools
import itertools
import string

import grpc
import pytest
import pytest_asyncio
from hypothesis import given
from hypothesis import strategies as st

from engine.core.engine import EngineConfig
from engine.core.scripted_model import ScriptedModel
from protos.decode.v1 import decode_pb2 as dpb
from protos.decode.v1 import decode_pb2_grpc
from protos.text.v1 import text_pb2 as tpb
from protos.text.v1 import text_pb2_grpc
from services.decode_server import start_decode_server
from services.text_server import start_text_server
from test_fuzz import (
    CONTEXT, EOS, VOCAB, Stack, answers_and_holds_nothing, check_decode, check_generate, fuzz_examples, plans,
    scripted_output, send, stopping_criteria, tiny_tokenizer,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack():
    model = ScriptedModel(vocab_size=VOCAB, eos_token_ids=EOS, max_batch_size=4, max_context_length=CONTEXT, max_guesses=4)
    decode = await start_decode_server(model, EngineConfig(max_queue_size=2, speculation="ngram"))
    text = await start_text_server(tiny_tokenizer(), f"127.0.0.1:{decode.port}")
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") for server in (decode, text)]
    s = Stack(
        decode, text, model, tiny_tokenizer(), decode_pb2_grpc.DecoderStub(channels[0]),
        text_pb2_grpc.TokenizerStub(channels[1]), text_pb2_grpc.TextGenerationStub(channels[1]), {},
    )
    try:
        yield s
        await answers_and_holds_nothing(s)
    finally:
        for channel in channels:
            await channel.close()
        await text.stop(None)
        await decode.stop(None)


@st.composite
def copy_heavy_ids(draw) -> list[int]:
    """An ascending run a+1 .. a+L, a few other ids, then a: the output counts a+1, a+2, ...,
    which the prompt already holds, so the n-gram proposer guesses right from the second token."""
    start = draw(st.integers(1, VOCAB - 1) | st.integers(VOCAB - 8, VOCAB - 1))  # (the second: through EOS 0 and 2)
    run = [(start + i) % VOCAB for i in range(draw(st.integers(4, 12)))]
    return run + draw(st.lists(st.integers(0, VOCAB - 1), max_size=2)) + [(start - 1) % VOCAB]


@st.composite
def decode_requests(draw) -> dpb.DecodeRequest:
    prompt = draw(copy_heavy_ids())
    stopping = draw(stopping_criteria(wild=False, room=CONTEXT - len(prompt)))
    if draw(st.booleans()):  # a stop id the output reaches, often inside an accepted run
        stopping.stop_token_ids.append((prompt[-1] + draw(st.integers(2, 8))) % VOCAB)
    return dpb.DecodeRequest(prompt_token_ids=prompt, stopping=stopping, return_logprobs=draw(st.booleans()))


@functools.cache
def round_trips() -> tuple[int, ...]:
    """Starts `a` whose copy-heavy prompt survives detokenizing and tokenizing again unchanged,
    so a text prompt reaches the decoder as those ids."""
    tokenizer = tiny_tokenizer()
    found = []
    for a in range(3, VOCAB - 12):
        ids = list(range(a + 1, a + 9)) + [a]
        if tokenizer.encode(tokenizer.decode(ids, False), add_special_tokens=False) == ids:
            found.append(a)
    return tuple(found)


@st.composite
def generate_requests(draw) -> tpb.GenerateRequest:
    a = draw(st.sampled_from(round_trips()))
    prompt = list(range(a + 1, a + 9)) + [a]
    request = tpb.GenerateRequest(prompt=tiny_tokenizer().decode(prompt, False), include_stop_string=draw(st.booleans()))
    request.stopping.CopyFrom(draw(stopping_criteria(wild=False, room=CONTEXT - len(prompt))))
    output = tiny_tokenizer().decode(scripted_output(prompt, request.stopping)[0], False)
    if output and draw(st.booleans()):  # a stop string the output holds: often met in the middle of a run's message
        start = draw(st.integers(0, len(output) - 1))
        request.stop_strings.append(output[start : start + draw(st.integers(1, 4))])
    request.stop_strings.extend(draw(st.lists(st.text(string.printable, min_size=1, max_size=2), max_size=2)))
    return request


@fuzz_examples(150)
@given(request=decode_requests(), plan=plans)
async def test_decode_streams_keep_the_invariants(stack, request, plan):
    check_decode(await send(stack, stack.decoder.Decode, request, plan), request, plan)


@fuzz_examples(150)
@given(request=generate_requests(), plan=plans, streamed=st.booleans())
async def test_generate_keeps_the_text_contract_with_stop_strings_across_runs(stack, request, plan, streamed):
    method = stack.generation.Generate if streamed else stack.generation.Complete
    check_generate(stack, await send(stack, method, request, plan), request, streamed, plan)


async def test_runs_arrive_as_one_response_each_and_the_metrics_count_them(stack):
    prompt = list(range(101, 121)) + [100]
    request = dpb.DecodeRequest(prompt_token_ids=prompt, stopping=dpb.StoppingCriteria(max_output_tokens=10))
    before = stack.decode.engine.stats().speculation
    responses = [r async for r in stack.decoder.Decode(request)]
    assert [e.token.id for r in responses for e in r.events if e.HasField("token")] == list(range(101, 111))
    # The first token (prefill), then 102 and 103 from plain steps (a source is looked up from
    # the last 3 ids, and "101 102 103" is the first 3 the prompt holds), with 104 in flight:
    # the proposer guesses 104-108 from the ids it has, 104 standing for the one in flight, and
    # the verify behind that step accepts 105-108 and samples 109; then 104 is read, then the
    # run goes out; the cap leaves 110 to a plain step, then Finished. A response ends only
    # where a step or a run ends (a client that lags gets several in one response, never part
    # of a run).
    ends = list(itertools.accumulate(len(r.events) for r in responses))
    assert set(ends) <= {1, 2, 3, 4, 9, 11} and ends[-1] == 11, ends
    after = stack.decode.engine.stats().speculation
    assert (after.proposed - before.proposed, after.accepted - before.accepted) == (4, 4)
    exposition = stack.decode.metrics.exposition().decode()
    assert f'tokenwire_speculative_accepted_tokens_total{{proposer="ngram"}} {float(after.accepted)}' in exposition
    assert f'tokenwire_speculative_proposed_tokens_total{{proposer="ngram"}} {float(after.proposed)}' in exposition
