"""Constrained decoding through the engine and both services (issue 43): the scheduler with the
scripted model, both gRPC services over it, `tokenwire generate --regex`, and one stack over the
real tiny-llama JaxModel.

The scripted model (engine.core.scripted_model) has tiny-llama's vocabulary (512 ids, EOS {0, 2}),
and under a banned row it samples its scripted id (the one after the id fed) when the row allows
it, else the lowest id the row allows. So its constrained outputs are worked out from the
tokenizer: "a" is id 67 and "b" 68, and a prompt ending in 10 wants 11 ("(") next, which no
constraint below allows. The constraints are compiled against tests/assets/tiny-llama's real
tokenizer.json (engine.constraints over llguidance).
"""

from __future__ import annotations

import asyncio
import functools
import json
import pickle
import re
from pathlib import Path

import grpc
import jsonschema
import pytest
from tokenizers import Tokenizer

from engine.constraints.spec import Constraint, ConstraintError
from engine.core.constrained import NO_TOKENIZER, ConstraintCompiler
from engine.core.engine import Engine, EngineConfig
from engine.core.engine_process import EngineProcess
from engine.core.errors import DecoderFault, InvalidArgument
from engine.core.events import Finished, FinishReason
from engine.core.request import Request, StoppingCriteria
from engine.core.scripted_model import ScriptedModel
from protos.decode.v1 import decode_pb2 as dpb
from protos.decode.v1 import decode_pb2_grpc
from protos.text.v1 import text_pb2_grpc
from services.cli import main
from services.client import generate_request
from services.decode_server import start_decode_server
from services.text_server import start_text_server
from support import tiny_served
from support.recording_sink import Recorder
from tokenizer_svc.tokenizer import TextTokenizer

TINY = Path(__file__).parent / "assets" / "tiny-llama"
TOKENIZER_JSON = TINY / "tokenizer.json"
EOS = frozenset({0, 2})
A, B, C, AB = 67, 68, 69, 432  # "a", "b", "c", "ab" in tiny-llama's vocabulary
STOP, LENGTH = dpb.FINISH_REASON_STOP, dpb.FINISH_REASON_LENGTH
SCHEMAS = [
    {"type": "object", "properties": {"x": {"type": "integer"}, "s": {"enum": ["hi", "yo"]}}, "required": ["x", "s"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "minItems": 2, "maxItems": 3}}, "required": ["ok", "tags"]},
    {"type": "object", "properties": {"p": {"$ref": "#/$defs/point"}}, "required": ["p"],
     "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"enum": [1, 2]}}, "required": ["x", "y"]}}},
]


@pytest.fixture(scope="module")
def compiler() -> ConstraintCompiler:
    return ConstraintCompiler(TOKENIZER_JSON, 512, EOS)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(str(TOKENIZER_JSON))


def scripted(**kw) -> ScriptedModel:
    return ScriptedModel(**{"vocab_size": 512, "eos_token_ids": EOS, "max_batch_size": 4, "max_context_length": 256, **kw})


@pytest.fixture
def engine():
    engine = Engine(scripted(), EngineConfig(max_queue_size=8))
    engine.start()
    yield engine
    engine.stop()


def run(engine: Engine, compiler, kind: str, text: str, prompt=(10,), n=None, **stopping) -> Recorder:
    constraint = None if kind is None else compiler.compile(Constraint(kind, text))
    sink = Recorder()
    engine.submit(Request("r", tuple(prompt), stopping=StoppingCriteria(n, **stopping), constraint=constraint), sink)
    assert sink.done.wait(10)
    return sink


def finished(sink: Recorder) -> Finished:
    assert sink.error is None, sink.error
    events = [e for b in sink.batches for e in b]
    assert [type(e) for e in events].count(Finished) == 1 and isinstance(events[-1], Finished)
    assert events[-1].usage.completion_tokens == len(sink.tokens)
    return events[-1]


# -- the scheduler, with the scripted model -------------------------------------------------------


def test_a_whole_output_finishes_with_stop_and_no_stop_token(engine, compiler, tok):
    sink = run(engine, compiler, "regex", "[ab]{3}")
    assert sink.tokens == [A, B, A]  # "(" is banned: the lowest allowed, "a"; then "b" (a + 1) is allowed; then "a"
    assert tok.decode(sink.tokens) == "aba"
    end = finished(sink)
    assert (end.reason, end.stop_token_id) == (FinishReason.STOP, None)


