"""`Unwarmed`: a JaxModel whose `warm_up` compiles nothing, for tests that serve a model (the decode
service's load calls `warm_up`) whose claims are about what it answers, not about what warm-up
covers: the programs their requests run compile as they come, the same ones, and those they never
run are never compiled. That warm-up covers every shape is the claim of tests/test_jax_model.py,
tests/test_verify.py and the model families' own files, on the tiny checkpoints; each file that
uses this says why it may."""

from __future__ import annotations

from engine.jax_backend.jax_model import JaxModel


class Unwarmed(JaxModel):
    """A JaxModel (loaded by `Unwarmed.load`, as JaxModel.load) that skips warm-up."""

    def warm_up(self) -> None:
        pass
