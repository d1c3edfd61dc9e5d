"""The errors the cores raise for a caller to act on; `services.errors` maps each to a status code.

They live here, below both cores, so that the text use case (tokenizer_svc) and the engine can
refuse input in the same terms without importing the gRPC shell.
"""

from __future__ import annotations

from typing import Iterable


class InvalidArgument(ValueError):
    """A request field is out of range. `field` is its path in the request message."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


class QueueFull(Exception):
    """The admission queue is at its bound; the caller should retry later."""


class EngineStopped(Exception):
    """The engine is not running (not started, stopping, or its loop died)."""


class ModelLoadFailed(Exception):
    """The model could not be built or warmed up; the message says why (`engine.core.model.load`)."""


class ModelRefused(ModelLoadFailed):
    """The model or its settings can never run as given, whatever a restart does: a ValueError at
    load, such as the memory check's refusal, a checkpoint config the engine does not take, or
    flags that do not go together. A configuration error, for the operator to fix."""


class DecoderFault(Exception):
    """A decode stream broke its contract (a miscount, an id the tokenizer does not have): a bug or
    a mismatched decoder, not the caller's fault. tokenizer_svc.generation raises its kinds."""


class StreamEndedWithoutFinished(Exception):
    """A decode stream ended without its Finished: the decoder went away mid-stream."""

    def __init__(self) -> None:
        super().__init__("the decode stream ended without Finished")


def check_token_ids(ids: Iterable[int], vocab_size: int, field: str) -> None:
    """Refuse ids outside [0, vocab_size), naming the first one as `field[i]`.

    The one vocabulary check: the decode service's prompt and stop ids, the text service's
    Detokenize ids and the tokenizer's own decode all go through it. Downstream nothing would
    notice: JAX clamps an out-of-range gather index, and a tokenizer drops an unknown id."""
    for i, token_id in enumerate(ids):
        if not 0 <= token_id < vocab_size:
            raise InvalidArgument(f"{field}[{i}]", f"{token_id} is not in the vocabulary [0, {vocab_size})")
