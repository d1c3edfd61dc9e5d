"""Chunked prefill: a prompt written into its slot over several `prefill_chunk` calls.

The model side (JaxModel on the tiny checkpoints, and once on the real model): blocked causal
attention equals the full reference; a prompt prefilled in uneven chunks (including a last piece
that would run past the context) gives the same greedy ids as one whole-prompt call; nothing
compiles after warm-up with chunks in the mix. The scheduler side (ScriptedModel): a long prompt
is read in chunks of `max_step_tokens`, with a decode step of the running streams after each,
while at least as many requests decode as wait, and its rest in one call once less than two
budgets are left (a short prompt beside running streams: one call, not a chunk and a call); a
burst of more waiting prompts than decoding streams is read whole; chunked and whole prefill send the same events; a request
cancelled mid-prefill frees its slot before the next step and sends nothing.
"""

from __future__ import annotations

import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.core.engine import Engine, EngineConfig
from engine.core.model import ChunkInput, DecodeInput, ModelUsageError, SlotSetup
from engine.core.request import Request, SamplingParams, StoppingCriteria
from engine.core.scripted_model import ScriptedModel
from support import real_served, tiny_served
from support.backend import require_cpu
from support.compile_watch import compile_events
from support.gated_steps import GatedSteps
from support.pages import own_pages
from support.recording_sink import Recorder
from engine.jax_backend import transformer
from engine.jax_backend.jax_model import JaxModel

ASSETS = Path(__file__).parent / "assets"
GREEDY = SlotSetup(SamplingParams(temperature=0.0, seed=0), frozenset())


# -- model side -------------------------------------------------------------------------------


class _Heads:
    n_heads, n_kv_heads, head_dim = 6, 2, 8
    attn_softcap = None  # (Gemma 2's soft-cap: none here)


