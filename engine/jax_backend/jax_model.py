"""`JaxModel`: the real model behind engine.core.model.Model, a JAX decoder with a paged KV cache;
this file is the execution, its parts each in a file of their own.

Data flow: `load` (engine.jax_backend.loading) reads a checkpoint with the served defaults and
builds the model, which allocates the device state once: the KV page pool (L buffers of
[K, N, P, D] for K and as many for V, `kv`) and each slot's banned-id row [B, V']. The scheduler
says which pages hold each slot's positions (`set_pages`); the block tables stay on the host
(engine.jax_backend.slot_table) and travel with every call as inputs of fixed shape, so a new
table never compiles. `prefill_chunk` writes positions [start, end) of a prompt into a slot's
pages (the scheduler's chunked prefill; `prefill` is the whole prompt as one chunk; a free slot
may start after a shared prefix whose pages its table already names) as calls of the compiled
chunk sizes (engine.jax_backend.shapes: `prompt_pieces`); each call attends, blocked and causal,
only to the slot's keys up to its end (transformer.chunk_attention), so a prompt's cost grows
with its length, not with the context; the chunk that ends the prompt samples its first token. `decode` runs one token for the first R slots, R being the smallest row
bucket above the highest active slot (the scheduler fills the lowest free slot first, so live
slots sit low), attending over the smallest attend bucket that covers every active position (on
the CPU in float32 a C++ kernel reads each row's live keys in place, engine.jax_backend.cpu_kernels:
one attend bucket, no window copied; its weight products of a few rows run on panel-packed copies
of the projections, made once here). A decode step is its layers as one jitted executable and
then its row bucket's sampler, which every sampling call shares (a greedy step may be one
executable: engine.jax_backend.steps). The host runs one step behind the device: `dispatch`
enqueues step N+1 with no wait (its inputs are the samples of step N, which never leave the
device, and host arrays packed into two transfers), and only then does `collect` read step N's
ids and logprobs; the scheduler decides on them while the device computes. Per-slot sampling
parameters live on the host (engine.jax_backend.slot_sampling) and travel with each step as [R]
columns. `verify` (speculative decoding: a slot's last sample and its guessed tokens in one
step, engine.jax_backend.verify) runs only where `max_guesses` is configured above 0.

The service validates requests; here `ModelUsageError` guards the Model contract, because JAX
would clamp an out-of-range id or position silently instead of failing, and would write a
position whose page the table does not name into the null page. Ids at or past the
tokenizer's size (padding rows of the embedding) have no head column, so no sampling mode can
ever choose one.

Shapes: B slots, R rows in a step, T prompt tokens, S context, A attended positions, N pool
pages, P page size, W block table width, V embedding rows, V' ids the tokenizer can produce, E
hidden, K kv heads, D head dim, L layers.
"""

from __future__ import annotations

import collections
import logging
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from engine.core.model import (
    ChunkInput, DecodeInput, KvLayout, ModelInfo, ModelUsageError, PromptInput, Sample, SlotSetup,
)
from engine.core.model_options import SERVED, ModelOptions
from engine.jax_backend import cpu_kernels, host_memory, loading, mesh, packed_prefill, quantize, ragged_attention, transformer
from engine.jax_backend.compile_progress import CompileProgress
from engine.jax_backend.decode_launch import DecodeLaunch
from engine.jax_backend.backend_profile import PACKED_TOKENS, profile
from engine.jax_backend.loading import auto_weights, int8_layout
from engine.jax_backend.shapes import (
    MAX_CHUNK, MIN_ATTEND, MIN_BUCKET, Shapes, bucket, length_buckets, prompt_pieces, smallest_chunk,
)
from engine.jax_backend.slot_table import SlotTable, require
from engine.jax_backend.slot_sampling import TOP_N, SlotSamplingState, chunk_arrays, mask_row
from engine.jax_backend.steps import Pending, Steps, fetch
from engine.jax_backend.verify import Verifying, guess_buckets, max_guesses, verify_rows
from engine.jax_backend.weights import Weights, decode_weights, read_every_step
from engine.model_store.checkpoint import ModelConfig

log = logging.getLogger(__name__)

__all__ = [  # what callers import from here (the rest lives in the modules above)
    "JaxModel", "MAX_CHUNK", "MIN_ATTEND", "MIN_BUCKET", "PACKED_TOKENS", "auto_weights",
    "int8_layout", "length_buckets", "prompt_pieces", "smallest_chunk",
]


