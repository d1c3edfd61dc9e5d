"""`until_nothing_held`: wait (bounded) until a decode server, a text server and their scripted
model hold nothing for any request: cancels reach the engine asynchronously."""

from __future__ import annotations

from support.waiting import until


def held(decode, text, model) -> tuple[int, int, int, int, int]:
    """(engine slots in use, engine queue depth, model slots held, decoder in flight, text in flight)."""
    stats = decode.engine.stats()
    return stats.slots_in_use, stats.queue_depth, model.slots_held, decode.admission.in_flight, text.admission.in_flight


async def until_nothing_held(decode, text, model) -> None:
    await until(lambda: held(decode, text, model) == (0, 0, 0, 0, 0),
                "nothing held (engine slots and queue, model slots, decoder and text in flight)", interval_s=0.01)