def test_eos_is_sampled_only_where_the_language_accepts_and_never_sent(engine, compiler):
    sink = run(engine, compiler, "regex", "a+")
    assert sink.tokens == [A]  # after "a" the lowest allowed id is EOS 0: the language accepts there
    end = finished(sink)
    assert (end.reason, end.stop_token_id) == (FinishReason.STOP, 0)


def test_min_output_tokens_masks_the_control_ids_on_top_of_the_constraint(engine, compiler):
    sink = run(engine, compiler, "regex", "a+", min_output_tokens=3)
    assert sink.tokens == [A, A, A]
    assert (finished(sink).reason, finished(sink).stop_token_id) == (FinishReason.STOP, 0)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_a_cut_of_an_unfinished_output_is_length_with_exactly_n_tokens(engine, compiler, n):
    sink = run(engine, compiler, "regex", "a{10}", n=n)
    assert sink.tokens == [A] * n
    assert finished(sink).reason == FinishReason.LENGTH


def test_a_whole_output_at_the_cap_is_stop(engine, compiler):
    sink = run(engine, compiler, "regex", "[ab]{3}", n=3)
    assert len(sink.tokens) == 3 and finished(sink).reason == FinishReason.STOP


@pytest.mark.parametrize("schema", SCHEMAS, ids=["enum", "array", "ref"])
def test_json_schema_outputs_parse_and_validate(engine, compiler, tok, schema):
    sink = run(engine, compiler, "json_schema", json.dumps(schema), n=200)
    assert finished(sink).reason == FinishReason.STOP
    jsonschema.validate(json.loads(tok.decode(sink.tokens)), schema)


def test_json_object_and_lark(engine, compiler, tok):
    assert tok.decode(run(engine, compiler, "lark", 'start: "yes" | "no"').tokens) == "no"
    sink = run(engine, compiler, "json_object", "", n=30)
    assert finished(sink).reason == FinishReason.LENGTH  # the scripted walk never closes its string
    assert tok.decode(sink.tokens).startswith('{"')


def test_a_constrained_batch_reads_its_step_before_the_next_an_unconstrained_one_runs_ahead(compiler):
    """The host runs one step behind the device only for batches with no constrained row: each
    `reads` entry is (the step read, the steps dispatched by then)."""
    for constrained in (False, True):
        model = scripted()
        engine = Engine(model)
        engine.start()
        try:
            if constrained:
                sink = run(engine, compiler, "regex", "a{6}")
                assert sink.tokens == [A] * 6 and model.bans == 5  # one ban a decode step
                assert all(read == dispatched for read, dispatched in model.reads)
            else:
                sink = run(engine, compiler, None, "", n=6)
                assert sink.tokens == list(range(11, 17)) and model.bans == 0
                assert any(dispatched > read for read, dispatched in model.reads)
        finally:
            engine.stop()


def test_a_model_that_samples_apart_reads_the_step_in_flight_while_the_next_ones_layers_run(compiler):
    """With `samples_apart` a constrained step's layers are dispatched before the step in flight
    is read, and its sampling after its rows: "a(bc){2}" wants "c" after "ab" and "b" after "c",
    so a step sampled under the row before its own (a sampling dispatched with its layers) takes
    an id the grammar refuses."""
    model = scripted(samples_apart=True)
    engine = Engine(model)
    engine.start()
    try:
        sink = run(engine, compiler, "regex", "a(bc){2}")
        assert sink.tokens == [AB, C, B, C] and (finished(sink).reason, finished(sink).stop_token_id) == (FinishReason.STOP, None)
        assert model.bans == 3 and any(dispatched > read for read, dispatched in model.reads)
    finally:
        engine.stop()


