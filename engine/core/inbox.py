"""`Inbox`: a queue with one consumer on an event loop, which takes everything waiting at once.

Why not asyncio.Queue: every consumer on the serving path (a request's events, a DecodeStream's
responses) drains what has arrived in one go, and put/get one item at a time costs a Queue's
bookkeeping (its `join` event, its getter deque) per item, once per request per engine step.
Here a put is an append and at most one wake-up; a take is a list swap.
"""

from __future__ import annotations

import asyncio


class Inbox:
    """Put and take on the loop's thread only (a thread hands items over with
    `loop.call_soon_threadsafe(inbox.put, item)` or a batching mailbox)."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: list = []
        self._waiter: asyncio.Future | None = None

    def put(self, item: object) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def __len__(self) -> int:
        return len(self._items)

    async def take(self) -> list:
        """Everything put since the last take, in order; waits while there is nothing."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items
