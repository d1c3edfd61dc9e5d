"""`compile_events()`: the JAX compile events of a block, to show that nothing compiles after
warm-up (JAX reports every compile it runs through jax.monitoring, whichever function ran it)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import jax


@contextlib.contextmanager
def compile_events() -> Iterator[list[str]]:
    """Yields the list that collects the name of every compile event while the block runs."""
    events: list[str] = []

    def listener(event: str, duration: float, **kwargs) -> None:
        if "compile" in event:
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