@pytest.mark.parametrize("apart", [False, True], ids=["read-first", "layers-first"])
def test_a_steps_constrained_rows_go_in_one_ban_and_a_failed_row_fails_its_request_alone(tok, apart):
    """Two constrained requests and a free one in one batch: each step's two rows go in one
    `ban`; a request whose row comes to allow nothing (with a head of 100 ids, "a" then "é",
    whose bytes are past id 100) fails alone, and the others go on."""
    small = ConstraintCompiler(TOKENIZER_JSON, 100, EOS)
    model = ScriptedModel(vocab_size=100, eos_token_ids=EOS, max_batch_size=4, max_context_length=64, samples_apart=apart)
    engine = Engine(model)
    engine.start()
    try:
        sinks = [Recorder() for _ in range(4)]
        for sink, (prompt, text) in zip(sinks, [((10,), "[ab]{4}"), ((20,), "[ab]{4}"), ((30,), "aé"), ((40,), None)]):
            grammar = None if text is None else small.compile(Constraint("regex", text))
            engine.submit(Request("r", prompt, stopping=StoppingCriteria(8), constraint=grammar), sink)
        assert all(sink.done.wait(10) for sink in sinks)
        assert sinks[0].tokens == sinks[1].tokens == [A, B] * 2 and sinks[3].tokens == list(range(41, 49))
        assert isinstance(sinks[2].error, InvalidArgument) and sinks[2].tokens == [A]
        assert model.bans <= model.decode_steps  # (one call a step, however many rows)
    finally:
        engine.stop()


def test_an_unconstrained_request_beside_a_constrained_one_is_unchanged(engine, compiler):
    free, held = Recorder(), Recorder()
    engine.submit(Request("free", (100,), stopping=StoppingCriteria(12)), free)
    engine.submit(Request("held", (10,), stopping=StoppingCriteria(12), constraint=compiler.compile(Constraint("regex", "a{12}"))), held)
    assert free.done.wait(10) and held.done.wait(10)
    assert free.tokens == list(range(101, 113)) and held.tokens == [A] * 12


@pytest.mark.parametrize("fused", [0, 4], ids=["chunks", "chunks-along-steps"])
def test_a_constrained_prompt_read_in_chunks_beside_a_running_stream(compiler, fused):
    """The slot's first row goes with the chunk that takes it (a `prefill_chunk`, or a chunk that
    rides along with a decode step), and the last chunk samples under it."""
    model = scripted(fused_chunk_tokens=fused, step_delay_s=0.005)  # the free stream runs while the other prompt is read
    engine = Engine(model, EngineConfig(max_step_tokens=4))
    engine.start()
    try:
        free, held = Recorder(), Recorder()
        engine.submit(Request("free", (100,), stopping=StoppingCriteria(30)), free)
        assert free.started.wait(10)
        engine.submit(Request("held", tuple(range(20, 45)) + (10,), stopping=StoppingCriteria(10),
                              constraint=compiler.compile(Constraint("regex", "a{10}"))), held)
        assert free.done.wait(10) and held.done.wait(10)
        assert free.tokens == list(range(101, 131)) and held.tokens == [A] * 10
        assert sum(1 for call in model.calls if call[0] == "prefill" and call[1] == 1) > 1  # read in chunks
        assert (model.fused_chunks > 0) == bool(fused)
    finally:
        engine.stop()


def test_prefix_cache_composes(compiler):
    model = scripted(page_size=4)
    engine = Engine(model)
    engine.start()
    try:
        prompt = tuple(range(20, 40)) + (10,)
        first = run(engine, compiler, "regex", "[ab]{5}", prompt=prompt)
        second = run(engine, compiler, "regex", "[ab]{5}", prompt=prompt)
        assert engine.stats().pages.hit_tokens >= 16  # the second prompt's full pages came from the cache
        assert second.tokens == first.tokens and len(first.tokens) == 5
    finally:
        engine.stop()


def test_a_preempted_constrained_request_goes_on_where_it_was(compiler):
    """Two requests that together outgrow a pool of 12 pages of 4: the later one is preempted and
    recomputed; its matcher, like its counts, goes on from the tokens it had sent (min_output_tokens
    too: EOS stays masked until 30 were sent in all). (llguidance allows only "ab" first: the
    tokenizer's own spelling of the language's start.)"""
    model = scripted(max_batch_size=2, kv_cache_tokens=48, page_size=4)
    engine = Engine(model, EngineConfig(max_step_tokens=0))
    engine.start()
    try:
        grammar = compiler.compile(Constraint("regex", "(ab)+"))
        sinks = [Recorder(), Recorder()]
        for i, sink in enumerate(sinks):
            request = Request(f"r{i}", tuple(range(20 + i, 28 + i)), stopping=StoppingCriteria(40, min_output_tokens=30), constraint=grammar)
            engine.submit(request, sink)
        assert all(sink.done.wait(10) for sink in sinks)
        assert engine.stats().preemptions >= 1
        for sink in sinks:
            assert sink.tokens == [AB] + [A, B] * 15 and (finished(sink).reason, finished(sink).stop_token_id) == (FinishReason.STOP, 0)
    finally:
        engine.stop()