class JaxModel(DecodeLaunch, Verifying):
    """A loaded checkpoint plus its device state; implements engine.core.model.Model."""

    def __init__(
        self, config: ModelConfig, weights: Weights, info: ModelInfo, dtype: jnp.dtype, options: ModelOptions = SERVED,
        *, plan: mesh.Plan | None = None, kernel_state: str | None = None,
        kernel_build: cpu_kernels.BuildOptions | None = None, split_sampler: bool | None = None, **overrides,
    ) -> None:
        """`options` and `overrides` as `load` takes them; `plan`: tensor parallelism (where each
        array lives on the mesh; None: one device); `kernel_state`: the CPU kernels' state as
        `load` decided it (None: decided here)."""
        options, knobs = loading.settings(options, overrides)
        backend = profile()
        b, s = info.max_batch_size, info.max_context_length
        self.info, self.config, self._weights, self.plan = info, config, weights, plan
        self._head_size = weights.lm_head.shape[1] if plan is None else plan.head_size  # V'
        sharding, replicated = (None, None) if plan is None else (plan.cache, plan.replicated)
        self.kv = KvLayout(options.kv_page_size, loading.pool_pages(options, b, s))
        k, v = transformer.init_pool(config, self.kv.num_pages, self.kv.page_size, dtype, sharding)
        self._k, self._v = list(k), list(v)  # per layer [K, N, P, D]; each call swaps in new buffers
        self._mask = jnp.zeros((b, self._head_size), bool, device=replicated)
        self._last = jnp.zeros(b, jnp.int32, device=replicated)  # [B] last samples
        self._pending: collections.deque[Pending] = collections.deque()  # dispatched steps, oldest first
        self._held = None  # a split step whose sampling waits (decode_launch.Held)
        jit_options = dict(compiler_options=backend.compiler_options)
        # For operators: "on: <origin> <path>", "off: <reason>" or "not applicable: <reason>".
        self.kernel_state, self.cpu_threads = loading.cpu_kernels_for(
            options, dtype, 1 if plan is None else plan.size, backend, kernel_state, kernel_build
        )
        self.kernels = loading.kernels_on(self.kernel_state)
        self.int8 = isinstance(weights.embed, quantize.Int8Matrix)  # --weights int8 (engine.jax_backend.quantize)
        if self.int8 and not self.kernels:
            raise ValueError(f"int8 weights need the CPU kernels, which are {self.kernel_state}")
        # On a GPU, decode attention is the ragged Pallas kernel (engine.jax_backend.ragged_attention),
        # which reads each row's live length too; not under a mesh, whose partitioner cannot split it.
        self.ragged = not self.kernels and plan is None and ragged_attention.applies(config.head_dim, self.kv.page_size)
        self.shapes = Shapes.plan(
            b, s, options.max_prefill_chunk, options.max_step_tokens, knobs, backend,
            one_attend=self.kernels or self.ragged, kernels=self.kernels, mesh=plan is not None,
        )
        self.default_step_tokens = self.shapes.default_step_tokens
        self.fused_chunk_tokens = self.shapes.fused_chunk_tokens
        self.packed_prefill_tokens = self.shapes.packed_prefill_tokens
        self.max_guesses = max_guesses(options.max_guesses, plan is not None)  # speculative decoding (verify)
        # its row buckets, up to the one that holds max_verify_rows
        self.verify_rows = verify_rows(self.shapes.rows, self.max_guesses, self.kernels, options.max_verify_rows)
        self.guess_buckets = guess_buckets(self.max_guesses)  # and its guess counts
        self.split_sampler = backend.split_sampler if split_sampler is None else split_sampler
        # dispatch(..., sample_later=True) (engine.core.model): split, every step; else a step of
        # the smallest row bucket (engine.jax_backend.decode_launch)
        self.samples_apart = b if self.split_sampler else self.shapes.rows[0]
        # split: the greedy sampler for a step whose rows are all greedy (False: never; a switch for
        # measurements on one host: every process of a multi-host group must pick alike)
        self.greedy_variant = True
        self.sampler_calls: collections.Counter[str] = collections.Counter()  # split: steps per variant
        # a decode step reads every layer; with the kernels, panel copies for products of a few rows
        self._decode_weights, self._lm_head = decode_weights(weights, self.kernels and not self.int8)
        self._slots = SlotTable(b, s, config.vocab_size, self.kv.page_size, self.kv.num_pages)
        self._sampling = SlotSamplingState(b)
        if backend.host_scratch:  # each call's scratch reuses the last one's pages
            host_memory.keep_scratch_resident()
        self._steps = Steps(self.kernels, self.ragged, None if plan is None else self._head_size, jit_options)
        if backend.host_scratch:  # what every step reads whole: in huge pages, a page walk per 2 MiB, not per 4 KiB
            read = read_every_step(self._decode_weights, self._lm_head, weights.final_norm)
            log.info("weights in huge pages: %s", host_memory.weights_in_huge_pages(read))

    @classmethod
    def load(
        cls, model_dir: str | Path, options: ModelOptions = SERVED, *, max_batch_size: int = 8,
        model_id: str | None = None, kernel_build: cpu_kernels.BuildOptions | None = None,
        split_sampler: bool | None = None, **overrides,
    ) -> JaxModel:
        """Read a Hugging Face directory and build the model as decode-server serves it, unless
        told otherwise: `options` (default SERVED, decode-server's defaults) changed by
        `overrides`, each a ModelOptions field or a compile-time ShapeKnobs field; `max_batch_size`
        slots. engine.jax_backend.loading.load says what each keyword does and what it raises.
        """
        return loading.load(
            cls, model_dir, options, max_batch_size=max_batch_size, model_id=model_id, kernel_build=kernel_build,
            split_sampler=split_sampler, **overrides,
        )

    # The ladders compiled for, each ascending (engine.jax_backend.shapes)
    buckets = property(lambda self: self.shapes.prompt, doc="Prompt chunk lengths (the last is the largest chunk).")
    attend_buckets = property(lambda self: self.shapes.attend, doc="Attended lengths of a decode step.")
    row_buckets = property(lambda self: self.shapes.rows, doc="Row counts (the first R slots) of a decode step.")
    fused_chunk_sizes = property(lambda self: self.shapes.fused, doc="Sizes of a chunk along with a decode step.")
    packed_prefill_sizes = property(lambda self: self.shapes.packed, doc="Sequence lengths of a packed prefill.")
    packed_prefill_rows = property(lambda self: self.shapes.packed_rows, doc="Row counts of a packed prefill's sampling.")

    @property
    def cache(self) -> transformer.KVCache:
        """The current page pools (each step donates their buffers and installs the next) and a copy of the tables."""
        return transformer.KVCache(tuple(self._k), tuple(self._v), jnp.asarray(self._slots.tables))

    def decode_hlo(self, rows: int, attend: int, chunk: bool = False) -> str:
        """The compiled decode step (`chunk`: the one taking a chunk along; split_sampler: its layers) as HLO
        text, so tests can check that it is one executable whose cache buffers are aliased, never copied."""
        return self._lower_step(rows, attend, chunk).compile().as_text()

    def compilations(self) -> int:
        """How many (function, shape) variants this model has compiled so far."""
        return sum(f._cache_size() for f in self._steps.jitted())

    def warm_up(self) -> None:
        """Compile every shape serving can use: each prompt bucket (one prefill layer of each
        kind: the layers of one sliding window share a compiled call, and its last position as the
        sampler's rows), the decode steps and samplers of each row bucket (decode_launch), packed
        prefill, and verify steps where configured, run with every row idle. Only with no request
        in flight: every write goes to the null page. Logs "compiled k of n shapes" as it goes
        (engine.jax_backend.compile_progress)."""
        if self._slots.length.any() or self._slots.held.any():
            raise ModelUsageError("warm_up with requests in flight")
        shapes = self.shapes
        # each item below compiles as many executables as it adds; tests/test_compile_budget checks the sum
        kinds = len(set(self._layer_kinds()))  # layers of differing windows or MLPs compile apart
        # the last positions of a prompt as the smallest row bucket, of a packed prefill as each of
        # its row buckets: one program per (size, rows), which the two may share
        ends = {(t, shapes.rows[0]) for t in shapes.prompt} | {(t, r) for t in shapes.packed for r in shapes.packed_rows}
        progress = CompileProgress((1 + kinds) * len(shapes.prompt) + len(ends) + 1 + len(shapes.rows) + self._step_shapes()
                                   + kinds * len(shapes.packed) + self._verify_shapes())
        zero, one_row = np.int32(0), np.ones(shapes.rows[0], np.int32)
        for t in shapes.prompt:  # embed, one prefill layer of each kind, the last position as the smallest row bucket
            x = self._steps.embed(self._weights.embed, np.zeros((1, t), np.int32))
            self._through(self._steps.prefill_layers, x, self._put_once(self._null_table), zero, zero, zero, kinds_only=True)
            self._steps.prompt_ends(x, one_row)
            progress.advance(2 + kinds)
        self._mask = self._steps.write_mask(self._mask, np.zeros(self._head_size, bool), np.int32(0))
        for rows in shapes.rows:  # `ban`'s sizes
            self._mask = self._steps.write_masks(self._mask, np.zeros((rows, self._head_size), bool), np.zeros(rows, np.int32))
        progress.advance(1 + len(shapes.rows))
        self._warm_up_steps(progress)  # every decode step and both samplers per row bucket (decode_launch)
        for t in shapes.packed:  # packed prefill: one layer per size (padding into the null page), the ends per row bucket
            x = self._steps.embed(self._weights.embed, np.zeros((1, t), np.int32))
            x = self._through(self._steps.packed_layers, x, *self._packed_arrays([], [], t), kinds_only=True)
            for rows in shapes.packed_rows:
                self._steps.prompt_ends(x, np.ones(rows, np.int32))
            progress.advance(kinds + len({(t, r) for r in shapes.packed_rows} - {(t, shapes.rows[0]) for t in shapes.prompt}))
        self._warm_up_verify(progress)  # speculative decoding's verify step, where configured (engine.jax_backend.verify)
        self.release(0)

    def prefill(self, slot: int, prompt_token_ids: Sequence[int], setup: SlotSetup, masked: bool) -> Sample:
        return self.prefill_chunk(slot, prompt_token_ids, 0, len(prompt_token_ids), setup, masked)  # (it ends the prompt: a Sample)

    def prefill_chunk(
        self, slot: int, prompt_token_ids: Sequence[int], start: int, end: int, setup: SlotSetup, masked: bool
    ) -> Sample | None:
        n = len(prompt_token_ids)
        self._slots.check_chunk(slot, prompt_token_ids, start, end)
        if self._slots.free(slot):  # from 0, or after a prefix hit's pages
            self._take(slot, setup)
        table = self._put_once(self._slots.tables[slot].copy())  # [W], once for every layer's call
        x, last, new = None, 0, start
        for lo, hi, size in prompt_pieces(start, end, self.shapes.prompt, self.info.max_context_length):  # [lo, lo + size)
            tokens = np.zeros(size, np.int32)
            tokens[: hi - lo] = prompt_token_ids[lo:hi]
            x = self._steps.embed(self._weights.embed, tokens[None])  # [1, C, E]
            x = self._through(self._steps.prefill_layers, x, table, np.int32(lo), np.int32(new), np.int32(hi))
            last, new = hi - lo, hi  # the last real token's index in the piece, plus one; where new positions begin
        self._slots.length[slot] = end
        if end < n:
            return None
        self._slots.filling[slot] = False
        ends = np.ones(self.shapes.rows[0], np.int32)  # [R]: the prompt's last position, then rows for nobody
        ends[0] = last
        token, logprob, top = self._sample_prompts(self._steps.prompt_ends(x, ends), [slot], [masked], [n])
        return Sample(int(token[0]), float(logprob[0]), top[0])

    def prefill_packed(self, prompts: Sequence[PromptInput]) -> list[Sample]:
        """The prompts end to end in one sequence of the smallest packed size that holds them
        (transformer.packed_prefill_layers, one call per layer for all of them), then one head
        and sampling call for every prompt's last position (engine.jax_backend.packed_prefill)."""
        m, b = len(prompts), self.info.max_batch_size
        require(0 < m <= b and self.packed_prefill_tokens > 0, f"a packed prefill of {m} prompts")
        slots, lengths = [p.slot for p in prompts], [len(p.prompt_token_ids) for p in prompts]
        require(len(set(slots)) == m, "a slot twice in one packed prefill")
        require(sum(lengths) <= self.packed_prefill_tokens, f"{sum(lengths)} prompt tokens in one packed prefill")
        for p in prompts:
            self._slots.check_chunk(p.slot, p.prompt_token_ids, 0, len(p.prompt_token_ids))
        for p in prompts:
            self._take(p.slot, p.setup)
        size = bucket(self.shapes.packed, sum(lengths))
        x = self._steps.embed(self._weights.embed, packed_prefill.tokens(prompts, size))  # [1, T, E]
        x = self._through(self._steps.packed_layers, x, *self._packed_arrays(slots, lengths, size))
        for p in prompts:
            self._slots.length[p.slot] = len(p.prompt_token_ids)
            self._slots.filling[p.slot] = False
        rows = bucket(self.shapes.packed_rows, max(m, 2))
        x = self._steps.prompt_ends(x, packed_prefill.ends(lengths, rows))  # [R, 1, E]
        token, logprob, top = self._sample_prompts(x, slots, [p.masked for p in prompts], lengths)
        return [Sample(int(token[i]), float(logprob[i]), top[i]) for i in range(m)]

    def _take(self, slot: int, setup: SlotSetup) -> None:
        """A free slot starts a request: its sampling parameters and masked ids."""
        require(all(0 <= t < self.config.vocab_size for t in setup.masked_token_ids), "a masked id outside the vocabulary")
        require(setup.sampling.seed is not None, "no seed (the engine sets one for every request)")
        self._sampling.take(slot, setup.sampling)
        row = mask_row(self._head_size, self.info.vocab_size, setup.masked_token_ids, setup.banned)  # [V']
        self._mask = self._steps.write_mask(self._mask, row, np.int32(slot))
        self._slots.filling[slot] = True

    def set_pages(self, slot: int, pages: Sequence[int]) -> None:
        """The slot's block table from now on (host only: each call takes the table along)."""
        self._slots.set_pages(slot, pages)

    def decode(self, inputs: Sequence[DecodeInput]) -> list[Sample]:
        require(not self._pending and self._held is None, "decode with a dispatched step not yet collected")
        self.dispatch(inputs)
        return self.collect()

    def dispatch(self, inputs: Sequence[DecodeInput], chunk: ChunkInput | None = None, sample_later: bool = False) -> None:
        """Enqueue one decode step and return without waiting for it: the device runs it while
        the host reads the previous step (`collect`). An input whose token_id is None feeds the
        slot's last sample, which never left the device. A `chunk` (at most fused_chunk_tokens,
        padded to their compiled size) is prefilled in the same executable
        (transformer.mixed_layers), its slot then awaiting its next chunk as after prefill_chunk.
        `sample_later` (split_sampler): the layers only, the sampling at `dispatch_sampling`."""
        slots, given = self._slots.check_step(inputs)
        rows = bucket(self.shapes.rows, int(slots.max()) + 1)
        attend = bucket(self.shapes.attend, int(given.max()) + 1)
        arrays = None
        if chunk is not None:
            c = chunk
            require(0 < c.end - c.start <= self.fused_chunk_tokens, f"a chunk of {c.end - c.start} tokens along with a step")
            require(c.slot not in set(slots.tolist()), f"slot {c.slot} both decodes and prefills in one step")
            size = bucket(self.shapes.fused, c.end - c.start)
            require(c.start + size <= self.info.max_context_length, "a chunk along with a step past the context")
            self._slots.check_chunk(c.slot, c.prompt_token_ids, c.start, c.end)
            require(c.end < len(c.prompt_token_ids), "a prompt's last chunk along with a step (it samples)")
            if self._slots.free(c.slot):  # from 0, or after a prefix hit's pages
                self._take(c.slot, c.setup)
            arrays = chunk_arrays(self._slots.tables[c.slot], c.prompt_token_ids[c.start : c.end], c.start, size)
        self._launch(slots, *self._pack(inputs, rows), attend, arrays, sample_later=sample_later)
        self._slots.length[slots] += 1
        if chunk is not None:
            self._slots.length[chunk.slot] = chunk.end

    def collect(self) -> list[Sample]:
        """The oldest dispatched step's samples, one per input in input order (waits for the device)."""
        require(bool(self._pending), "collect with no step dispatched (or only one whose sampling waits)")
        step = self._pending.popleft()
        tokens, logprobs, tops = fetch(step.samples, step.top_n)
        slots = step.slots.tolist()
        return [Sample(t, p, tops[s]) for s, t, p in zip(slots, tokens[slots].tolist(), logprobs[slots].tolist())]

    def rewind(self, slot: int, length: int) -> None:
        """The slot's count back to `length`, with no step in flight: its next step feeds position
        `length` (its token given: the last sample is no longer the one before it). A draft
        model's speculative positions, once the target rejected them (engine.core.speculation.draft)."""
        require(not self._pending and self._held is None, "rewind with a dispatched step not yet collected")
        self._slots.rewind(slot, length)

    def release(self, slot: int) -> None:
        self._slots.release(slot)
        self._sampling.release(slot)

    @property
    def _null_table(self) -> np.ndarray:
        """A block table naming no page [W]: every write through it goes to the null page."""
        return np.zeros(self._slots.tables.shape[1], np.int32)

    def _pack(self, inputs: Sequence[DecodeInput], rows: int) -> tuple[np.ndarray, np.ndarray]:
        """A step's packed host inputs, the rows' block tables among them (slot_sampling.pack)."""
        return self._sampling.pack(inputs, rows, self._slots.tables)

    def _packed_arrays(self, slots: Sequence[int], lengths: Sequence[int], size: int) -> tuple[np.ndarray, ...]:
        """A packed prefill's per-token pages, positions and prompts (packed_prefill.token_arrays)."""
        return packed_prefill.token_arrays(self._slots.tables, slots, lengths, size, self.kv.page_size)

    def _put_once(self, array: np.ndarray) -> jax.Array:
        """A host input that several calls read (a prefill's table, for each layer): on the device once."""
        return jax.device_put(array) if self.plan is None else self.plan.put(array)

    def _put(self, tree):
        """Per-step host inputs for the step: as they are on one device (the jitted call copies
        numpy arrays itself, less host work than a device_put first, and on the CPU that work takes
        cores from the step; docs/benchmarks.md, 'Figures behind code comments'), onto every device of the mesh,
        replicated, under tensor parallelism."""
        return tree if self.plan is None else self.plan.put(tree)

    def _through(self, layer_call, x: jax.Array, *args, kinds_only: bool = False) -> jax.Array:
        """Hidden states x [1, T, E] through every layer (`kinds_only`: only the first layer of
        each kind, i.e. of each sliding window, which is what warm-up must compile), one jitted
        call per layer (`layer_call`: a prompt piece's prefill_layers, or packed_layers) with its
        cache buffers donated, the returned buffers installed; -> hidden states. A family whose
        layers differ (ModelConfig.layer_windows) passes each call its layer's window, static."""
        per_layer = self.config.layer_windows
        kinds = self._layer_kinds()
        for i, layer in enumerate(self._decode_weights):
            if kinds_only and kinds.index(kinds[i]) != i:
                continue
            x, self._k[i : i + 1], self._v[i : i + 1] = layer_call(
                (layer,), (self._k[i],), (self._v[i],), x, *args, cfg=self.config,
                windows=None if per_layer is None else per_layer[i : i + 1],
            )
        return x

    def _layer_kinds(self) -> list[tuple]:
        """Per layer what its prefill call compiles for: its window, and whether its MLP is
        experts (engine.jax_backend.moe) or dense (Qwen3-MoE's mlp_only_layers mix the two)."""
        windows = self.config.layer_windows or (self.config.sliding_window,) * self.config.n_layers
        return [(window, layer.experts is None) for window, layer in zip(windows, self._decode_weights, strict=True)]

    def _sample_prompts(self, x: jax.Array, slots: Sequence[int], masked: Sequence[bool], lengths: Sequence[int]):
        """Head and sampling of prompts' last positions x [R, 1, E] (the first len(slots) rows;
        the rest sample for nobody), by the sampler of that row bucket that decode steps use too,
        each sample also the slot's first decode input on the device. -> sampled ids [R], their
        logprobs [R], and per row its alternatives (fetched from the device only when some row
        asks for them)."""
        ints, floats, at = self._sampling.pack_prompts(slots, masked, lengths, x.shape[0], self._slots.tables.shape[1])
        samples = self._sample(x, *self._both_calls((ints, floats)), self._put(at), self._all_greedy(ints, floats))
        return fetch(samples, ints[:, TOP_N])
