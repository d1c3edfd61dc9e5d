"""`JaxModel.verify` (speculative decoding, issue 45): a verify step gives exactly what plain
decoding gives.

Greedy, on tiny-llama in float32 and int8 (the CPU kernels' paths) and tiny-gemma3 (sliding
windows of 8, so a guessed span crosses a window edge): three sequences of different prompt
lengths decode once plainly, then again through verify calls with random guesses, some the plain
run's next ids and some corrupted, a random number of them per row (none included), rows in a
shuffled order and some slots left out, with plain decode steps in between, and a third of the
calls enqueued behind a plain step not yet collected; every sample (id,
logprob, alternatives) equals the plain run's at its position. A call is of one guess bucket
(its first row has that many guesses, K but in the float32 case's calls of two rows, which walk
the buckets); the float32 case also walks the row buckets (some slots a call), the int8 and
Gemma 3 ones run every call at the batch's one row bucket (fewer compiles; the ladders are not
theirs to test). The pages are shuffled, so a guessed span that crosses a page boundary goes on
in a page elsewhere (pages of 4 positions for the int8 and Gemma 3 models, where most spans
cross one; the served 16 for the float32 model, whose run counts the spans that cross and
asserts some), and a decode after a verify reads the KV the verify wrote and overwrites the
garbage of its rejected guesses. Sampled: the same seed gives
the same ids as plain sampling (verify's draw is plain sampling's at each position), and over
many seeds the first sample and the acceptance of a fixed guess follow the target distribution
(chi-square, and the acceptance rate against the guess's probability).

The float32 tiny-llama is warmed up once for the module, and its warm-up is counted here: a verify
step per verify row bucket and guess bucket, compiled for real, and nothing compiled after it
(tests/test_compile_budget.py lowers the same configuration and counts the same programs without
compiling them). It is support.tiny_served's configuration with max_guesses 4 and verify steps of
at most 2 rows (`max_verify_rows`: decode-server's --speculation-max-batch, 1 by default; 2 walks
two row buckets, and a call of 3 rows runs as two steps), on which a model's other programs do
not depend: those 43 are read back from the run's compilation cache wherever another file warmed
that configuration first. The int8 and Gemma 3 models are not
warmed up: each call compiles what it uses.
"""

from __future__ import annotations

import itertools
import logging
import re
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from engine.core.model import DecodeInput, ModelUsageError, PromptInput, SlotSetup, VerifyInput
from engine.core.request import SamplingParams
from engine.jax_backend.jax_model import JaxModel
from support import prerequisites, tiny_served
from support.compile_watch import compile_events

ASSETS = Path(__file__).parent / "assets"
K = 4  # max_guesses
CONTEXT = 64
PROMPTS = [(1, 2, 3, 4, 5), (7, 8, 9), (11, 12, 13, 14, 15, 16, 17, 18, 19)]
STEPS = 24  # samples per sequence compared


def _load(name: str, weights: str, batch: int = 4, guesses: int = K, rows: int = 1) -> JaxModel:
    """`rows`: the smallest row bucket (`min_rows`); the batch itself leaves one row bucket, so one
    decode and one verify row shape, for a model whose run need not cross the row ladder."""
    prerequisites.cpu_kernels()  # skips, or fails under TOKENWIRE_TEST_NO_SKIP, without them
    return JaxModel.load(
        ASSETS / name, max_batch_size=batch, max_context_length=CONTEXT, dtype="float32", weights=weights,
        kv_page_size=4, max_guesses=guesses, min_rows=rows,
    )


