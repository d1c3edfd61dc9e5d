"""Top log-probabilities from the engine up (what the HTTP front's `top_logprobs` rests on):
the JAX sampling step's top-k, the real model computing it inside its compiled step with no
compile after warm-up, and the decode contract's validation and Token field (invariant 16)."""

from __future__ import annotations

import grpc
import jax
import numpy as np
import pytest

from engine.core.model import DecodeInput, SlotSetup
from engine.core.request import MAX_TOP_LOGPROBS, SamplingParams
from engine.jax_backend import sampling
from support import tiny_served
from support.pages import own_pages_all
from services.client import decode_request


def test_top_logprobs_are_the_best_ids_of_the_raw_distribution_and_skipped_when_nobody_asks():
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 3, (3, 64)).astype(np.float32)
    logits[1, [5, 9]] = 50.0  # a tie: the lower id first
    top = jax.jit(sampling.top_logprobs)
    ids, logprobs = (np.asarray(a) for a in top(logits, np.array([2, 0, 20], np.int32)))
    raw = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    assert ids.shape == logprobs.shape == (3, MAX_TOP_LOGPROBS)
    for row in range(3):
        want = np.argsort(-raw[row], kind="stable")[:MAX_TOP_LOGPROBS]
        np.testing.assert_array_equal(ids[row], want)
        np.testing.assert_allclose(logprobs[row], raw[row, want], atol=1e-5)
    assert list(ids[1, :2]) == [5, 9]
    ids, logprobs = top(logits, np.zeros(3, np.int32))  # no row asks: the branch that computes nothing
    assert not np.asarray(ids).any() and not np.asarray(logprobs).any()


def test_the_real_model_reports_top_logprobs_per_slot_with_no_compile_after_warm_up():
    # support.tiny_served's configuration, which other files warm up too: read back from the run's
    # compilation cache (the claim is about whatever shapes warm-up compiled, two slots are used)
    model = tiny_served.load()
    model.warm_up()
    compiled = model.compilations()
    own_pages_all(model)
    asks = model.prefill(0, [1, 5, 7, 9], SlotSetup(SamplingParams(seed=1, top_logprobs=5), frozenset()), False)
    plain = model.prefill(1, [1, 5, 7], SlotSetup(SamplingParams(seed=1), frozenset()), False)
    samples = [asks, plain] + model.decode([DecodeInput(0, asks.token_id, 4, False), DecodeInput(1, plain.token_id, 3, False)])
    for sample in samples[::2]:  # slot 0, greedy: its token is the best alternative, with the same logprob
        assert len(sample.top_logprobs) == 5
        assert sample.top_logprobs[0][0] == sample.token_id
        assert sample.top_logprobs[0][1] == pytest.approx(sample.logprob, abs=1e-5)
        assert [p for _, p in sample.top_logprobs] == sorted((p for _, p in sample.top_logprobs), reverse=True)
    assert samples[1].top_logprobs == samples[3].top_logprobs == ()
    assert model.compilations() == compiled, "top_logprobs must not add a compiled shape"


async def test_the_decoder_sends_the_alternatives_and_refuses_out_of_range_counts(decoder):
    """The scripted model: the alternatives of token t are t, t + 1, ... (engine.core.scripted_model)."""
    request = decode_request([10], max_output_tokens=3, return_logprobs=True)
    request.top_logprobs = 2
    events = [e async for r in decoder.Decode(request) for e in r.events]
    tokens = [e.token for e in events if e.HasField("token")]
    assert [t.id for t in tokens] == [11, 12, 13]
    assert [[a.id for a in t.top_logprobs] for t in tokens] == [[11, 12], [12, 13], [13, 14]]
    assert all(t.top_logprobs[0].logprob == pytest.approx(t.logprob) for t in tokens)
    for count, logprobs, problem in ((MAX_TOP_LOGPROBS + 1, True, "at most"), (1, False, "return_logprobs")):
        bad = decode_request([10], max_output_tokens=1, return_logprobs=logprobs)
        bad.top_logprobs = count
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            [r async for r in decoder.Decode(bad)]
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "top_logprobs" in refused.value.details() and problem in refused.value.details()
