"""Speculative decoding with a draft model (issue 45, `--draft-model`): the draft's greedy guesses
change no greedy id of the target, a model drafting for itself has every guess accepted, sampled
requests keep the stream contract, a draft with no free slot just stops guessing, and the
configurations that cannot work are refused at the command line (exit 2, the reason last).

Real parts: tiny-llama is the target in tests/support/tiny_served's configuration with a verify
step (`max_guesses` 4, verify steps of up to 2 rows), as tests/test_verify warms it up, and drafts
in tiny_served's own configuration, as every file loading tiny-llama does; tiny-mistral, a
different checkpoint with the same tokenizer, is the draft whose guesses the target sometimes
rejects. Nothing is warmed up (the decode service's load neither: support.unwarmed): each model
compiles only the few shapes these prompts use (in a run, most are read back from other files'
warm-ups).
"""

from __future__ import annotations

import json
import shutil

import pytest

from engine.core.engine import Engine, EngineConfig
from engine.core.events import FinishReason
from engine.core.model import ModelUsageError
from engine.core.request import Request, SamplingParams, StoppingCriteria
from engine.core.speculation.draft import DraftProposer
from support import tiny_served
from support.recording_sink import Recorder
from support.unwarmed import Unwarmed
from support.waiting import until_sync
from test_cli import in_process

TINY = tiny_served.ASSETS / "tiny-llama"
PROMPTS = [  # ids below the tokenizer's 512; all in the 8-token prompt bucket
    (1, 5, 9, 200, 3, 7),
    (4, 4, 4, 4, 4, 4, 4, 4),
    (300, 12, 45, 77),
    (17, 260, 17, 260, 17),
]
TOKENS = 24


@pytest.fixture(scope="module")
def target():
    # test_verify's configuration, which that file warms up: read back in a run
    return tiny_served.load(cls=Unwarmed, max_guesses=4, max_verify_rows=2)


@pytest.fixture(scope="module")
def llama():
    """tiny-llama as a draft, shared by the tests (each leaves its slots free, as a proposer's
    requests do when they end): its steps compile once."""
    return tiny_served.load()


@pytest.fixture(scope="module")
def mistral():
    return tiny_served.load("tiny-mistral")


@pytest.fixture(scope="module")
def plain(target):
    """Plain greedy decoding's ids for each prompt (no speculation)."""
    return serve(Engine(target, EngineConfig()), [greedy(p) for p in PROMPTS])


def greedy(prompt, tokens=TOKENS) -> Request:
    return Request(f"r{prompt}", tuple(prompt), SamplingParams(temperature=0.0), StoppingCriteria(tokens, ignore_eos=True))


def serve(engine: Engine, requests: list[Request]) -> list[Recorder]:
    """Each request to its end, one at a time (batch 1: a row guesses all it may)."""
    sinks = []
    engine.start()
    try:
        for request in requests:
            sink = Recorder()
            engine.submit(request, sink)
            assert sink.done.wait(120) and sink.error is None, sink.error
            sinks.append(sink)
    finally:
        engine.stop()
    return sinks


def speculative(target, draft) -> Engine:
    return Engine(target, EngineConfig(speculation="draft", speculative_tokens=4), proposer=DraftProposer(draft))


def test_a_model_drafting_for_itself_has_every_guess_accepted(target, plain, llama):
    engine = speculative(target, llama)
    ids = [s.tokens for s in serve(engine, [greedy(p) for p in PROMPTS])]
    assert ids == [s.tokens for s in plain]
    stats = engine.stats().speculation
    assert stats.proposer == "draft"  # the metrics' label
    # greedy on both sides, the same weights and bits: every guess is the target's own next id
    assert stats.proposed > len(PROMPTS) * TOKENS // 2 and stats.accepted == stats.proposed, stats


def test_another_checkpoint_drafting_keeps_the_greedy_ids(target, plain, mistral):
    """tiny-mistral guesses for tiny-llama: other weights, so the target rejects many guesses and
    the draft rewinds its slot; the ids stay plain decoding's."""
    engine = speculative(target, mistral)
    ids = [s.tokens for s in serve(engine, [greedy(p) for p in PROMPTS])]
    assert ids == [s.tokens for s in plain]
    stats = engine.stats().speculation
    print(f"tiny-mistral drafting for tiny-llama: {stats.accepted} of {stats.proposed} guesses accepted")
    assert stats.proposed > 0 and stats.accepted < stats.proposed, stats


