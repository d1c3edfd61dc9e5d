"""`slow_scripted`: a scripted model whose load takes `seconds`, for an engine process's child
(a module-level function, so that it pickles to the child by name)."""

from __future__ import annotations

import time

from engine.core.scripted_model import ScriptedModel


def slow_scripted(seconds: float) -> ScriptedModel:
    time.sleep(seconds)
    return ScriptedModel(vocab_size=512, eos_token_ids=frozenset({0, 2}), max_context_length=256)