class _Said(logging.Handler):
    """Collects warm-up's progress lines (a module fixture has no caplog)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def warmed() -> tuple[JaxModel, list[str], list[str], int]:
    """tiny-llama in support.tiny_served's configuration (float32, 4 slots, a context of 64, the
    served pages of 16) with max_guesses 4 and max_verify_rows 2, warmed up: -> the model, warm-up's
    log lines, the compile events of its warm-up and the executables it left in jit's caches. The
    tests below share the model (each releases what it takes)."""
    prerequisites.cpu_kernels()  # skips, or fails under TOKENWIRE_TEST_NO_SKIP, without them
    model, said = tiny_served.load(max_guesses=K, max_verify_rows=2), _Said()
    log = logging.getLogger("engine.jax_backend.warm_up")
    level = log.level
    log.setLevel(logging.INFO)
    log.addHandler(said)
    try:
        with compile_events() as compiles:
            model.warm_up()
    finally:
        log.removeHandler(said)
        log.setLevel(level)
    return model, said.lines, compiles, model.compilations()


@pytest.fixture(scope="module")
def llama(warmed) -> JaxModel:
    return warmed[0]


def _shuffled_pages(model: JaxModel, rng: np.random.Generator) -> None:
    """Every slot a whole context of pages, drawn at random from the pool (no two slots share one)."""
    w = CONTEXT // model.kv.page_size
    pages = rng.permutation(np.arange(1, model.kv.num_pages))
    for slot in range(model.info.max_batch_size):
        model.set_pages(slot, pages[slot * w : (slot + 1) * w].tolist())


def _setup(slot: int, temperature: float = 0.0, seed: int = 0, **kw) -> SlotSetup:
    top = 3 if slot == 1 else 0  # one sequence asks for alternatives
    return SlotSetup(SamplingParams(temperature=temperature, seed=seed, top_logprobs=top, **kw), frozenset())


def _plain(model: JaxModel, n: int) -> list[list]:
    """Each prompt's first n samples by prefill and plain decode steps (slot = prompt index)."""
    runs = [[model.prefill(slot, p, _setup(slot), False)] for slot, p in enumerate(PROMPTS)]
    for i in range(n - 1):
        outs = model.decode([DecodeInput(slot, None, len(p) + i, False) for slot, p in enumerate(PROMPTS)])
        for run, sample in zip(runs, outs):
            run.append(sample)
    for slot in range(len(PROMPTS)):
        model.release(slot)
    return runs


def _speculated(
    model: JaxModel, plain: list[list], rng: np.random.Generator, some: bool
) -> tuple[list[list], list[int], set[int], int]:
    """The same prompts through verify calls with random guesses (module docstring), some behind a
    plain step still in flight, plain decode steps in between, `some` slots each time (else every one still short of STEPS); -> each
    prompt's samples, each accepted run's guess count, the calls' guess counts, and how many rows
    fed tokens on both sides of a page boundary. A call's first
    row has its call's count of guesses, the others a random count up to it: K, one guess bucket,
    except in a `some` run's calls of two rows, which take 1, 2 and K in turn, so the guess
    buckets' ladder is walked at one row bucket, not at each (fewer shapes)."""
    runs = [[model.prefill(slot, p, _setup(slot), False)] for slot, p in enumerate(PROMPTS)]
    accepted, tops, ladder, crossed, behind = [], set(), itertools.cycle((1, 2, K)), 0, 0
    while min(len(r) for r in runs) < STEPS:
        short = [s for s in range(len(PROMPTS)) if len(runs[s]) < STEPS]
        slots = [s for s in short if not some or rng.random() < 0.7] or short[:1]
        at = {s: len(PROMPTS[s]) + len(runs[s]) - 1 for s in slots}  # each slot's next free position
        if rng.random() < 0.2:
            outs = model.decode([DecodeInput(s, None, at[s], False) for s in slots])
            for s, sample in zip(slots, outs):
                runs[s].append(sample)
            continue
        # a third of the calls go behind a plain step of their slots still in flight (the
        # scheduler's ahead guesses): fed that step's sample, one position on
        ahead = int(rng.random() < 0.3)
        if ahead:
            model.dispatch([DecodeInput(s, None, at[s], False) for s in slots])
        inputs, top = [], next(ladder) if some and len(slots) == 2 else K  # the call's guess count
        tops.add(top)
        for row, s in enumerate(rng.permutation(slots).tolist()):
            n, count = len(runs[s]) + ahead, int(rng.integers(0, top + 1)) if row else top
            guesses = [x.token_id for x in plain[s][n : n + count]]
            if guesses and rng.random() < 0.5:  # one wrong guess
                guesses[int(rng.integers(len(guesses)))] = int(rng.integers(model.info.vocab_size))
            inputs.append(VerifyInput(s, at[s] + ahead, tuple(guesses), False))
            crossed += (at[s] + ahead) // model.kv.page_size != (at[s] + ahead + len(guesses)) // model.kv.page_size
        verified = model.verify(inputs)
        if ahead:
            behind += 1
            for s, sample in zip(slots, model.collect()):
                runs[s].append(sample)
        for i, run in zip(inputs, verified):
            assert 1 <= len(run) <= len(i.guesses) + 1
            runs[i.slot].extend(run)
            accepted.append(len(run) - 1)
    for slot in range(len(PROMPTS)):
        model.release(slot)
    assert behind >= 3, behind  # verify calls behind a step in flight
    return runs, accepted, tops, crossed