def test_seeded_sampling_with_the_draft_keeps_the_stream_contract(target, llama):
    """Sampled rows accept a greedy draft's guess by rejection sampling: every run is cut at exactly
    max_output_tokens, EOS (masked below min_output_tokens) is never sent, usage counts what was."""
    requests = [
        Request(f"s{i}", prompt, SamplingParams(temperature=1.0, seed=i), StoppingCriteria(TOKENS, min_output_tokens=TOKENS))
        for i, prompt in enumerate(PROMPTS)
    ] + [Request("free", PROMPTS[0], SamplingParams(temperature=0.8, top_k=40, seed=9), StoppingCriteria(TOKENS))]
    engine = speculative(target, llama)
    sinks = serve(engine, requests)
    eos = target.info.eos_token_ids
    for sink in sinks[:-1]:
        assert len(sink.tokens) == TOKENS and not eos & set(sink.tokens), sink.tokens
        assert sink.finished.reason == FinishReason.LENGTH and sink.finished.usage.completion_tokens == TOKENS
    last = sinks[-1]
    assert len(last.tokens) <= TOKENS and not eos & set(last.tokens) and last.finished.usage.completion_tokens == len(last.tokens)
    assert engine.stats().speculation.proposed > 0


def test_a_draft_with_no_free_slot_stops_guessing_and_changes_nothing(target, plain, llama):
    """Every draft slot is taken by other histories: the request gets no guesses, and its ids are
    plain decoding's; once a slot is free again, guesses resume."""
    proposer = DraftProposer(llama)
    others = [proposer.open(p) for p in PROMPTS]  # as many as the draft's slots, each given one by a proposal
    assert len(others) == target.info.max_batch_size
    assert all(proposer.propose([(h, 1)]) != [()] for h in others) and not proposer.expects(proposer.open((1, 2)))
    try:
        engine = Engine(target, EngineConfig(speculation="draft", speculative_tokens=4), proposer=proposer)
        assert [s.tokens for s in serve(engine, [greedy(PROMPTS[0])])] == [plain[0].tokens]
        assert engine.stats().speculation.proposed == 0
        proposer.close(others[0])
        engine = Engine(target, EngineConfig(speculation="draft", speculative_tokens=4), proposer=proposer)
        assert [s.tokens for s in serve(engine, [greedy(PROMPTS[1])])] == [plain[1].tokens]
        assert engine.stats().speculation.accepted > 0
    finally:
        for history in others:
            proposer.close(history)  # (the draft's slots, free for the next test)


async def test_the_decode_service_serves_with_a_draft_and_labels_its_metrics(target, plain, llama):
    """The service's path (`start_decode_server(proposer=...)`, as decode-server --draft-model
    builds it): a Decode stream gets plain decoding's ids, and the speculative counters carry the
    proposer's name, "draft"."""
    import grpc
    from prometheus_client import generate_latest

    from protos.decode.v1 import decode_pb2_grpc
    from services.client import decode_request
    from services.decode_server import start_decode_server
    from services.metrics import Metrics

    metrics = Metrics()
    server = await start_decode_server(
        target, EngineConfig(speculation="draft"), metrics=metrics, proposer=lambda model: DraftProposer(llama)
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = decode_pb2_grpc.DecoderStub(channel)
            request = decode_request(PROMPTS[0], max_output_tokens=TOKENS, ignore_eos=True)
            ids = [e.token.id async for r in stub.Decode(request) for e in r.events if e.HasField("token")]
    finally:
        await server.stop(None)
    assert ids == plain[0].tokens
    text = generate_latest(metrics.registry).decode()
    accepted = next(line for line in text.splitlines() if line.startswith("tokenwire_speculative_accepted_tokens_total"))
    assert accepted.startswith('tokenwire_speculative_accepted_tokens_total{proposer="draft"}') and float(accepted.split()[-1]) > 0


def test_a_history_caught_up_guesses_as_one_read_afresh(llama):
    """What the draft guesses after the request moved on does not depend on how its slot caught
    up: a rejected guess (rewound, the target's id fed), every guess accepted (two ids fed), or
    many ids at once (prefilled again) give the guesses of a history opened on the same ids; nor
    on the rows proposed with it in the same steps."""
    proposer = DraftProposer(llama)

    def fresh(ids):
        history = proposer.open(ids)
        try:
            return proposer.propose([(history, 4)])[0]
        finally:
            proposer.close(history)

    moves = {
        "the second guess rejected": lambda guesses: [guesses[0], (guesses[1] + 1) % 512],
        "every guess accepted, then the target's own id": lambda guesses: [*guesses, 7],
        "many ids at once (a row back from a rest)": lambda guesses: list(range(100, 120)),
    }
    history = proposer.open(PROMPTS[0])
    guesses = proposer.propose([(history, 4)])[0]
    assert len(guesses) == 4 and guesses == fresh(PROMPTS[0])
    for move, emitted in moves.items():
        history.extend(emitted(guesses))
        guesses = proposer.propose([(history, 4)])[0]
        assert guesses == fresh(history.ids), move
    # two rows in the same steps (one with 2 ids to feed first, one with none): each as alone
    other = proposer.open(PROMPTS[1])
    alone = fresh(PROMPTS[1])
    history.extend([*guesses, 7])
    assert proposer.propose([(history, 4), (other, 3)]) == [fresh(history.ids), alone[:3]]
    proposer.close(other)
    slot, count = history.slot, history.count
    with pytest.raises(ModelUsageError, match="outside 1.."):
        proposer.model.rewind(slot, count + 1)
    proposer.close(history)
    with pytest.raises(ModelUsageError, match="which was not prefilled"):
        proposer.model.rewind(slot, 1)


class _Ids(list):
    def extend(self, ids):  # (list.extend, named as History wants)
        super().extend(ids)


class Counting:
    """A proposer for the scripted model (after t comes t + 1) that counts the histories open:
    a draft's slot is held by a history until `close`, so none may be left open."""

    name = "counting"

    def __init__(self) -> None:
        self.open_histories = 0

    def open(self, ids):
        self.open_histories += 1
        return _Ids(ids)

    def propose(self, rows):
        return [tuple(range(history[-1] + 1, history[-1] + 1 + k)) for history, k in rows]

    def close(self, history) -> None:
        self.open_histories -= 1


def test_a_request_preempted_then_cancelled_while_it_waits_closes_its_history():
    """Two requests outgrow a small pool: the later one is preempted after speculating, keeping
    its history, and is cancelled while it waits to be read again (the engine thread cancels it,
    at the delivery after the preemption, so it surely waits): its history is closed all the same."""
    from engine.core.scripted_model import ScriptedModel

    model = ScriptedModel(max_batch_size=2, max_context_length=256, max_guesses=4, page_size=4, kv_cache_tokens=128)
    proposer = Counting()
    engine = Engine(model, EngineConfig(speculation="ngram", speculation_max_batch=2), proposer=proposer)
    tickets: list[int] = []

    def cancel_the_preempted() -> None:
        if len(tickets) == 2 and engine.stats().preemptions:
            engine.abort(tickets.pop())

    engine.after_delivery(cancel_the_preempted)
    sinks = [Recorder(), Recorder()]
    engine.start()
    try:
        for prompt, sink in zip(([10], [500]), sinks):
            tickets.append(engine.submit(Request(f"p{prompt}", tuple(prompt), SamplingParams(), StoppingCriteria(100)), sink))
        assert sinks[0].done.wait(30) and sinks[0].tokens == list(range(11, 111))
        assert len(tickets) == 1 and not sinks[1].done.is_set()  # cancelled: no more events
        until_sync(lambda: engine.stats().slots_in_use == 0 and engine.stats().queue_depth == 0, "nothing held")
        assert engine.stats().speculation.accepted > 0 and proposer.open_histories == 0
    finally:
        engine.stop()


def _draft_dir(tmp_path, config=None, generation=None):
    """tiny-llama's files but its weights (refused before any weight is read), with changes."""
    directory = tmp_path / "draft"
    directory.mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / name, directory / name)
    for name, changes in (("config.json", config), ("generation_config.json", generation)):
        if changes:
            path = directory / name
            path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return directory


