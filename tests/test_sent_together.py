"""`sent_together`: handlers woken in one event-loop turn all make their responses before any of
them is sent; nothing is lost, reordered or left open."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from services.sent_together import sent_together
from support.waiting import LIMIT_S, until


async def _handlers(log: list[str], names: str, wrap) -> None:
    """One handler per name, all woken by the same step, each making two responses; `log` gets
    "made X" when a response is made and "sent X" when the consumer (gRPC's place) receives it."""
    steps = [asyncio.get_running_loop().create_future() for _ in range(2)]

    async def responses(name: str):
        for n, step in enumerate(steps):
            await step
            log.append(f"made {name}{n}")
            yield f"{name}{n}"

    async def handler(name: str) -> list[str]:
        got = []
        async with contextlib.aclosing(wrap(responses(name))) as sent:
            async for response in sent:
                log.append(f"sent {response}")
                got.append(response)
        return got

    tasks = [asyncio.ensure_future(handler(name)) for name in names]
    await asyncio.sleep(0)  # every handler waits for the first step
    for n, step in enumerate(steps):
        step.set_result(None)
        # the next step only once every handler's response to this one is sent
        await until(lambda: all(f"sent {name}{n}" in log for name in names), f"step {n}'s responses sent")
    assert [await asyncio.wait_for(t, LIMIT_S) for t in tasks] == [[f"{name}0", f"{name}1"] for name in names]


async def test_every_handler_woken_in_a_turn_makes_its_response_before_any_is_sent():
    log: list[str] = []
    await _handlers(log, "abc", sent_together)
    assert log == [
        "made a0", "made b0", "made c0", "sent a0", "sent b0", "sent c0",
        "made a1", "made b1", "made c1", "sent a1", "sent b1", "sent c1",
    ]


async def test_without_it_each_response_is_sent_as_soon_as_it_is_made():
    """The control: the order the test above would see if sent_together passed responses on at
    once (what a handler did before it)."""
    log: list[str] = []

    async def at_once(responses):
        async for response in responses:
            yield response

    await _handlers(log, "ab", at_once)
    assert log[:4] == ["made a0", "sent a0", "made b0", "sent b0"]


async def test_closing_it_early_closes_the_responses_and_an_error_passes_through():
    closed = []

    async def responses():
        try:
            yield 1
            yield 2
        finally:
            closed.append(True)

    async with contextlib.aclosing(sent_together(responses())) as sent:
        async for response in sent:
            assert response == 1
            break
    assert closed == [True]  # a client that leaves (cancel, deadline) cancels the decode

    async def failing():
        yield 1
        raise ValueError("the decoder broke its contract")

    got = []
    with pytest.raises(ValueError, match="broke its contract"):
        async for response in sent_together(failing()):
            got.append(response)
    assert got == [1]