def test_a_row_that_allows_nothing_fails_the_request_not_the_engine(tok):
    """With a head of 100 ids, "é" (bytes past id 100) cannot be spelt: the request fails with
    InvalidArgument and the engine goes on."""
    small = ConstraintCompiler(TOKENIZER_JSON, 100, EOS)
    engine = Engine(ScriptedModel(vocab_size=100, eos_token_ids=EOS, max_batch_size=2, max_context_length=64))
    engine.start()
    try:
        sink = run(engine, small, "regex", "é")
        assert isinstance(sink.error, InvalidArgument) and sink.error.field == "constraint"
        assert sink.tokens == []
        assert run(engine, small, "regex", "a").tokens == [A]
    finally:
        engine.stop()


class IgnoresBans(ScriptedModel):
    """A broken model: it takes the banned rows and samples its script regardless."""

    def ban(self, slots, banned) -> None:
        pass


def test_a_model_that_samples_a_banned_id_fails_that_request_not_the_engine(compiler):
    """Past the first token (sampled under the row its setup carries), the model keeps sampling
    under that first row, which does not hold JSON's next step: the matcher refuses an id, the
    request fails with DecoderFault (INTERNAL: a model bug, not the caller's), and the engine
    serves the next request."""
    engine = Engine(IgnoresBans(vocab_size=512, eos_token_ids=EOS, max_batch_size=2, max_context_length=64))
    engine.start()
    try:
        sink = run(engine, compiler, "json_object", "", n=8)
        assert isinstance(sink.error, DecoderFault) and "constraint bans" in str(sink.error)
        assert engine.stats().alive and engine.stats().slots_in_use == 0
        plain = run(engine, compiler, None, "", n=3)
        finished(plain)
        assert plain.tokens == [11, 12, 13] and engine.stats().alive
    finally:
        engine.stop()


def test_banned_rows_of_several_matchers_at_once_are_each_ones_own_and_a_failed_one_is_apart(compiler):
    """One parallel call (engine.constraints.matcher.banned_rows) gives each matcher the row its
    own `banned()` gives, whatever its state; a failed matcher gets its error and an all-banned
    row, and the others their rows."""
    from engine.constraints.matcher import banned_rows

    matchers = [compiler.compile(Constraint("regex", text)).matcher() for text in ("[ab]{3}", "a(bc){2}", "[ab]{3}", "a+")]
    matchers[1].advance(AB)
    matchers[2].advance(A)
    matchers[2].advance(A)  # one letter left: "ab" no longer allowed
    with pytest.raises(ConstraintError):
        matchers[3].advance(B)  # "b" where only "a" may be: the matcher has failed
    rows, errors = banned_rows(matchers)  # [4, V]
    assert rows.shape == (4, 512) and [e is None for e in errors] == [True, True, True, False]
    for i in range(3):
        assert (rows[i] == matchers[i].banned()).all()
    assert not (rows[0] == rows[1]).all() and not (rows[0] == rows[2]).all()  # three different states
    assert rows[3].all() and errors[3].field == "constraint.regex"


def test_a_compiled_constraint_pickles_for_the_engine_process(compiler):
    """A request crosses a pipe to the engine process: its grammar is compiled again there."""
    grammar = compiler.compile(Constraint("json_schema", json.dumps(SCHEMAS[0])))
    copy = pickle.loads(pickle.dumps(grammar))
    assert (copy.matcher().banned() == grammar.matcher().banned()).all()


