"""`Inbox`: one consumer takes everything waiting, in order, and waits only when nothing is."""

from __future__ import annotations

import asyncio

from engine.core.inbox import Inbox


async def test_take_returns_everything_put_so_far_in_order_and_then_waits():
    inbox = Inbox()
    for i in range(3):
        inbox.put(i)
    assert len(inbox) == 3
    assert await inbox.take() == [0, 1, 2]
    assert len(inbox) == 0
    waiting = asyncio.ensure_future(inbox.take())
    await asyncio.sleep(0)
    assert not waiting.done()  # nothing to take: it waits
    inbox.put("a")
    inbox.put("b")  # before the consumer runs: it gets both at once
    assert await asyncio.wait_for(waiting, 1.0) == ["a", "b"]


async def test_a_cancelled_take_loses_nothing():
    inbox = Inbox()
    waiting = asyncio.ensure_future(inbox.take())
    await asyncio.sleep(0)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    inbox.put(1)  # no waiter left to wake: kept for the next take
    assert await asyncio.wait_for(inbox.take(), 1.0) == [1]