@pytest.mark.parametrize(
    "context, page, block, chunk, start",
    [(64, 16, 16, 16, 0), (64, 8, 16, 16, 32), (100, 16, 32, 24, 70), (100, 4, 128, 7, 50), (100, 16, 8, 7, 50)],
)
def test_chunk_attention_equals_full_causal_attention(context, page, block, chunk, start):
    """Queries at start..start+C-1 over the slot's keys, read through a shuffled block table:
    the blocked online softmax (blocks that do not divide the context, a block larger than it or
    smaller than a page) matches softmax over every earlier key.
    Both run with full float32 products: a GPU's default for float32 dots is TensorFloat-32 (a
    10-bit mantissa), which alone put the two 1e-3 apart on an H200 (scripts/gpu_check)."""
    cfg = _Heads()
    rng = np.random.default_rng(start)
    w = -(-context // page)
    k_pages = rng.standard_normal((2, 2 * w + 1, page, 8)).astype(np.float32)  # [K, N, P, D], room for others' pages
    v_pages = rng.standard_normal((2, 2 * w + 1, page, 8)).astype(np.float32)
    table = rng.permutation(np.arange(1, 2 * w + 1))[:w].astype(np.int32)  # [W], pages in no order
    q = rng.standard_normal((chunk, 6, 8)).astype(np.float32)
    end = start + chunk
    k = np.asarray(transformer.gather_pages(k_pages, table))[:, :end].swapaxes(0, 1)[None]  # [1, A, K, D]
    v = np.asarray(transformer.gather_pages(v_pages, table))[:, :end].swapaxes(0, 1)[None]
    with jax.default_matmul_precision("float32"):
        got = transformer.chunk_attention(q, k_pages, v_pages, table, np.int32(start), cfg, block=block)
        want = transformer.attention(q[None], k, v, jnp.arange(start, end)[None], cfg)[0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)


def _greedy(model: JaxModel, prompt: tuple[int, ...], n: int, cuts: list[int] | None) -> tuple[list[int], float]:
    """Greedy ids of `prompt` in slot 1 (slot 0 holds another request), prefilled whole or cut
    at `cuts`; -> ids and the first token's logprob."""
    own_pages(model, 0), own_pages(model, 1)
    model.prefill(0, (5, 6, 7), GREEDY, masked=False)
    if cuts is None:
        first = model.prefill(1, prompt, GREEDY, masked=False)
    else:
        bounds = [0, *cuts, len(prompt)]
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            first = model.prefill_chunk(1, prompt, lo, hi, GREEDY, masked=False)
            assert (first is None) == (hi < len(prompt))
    ids = [first.token_id]
    for step in range(n - 1):
        ids.append(model.decode([DecodeInput(1, ids[-1], len(prompt) + step, False)])[0].token_id)
    model.release(0)
    model.release(1)
    return ids, first.logprob


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen3"])
def pair(request) -> tuple[JaxModel, JaxModel]:
    """The same checkpoint twice, in support.tiny_served's configuration (context 64, whose
    executables other files compile too: read back from the run's compilation cache): `whole`
    runs any prompt as one call (one bucket, the context); `chunked` has chunk buckets 8 and 16,
    so a prompt of more than 16 runs in several calls, and a last piece near the end of the
    context starts earlier to stay inside it (61 tokens cut at 50: the last call is 48-63). Equal ids from different chunkings are a float32 CPU claim
    (support.backend). tiny-llama's `chunked` is warmed up, for the claims that nothing compiles
    after warm-up: the shapes warm-up makes are the configuration's, which the checkpoints share;
    the other compiles as it runs. tiny-qwen3 is here for its 32-wide heads; tiny-qwen2 has
    tiny-llama's heads and adds only q/k/v biases and a tied head, which no chunking changes (its
    own goldens are test_transformer_parity's, its packed prompts test_packed_prefill's)."""
    require_cpu()
    whole = tiny_served.load(request.param, min_bucket=64, fused_chunk_tokens=0)
    chunked = tiny_served.load(request.param, max_chunk=16)
    assert whole.buckets == (64,) and chunked.buckets == (8, 16)
    chunked.warmed = request.param == "tiny-llama"
    if chunked.warmed:
        chunked.warm_up()  # `whole` is the reference only, and compiles the few shapes it runs as it runs them
    return whole, chunked


@pytest.mark.parametrize(
    "length, cuts", [(9, None), (40, None), (40, [7, 20, 33]), (61, [1, 2, 50]), (57, [16, 32, 48, 56])]
)
def test_chunked_prefill_gives_the_same_greedy_ids_on_tiny_checkpoints(pair, length, cuts):
    whole, chunked = pair
    prompt = tuple(int(t) for t in np.random.default_rng(length).integers(3, 250, length))
    n = min(8, 64 - length)
    want, want_logprob = _greedy(whole, prompt, n, None)
    got, got_logprob = _greedy(chunked, prompt, n, cuts)
    assert got == want
    assert abs(got_logprob - want_logprob) < 1e-4


@pytest.mark.parametrize("pair", ["tiny-llama"], indirect=True)  # the warmed-up one (pair's docstring)
def test_nothing_compiles_after_warm_up_with_chunks_in_the_mix(pair):
    _, model = pair
    before = model.compilations()
    with compile_events() as compiles:
        prompt = tuple(range(3, 58))
        _greedy(model, prompt, 3, [5, 6, 29, 50])
        _greedy(model, prompt[:23], 10, None)
        own_pages(model, 0)
        model.prefill_chunk(0, prompt, 0, 17, GREEDY, masked=False)  # cancelled mid-prefill
        model.release(0)
    assert model.compilations() == before
    assert compiles == []


def test_a_slot_mid_prefill_cannot_decode_or_skip_a_chunk(pair):
    _, model = pair
    prompt = tuple(range(3, 30))
    own_pages(model, 0)
    model.prefill_chunk(0, prompt, 0, 10, GREEDY, masked=False)
    with pytest.raises(ModelUsageError):
        model.decode([DecodeInput(0, 5, 10, False)])
    with pytest.raises(ModelUsageError):
        model.prefill_chunk(0, prompt, 11, 20, GREEDY, masked=False)
    model.release(0)
    own_pages(model, 0)
    assert model.prefill_chunk(0, prompt, 0, len(prompt), GREEDY, masked=False) is not None
    model.release(0)


def test_chunks_carried_by_decode_steps_change_no_id(pair):
    """A prompt whose chunks ride along with another slot's decode steps (`dispatch(inputs,
    chunk)`: one pass over the weights for both, a short chunk padded to a compiled size) gives
    the same greedy ids as one whole-prompt call, and the decoding slot gets the ids it gets
    alone; nothing compiles after warm-up."""
    whole, model = pair
    assert model.fused_chunk_tokens == 8 and model.fused_chunk_sizes == (8,)  # the CPU's default budget, the served smallest chunk
    prompt = tuple(int(t) for t in np.random.default_rng(7).integers(3, 250, 45))
    want, want_logprob = _greedy(whole, prompt, 6, None)

    def decode_slot_0(chunks) -> list[int]:
        own_pages(model, 0), own_pages(model, 1)
        ids = [model.prefill(0, (5, 6, 7), GREEDY, masked=False).token_id]
        for chunk in chunks:
            model.dispatch([DecodeInput(0, None, 2 + len(ids), False)], chunk)
            ids.append(model.collect()[0].token_id)
        return ids

    alone = decode_slot_0([None] * 6)
    model.release(0)
    with compile_events() as compiles:
        before = model.compilations()
        cuts = ((0, 8), (8, 16), (16, 24), (24, 32), (32, 40), (40, 43))  # the last of 3, padded to 8
        beside = decode_slot_0([ChunkInput(1, prompt, lo, hi, GREEDY) for lo, hi in cuts])
        first = model.prefill_chunk(1, prompt, 43, 45, GREEDY, masked=False)
        ids = [first.token_id]
        for step in range(5):
            ids.append(model.decode([DecodeInput(1, ids[-1], len(prompt) + step, False)])[0].token_id)
        model.release(0)
        model.release(1)
    assert beside == alone
    assert ids == want and abs(first.logprob - want_logprob) < 1e-4
    if model.warmed:
        assert model.compilations() == before and compiles == []
    own_pages(model, 0), own_pages(model, 1)
    model.prefill(0, (5, 6, 7), GREEDY, masked=False)
    with pytest.raises(ModelUsageError, match="last chunk"):  # a last chunk samples: it cannot ride along
        model.dispatch([DecodeInput(0, None, 3, False)], ChunkInput(1, prompt[:8], 0, 8, GREEDY))
    model.release(0)
    model.release(1)


@pytest.mark.real_model
def test_chunked_and_prefix_cached_prefill_give_the_same_greedy_ids_on_the_real_model(real_model):
    require_cpu()
    path = real_model
    # support.real_served's configuration (test_int8 compiles its float32 8-row decode step too):
    # a context of 512 and prompts of ~300 tokens, every piece size from 256 down, in fewer FLOPs
    # than a longer prompt (each whole read of the prompt is a float32 prefill of the 30 layers)
    model = real_served.load(path, weights="float32")
    rng = np.random.default_rng(0)
    prompt = tuple(int(t) for t in rng.integers(3, 49152, 300))
    want, want_logprob = _greedy(model, prompt, 8, None)  # 300 = 256 + 32 + 8 + 4
    got, got_logprob = _greedy(model, prompt, 8, [100, 157, 212])
    assert got == want
    assert abs(got_logprob - want_logprob) < 1e-3
    # its first 24 tokens in three chunks along with slot 0's decode steps, the rest in one call
    assert model.fused_chunk_tokens == 8 and model.fused_chunk_sizes == (8,)  # the CPU's default budget, the served smallest chunk
    own_pages(model, 0), own_pages(model, 1)
    fed = [model.prefill(0, (5, 6, 7), GREEDY, masked=False).token_id]
    for lo in (0, 8, 16):
        model.dispatch([DecodeInput(0, fed[-1], 2 + len(fed), False)], ChunkInput(1, prompt, lo, lo + 8, GREEDY))
        fed.append(model.collect()[0].token_id)
    first = model.prefill_chunk(1, prompt, 24, len(prompt), GREEDY, masked=False)
    got = [first.token_id]
    for step in range(7):
        got.append(model.decode([DecodeInput(1, got[-1], len(prompt) + step, False)])[0].token_id)
    model.release(0)
    model.release(1)
    assert got == want and abs(first.logprob - want_logprob) < 1e-3
    # a prompt sharing the first 200 tokens: its first 12 pages of 16 are the very pages that
    # hold `prompt`'s KV (a prefix hit: no copy), the rest computed into pages of its own
    other = prompt[:200] + tuple(int(t) for t in rng.integers(3, 49152, 90))
    want, want_logprob = _greedy(model, other, 8, None)
    pages = own_pages(model, 1)
    model.prefill(1, prompt, GREEDY, masked=False)
    model.release(1)
    hit, spare = 200 // 16, own_pages(model, 0)  # slot 0's pages, unused: the rest goes there
    model.release(0)
    model.set_pages(1, pages[:hit] + spare[hit:])
    first = model.prefill_chunk(1, other, hit * 16, len(other), GREEDY, masked=False)
    got = [first.token_id]
    for step in range(7):
        got.append(model.decode([DecodeInput(1, got[-1], len(other) + step, False)])[0].token_id)
    model.release(1)
    assert got == want
    assert abs(first.logprob - want_logprob) < 1e-3


# -- scheduler side ---------------------------------------------------------------------------




def _request(prompt, n) -> Request:
    return Request("r", tuple(prompt), stopping=StoppingCriteria(n))


def _beside_a_running_stream(fused: int, budget: int, running_n: int, prompt: list[int], n: int):
    """A stream of `running_n` tokens decoding, then `prompt` (n tokens) submitted beside it, with a
    step budget of `budget`; -> the model (its calls), and both recorders once both are done."""
    model = ScriptedModel(vocab_size=1000, max_batch_size=2, max_context_length=256, step_delay_s=0.002, fused_chunk_tokens=fused)
    engine = Engine(model, EngineConfig(max_step_tokens=budget))
    engine.start()
    try:
        running, other = Recorder(), Recorder()
        engine.submit(_request([10], running_n), running)
        assert running.started.wait(5)
        engine.submit(_request(prompt, n), other)
        assert other.done.wait(5) and running.done.wait(5)
    finally:
        engine.stop()
    return model, running, other


@pytest.mark.parametrize("fused", [0, 16], ids=["chunk-calls", "chunks-along-with-steps"])
def test_a_decoding_stream_keeps_getting_tokens_while_a_long_prompt_is_chunk_prefilled(fused):
    """Between any two chunks, one decode step of the running stream. With a model that takes a
    chunk along with a step, every chunk but the last goes with the step after it (one pass over
    the weights); the last, which samples the first token, is a call of its own."""
    long_prompt = [3] * 99 + [500]  # 100 tokens: chunks of 16, the last 20 in one (less than two budgets left)
    model, running, long = _beside_a_running_stream(fused, 16, 60, long_prompt, 3)
    chunks = [c for c in model.calls if c[0] == "prefill" and c[1] == 1]
    assert [(c[2], c[3]) for c in chunks] == [(i, i + 16) for i in range(0, 80, 16)] + [(80, 100)]
    at = [model.calls.index(c) for c in chunks]
    for a, b in zip(at[:-1], at[1:]):  # between any two chunks, one decode step of the running stream
        assert model.calls[a + 1 : b] == [("decode", (0,))]
    assert long.tokens == [501, 502, 503]  # its first token comes from the last chunk
    assert running.tokens == list(range(11, 71))
    assert model.fused_chunks == (len(chunks) - 1 if fused else 0)


@pytest.mark.parametrize("fused", [0, 8], ids=["chunk-calls", "chunks-along-with-steps"])
def test_a_short_prompt_beside_running_streams_is_one_call_not_a_chunk_and_a_call(fused):
    """10 tokens against a budget of 8, while a stream decodes: read whole in one iteration (its
    first token a step sooner), where a chunk of 8 would leave 2 for a call of their own a step on."""
    model, running, short = _beside_a_running_stream(fused, 8, 40, [3] * 9 + [600], 2)
    assert [c for c in model.calls if c[0] == "prefill" and c[1] == 1] == [("prefill", 1, 0, 10)]
    assert model.fused_chunks == 0
    assert short.tokens == [601, 602] and running.tokens == list(range(11, 51))


@pytest.mark.parametrize("fused", [0, 64], ids=["chunk-calls", "chunks-along-with-steps"])
@pytest.mark.parametrize("max_step_tokens", [0, 1, 5, 64])
def test_chunked_and_whole_prefill_send_the_same_events(max_step_tokens, fused):
    model = ScriptedModel(vocab_size=1000, max_batch_size=3, max_context_length=128, fused_chunk_tokens=fused)
    engine = Engine(model, EngineConfig(max_step_tokens=max_step_tokens))
    engine.start()
    try:
        sinks = [Recorder() for _ in range(4)]
        for i, sink in enumerate(sinks):
            engine.submit(_request(list(range(1, 20 * i + 3)) + [100 * i + 2], 5 + i), sink)
        assert all(s.done.wait(5) for s in sinks)
    finally:
        engine.stop()
    for i, sink in enumerate(sinks):
        assert sink.tokens == list(range(100 * i + 3, 100 * i + 3 + 5 + i))
        assert sink.batches[-1][-1].usage.prompt_tokens == 20 * i + 3


class GatedChunks(ScriptedModel):
    """Holds every prefill chunk that `holds(start)` picks until the test opens the gate."""

    def __init__(self, holds, **kw) -> None:
        super().__init__(**kw)
        self.holds = holds
        self.entered = threading.Event()
        self.gate = threading.Event()

    def prefill_chunk(self, slot, prompt_token_ids, start, end, setup, masked):
        if self.holds(start) and not self.gate.is_set():
            self.entered.set()
            assert self.gate.wait(10)
        return super().prefill_chunk(slot, prompt_token_ids, start, end, setup, masked)


def test_with_nothing_decoding_prompts_are_read_whole_and_the_budget_binds_once_as_many_decode():
    """Nobody waits on an idle engine, so the two long prompts that arrive together are read whole
    in one iteration, with no step between them; a third long prompt that arrives while a stream
    decodes (one waits, one decodes) gets chunks of the budget with a step between."""
    model = GatedChunks(lambda start: True, vocab_size=1000, max_batch_size=3, max_context_length=256,
                        step_delay_s=0.002)  # the first call; steps slow enough that the first still decodes
    engine = Engine(model, EngineConfig(max_step_tokens=16))
    engine.start()
    try:
        gate_holder, first, second, third = Recorder(), Recorder(), Recorder(), Recorder()
        engine.submit(_request([7], 1), gate_holder)  # ends at its prefill: nothing decodes after it
        assert model.entered.wait(5)
        engine.submit(_request([3] * 59 + [100], 150), first)
        engine.submit(_request([4] * 49 + [200], 1), second)  # ends at its prefill, so its slot is free for the third
        model.gate.set()
        assert first.started.wait(5) and second.done.wait(5)
        engine.submit(_request([5] * 49 + [300], 3), third)
        assert first.done.wait(5) and third.done.wait(5)
    finally:
        engine.stop()
    assert first.tokens == list(range(101, 251)) and second.tokens == [201] and third.tokens == [301, 302, 303]
    prefills = [c for c in model.calls if c[0] == "prefill"]
    assert prefills[:3] == [("prefill", 0, 0, 1), ("prefill", 0, 0, 60), ("prefill", 1, 0, 50)]  # both whole
    assert model.calls.index(prefills[2]) == model.calls.index(prefills[1]) + 1  # in one iteration
    chunks = [c for c in prefills[3:] if c[1] == 1]
    assert [(c[2], c[3]) for c in chunks] == [(0, 16), (16, 32), (32, 50)]  # the last 18: less than two budgets
    at = [model.calls.index(c) for c in chunks]
    for a, b in zip(at[:-1], at[1:]):
        assert model.calls[a + 1 : b] == [("decode", (0,))]


@pytest.mark.parametrize("fused", [0, 16], ids=["chunk-calls", "chunks-along-with-steps"])
def test_a_burst_of_prompts_beside_fewer_streams_is_read_whole_before_the_next_step(fused):
    """One stream decodes; three long prompts arrive together (a burst: more wait than decode).
    The budget would read them 16 tokens a step, one after another, while the stream runs to its
    end; instead the iteration that admits them reads all three whole, and the next step carries
    the four streams together."""
    model = GatedSteps(lambda step: step == 2, vocab_size=1000, max_batch_size=4, max_context_length=256,
                       fused_chunk_tokens=fused)
    engine = Engine(model, EngineConfig(max_step_tokens=16))
    engine.start()
    try:
        running, burst = Recorder(), [Recorder() for _ in range(3)]
        engine.submit(_request([10], 30), running)
        assert model.entered.wait(5)  # its second step is held: the burst arrives meanwhile
        for i, sink in enumerate(burst):
            engine.submit(_request([3 + i] * 63 + [100 * (i + 2)], 4), sink)
        model.gate.set()
        assert running.done.wait(5) and all(s.done.wait(5) for s in burst)
    finally:
        engine.stop()
    prefills = [c for c in model.calls if c[0] == "prefill"]
    assert prefills[1:] == [("prefill", slot, 0, 64) for slot in (1, 2, 3)]  # each whole
    at = [model.calls.index(c) for c in prefills[1:]]
    assert at == [at[0], at[0] + 1, at[0] + 2]  # no step between them
    assert model.calls[at[-1] + 1][0] == "decode" and set(model.calls[at[-1] + 1][1]) >= {1, 2, 3}
    assert [s.tokens for s in burst] == [list(range(100 * (i + 2) + 1, 100 * (i + 2) + 5)) for i in range(3)]
    assert running.tokens == list(range(11, 41))


@pytest.mark.parametrize("fused", [0, 8], ids=["chunk-calls", "chunks-along-with-steps"])
def test_cancelling_during_a_chunked_prefill_frees_the_slot_before_the_next_step(fused):
    """(With chunks along with steps, the second chunk is held inside the step that carries it.)"""
    model = GatedChunks(
        lambda start: start > 0, vocab_size=1000, max_batch_size=2, max_context_length=256, step_delay_s=0.002,
        fused_chunk_tokens=fused,
    )
    engine = Engine(model, EngineConfig(max_step_tokens=8))
    engine.start()
    try:
        running, cancelled, after = Recorder(), Recorder(), Recorder()
        engine.submit(_request([900], 50), running)  # decoding, so the budget binds
        assert running.started.wait(5)
        ticket = engine.submit(_request(range(1, 60), 5), cancelled)
        assert model.entered.wait(5)  # inside its second chunk
        engine.abort(ticket)
        engine.submit(_request([40], 2), after)  # waits for the slot
        model.gate.set()
        assert after.done.wait(5) and running.done.wait(5)
    finally:
        engine.stop()
    assert cancelled.batches == []  # no event for it, ever
    assert after.tokens == [41, 42]
    prefills = [c for c in model.calls if c[0] == "prefill" and c[1] == 1]
    assert prefills[:2] == [("prefill", 1, 0, 8), ("prefill", 1, 8, 16)]  # no chunk after the cancel
    assert prefills[2] == ("prefill", 1, 0, 1)  # the slot went to the next request
    assert model.slots_held == 0 and engine.stats().slots_in_use == 0


@pytest.mark.parametrize("fused", [0, 4], ids=["chunk-calls", "chunks-along-with-steps"])
def test_cancelling_between_chunks_frees_the_slot(fused):
    model = ScriptedModel(vocab_size=1000, max_batch_size=2, max_context_length=512, step_delay_s=0.01, fused_chunk_tokens=fused)
    engine = Engine(model, EngineConfig(max_step_tokens=4))
    engine.start()
    try:
        running, cancelled = Recorder(), Recorder()
        engine.submit(_request([10], 200), running)
        assert running.started.wait(5)
        ticket = engine.submit(_request(range(1, 400), 5), cancelled)
        while sum(1 for c in model.calls if c[0] == "prefill" and c[1] == 1) < 3:
            threading.Event().wait(0.005)
        engine.abort(ticket)
        while engine.stats().slots_in_use != 1:
            threading.Event().wait(0.005)
        chunks = sum(1 for c in model.calls if c[0] == "prefill" and c[1] == 1)
        threading.Event().wait(0.05)
        assert sum(1 for c in model.calls if c[0] == "prefill" and c[1] == 1) == chunks  # no more chunks
        assert running.done.wait(5) and running.tokens == list(range(11, 211))
    finally:
        engine.stop()
    assert cancelled.batches == [] and model.slots_held == 0
    assert (model.fused_chunks >= 3) == bool(fused)