def test_constrained_requests_through_the_engine_process(tok):
    """The decode service's engine runs in a child process: the grammar is pickled across and
    compiled again there, and a request the child fails (a row that allows nothing, as above)
    fails with the same InvalidArgument in the parent."""
    small = ConstraintCompiler(TOKENIZER_JSON, 100, EOS)
    process = EngineProcess(functools.partial(ScriptedModel, vocab_size=100, eos_token_ids=EOS, max_batch_size=2, max_context_length=64))
    process.start()
    try:
        held, failed = Recorder(), Recorder()
        process.submit(Request("held", (10,), constraint=small.compile(Constraint("regex", "[ab]{3}"))), held)
        process.submit(Request("failed", (10,), constraint=small.compile(Constraint("regex", "é"))), failed)
        assert held.done.wait(10) and failed.done.wait(10)
        assert tok.decode(held.tokens) == "aba" and finished(held).reason == FinishReason.STOP
        assert isinstance(failed.error, InvalidArgument) and str(failed.error).startswith("constraint: no token")
    finally:
        process.stop()


# -- both services over gRPC, the scripted model ---------------------------------------------------


@pytest.fixture
async def stack():
    model = scripted()
    decode = await start_decode_server(model, EngineConfig(max_queue_size=8), tokenizer_json=TOKENIZER_JSON)
    text = await start_text_server(TextTokenizer.from_dir(TINY), f"127.0.0.1:{decode.port}")
    decode_channel = grpc.aio.insecure_channel(f"127.0.0.1:{decode.port}")
    text_channel = grpc.aio.insecure_channel(f"127.0.0.1:{text.port}")
    yield model, decode_pb2_grpc.DecoderStub(decode_channel), text_pb2_grpc.TextGenerationStub(text_channel), text.port
    await decode_channel.close()
    await text_channel.close()
    await text.stop(None)
    await decode.stop(None)


def decode_request(constraint: dpb.Constraint, n: int = 100, **stopping) -> dpb.DecodeRequest:
    return dpb.DecodeRequest(
        prompt_token_ids=[10], stopping=dpb.StoppingCriteria(max_output_tokens=n, **stopping), constraint=constraint
    )


async def invalid_argument(call) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return caught.value.details()


async def test_decode_holds_the_stream_to_a_json_schema(stack, tok):
    _, decoder, _, _ = stack
    schema = SCHEMAS[1]
    events = [e async for r in decoder.Decode(decode_request(dpb.Constraint(json_schema=json.dumps(schema)))) for e in r.events]
    tokens, end = [e.token.id for e in events[:-1]], events[-1].finished
    assert (end.reason, end.HasField("stop_token_id"), end.usage.completion_tokens) == (STOP, False, len(tokens))
    jsonschema.validate(json.loads(tok.decode(tokens)), schema)


@pytest.mark.parametrize("constraint, stopping, field", [
    (dpb.Constraint(json_schema='{"not": {"type": "string"}}'), {}, "constraint.json_schema: "),
    (dpb.Constraint(json_schema="{not json"), {}, "constraint.json_schema: "),
    (dpb.Constraint(regex="(a"), {}, "constraint.regex: "),
    (dpb.Constraint(lark="start: nothing_defined"), {}, "constraint.lark: "),
    (dpb.Constraint(json_object=False), {}, "constraint.json_object: must be true"),
    (dpb.Constraint(regex="a+"), {"ignore_eos": True}, "stopping.ignore_eos: "),
])
async def test_a_constraint_that_cannot_run_is_invalid_argument_naming_the_field(stack, constraint, stopping, field):
    model, decoder, _, _ = stack
    details = await invalid_argument(decoder.Decode(decode_request(constraint, **stopping)).read())
    assert details.startswith(field), details
    assert model.prefills == 0


async def test_a_decoder_without_a_tokenizer_refuses_constraints():
    decode = await start_decode_server(scripted())
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{decode.port}") as channel:
            details = await invalid_argument(
                decode_pb2_grpc.DecoderStub(channel).Decode(decode_request(dpb.Constraint(regex="a"))).read()
            )
        assert details == f"constraint.regex: {NO_TOKENIZER}"
    finally:
        await decode.stop(None)


