"""Clients that leave: the HTTP front cancels the text and decode calls and frees the slot.

The stack (tests/support/openai_stack.py) runs on its own thread; the clients here are real HTTP
clients (httpx, as the openai SDK uses) on the test's loop. "Nothing left behind" is read from
every layer: the front's in-flight gauge and its event loop's tasks, the text service's
admissions, the decode engine's slots and queue, and the scripted model's held slots. How soon a
place is freed is counted in the scripted model's decode steps, not in seconds; what must be gone
in the end is waited for with a bound that only a leak reaches (it never goes).
"""

from __future__ import annotations

import asyncio
import random

import httpx2 as httpx
import pytest

from tests.support.openai_stack import MODEL_NAME, Stack
from tests.support.waiting import until_answer

CHAT = [{"role": "user", "content": "hello there"}]
IDLE = {"api_in_flight": 0, "text_admitted": 0, "decode_slots": 0, "decode_queue": 0, "model_slots": 0}


def body(stream: bool, max_tokens: int | None = None) -> dict:
    return {"model": MODEL_NAME, "messages": CHAT, "stream": stream, "max_tokens": max_tokens}


# A request that leaves is cancelled through the front, the text service and the decode stream
# within a few decode steps (2-3 when it works); left running, the answer below takes ~500.
FREED_WITHIN_STEPS = 20


async def wait_until(stack: Stack, check, what: str, *, steps_since: int | None = None) -> dict:
    """Poll the stack's leftovers until `check(leftovers)` (bounded). With `steps_since`, fail as
    soon as more than FREED_WITHIN_STEPS of the model's decode steps have passed since then."""
    now: dict = {}

    async def reached() -> bool:
        nonlocal now
        now = await asyncio.to_thread(stack.leftovers)
        if check(now):
            return True
        if steps_since is not None:
            taken = stack.model.decode_steps - steps_since
            assert taken <= FREED_WITHIN_STEPS, f"{what}: still held {taken} decode steps on: {now}"
        return False

    await until_answer(reached, True, what, interval_s=0.02)
    return now


def idle(baseline_tasks: int):
    return lambda now: {k: now[k] for k in IDLE} == IDLE and now["tasks"] <= baseline_tasks


@pytest.mark.parametrize("stream", [True, False])
async def test_a_client_that_leaves_while_queued_or_decoding_frees_its_place_within_a_few_steps(stream):
    """One slot: the first request decodes (a ~500-step answer at 50 ms a step), the second waits
    in the decode queue. Each leaves in turn; its place is free within FREED_WITHIN_STEPS decode
    steps of the first (which keeps stepping until it leaves itself)."""
    with Stack(step_delay_s=0.05, max_batch_size=1) as stack:
        baseline = stack.leftovers()["tasks"]
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
            decoding = asyncio.create_task(http.post("/chat/completions", json=body(stream)))
            await wait_until(stack, lambda now: now["model_slots"] == 1, "the first request decodes")
            queued = asyncio.create_task(http.post("/chat/completions", json=body(stream)))
            await wait_until(stack, lambda now: now["decode_queue"] == 1, "the second request waits")
            left_at = stack.model.decode_steps
            queued.cancel()  # the client goes away while its request waits for a slot
            await asyncio.gather(queued, return_exceptions=True)
            await wait_until(stack, lambda now: now["decode_queue"] == 0 and now["text_admitted"] == 1,
                             "the queued request's place freed", steps_since=left_at)
            left_at = stack.model.decode_steps
            decoding.cancel()  # and while its answer is being decoded
            await asyncio.gather(decoding, return_exceptions=True)
            await wait_until(stack, lambda now: now["model_slots"] == 0 and now["decode_slots"] == 0,
                             "the decoding request's slot freed", steps_since=left_at)
        await wait_until(stack, idle(baseline), "nothing left behind")
        assert stack.model.decode_steps < 200, "the first answer was cut short, not run to its end"


async def test_100_concurrent_streams_with_random_disconnects_leave_nothing_behind():
    rng = random.Random(16)
    with Stack(step_delay_s=0.005, max_batch_size=8, max_queue_size=128) as stack:
        baseline = stack.leftovers()["tasks"]
        finished = []
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)

        async with httpx.AsyncClient(base_url=stack.url, timeout=60, limits=limits) as http:

            async def one(mode: str, max_tokens: int, leave_after: float, lines_before_leaving: int) -> None:
                if mode == "read to the end":
                    async with http.stream("POST", "/chat/completions", json=body(True, max_tokens)) as response:
                        lines = [line async for line in response.aiter_lines() if line]
                    assert response.status_code == 200 and lines[-1] == "data: [DONE]"
                    finished.append(max_tokens)
                elif mode == "leave mid-stream":
                    async with http.stream("POST", "/chat/completions", json=body(True, max_tokens)) as response:
                        seen = 0
                        async for line in response.aiter_lines():
                            seen += bool(line)
                            if seen >= lines_before_leaving:
                                break  # leaving the block closes the connection
                else:  # leave before the first byte (queued or prefilling), streamed or not
                    request = asyncio.create_task(http.post("/chat/completions", json=body(mode == "leave early, streamed", max_tokens)))
                    await asyncio.sleep(leave_after)
                    request.cancel()
                    await asyncio.gather(request, return_exceptions=True)

            modes = ["read to the end", "leave mid-stream", "leave early, streamed", "leave early, not streamed"]
            await asyncio.gather(*(
                one(rng.choice(modes), rng.randint(4, 60), rng.uniform(0.0, 0.3), rng.randint(1, 5)) for _ in range(100)
            ))
        # a leak never goes: the wait's bound only fails it (how soon a place is freed: the test above)
        await wait_until(stack, idle(baseline), "nothing left behind")
        assert finished and stack.model.decode_steps > 0
