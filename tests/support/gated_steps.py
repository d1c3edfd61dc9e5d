"""`GatedSteps`: the scripted model with one decode step held until the test opens a gate, so
that requests submitted meanwhile reach the scheduler together (a burst)."""

from __future__ import annotations

import threading

from engine.core.scripted_model import ScriptedModel


class GatedSteps(ScriptedModel):
    """Holds the decode step that `holds(step number)` picks until the test opens the gate."""

    def __init__(self, holds, **kw) -> None:
        super().__init__(**kw)
        self.holds = holds
        self.steps = 0
        self.entered = threading.Event()
        self.gate = threading.Event()

    def dispatch(self, inputs, chunk=None):
        self.steps += 1
        if self.holds(self.steps) and not self.gate.is_set():
            self.entered.set()
            assert self.gate.wait(10)
        return super().dispatch(inputs, chunk)