@pytest.mark.parametrize("name, weights", [("tiny-llama", "float32"), ("tiny-llama", "int8"), ("tiny-gemma3", "float32")])
def test_greedy_verify_runs_are_plain_greedy_decoding_sample_for_sample(name, weights, request):
    first = (name, weights) == ("tiny-llama", "float32")  # the thorough one: some slots per call
    # the others: 4 slots all in one row bucket (every call's rows are padded to 4: one decode and
    # one verify row shape; greedy verify equals decode at any row bucket, the thorough case's claim)
    model = request.getfixturevalue("llama") if first else _load(name, weights, rows=4)
    rng = np.random.default_rng(45)
    _shuffled_pages(model, rng)
    plain = _plain(model, STEPS + K + 2)
    _shuffled_pages(model, rng)  # other pages: what the plain run left in them does not matter
    runs, accepted, tops, crossed = _speculated(model, plain, rng, some=first)
    assert crossed >= 3, crossed  # verify rows whose KV writes go on in another (shuffled) page
    assert tops == ({1, 2, K} if first else {K})  # the guess buckets: all (1, 2, 4) in the thorough run
    for slot, (got, want) in enumerate(zip(runs, plain)):
        assert STEPS <= len(got) < len(want)
        differs = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        assert differs is None, f"slot {slot} differs from sample {differs} on"
    assert any(r.top_logprobs for r in runs[1]) and all(r.top_logprobs for r in runs[1])
    assert max(accepted) == K and 0 in accepted  # whole runs taken, and runs cut at their first guess


def test_sampled_verify_draws_plain_samplings_ids_for_the_same_seed(llama):
    model = llama
    _shuffled_pages(model, np.random.default_rng(0))
    prompt, n = PROMPTS[0], 24
    setup = SlotSetup(SamplingParams(temperature=1.3, top_k=40, seed=2**40 + 7), frozenset())
    plain = [model.prefill(0, prompt, setup, False)]
    for i in range(n + K):
        plain.append(model.decode([DecodeInput(0, None, len(prompt) + i, False)])[0])
    model.release(0)
    _shuffled_pages(model, rng := np.random.default_rng(1))
    got = [model.prefill(0, prompt, setup, False)]
    calls = 0
    while len(got) < n:
        m, calls = len(got), calls + 1
        guesses = [x.token_id for x in plain[m : m + K]]
        guesses[int(rng.integers(K))] = int(rng.integers(512))
        got.extend(model.verify([VerifyInput(0, len(prompt) + m - 1, tuple(guesses), False)])[0])
    model.release(0)
    assert got == plain[: len(got)]
    assert len(got) - 1 > 1.5 * calls  # right guesses are taken: more than one sample per call, on average


