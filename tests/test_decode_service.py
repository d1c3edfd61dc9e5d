"""Stream invariants through a real Decoder server on loopback, driven by the scripted model.

The scripted model counts: after token t comes t + 1 (mod 1000). EOS is 2. So a prompt ending
in 0 samples 1 at prefill, then 2 = EOS; a prompt ending in 1 samples EOS at prefill.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from protos.decode.v1 import decode_pb2 as pb
from support.waiting import steps_until_freed

STOP, LENGTH = pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH


def request(prompt, max_output_tokens=None, **stopping) -> pb.DecodeRequest:
    crit = pb.StoppingCriteria(**stopping)
    if max_output_tokens is not None:
        crit.max_output_tokens = max_output_tokens
    return pb.DecodeRequest(prompt_token_ids=prompt, stopping=crit)


async def collect(decoder, req) -> tuple[list[int], pb.Finished, list[pb.DecodeResponse]]:
    """Run a Decode and check the structural invariants every stream must hold."""
    responses = [r async for r in decoder.Decode(req)]
    events = [e for r in responses for e in r.events]
    assert all(r.events for r in responses), "a DecodeResponse must never be empty"
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds.count("finished") == 1 and kinds[-1] == "finished", kinds
    finished = events[-1].finished
    tokens = [e.token.id for e in events[:-1]]
    assert finished.reason in (STOP, LENGTH)
    assert finished.usage.completion_tokens == len(tokens)
    assert finished.usage.prompt_tokens == len(req.prompt_token_ids)
    assert finished.HasField("stop_token_id") == (finished.reason == STOP)
    return tokens, finished, responses


@pytest.mark.parametrize("n", [1, 2, 3, 7])
async def test_max_output_tokens_n_gives_exactly_n_tokens(decoder, scripted_model, n):
    tokens, finished, _ = await collect(decoder, request([10], n))
    assert tokens == list(range(11, 11 + n))
    assert finished.reason == LENGTH


async def test_n_equal_1_never_takes_a_decode_step(decoder, scripted_model):
    await collect(decoder, request([10], 1))
    assert scripted_model.prefills == 1 and scripted_model.decode_steps == 0


async def test_eos_at_prefill_gives_no_tokens_and_never_decodes(decoder, scripted_model):
    tokens, finished, _ = await collect(decoder, request([5, 1], 5))
    assert tokens == []
    assert (finished.reason, finished.stop_token_id, finished.usage.completion_tokens) == (STOP, 2, 0)
    assert scripted_model.decode_steps == 0


async def test_eos_mid_stream_is_not_sent_or_counted(decoder):
    tokens, finished, _ = await collect(decoder, request([997], 10))  # 998, 999, 0, 1, then EOS 2
    assert tokens == [998, 999, 0, 1]
    assert (finished.reason, finished.stop_token_id) == (STOP, 2)


async def test_control_token_exactly_at_the_cap_stop_wins(decoder):
    # 0 then 1 then 2=EOS: with a cap of 3 the third token is EOS -> STOP, 2 tokens, EOS not sent
    tokens, finished, _ = await collect(decoder, request([999], 3))
    assert tokens == [0, 1]
    assert finished.reason == STOP and finished.usage.completion_tokens == 2


async def test_token_reaching_the_cap_is_output(decoder):
    tokens, finished, _ = await collect(decoder, request([999], 2))  # 0, 1 then cap; EOS would be next
    assert tokens == [0, 1] and finished.reason == LENGTH


async def test_stop_token_ids_stop_and_are_not_sent(decoder):
    tokens, finished, _ = await collect(decoder, request([10], 10, stop_token_ids=[13, 500]))
    assert tokens == [11, 12]
    assert (finished.reason, finished.stop_token_id) == (STOP, 13)


async def test_ignore_eos_makes_eos_an_ordinary_token(decoder):
    tokens, finished, _ = await collect(decoder, request([999], 5, ignore_eos=True))
    assert tokens == [0, 1, 2, 3, 4]
    assert finished.reason == LENGTH


async def test_ignore_eos_still_honours_stop_token_ids(decoder):
    tokens, finished, _ = await collect(decoder, request([999], 10, ignore_eos=True, stop_token_ids=[4]))
    assert tokens == [0, 1, 2, 3]
    assert (finished.reason, finished.stop_token_id) == (STOP, 4)


async def test_large_n_with_ignore_eos(decoder):
    tokens, finished, _ = await collect(decoder, request([1], 60, ignore_eos=True))
    assert tokens == list(range(2, 62)) and finished.reason == LENGTH


async def test_unset_cap_runs_to_the_context_limit(decoder, scripted_model):
    tokens, finished, _ = await collect(decoder, request([3, 4], ignore_eos=True))
    assert len(tokens) == scripted_model.info.max_context_length - 2
    assert finished.reason == LENGTH


async def test_min_output_tokens_masks_control_tokens(decoder):
    # prompt ends in 1: EOS (2) would come at prefill; masked, the model skips to 3
    tokens, finished, _ = await collect(decoder, request([1], 5, min_output_tokens=1))
    assert tokens == [3, 4, 5, 6, 7]
    assert finished.reason == LENGTH


async def test_logprobs_only_when_asked(decoder):
    req = request([10], 3)
    _, _, plain = await collect(decoder, req)
    assert not any(e.token.HasField("logprob") for r in plain for e in r.events[:-1])
    req.return_logprobs = True
    _, _, with_lp = await collect(decoder, req)
    lps = [round(e.token.logprob, 5) for r in with_lp for e in r.events if e.HasField("token")]
    assert lps == [-0.1, -0.2, -0.3]  # scripted: -(t % 10) / 10 for t = 11, 12, 13


async def test_get_model_info(decoder, scripted_model):
    info = await decoder.GetModelInfo(pb.GetModelInfoRequest())
    assert (info.vocab_size, info.max_context_length, list(info.eos_token_ids), info.max_batch_size) == (
        1000, 64, [2], 4
    )


async def test_concurrent_streams_each_hold_their_invariants(decoder):
    # More than the 4 slots, so some wait; no more than the 8 the queue holds, so none is refused
    # even when every request arrives before the scheduler admits the first (a busy machine).
    reqs = [request([10 * i + 3], 1 + i % 5) for i in range(8)]
    results = await asyncio.gather(*(collect(decoder, r) for r in reqs))
    for i, (tokens, finished, _) in enumerate(results):
        first = 10 * i + 4
        assert tokens == list(range(first, first + 1 + i % 5))


# Cancelling must end a request long before it would end on its own, or these tests prove
# nothing. The conftest model has a 64-token context, so [10] with ignore_eos and no cap runs 63
# tokens: the prefill and 62 decode steps, 6.2 s at 0.1 s a step. A cancel or deadline must free
# the slot within 20 decode steps (2 s, a third of that), counted by the model, so a busy machine
# that is slow elsewhere (while the engine is idle) cannot fail it, and a cancel that does nothing
# (the request runs all 62 steps) cannot pass it.
SLOW_STEP_S = 0.1
NATURAL_STEPS = 62
FREED_WITHIN_STEPS = 20


async def slot_freed(decode_server, scripted_model, at_most: int) -> int:
    """support.waiting.steps_until_freed on the engine's and the model's slots: the model's decode
    steps by then (the fixture's model is fresh: counted from 0)."""
    return await steps_until_freed(
        lambda: decode_server.engine.stats().slots_in_use or scripted_model.slots_held,
        lambda: scripted_model.decode_steps, 0, at_most, limit_s=2 * NATURAL_STEPS * SLOW_STEP_S,
    )


async def test_client_cancel_frees_the_slot(scripted_model, decode_server, decoder):
    scripted_model.step_delay_s = SLOW_STEP_S
    call = decoder.Decode(request([10], ignore_eos=True))
    assert (await call.read()).events[0].token.id == 11  # the request holds a slot and is streaming
    assert decode_server.engine.stats().slots_in_use == 1
    call.cancel()
    await slot_freed(decode_server, scripted_model, FREED_WITHIN_STEPS)  # else the cancel did not end it
    assert decode_server.engine.stats().queue_depth == 0


async def test_deadline_frees_the_slot(scripted_model, decode_server, decoder):
    scripted_model.step_delay_s = SLOW_STEP_S
    tokens = []
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for response in decoder.Decode(request([10], ignore_eos=True), timeout=0.5):  # ~5 steps
            tokens += [e.token.id for e in response.events if e.HasField("token")]
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert tokens[:1] == [11], "the request never streamed, so its deadline freed nothing"
    await slot_freed(decode_server, scripted_model, FREED_WITHIN_STEPS)  # else the deadline did not end it


async def test_clients_stream_events_and_leaving_early_cancels(scripted_model, decode_server):
    from services.client import AsyncDecodeClient, DecodeClient

    target = f"127.0.0.1:{decode_server.port}"
    scripted_model.step_delay_s = SLOW_STEP_S

    def sync_first_two() -> list:
        with DecodeClient(target) as client:
            events = list(client.decode([10], max_output_tokens=3))  # the prefill and 2 decode steps
            assert [e.token.id for e in events[:-1]] == [11, 12, 13] and events[-1].HasField("finished")
            stream = client.decode([10], ignore_eos=True)
            first = [next(stream), next(stream)]
            stream.close()  # leaving early cancels the call
            return first

    assert [e.token.id for e in await asyncio.to_thread(sync_first_two)] == [11, 12]
    async with AsyncDecodeClient(target) as client:
        stream = client.decode([10], ignore_eos=True)
        assert (await stream.__anext__()).token.id == 11
        await stream.aclose()
    # 2 steps for the first request, then the two early leavers together within FREED_WITHIN_STEPS
    # (about 3 when their cancels work); either one left running takes the count to 2 + NATURAL_STEPS
    await slot_freed(decode_server, scripted_model, 2 + FREED_WITHIN_STEPS)  # else a leaver was not cancelled
