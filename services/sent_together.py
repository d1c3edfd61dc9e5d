"""`sent_together`: a server-streaming handler's responses, each sent one event-loop turn after
it is ready, so that what one engine step makes ready for many streams goes out together.

Why: one engine step wakes every stream's handler in the same loop turn, and each handler does
its own Python for the step (routing, detokenizing, protobuf, metrics) before it hands its
response to gRPC, which writes it to the socket at once. Sent
as each is made, the responses of a step leave one by one over the whole turn, so a client
process reads them one at a time: each read is a wake-up of gRPC's threads and of its event
loop. Holding each response for the rest of the turn (`asyncio.sleep(0)` puts the handler
behind every handler already woken in it) makes the turn prepare them all and the next one send
them back to back, and a client reads several with one wake-up. Nothing waits for another step's
output: a response waits at most for the other handlers of its own turn. Measured bare and
through the text service, a client's CPU and context switches a message fell with it
(docs/benchmarks.md, 'Figures behind code comments').
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, TypeVar

T = TypeVar("T")


async def sent_together(responses: AsyncIterator[T]) -> AsyncIterator[T]:
    """Each of `responses`, one loop turn after it was made; closing this closes `responses`."""
    async with contextlib.aclosing(responses):
        async for response in responses:
            await asyncio.sleep(0)  # behind the other handlers woken in this turn
            yield response