def test_sampled_acceptance_and_first_samples_follow_the_target_distribution(llama):
    """One position, DRAWS seeds (4 sequences at a time: a packed prefill, then one verify), a
    fixed guess g. Each prefill's sample is forced to the greedy one (every other id masked), so
    the verify's first sample s_0 is drawn after the same context every time, from the target q
    (temperature 0.8, top_k 8: exactly the softmax of the 8 best raw logprobs over 0.8, read from
    a greedy decode's alternatives there). s_0 follows q (chi-square), the runs that accept g are
    a share q(g) of all (binomial), and the rejected runs' s_0 follow q without g, renormalised."""
    draws, batch, temperature, model = 2048, 4, 0.8, llama
    rng = np.random.default_rng(0)
    _shuffled_pages(model, rng)
    prompt = PROMPTS[0]
    greedy = SlotSetup(SamplingParams(temperature=0.0, seed=0, top_logprobs=8), frozenset())
    forced = model.prefill(0, prompt, greedy, False).token_id
    ref = model.decode([DecodeInput(0, None, len(prompt), False)])[0]
    model.release(0)
    ids = np.array([i for i, _ in ref.top_logprobs])  # the 8 best ids after prompt + forced, best first
    q = np.exp(np.array([p for _, p in ref.top_logprobs], np.float64) / temperature)
    q /= q.sum()
    g = 1  # the guess: the second best id (its index in ids)
    others = frozenset(range(model.info.vocab_size)) - {forced}
    first, took = [], []
    for lo in range(0, draws, batch):
        _shuffled_pages(model, rng)
        params = [SamplingParams(temperature=temperature, top_k=8, seed=lo + s) for s in range(batch)]
        model.prefill_packed([PromptInput(s, prompt, SlotSetup(params[s], others), True) for s in range(batch)])
        runs = model.verify([VerifyInput(s, len(prompt), (int(ids[g]),), False) for s in range(batch)])
        first.extend(run[0].token_id for run in runs)
        took.extend(len(run) == 2 for run in runs)
        for s in range(batch):
            model.release(s)
    first, took = np.array(first), np.array(took)
    assert np.isin(first, ids).all()  # top_k 8: nothing else is ever drawn
    assert (took == (first == ids[g])).all()  # g is taken exactly when s_0 is g
    counts = (first[:, None] == ids[None]).sum(axis=0)  # [8]
    assert stats.chisquare(counts, q * draws).pvalue > 1e-3, (counts, q * draws)
    assert stats.binomtest(int(took.sum()), draws, q[g]).pvalue > 1e-3, (took.sum(), q[g] * draws)
    rest = np.delete(counts, g)
    assert stats.chisquare(rest, np.delete(q, g) / (1 - q[g]) * rest.sum()).pvalue > 1e-3


def test_verify_refuses_what_the_contract_does_not_allow(llama):
    model = llama
    _shuffled_pages(model, np.random.default_rng(0))
    n, long = len(PROMPTS[0]), CONTEXT - 3
    model.prefill(0, PROMPTS[0], _setup(0), False)
    bad = {
        "past max_guesses 4": VerifyInput(0, n, (1,) * (K + 1), False),
        "outside the vocabulary": VerifyInput(0, n, (model.info.vocab_size,), False),
        "not the slot's next one": VerifyInput(0, n + 1, (1,), False),
        "not prefilled": VerifyInput(1, 0, (), False),
    }
    for problem, i in bad.items():
        with pytest.raises(ModelUsageError, match=problem):
            model.verify([i])
    model.prefill(1, (5,) * long, _setup(0), False)
    with pytest.raises(ModelUsageError, match="past the context"):
        model.verify([VerifyInput(1, long, (1, 2, 3), False)])
    page = model.kv.page_size
    model.prefill(2, (7,) * (page - 2), _setup(0), False)
    model.set_pages(2, model._slots.tables[2][:1].tolist())  # a page for the first `page` positions only
    with pytest.raises(ModelUsageError, match="no page"):
        model.verify([VerifyInput(2, page - 2, (1, 2, 3), False)])  # its guesses reach position page + 1
    runs = model.verify([VerifyInput(1, long, (1, 2), False), VerifyInput(0, n, (1, 2), False)])  # still serving
    assert [1 <= len(r) <= 3 for r in runs] == [True, True]
    for slot in range(3):
        model.release(slot)
    off = JaxModel.load(ASSETS / "tiny-llama", max_batch_size=1, max_context_length=CONTEXT, dtype="float32")
    assert off.max_guesses == 0 and off.verify_rows == ()
    with pytest.raises(ModelUsageError, match="max_guesses 0"):
        off.verify([VerifyInput(0, 1, (), False)])
    with pytest.raises(ValueError, match="max_guesses must be in 0..63"):
        _load("tiny-llama", "float32", guesses=64)


