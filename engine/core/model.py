"""The `Model` interface the scheduler drives, and what crosses it.

A model runs up to `max_batch_size` slots (sequences decoded together) of at most
`max_context_length` positions each, and keeps their KV in one pool of pages (`kv`: a
`KvLayout`; issue 41). Which pages a slot's positions live in is the scheduler's decision
(engine.core.kv_pages): it names a slot's pages with `set_pages` before any call writes or reads
a position past the slot's previous table, so a model never allocates; it writes and reads
through the table, and refuses (ModelUsageError) a position its table has no page for. Pages may
be shared by several slots (a cached prompt prefix): a slot never writes a shared page, because
the scheduler shares only full pages that hold positions before the slot's first write.

The scheduler prefills one request into a free slot (whole, or in chunks over several steps:
`prefill_chunk`, or a chunk carried by a decode step, `dispatch(inputs, chunk)`), from position
0 or, when its prompt starts with cached pages, from the end of those pages; then calls `decode`
once per step for every active slot whose prompt is complete, and releases a slot when its
request ends (or is cancelled, mid-prefill included, or preempted to free its pages).
A decode step is dispatched (`dispatch`) before the previous one's samples are read (`collect`),
so the host works one step behind the device: a step's inputs name the slot and position, and its
token is the slot's last sample, which the model keeps (on the device for the JAX model). A step
may thus run for a request that the previous step finished; the scheduler discards that sample.
Several whole prompts that are read in the same iteration may go in one call (`prefill_packed`).
With speculative decoding on (issue 45; engine.core.speculation), a model whose `max_guesses`
is above 0 may be asked instead to `verify` guessed ids for several slots: a synchronous step
that feeds each slot's last sample and its guesses in one pass and returns the run of samples
that plain decoding would have produced up to the first guess it rejects. A decode step may be
in flight when it is called: the verify runs after it (its samples are the slots' last samples
then), and it is still read by `collect` afterwards.
A model samples on its own (on the device for the JAX model); it never decides
whether a token is emitted: that is `engine.core.stopping.decide`.
A constrained request (issue 43) samples every token under a row of banned ids that depends on
the tokens before it: its first row comes with its slot (`SlotSetup.banned`), each later one by
`ban` (every constrained row of a step in one call) before the step that samples under it.
That row depends on the token just sampled, so the scheduler reads a constrained request's step
before the next one samples: for a step the model `samples_apart` (its slots all below it), it
dispatches the next step's layers first and its sampling after the rows (`dispatch(...,
sample_later=True)`, `ban`, `dispatch_sampling`); elsewhere it reads before it dispatches
(engine.core.engine).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import numpy as np

from engine.core.errors import InvalidArgument, ModelLoadFailed, ModelRefused, check_token_ids
from engine.core.request import SamplingParams


class ModelUsageError(RuntimeError):
    """A caller broke this contract (a slot prefilled twice, a position that is not the slot's
    next one or that its block table has no page for, an id outside the vocabulary): a bug upstream, not bad user input, which the services
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
class KvLayout:
    """A model's KV page pool (issue 41): `num_pages` pages of `page_size` positions, page 0 the
    null page that pads block tables (so `num_pages - 1` hold KV), as engine.core.kv_pages counts."""

    page_size: int
    num_pages: int


@dataclass(frozen=True, slots=True)
class Sample:
    token_id: int
    logprob: float  # log-probability under the model's own distribution (before temperature and cuts)
    # the slot's sampling.top_logprobs most likely (id, logprob) of the same distribution, best first
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SlotSetup:
    """Per-request state a model keeps for a slot from prefill until release."""

    sampling: SamplingParams  # seed always set, in [0, 2**64) (the engine draws one when the caller did not)
    masked_token_ids: frozenset[int]  # ids that must not be sampled while a step says `masked`
    # [V] bool (V = info.vocab_size), a constrained request's first row of banned ids: written as
    # the slot's row in place of masked_token_ids (which it already includes where they apply)
    banned: np.ndarray | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class DecodeInput:
    """One active slot's input to a decode step."""

    slot: int
    token_id: int | None  # the token fed in; None: the slot's last sample, which the model holds
    position: int  # its position: exactly the slot's next free position (prompt_len + tokens fed so far)
    masked: bool  # mask the slot's `masked_token_ids` when sampling this step


