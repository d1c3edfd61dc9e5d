"""`ScriptedModel`: the one sanctioned test double, a `Model` whose outputs are worked out by hand.

Rule: the token sampled after feeding token `t` is `(t + 1) % vocab_size` -- prefill feeds the
prompt's last token (a chunked prefill samples only on its last chunk, which holds that token), decode feeds the last sampled token. So a prompt ending in 10 produces
11, 12, 13, ... When a step is `masked` and the next id is one of the slot's masked ids, the
count skips forward to the first id that is not masked. A slot with a row of banned ids (a
constrained request: `SlotSetup.banned`, then `ban`) samples, in a `masked` step, its scripted id
if the row allows it, else the lowest id the row allows (a row that allows none, or is not [V]
bool, raises ModelUsageError, as a real model would sample garbage); `bans` counts the `ban`
calls. With `samples_apart`, `dispatch(..., sample_later=True)` writes the step's inputs and
`dispatch_sampling` draws its samples, under the rows as they are then. Sampling parameters are ignored
(`samplings` records each slot's as it took them, so tests can see what reached the model).
The logprob of token `t` is `-(t % 10) / 10`. With `sampling.top_logprobs = k`, the
alternatives are the sampled token and the k - 1 ids after it, `(t + i) % vocab_size` with
logprob `-(t % 10) / 10 - i`.

It drives the real scheduler and stop decision in tests; `step_delay_s` is each decode step's
time on a device that runs beside the host, as an accelerator does: `dispatch` returns at once and
`collect` waits until the step is due (each step starts when the previous one ends), so tests
catch requests in flight (cancellation, overload, drain) and benchmarks see a host one step
behind. `fail_at_step` makes one decode step's `collect` raise, as a lost device would. With
`fused_chunk_tokens` a step takes a prompt chunk along (`dispatch(inputs, chunk)`), counted in
`fused_chunks` and recorded as the prefill it stands for. With `packed_prefill_tokens` it takes several whole
prompts in one call (`prefill_packed`), each sampled as `prefill` would. `calls` records every
prefill chunk ("prefill", slot, start, end), packed prefill ("packed", ((slot, prompt length),
...)) and decode step ("decode", slots), in order, so scheduler tests can
check how chunks and steps interleave; `reads` records, for each `collect`, (the step read, the
steps dispatched by then), so they can check that the host reads a step only after the next one
is enqueued; `prefill_tokens` counts the prompt positions computed (a prefix hit's are not), and
`table(slot)` is a slot's block table as the model holds it.

With `max_guesses` it verifies guesses (speculative decoding, `verify`) by its script: after the
fed last sample comes the next id, and each guess equal to what the script samples after the id
before it is accepted; the run ends at the first guess that differs (its scripted id instead) or
one past the last guess. The guesses past the run are written into the slot's pages, as a real
model writes them, and then forgotten: the slot holds position + len(run) positions, and a step
that later reads one of those garbage positions as its own reads what it wrote there itself.
`verify_steps` counts the calls, and `calls` records each as ("verify", ((slot, guesses), ...)).
A verify may follow a dispatched step not yet collected: it feeds that step's samples, and is
due a step's time after it.

**Its KV pages make the scheduler's mistakes loud.** The pool (`kv`: `kv_cache_tokens`
positions in pages of `page_size`; 0: max_batch_size x max_context_length) stores, per page and
offset, the token id written there: what a real model's KV at that position would encode. A
prefill writes its prompt ids, a decode step the id it feeds, each through the slot's block table
(`set_pages`); a position past the table raises ModelUsageError (a real model would write page 0).
After every call that writes, every active slot's table must read back exactly its own
sequence's ids at each position it has written or took from a prefix hit, else ModelUsageError.
So a prefix shared with the wrong prompt, a live page handed to another sequence, a table not
refreshed after growth or a swap, or a recompute that feeds other ids fails the test at once,
not as wrong output somewhere later.
"""

from __future__ import annotations

import collections
import time
from typing import Sequence

import numpy as np