def test_warm_up_adds_a_verify_step_per_row_and_guess_bucket_and_nothing_compiles_after(warmed):
    """The compile budget of speculative decoding (tests/test_compile_budget.py has the others):
    max_guesses 4 adds one verify step per verify row bucket (the row buckets up to the one that
    holds max_verify_rows 2, each of R x 5 fed tokens within the CPU kernels' products of up to 64
    rows: 1 and 2), guess bucket (1, 2, 4) and attend shape (1) to the 43 of this configuration
    without it (the served options at 4 slots, a context of 64: 4 prompt buckets x 3, 3 rows x (the
    layers alone, the greedy step, the layers with the 8-token chunk), 3 rows x 2 samplers, the
    mask, 3 constrained-row writes, 4 packed sizes x (a layer, the last positions of 2 row buckets):
    support.tiny_served's 43, read back from the run's compilation cache where another file warmed
    them first). Counted in jit's caches, announced the same by warm-up's log, bounded in JAX's
    compile events (at most a few of jnp's helpers beyond the 49), and after warm-up a verify of
    each row bucket, and one of 3 rows (two steps), compiles nothing. tests/test_compile_budget.py
    lowers this configuration without compiling it and counts the same 49 programs: what its lowered
    counts rely on."""
    model, said, compiles, compiled = warmed
    assert model.verify_rows == (1, 2) and model.guess_buckets == (1, 2, 4) and model.attend_buckets == (64,)
    assert compiled == 4 * 3 + 3 * 3 + 3 * 2 + 1 + 3 + 4 * 3 + 2 * 3 == 49
    assert said[0] == "warm-up: compiling 49 shapes", said
    counts = [(int(m[1]), int(m[2])) for line in said[1:] if (m := re.match(r"warm-up: compiled (\d+) of (\d+) shapes", line))]
    assert len(counts) == len(said) - 1 >= 4 and {n for _, n in counts} == {49} and counts[-1][0] == 49, said
    assert len([c for c in compiles if "backend_compile" in c]) <= 49 + 4
    _shuffled_pages(model, np.random.default_rng(3))
    for slot in range(3):
        model.prefill(slot, (1, 2, 3), _setup(0), False)
    before = model.compilations()  # (compiled, unless another test here compiled a shape warm-up left out)
    with compile_events() as after:
        at = [3, 3, 3]  # each slot's next position
        # (slot, guesses) per call: rows 1, 2 and 3 (a step of 2, then of 1), guesses 4, 2 and 1
        for call in ([(0, (4, 5, 6, 7))], [(1, (9, 9)), (0, ())], [(2, (8,)), (1, ()), (0, ())]):
            runs = model.verify([VerifyInput(slot, at[slot], guesses, False) for slot, guesses in call])
            for (slot, _), run in zip(call, runs):
                at[slot] += len(run)
    for slot in range(3):
        model.release(slot)
    assert model.compilations() == before == compiled and not [c for c in after if "backend_compile" in c], after