@dataclass(frozen=True, slots=True)
class VerifyInput:
    """One slot's input to a verify step (speculative decoding, issue 45)."""

    slot: int
    position: int  # the slot's next free position, as DecodeInput.position: its last sample is fed here
    guesses: tuple[int, ...]  # proposed ids for positions position+1 .. position+len(guesses); may be ()
    masked: bool  # as DecodeInput.masked, for every token this step samples for the slot


@dataclass(frozen=True)
class ChunkInput:
    """A prompt chunk that rides along with a decode step (`dispatch(inputs, chunk)`): the KV of
    prompt_token_ids[start:end] written into `slot` exactly as `prefill_chunk` would write it,
    in the same pass over the weights as the step's rows. Never a prompt's last chunk (that one
    samples the first token, and runs as `prefill_chunk`). On a free slot it takes the slot, as
    a first `prefill_chunk` does: at `start == 0`, or after a prefix hit at a page-aligned start."""

    slot: int
    prompt_token_ids: tuple[int, ...]
    start: int
    end: int
    setup: SlotSetup


@dataclass(frozen=True)
class PromptInput:
    """One whole prompt of a packed prefill (`prefill_packed`): taken into the free `slot` with
    `setup`, as `prefill` takes it."""

    slot: int
    prompt_token_ids: tuple[int, ...]
    setup: SlotSetup
    masked: bool  # mask the slot's masked ids when sampling its first token