async def test_generate_passes_the_constraint_through_and_stop_strings_compose(stack):
    _, _, text, _ = stack
    request = generate_request("hi", max_output_tokens=10)
    request.constraint.regex = "[ab]{3}"
    completion = await text.Complete(request)
    assert (completion.text, completion.reason, completion.HasField("stop_token_id")) == ("aba", STOP, False)
    request.stop_strings.append("b")
    completion = await text.Complete(request)
    assert (completion.text, completion.reason, completion.stop_string) == ("a", STOP, "b")


async def test_the_text_service_refuses_a_bad_constraint_before_the_decoder_sees_it(stack):
    model, _, text, _ = stack
    request = generate_request("hi", max_output_tokens=10)
    request.constraint.json_schema = '{"type": "string", "format": "no-such-format"}'
    details = await invalid_argument(text.Complete(request))
    assert details.startswith("constraint.json_schema: ") and "format" in details
    assert model.prefills == 0


async def test_cli_generate_regex_and_json_schema(stack, tmp_path, capsys):
    _, _, _, port = stack
    server = ["generate", "--server", f"127.0.0.1:{port}", "--json", "--max-tokens", "50", "hi"]
    assert await asyncio.to_thread(main, server + ["--regex", "[ab]{3}"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == "aba"
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMAS[0]))
    assert await asyncio.to_thread(main, server + ["--json-schema", str(schema)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["reason"] == "stop"
    jsonschema.validate(json.loads(result["text"]), SCHEMAS[0])
    with pytest.raises(SystemExit) as exited:
        main(server + ["--regex", "a", "--json-schema", str(schema)])
    assert exited.value.code == 2 and "not allowed with argument" in capsys.readouterr().err.strip().splitlines()[-1]
    assert await asyncio.to_thread(main, server + ["--json-schema", str(tmp_path / "missing.json")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("tokenwire generate: --json-schema: cannot read")


# -- the real JAX model ---------------------------------------------------------------------------

TINY_SCHEMA = {
    "type": "object",
    "properties": {"name": {"enum": ["ab", "cd"]}, "ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
    "required": ["name", "ok", "n"],
}


async def test_tiny_llama_greedy_stream_under_a_json_schema_parses_and_validates(tok):
    """tiny-llama's random weights would never write JSON on their own: under the mask, greedy
    decoding walks the schema's (finite) language to its end, by Decode and by the text
    service's DecodeStream alike."""
    # support.tiny_served's configuration, which other files warm up: read back from the run's
    # compilation cache (its warm-up, at start, is most of this test's time when compiled)
    model = tiny_served.load()
    decode = await start_decode_server(model, EngineConfig(max_queue_size=4), tokenizer_json=TOKENIZER_JSON)
    text = await start_text_server(TextTokenizer.from_dir(TINY), f"127.0.0.1:{decode.port}")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{decode.port}") as channel:
            request = dpb.DecodeRequest(
                prompt_token_ids=tok.encode("The answer:").ids, stopping=dpb.StoppingCriteria(max_output_tokens=48),
                constraint=dpb.Constraint(json_schema=json.dumps(TINY_SCHEMA)),
            )
            events = [e async for r in decode_pb2_grpc.DecoderStub(channel).Decode(request) for e in r.events]
        tokens, end = [e.token.id for e in events[:-1]], events[-1].finished
        assert (end.reason, end.HasField("stop_token_id")) == (STOP, False)
        jsonschema.validate(json.loads(tok.decode(tokens)), TINY_SCHEMA)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{text.port}") as channel:
            request = generate_request("The answer:", max_output_tokens=48)
            request.constraint.json_schema = json.dumps(TINY_SCHEMA)
            completion = await text_pb2_grpc.TextGenerationStub(channel).Complete(request)
        assert list(completion.token_ids) == tokens and completion.reason == STOP
    finally:
        await text.stop(None)
        await decode.stop(None)


def _held_beside_free(engine, tok, prompt, grammar, alone: list[int]) -> None:
    """A stream under TINY_SCHEMA and a free one beside it: the held one ends STOP with JSON of
    the schema, and the free one gives what it gave alone (`alone`)."""
    held, free = Recorder(), Recorder()
    engine.submit(Request("held", prompt, stopping=StoppingCriteria(48), constraint=grammar), held)
    engine.submit(Request("free", prompt, stopping=StoppingCriteria(12, ignore_eos=True)), free)
    assert held.done.wait(60) and free.done.wait(60)
    assert finished(held).reason == FinishReason.STOP
    jsonschema.validate(json.loads(tok.decode(held.tokens)), TINY_SCHEMA)
    assert free.tokens == alone


def test_tiny_llama_split_sampler_samples_apart_and_keeps_the_schema(tok):
    """The real model with its sampler apart from its layers (split_sampler): a constrained
    step's layers run while the host reads the step before and computes the rows, its sampling
    after them. A stream under the schema and a free one beside it: random weights write JSON
    only if every step sampled under its own row (a row one step late lets through an id the
    grammar refuses), and the free stream is the one it is alone."""
    # support.tiny_served's split model, which test_split_sampler warms up: read back from the
    # run's compilation cache (warm-up is most of this test's time when compiled)
    model = tiny_served.load(split_sampler=True)
    assert model.samples_apart
    compiler = ConstraintCompiler(TOKENIZER_JSON, model.info.vocab_size, model.info.eos_token_ids)
    grammar = compiler.compile(Constraint("json_schema", json.dumps(TINY_SCHEMA)))
    model.warm_up()
    engine = Engine(model)
    engine.start()
    try:
        prompt = tuple(tok.encode("The answer:").ids)
        alone = Recorder()
        engine.submit(Request("alone", prompt, stopping=StoppingCriteria(12, ignore_eos=True)), alone)
        assert alone.done.wait(60)
        _held_beside_free(engine, tok, prompt, grammar, alone.tokens)
    finally:
        engine.stop()


def test_tiny_llama_one_executable_samples_a_stream_alone_apart_and_its_rows_with_its_sampling(tok):
    """On a model whose step is one executable (the CPU's default), a constrained stream alone (a
    step of the smallest row bucket) goes layers first too, its rows given to the sampling that
    waits for them (`ban` while a step's sampling waits: steps.step_sample_under); with a second
    request beside it, the step is read first. A row given so applies to that sampling and to the
    slot's later steps, as a row written by a call of its own; the schema holds only if every
    step sampled under its own row, and nothing compiles after warm-up."""
    import numpy as np

    from engine.core.model import DecodeInput, SlotSetup
    from engine.core.request import SamplingParams
    # support.tiny_served's configuration (row buckets 1, 2 and 4): read back from the run's
    # compilation cache
    model = tiny_served.load()
    assert not model.split_sampler and model.samples_apart == 1
    model.warm_up()
    warm = model.compilations()
    model.set_pages(0, [1, 2])
    model.prefill(0, [3, 4, 5], SlotSetup(SamplingParams(seed=1), frozenset()), False)
    banned = np.zeros((1, model.info.vocab_size), bool)
    banned[0, :500] = True  # only the last 12 ids may come next
    model.dispatch([DecodeInput(0, None, 3, True)], sample_later=True)
    model.ban([0], banned)
    model.dispatch_sampling()
    assert model.collect()[0].token_id >= 500
    assert model.decode([DecodeInput(0, None, 4, True)])[0].token_id >= 500  # the row stayed the slot's
    model.release(0)
    calls = sum(model.sampler_calls.values())
    compiler = ConstraintCompiler(TOKENIZER_JSON, model.info.vocab_size, model.info.eos_token_ids)
    grammar = compiler.compile(Constraint("json_schema", json.dumps(TINY_SCHEMA)))
    engine = Engine(model)
    engine.start()
    try:
        prompt = tuple(tok.encode("The answer:").ids)
        alone = Recorder()
        engine.submit(Request("alone", prompt, stopping=StoppingCriteria(12, ignore_eos=True)), alone)
        assert alone.done.wait(60)
        assert sum(model.sampler_calls.values()) == calls  # an unconstrained stream: today's one executable
        held = Recorder()
        engine.submit(Request("held", prompt, stopping=StoppingCriteria(48), constraint=grammar), held)
        assert held.done.wait(60)
        assert finished(held).reason == FinishReason.STOP
        jsonschema.validate(json.loads(tok.decode(held.tokens)), TINY_SCHEMA)
        assert sum(model.sampler_calls.values()) >= calls + len(held.tokens) - 1  # every decode step apart
        _held_beside_free(engine, tok, prompt, grammar, alone.tokens)  # two rows: read first
    finally:
        engine.stop()
    assert model.compilations() == warm
