"""`ScriptedModel`: the one sanctioned test double, a `Model` whose outputs are worked out by hand.

Rule: the token sampled after feeding token `t` is `(t + 1) % vocab_size` -- prefill feeds the
prompt's last token (a chunked prefill samples only on its last chunk, which holds that token), decode feeds the last sampled token. So a prompt ending in 10 produces
11, 12, 13, ... When a step is `masked` and the next id is one of the slot's masked ids, the
count skips forward to the first id that is not masked. Sampling parameters are ignored.
The logprob of token `t` is `-(t % 10) / 10`.

It drives the real scheduler and stop decision in tests; `step_delay_s` slows each decode
step so tests can catch requests in flight (cancellation, overload, drain); `fail_at_step` makes
one decode step raise, as a lost device would. `calls` records every prefill chunk
("prefill", slot, start, end) and decode step ("decode", slots), in order, so scheduler tests can
check how chunks and steps interleave.
"""

from __future__ import annotations

import time
from typing import Sequence

from engine.core.model import DecodeInput, ModelInfo, ModelUsageError, Sample, SlotSetup


class ScriptedModel:
    def __init__(
        self,
        vocab_size: int = 1000,
        eos_token_ids: frozenset[int] = frozenset({2}),
        max_batch_size: int = 4,
        max_context_length: int = 256,
        step_delay_s: float = 0.0,
        model_id: str = "scripted",
        fail_at_step: int | None = None,
    ) -> None:
        self.info = ModelInfo(model_id, vocab_size, max_context_length, max_batch_size, frozenset(eos_token_ids))
        self.step_delay_s = step_delay_s
        self.fail_at_step = fail_at_step  # decode step number (1-based) that raises, to test failures
        self._masked: dict[int, frozenset[int]] = {}  # slot -> ids masked while a step says so
        self._filling: dict[int, int] = {}  # slot -> prompt positions written, while more chunks are due
        self.calls: list[tuple] = []
        self.prefills = 0  # counters, so tests can check e.g. that N = 1 never decodes
        self.decode_steps = 0

    def warm_up(self) -> None:
        pass

    def _next(self, slot: int, fed: int, masked: bool) -> Sample:
        token = (fed + 1) % self.info.vocab_size
        while masked and token in self._masked[slot]:
            token = (token + 1) % self.info.vocab_size
        return Sample(token, -(token % 10) / 10)

    def prefill(self, slot: int, prompt_token_ids: Sequence[int], setup: SlotSetup, masked: bool) -> Sample:
        sample = self.prefill_chunk(slot, prompt_token_ids, 0, len(prompt_token_ids), setup, masked)
        assert sample is not None
        return sample

    def prefill_chunk(
        self, slot: int, prompt_token_ids: Sequence[int], start: int, end: int, setup: SlotSetup, masked: bool
    ) -> Sample | None:
        n = len(prompt_token_ids)
        if not 0 <= start < end <= n:
            raise ModelUsageError(f"a chunk [{start}, {end}) of a prompt of {n} tokens")
        if start == 0:
            if slot in self._masked or not 0 <= slot < self.info.max_batch_size:
                raise ModelUsageError(f"slot {slot} is in use or not one of the {self.info.max_batch_size} slots")
            self.prefills += 1
            self._masked[slot] = setup.masked_token_ids
        elif self._filling.get(slot) != start:
            raise ModelUsageError(f"a chunk at {start} is not slot {slot}'s next one")
        self.calls.append(("prefill", slot, start, end))
        if end < n:
            self._filling[slot] = end
            return None
        self._filling.pop(slot, None)
        return self._next(slot, prompt_token_ids[-1], masked)

    def decode(self, inputs: Sequence[DecodeInput]) -> list[Sample]:
        self.decode_steps += 1
        if self.decode_steps == self.fail_at_step:
            raise RuntimeError(f"scripted failure at decode step {self.decode_steps}")
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        self.calls.append(("decode", tuple(i.slot for i in inputs)))
        for i in inputs:
            if i.slot in self._filling:
                raise ModelUsageError(f"slot {i.slot} decoded before its last prefill chunk")
            if i.position >= self.info.max_context_length:
                raise ModelUsageError(f"slot {i.slot} decoded past the context")
        return [self._next(i.slot, i.token_id, i.masked) for i in inputs]

    def release(self, slot: int) -> None:
        del self._masked[slot]
        self._filling.pop(slot, None)

    @property
    def slots_held(self) -> int:
        return len(self._masked)