from engine.core.model import ChunkInput, DecodeInput, KvLayout, ModelInfo, ModelUsageError, PromptInput, Sample, SlotSetup, VerifyInput
from engine.core.request import SamplingParams


def _sleep_until(t: float) -> None:
    """Wait until perf_counter() reaches `t` (at once if it has)."""
    wait = t - time.perf_counter()
    if wait > 0:
        time.sleep(wait)


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
        kv_cache_tokens: int = 0,
        page_size: int = 16,
        fused_chunk_tokens: int = 0,
        packed_prefill_tokens: int = 0,
        samples_apart: bool = False,
        max_guesses: int = 0,
    ) -> None:
        self.info = ModelInfo(model_id, vocab_size, max_context_length, max_batch_size, frozenset(eos_token_ids))
        if kv_cache_tokens < 0 or page_size < 1:
            raise ValueError(f"kv_cache_tokens must be >= 0 and page_size >= 1, got {kv_cache_tokens}, {page_size}")
        positions = kv_cache_tokens or max_batch_size * max_context_length
        self.kv = KvLayout(page_size, -(-positions // page_size) + 1)  # + the null page
        width = -(-max_context_length // page_size)  # W: pages in a full table
        self._store = np.full((self.kv.num_pages, page_size), -1, np.int64)  # [N, P]: the id written at each position
        self._tables = np.zeros((max_batch_size, width), np.int32)  # [B, W]: each slot's block table
        self._pages = np.zeros(max_batch_size, np.int64)  # [B]: pages each table names (the rest is the null page)
        self._ids = np.full((max_batch_size, width * page_size), -1, np.int64)  # [B, W * P]: each slot's own ids (-1: none)
        self._written = [0] * max_batch_size  # slot -> positions its sequence holds (what the next write must follow)
        self.prefill_tokens = 0  # prompt positions computed (written by a prefill), all calls together
        self.default_step_tokens = 256
        self.fused_chunk_tokens = fused_chunk_tokens
        self.packed_prefill_tokens = packed_prefill_tokens
        self.samples_apart = max_batch_size if samples_apart else 0  # (every step, or none)
        self.max_guesses = max_guesses
        self.verify_steps = 0
        self._held: list[tuple[DecodeInput, int]] | None = None  # a step's (input, id fed) whose sampling waits
        self.fused_chunks = 0  # chunks that came with a decode step (recorded in `calls` as a prefill before it)
        self.step_delay_s = step_delay_s
        self.fail_at_step = fail_at_step  # decode step number (1-based) that raises, to test failures
        self._masked: dict[int, frozenset[int]] = {}  # slot -> ids masked while a step says so
        self._banned: dict[int, np.ndarray] = {}  # slot -> its [V] row of banned ids, when it has one
        self.bans = 0  # `ban` calls, so tests can see that unconstrained requests make none
        self._top: dict[int, int] = {}  # slot -> how many alternatives each sample reports
        self.samplings: list[SamplingParams] = []  # each slot's sampling parameters as it took them, in order
        self._filling: dict[int, int] = {}  # slot -> prompt positions written, while more chunks are due
        self.calls: list[tuple] = []
        self.prefills = 0  # counters, so tests can check e.g. that N = 1 never decodes
        self.decode_steps = 0
        self._last: dict[int, int] = {}  # slot -> its last sample, the next step's input
        self.reads: list[tuple[int, int]] = []  # (the step read, the steps dispatched by then)
        self._next_free = 0.0  # when the "device" finishes the steps dispatched so far (perf_counter)
        self._pending: collections.deque[tuple[int, float, list[Sample]]] = collections.deque()  # (step, due, samples)

    def warm_up(self) -> None:
        pass

    def _next(self, slot: int, fed: int, masked: bool) -> Sample:
        token = (fed + 1) % self.info.vocab_size
        banned = self._banned.get(slot)
        if masked and banned is not None:
            if banned[token]:
                token = int(np.argmin(banned))  # the lowest allowed id (the row allows one: `_row`)
        else:
            while masked and token in self._masked[slot]:
                token = (token + 1) % self.info.vocab_size
        logprob = -(token % 10) / 10
        top = tuple(((token + i) % self.info.vocab_size, logprob - i) for i in range(self._top.get(slot, 0)))
        return Sample(token, logprob, top)

    def prefill(self, slot: int, prompt_token_ids: Sequence[int], setup: SlotSetup, masked: bool) -> Sample:
        sample = self.prefill_chunk(slot, prompt_token_ids, 0, len(prompt_token_ids), setup, masked)
        assert sample is not None
        return sample

    def prefill_chunk(
        self, slot: int, prompt_token_ids: Sequence[int], start: int, end: int, setup: SlotSetup, masked: bool
    ) -> Sample | None:
        self.calls.append(("prefill", slot, start, end))
        return self._chunk(slot, prompt_token_ids, start, end, setup, masked)

    def prefill_packed(self, prompts: Sequence[PromptInput]) -> list[Sample]:
        total = sum(len(p.prompt_token_ids) for p in prompts)
        if not prompts or total > self.packed_prefill_tokens or len({p.slot for p in prompts}) < len(prompts):
            raise ModelUsageError(f"a packed prefill of {len(prompts)} prompts, {total} tokens")
        self.calls.append(("packed", tuple((p.slot, len(p.prompt_token_ids)) for p in prompts)))
        samples = [self._chunk(p.slot, p.prompt_token_ids, 0, len(p.prompt_token_ids), p.setup, p.masked) for p in prompts]
        return [sample for sample in samples if sample is not None]

    def _chunk(
        self, slot: int, prompt_token_ids: Sequence[int], start: int, end: int, setup: SlotSetup, masked: bool
    ) -> Sample | None:
        n = len(prompt_token_ids)
        if not 0 <= start < end <= n:
            raise ModelUsageError(f"a chunk [{start}, {end}) of a prompt of {n} tokens")
        if slot not in self._masked:  # a free slot, taken here: at 0, or after a prefix hit's pages
            if start % self.kv.page_size:
                raise ModelUsageError(f"a first chunk of slot {slot} at {start}, not at 0 or a page boundary")
            self._take(slot, setup)
            self._ids[slot, :start] = prompt_token_ids[:start]  # the hit: its pages must hold these ids
            self._written[slot] = start
        elif self._filling.get(slot) != start:
            raise ModelUsageError(f"a chunk at {start} is not slot {slot}'s next one")
        self._write(slot, start, prompt_token_ids[start:end])
        self.prefill_tokens += end - start
        self._check()
        if end < n:
            self._filling[slot] = end
            return None
        self._filling.pop(slot, None)
        _sleep_until(self._next_free)  # the device runs in order: after the steps in flight
        sample = self._next(slot, prompt_token_ids[-1], masked)
        self._last[slot] = sample.token_id
        return sample

    def _take(self, slot: int, setup: SlotSetup) -> None:
        if slot in self._masked or not 0 <= slot < self.info.max_batch_size:
            raise ModelUsageError(f"slot {slot} is in use or not one of the {self.info.max_batch_size} slots")
        self.prefills += 1
        self._masked[slot] = setup.masked_token_ids
        if setup.banned is not None:
            self._banned[slot] = self._row(setup.banned)
        self._top[slot] = min(setup.sampling.top_logprobs, self.info.vocab_size)
        self.samplings.append(setup.sampling)

    def ban(self, slots: Sequence[int], banned: np.ndarray) -> None:
        if np.shape(banned)[:1] != (len(slots),) or len(set(slots)) != len(slots):
            raise ModelUsageError(f"{len(slots)} slots (each once) for banned rows of shape {np.shape(banned)}")
        for slot, row in zip(slots, banned):
            if slot not in self._masked:
                raise ModelUsageError(f"ban on slot {slot}, which holds no request")
            self._banned[slot] = self._row(row)
        self.bans += 1

    def _row(self, banned: np.ndarray) -> np.ndarray:
        row = np.asarray(banned)
        if row.dtype != bool or row.shape != (self.info.vocab_size,):
            raise ModelUsageError(f"a banned row of {row.dtype} {row.shape}, not bool ({self.info.vocab_size},)")
        if row.all():
            raise ModelUsageError("a banned row that allows no id")
        return row.copy()

    def set_pages(self, slot: int, pages: Sequence[int]) -> None:
        width = self._tables.shape[1]
        if not 0 <= slot < self.info.max_batch_size or len(pages) > width:
            raise ModelUsageError(f"{len(pages)} pages for slot {slot}: at most {width}, for one of {self.info.max_batch_size} slots")
        if any(not 0 < page < self.kv.num_pages for page in pages):
            raise ModelUsageError(f"slot {slot}'s pages {list(pages)} are not all in 1..{self.kv.num_pages - 1}")
        self._tables[slot] = 0
        self._tables[slot, : len(pages)] = pages
        self._pages[slot] = len(pages)
        self._check()

    def _write(self, slot: int, position: int, ids: Sequence[int]) -> None:
        """Write `ids` at the slot's positions from `position` (its next one) through its table."""
        size, end = self.kv.page_size, position + len(ids)
        if position != self._written[slot]:
            raise ModelUsageError(f"slot {slot} writes at {position}, but its next position is {self._written[slot]}")
        if -(-end // size) > self._pages[slot]:
            raise ModelUsageError(f"slot {slot} writes position {end - 1}, past its block table of {self._pages[slot]} pages")
        positions = np.arange(position, end)  # [T]
        self._store[self._tables[slot, positions // size], positions % size] = ids
        self._ids[slot, position:end] = ids
        self._written[slot] = end

    def _check(self) -> None:
        """Every active slot's table reads back its own ids at every position it holds."""
        slots = sorted(self._masked)
        if not slots:
            return
        held = self._ids[slots, : max(self._written[s] for s in slots)]  # [S, T]
        read = self._store[self._tables[slots]].reshape(len(slots), -1)[:, : held.shape[1]]  # [S, W * P] -> [S, T]
        wrong = np.argwhere((held >= 0) & (read != held))
        if len(wrong):
            row, position = (int(x) for x in wrong[0])
            page = int(self._tables[slots[row], position // self.kv.page_size])
            raise ModelUsageError(
                f"slot {slots[row]} reads id {read[row, position]} at position {position} (page {page}), "
                f"but its sequence holds {held[row, position]} there"
            )

    def decode(self, inputs: Sequence[DecodeInput]) -> list[Sample]:
        if self._pending:
            raise ModelUsageError("decode with a dispatched step not yet collected")
        self.dispatch(inputs)
        return self.collect()

    def dispatch(self, inputs: Sequence[DecodeInput], chunk: ChunkInput | None = None, sample_later: bool = False) -> None:
        if self._held is not None:
            raise ModelUsageError("a decode step dispatched while the last one's sampling waits")
        if sample_later and not all(i.slot < self.samples_apart for i in inputs):
            raise ModelUsageError("sample_later on a model that does not sample apart")
        if not inputs:
            raise ModelUsageError("a decode step with no inputs")
        if chunk is not None:
            if not 0 < chunk.end - chunk.start <= self.fused_chunk_tokens or chunk.end >= len(chunk.prompt_token_ids):
                raise ModelUsageError(f"a chunk [{chunk.start}, {chunk.end}) cannot ride along with a step")
            if chunk.slot in {i.slot for i in inputs}:
                raise ModelUsageError(f"slot {chunk.slot} both decodes and prefills in one step")
            self.prefill_chunk(chunk.slot, chunk.prompt_token_ids, chunk.start, chunk.end, chunk.setup, False)
            self.fused_chunks += 1
        self.decode_steps += 1
        self.calls.append(("decode", tuple(i.slot for i in inputs)))
        for i in inputs:
            if i.slot in self._filling or i.slot not in self._masked:
                raise ModelUsageError(f"slot {i.slot} decoded before its last prefill chunk")
            if i.position >= self.info.max_context_length:
                raise ModelUsageError(f"slot {i.slot} decoded past the context")
        held = []
        for i in inputs:
            fed = self._last[i.slot] if i.token_id is None else i.token_id
            self._write(i.slot, i.position, (fed,))
            held.append((i, fed))
        self._check()
        self._next_free = max(self._next_free, time.perf_counter()) + self.step_delay_s
        self._held = held
        if not sample_later:
            self.dispatch_sampling()

    def dispatch_sampling(self) -> None:
        """The held step's samples, under each slot's banned row as it is now."""
        if self._held is None:
            raise ModelUsageError("dispatch_sampling with no step waiting for its sampling")
        held, self._held = self._held, None
        samples = []
        for i, fed in held:
            if i.slot not in self._masked:  # released since the dispatch: its sample is discarded
                samples.append(Sample(0, 0.0))
                continue
            sample = self._next(i.slot, fed, i.masked)
            self._last[i.slot] = sample.token_id
            samples.append(sample)
        self._pending.append((self.decode_steps, self._next_free, samples))

    def verify(self, inputs: Sequence[VerifyInput]) -> list[tuple[Sample, ...]]:
        if self._held is not None:
            raise ModelUsageError("verify while a decode step's sampling waits")
        if not inputs or len({i.slot for i in inputs}) < len(inputs):
            raise ModelUsageError(f"a verify step of {len(inputs)} rows, each slot at most once")
        self.verify_steps += 1
        self.calls.append(("verify", tuple((i.slot, len(i.guesses)) for i in inputs)))
        for i in inputs:
            if i.slot in self._filling or i.slot not in self._masked:
                raise ModelUsageError(f"slot {i.slot} verified before its last prefill chunk")
            if len(i.guesses) > self.max_guesses or i.position + len(i.guesses) >= self.info.max_context_length:
                raise ModelUsageError(
                    f"slot {i.slot}: {len(i.guesses)} guesses at {i.position} (at most {self.max_guesses})"
                )
            if any(not 0 <= token < self.info.vocab_size for token in i.guesses):
                raise ModelUsageError(f"slot {i.slot}: a guess outside the vocabulary in {i.guesses}")
        runs = []
        for i in inputs:
            fed = (self._last[i.slot], *i.guesses)
            self._write(i.slot, i.position, fed)  # (past its table: ModelUsageError)
            run = []
            for j, token in enumerate(fed):
                run.append(self._next(i.slot, token, i.masked))
                if j == len(i.guesses) or run[-1].token_id != i.guesses[j]:
                    break
            end = i.position + len(run)  # the slot's count: what follows is garbage, overwritten later
            self._ids[i.slot, end:] = -1
            self._written[i.slot] = end
            self._last[i.slot] = run[-1].token_id
            runs.append(tuple(run))
        self._check()
        self._next_free = max(self._next_free, time.perf_counter()) + self.step_delay_s
        _sleep_until(self._next_free)
        return runs

    def collect(self) -> list[Sample]:
        if not self._pending:
            raise ModelUsageError("collect with no step dispatched")
        step, due, samples = self._pending.popleft()
        self.reads.append((step, self.decode_steps))
        _sleep_until(due)
        if step == self.fail_at_step:
            raise RuntimeError(f"scripted failure at decode step {step}")
        return samples

    def release(self, slot: int) -> None:
        """(A slot whose request never reached its prefill, only `set_pages`, is released too.)"""
        self._masked.pop(slot, None)
        self._banned.pop(slot, None)
        self._last.pop(slot, None)
        self._top.pop(slot, None)
        self._filling.pop(slot, None)
        self._tables[slot] = 0
        self._pages[slot] = 0
        self._ids[slot] = -1
        self._written[slot] = 0

    def table(self, slot: int) -> tuple[int, ...]:
        """The slot's block table as the model holds it (the pages `set_pages` named last)."""
        return tuple(int(page) for page in self._tables[slot, : self._pages[slot]])

    @property
    def slots_held(self) -> int:
        return len(self._masked)
