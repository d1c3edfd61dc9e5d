"""The `Model` interface the scheduler drives, and what crosses it.

A model owns a slot-based KV cache of `max_batch_size` slots x `max_context_length`
positions. The scheduler prefills one request into a free slot (whole, or in chunks over several
steps, `prefill_chunk`), then calls `decode` once per step for every active slot whose prompt is
complete, and releases a slot when its request ends (or is cancelled, mid-prefill included).
A model samples on its own (on the device for the JAX model); it never decides
whether a token is emitted: that is `engine.core.stopping.decide`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from engine.core.errors import InvalidArgument, check_token_ids
from engine.core.request import SamplingParams


class ModelUsageError(RuntimeError):
    """A caller broke this contract (a slot prefilled twice, a position that is not the slot's
    next one, an id outside the vocabulary): a bug upstream, not bad user input, which the services
    refuse earlier. Models raise it rather than assert: JAX would clamp an out-of-range id or
    position silently, and `python -O` strips asserts. In the engine loop it is fatal."""


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    vocab_size: int
    max_context_length: int
    max_batch_size: int
    eos_token_ids: frozenset[int]  # union of config.json, generation_config.json and tokenizer eos

    def check_prompt(self, ids: Sequence[int], field: str) -> tuple[int, ...]:
        """Prompt ids this model can take: not empty, in its vocabulary, leaving room for output;
        else InvalidArgument naming `field`. The decode service's prompt_token_ids and the text
        service's tokenized prompt both go through it."""
        if not ids:
            raise InvalidArgument(field, "must not be empty")
        check_token_ids(ids, self.vocab_size, field)
        if len(ids) >= self.max_context_length:
            raise InvalidArgument(
                field, f"{len(ids)} tokens leave no room for output in a context of {self.max_context_length}"
            )
        return tuple(ids)


@dataclass(frozen=True)
class Sample:
    token_id: int
    logprob: float  # log-probability under the model's own distribution (before temperature and cuts)


@dataclass(frozen=True)
class SlotSetup:
    """Per-request state a model keeps for a slot from prefill until release."""

    sampling: SamplingParams  # seed always set, in [0, 2**64) (the engine draws one when the caller did not)
    masked_token_ids: frozenset[int]  # ids that must not be sampled while a step says `masked`


@dataclass(frozen=True)
class DecodeInput:
    """One active slot's input to a decode step."""

    slot: int
    token_id: int  # the last sampled token, fed back in
    position: int  # its position: exactly the slot's next free position (prompt_len + tokens fed so far)
    masked: bool  # mask the slot's `masked_token_ids` when sampling this step


class Model(Protocol):
    info: ModelInfo

    def warm_up(self) -> None:
        """Compile every shape the model will use; nothing compiles after this."""

    def prefill(self, slot: int, prompt_token_ids: Sequence[int], setup: SlotSetup, masked: bool) -> Sample:
        """Write the prompt's KV into `slot` and sample the first output token (position len(prompt))."""

    def prefill_chunk(
        self, slot: int, prompt_token_ids: Sequence[int], start: int, end: int, setup: SlotSetup, masked: bool
    ) -> Sample | None:
        """Write the KV of `prompt_token_ids[start:end]` into `slot` at positions start..end-1,
        attending to the slot's positions [0, start) written by the earlier chunks. `start == 0`
        takes a free slot (and `setup`, as `prefill` does); otherwise `start` must be where the
        slot's previous chunk ended. The last chunk (`end == len(prompt_token_ids)`) samples and
        returns the first output token (position len(prompt)), exactly as `prefill` of the whole
        prompt would; earlier chunks return None, and the slot must not decode until its last.
        `prefill(slot, p, setup, masked)` is `prefill_chunk(slot, p, 0, len(p), setup, masked)`."""

    def decode(self, inputs: Sequence[DecodeInput]) -> list[Sample]:
        """One step for the given slots; returns one sample per input, in the same order."""

    def release(self, slot: int) -> None:
        """Forget the slot's request; the slot may be prefilled again."""