@pytest.mark.parametrize("changes, reason", [
    (dict(config={"vocab_size": 300}), "its tokenizer has 300 ids and the model's 512: a draft model must have the model's tokenizer"),
    (dict(generation={"eos_token_id": [0, 2, 7]}), "its EOS ids [0, 2, 7] differ from the model's [0, 2]"),
    (dict(config={"max_position_embeddings": 32}), "its context of 32 positions (max_position_embeddings) is shorter than the model's 256"),
], ids=["vocabulary", "eos", "context"])
def test_a_draft_that_cannot_guess_for_the_model_is_refused_before_loading(tmp_path, capsys, changes, reason):
    code, _, err = in_process(capsys, "decode-server", "--model", str(TINY), "--draft-model", str(_draft_dir(tmp_path, **changes)))
    last = err.strip().splitlines()[-1]
    assert code == 2 and reason in last, err


@pytest.mark.parametrize("argv, reason", [
    (["--speculation", "draft"], "--speculation draft guesses with a draft model: give it with --draft-model NAME|DIR"),
    (["--draft-model", "d", "--speculation", "ngram"], "--draft-model d guesses for --speculation draft, not --speculation ngram"),
    (["--draft-model", "d", "--model", "scripted:m"], "--draft-model guesses for a real model: --model scripted:DIR takes none"),
    (["--draft-model", "d", "--tensor-parallel", "2"], "--draft-model needs the model's verify step, which --tensor-parallel 2"),
])
def test_flags_that_do_not_go_together_are_refused(capsys, argv, reason):
    code, _, err = in_process(capsys, "decode-server", "--model", "no-such-model", *argv)
    last = err.strip().splitlines()[-1]
    assert code == 2 and reason in last and "no-such-model" not in last, err


def test_a_draft_model_alone_implies_draft_speculation():
    from services.config import DecodeServerConfig
    from services.flags import build_parser

    config = DecodeServerConfig.from_args(build_parser().parse_args(["decode-server", "--model", "m", "--draft-model", "d"]))
    assert config.engine.speculation == "draft" and config.draft_model == "d"
    assert config.model_options.max_guesses == EngineConfig.speculative_tokens