class Model(Protocol):
    info: ModelInfo
    kv: KvLayout  # the page pool that holds every slot's KV
    # prompt tokens to prefill per step while other requests decode, unless configured: about
    # what this model reads in the time of a few of its decode steps on its hardware
    default_step_tokens: int
    # the longest chunk `dispatch` takes along with a step (0: none; every chunk is `prefill_chunk`)
    fused_chunk_tokens: int
    # the most prompt tokens, all prompts together, one `prefill_packed` call takes (0: none; each
    # prompt is its own `prefill`)
    packed_prefill_tokens: int
    # the steps `dispatch(..., sample_later=True)` takes: those whose slots are all below this
    # (0: none). Such a step's layers start at once and its sampling at `dispatch_sampling`,
    # under the rows `ban` wrote in between
    samples_apart: int
    # the most guesses one row of `verify` takes (0: this model does not verify)
    max_guesses: int

    def warm_up(self) -> None:
        """Compile every shape the model will use; nothing compiles after this."""

    def prefill(self, slot: int, prompt_token_ids: Sequence[int], setup: SlotSetup, masked: bool) -> Sample:
        """Write the prompt's KV into `slot` and sample the first output token (position len(prompt))."""

    def prefill_chunk(
        self, slot: int, prompt_token_ids: Sequence[int], start: int, end: int, setup: SlotSetup, masked: bool
    ) -> Sample | None:
        """Write the KV of `prompt_token_ids[start:end]` into `slot` at positions start..end-1,
        attending to the slot's positions [0, start) written by the earlier chunks. On a free slot
        it takes the slot (and `setup`, as `prefill` does): at `start == 0`, or at a `start` that
        is a multiple of `kv.page_size` whose positions [0, start) the slot's table already names
        pages for, holding that prompt's KV (a prefix hit). On a taken slot `start` must be where
        the slot's previous chunk ended. The last chunk (`end == len(prompt_token_ids)`) samples and
        returns the first output token (position len(prompt)), exactly as `prefill` of the whole
        prompt would; earlier chunks return None, and the slot must not decode until its last.
        `prefill(slot, p, setup, masked)` is `prefill_chunk(slot, p, 0, len(p), setup, masked)`."""

    def prefill_packed(self, prompts: Sequence[PromptInput]) -> list[Sample]:
        """Several whole prompts (into distinct free slots, at most `packed_prefill_tokens` in all)
        in one call, one pass over the weights for all of them: each as `prefill` would write and
        sample it, the samples in input order. Where a call a prompt costs more than its tokens
        (an accelerator's fixed cost per call), a burst of short prompts costs about one call."""

    def decode(self, inputs: Sequence[DecodeInput]) -> list[Sample]:
        """One step for the given slots; returns one sample per input, in the same order.
        `dispatch` then `collect`, with no other step in flight."""

    def verify(self, inputs: Sequence[VerifyInput]) -> list[tuple[Sample, ...]]:
        """One pass over the weights for the given slots, which returns its samples: each slot's
        last sample is fed at `position` and its guesses at the positions after it, and the model samples at each fed position as `decode` would have
        there. It returns each input's accepted run, in input order: samples s_0..s_m, where
        s_j.token_id == guesses[j] for every j < m, and s_m is the first sample that differs from
        its guess, or the one after the last guess (m <= len(guesses)). Greedy rows take the
        argmax; sampled rows accept guess j with the target probability of that id and, on a
        rejection, sample from the target with that id removed and renormalised (rejection
        sampling for a one-hot proposal: plain sampling's distribution exactly). Afterwards the
        slot's count is position+m+1 and s_m is its last sample (fed by its next step); KV written
        past position+m is garbage the slot overwrites later. The scheduler names pages for every
        position up to position+len(guesses) (set_pages) before the call. Steps dispatched and
        not yet collected (not one whose sampling waits) run first: a slot's last sample is then
        the one its latest such step draws, `position` counts that step, and those steps are
        collected after the call as ever (it does not read them)."""

    def dispatch(self, inputs: Sequence[DecodeInput], chunk: ChunkInput | None = None, sample_later: bool = False) -> None:
        """Start one step for the given slots (not empty) and return without waiting for its
        samples. Positions are checked against the slots' own counts, which a dispatch advances,
        so a step may be dispatched while the previous one is in flight. With `chunk` (at most
        `fused_chunk_tokens` tokens, for a slot that is not one of the inputs), that prompt chunk
        is prefilled in the same step, as if by `prefill_chunk` just before it. With
        `sample_later` (a step whose slots are all below `samples_apart`) only the step's
        layers start; its sampling waits for `dispatch_sampling`, and no other step may be
        dispatched until then."""

    def dispatch_sampling(self) -> None:
        """Start the sampling of the step dispatched with `sample_later`, under each slot's row
        of banned ids as it is now (the rows `ban` wrote after that dispatch apply): a
        constrained request's next row, computed from the previous step's samples while this
        step's layers run. Its samples are collected in turn, as any step's."""


    def collect(self) -> list[Sample]:
        """Wait for the oldest dispatched step: one sample per input, in input order."""

    def set_pages(self, slot: int, pages: Sequence[int]) -> None:
        """The slot's block table from now on: `pages[i]` (in 1..kv.num_pages - 1) holds its
        positions [i * P, (i + 1) * P), P being `kv.page_size`. Called on a free slot before its
        first prefill (the prompt's pages, a prefix hit's shared ones first), when a decode
        step's position reaches a page past the table's end, and when the scheduler swaps a page
        for a cached twin holding the same KV. It may be called while a step is in flight; the
        steps dispatched after it use the new table."""

    def ban(self, slots: Sequence[int], banned: np.ndarray) -> None:
        """Replace each of the taken `slots`' rows of banned ids (the row its `SlotSetup` wrote)
        with its row of `banned`, [R, V] bool (R = len(slots); True = never sampled while a step
        says `masked`), for the steps dispatched after this call: a decode step's constrained
        requests' next rows (engine.core.constrained), all in one call."""

    def release(self, slot: int) -> None:
        """Forget the slot's request and clear its block table; the slot may be prefilled again
        (after `set_pages`). Also for a slot given pages whose prefill never came (cancelled or
        preempted before it)."""


ModelFactory = Callable[[], Model]  # builds the model; picklable where an engine process calls it

log = logging.getLogger(__name__)


def load(factory: ModelFactory) -> Model:
    """`factory()`, warmed up: the one load of every engine, in an engine process or on a thread.
    Raises ModelLoadFailed with the reason, sorted by what a restart can do about it:
      * a ValueError is the model or the settings (the memory check, the checkpoint's config, the
        flags): ModelRefused, its message alone;
      * an OSError (a file missing or unreadable): its message alone;
      * anything else is unexpected: its traceback is logged here, and the reason is its type and
        message."""
    try:
        started = time.monotonic()
        model = factory()
        loaded = time.monotonic()
        model.warm_up()
    except ValueError as error:
        raise ModelRefused(str(error)) from error
    except OSError as error:
        raise ModelLoadFailed(str(error)) from error
    except Exception as error:
        log.exception("loading the model failed")
        raise ModelLoadFailed(f"{type(error).__name__}: {error}") from error
    log.info("model loaded in %.1f s and warmed up in %.1f s", loaded - started, time.monotonic() - loaded)
    return model
