"""`JaxModel`: the real model behind engine.model.Model, a JAX decoder with a slot-based KV cache.

Data flow: `load` reads a checkpoint (engine.checkpoint) and allocates the device state once: the
KV cache (L buffers of [B, S, K, D]) and each slot's banned-id row [B, V]. `prefill` runs one
prompt, padded to the smallest bucket that holds it, into a slot and samples its first token;
`decode` runs one token for all B slots at a fixed batch shape and attends over the smallest
bucket that covers every active slot's position. Both are single jitted calls that take the state
donated and hand back the updated one, so the cache is written in place. Per-slot sampling
parameters live on the host and travel with each call as [B] arrays (a few bytes); sampling runs
inside the call (engine.sampling).

Shapes are bucketed (powers of two from MIN_BUCKET up to the context, plus the context itself) and
`warm_up` compiles every bucket, so serving compiles nothing: `compilations()` lets tests check.
The service validates requests; here only asserts guard the invariants, because JAX would clamp an
out-of-range id or position silently instead of failing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from engine import sampling, transformer
from engine.checkpoint import CheckpointError, ModelConfig, Weights, default_dtype, load_checkpoint
from engine.model import DecodeInput, ModelInfo, Sample, SlotSetup
from engine.sampling import SlotSampling

MIN_BUCKET = 16


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DeviceState:
    """Everything a step updates in place: donated in, returned out."""

    cache: transformer.KVCache
    mask: jax.Array  # [B, V] bool, each slot's masked_token_ids, written at prefill


def length_buckets(max_context: int, smallest: int = MIN_BUCKET) -> tuple[int, ...]:
    """Powers of two from `smallest` below `max_context`, then `max_context` itself."""
    sizes, size = [], smallest
    while size < max_context:
        sizes.append(size)
        size *= 2
    return (*sizes, max_context)


def _bucket(buckets: tuple[int, ...], length: int) -> int:
    return next(b for b in buckets if b >= length)


def _prefill_step(
    weights: Weights,
    state: DeviceState,
    tokens: jax.Array,  # [T] prompt then padding
    length: jax.Array,  # [] real prompt length
    slot: jax.Array,  # []
    mask_row: jax.Array,  # [V] bool
    masked: jax.Array,  # [] bool
    params: SlotSampling,  # one row
    cfg: ModelConfig,
) -> tuple[jax.Array, jax.Array, DeviceState]:
    logits, cache = transformer.prefill(weights, state.cache, tokens, length, slot, cfg)  # [V]
    mask = jax.lax.dynamic_update_slice(state.mask, mask_row[None], (slot, 0))  # [B, V]
    token, logprob = sampling.sample(logits[None], params, length[None], mask_row[None], masked[None])
    return token[0], logprob[0], DeviceState(cache, mask)


def _decode_step(
    weights: Weights,
    state: DeviceState,
    tokens: jax.Array,  # [B] last sampled token per slot
    positions: jax.Array,  # [B] that token's position
    active: jax.Array,  # [B] bool, slots in this step
    masked: jax.Array,  # [B] bool
    params: SlotSampling,  # [B] rows
    cfg: ModelConfig,
    attend: int,
) -> tuple[jax.Array, jax.Array, DeviceState]:
    logits, cache = transformer.decode(weights, state.cache, tokens, positions, active, cfg, attend)  # [B, V]
    token, logprob = sampling.sample(logits, params, positions + 1, state.mask, masked & active)
    return token, logprob, DeviceState(cache, state.mask)


class JaxModel:
    """A loaded checkpoint plus its device state; implements engine.model.Model."""

    def __init__(
        self,
        config: ModelConfig,
        weights: Weights,
        info: ModelInfo,
        dtype: jnp.dtype,
        min_bucket: int = MIN_BUCKET,
    ) -> None:
        b, v = info.max_batch_size, config.vocab_size
        self.info = info
        self.config = config
        self._weights = weights
        self._state = DeviceState(
            transformer.init_cache(config, b, info.max_context_length, dtype), jnp.zeros((b, v), bool)
        )
        self._buckets = length_buckets(info.max_context_length, min(min_bucket, info.max_context_length))
        self._length = np.zeros(b, np.int64)  # positions written per slot; 0 = free slot
        self._temperature = np.zeros(b, np.float32)
        self._top_k = np.zeros(b, np.int32)
        self._top_p = np.ones(b, np.float32)
        self._min_p = np.zeros(b, np.float32)
        self._seed = np.zeros((b, 2), np.uint32)
        self._prefill = jax.jit(_prefill_step, static_argnames=("cfg",), donate_argnames=("state",))
        self._decode = jax.jit(_decode_step, static_argnames=("cfg", "attend"), donate_argnames=("state",))

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        *,
        max_batch_size: int = 8,
        max_context_length: int | None = None,
        dtype: str | None = None,
        model_id: str | None = None,
        min_bucket: int = MIN_BUCKET,
    ) -> JaxModel:
        """Read a Hugging Face directory; context defaults to min(max_position_embeddings, 2048).

        `min_bucket` is the smallest compiled length: fewer buckets compile faster (tests use one).
        """
        model_dir = Path(model_dir)
        ckpt = load_checkpoint(model_dir, dtype)
        cfg = ckpt.config
        context = max_context_length or min(cfg.max_position_embeddings, 2048)
        if cfg.sliding_window is not None and cfg.sliding_window < context:
            raise CheckpointError(
                f"{cfg.architecture}: sliding_window {cfg.sliding_window} < context {context} is not supported"
            )
        info = ModelInfo(
            model_id=model_id or model_dir.name,
            vocab_size=cfg.vocab_size,
            max_context_length=context,
            max_batch_size=max_batch_size,
            eos_token_ids=ckpt.eos_token_ids,
        )
        return cls(cfg, ckpt.weights, info, jnp.dtype(dtype or default_dtype()), min_bucket)

    @property
    def buckets(self) -> tuple[int, ...]:
        """Prompt and attended lengths compiled for, in increasing order."""
        return self._buckets

    @property
    def cache(self) -> transformer.KVCache:
        """The current KV cache; each step consumes (donates) it and installs the next."""
        return self._state.cache

    def decode_hlo(self, attend: int) -> str:
        """The compiled decode step for `attend` as HLO text (cached once warmed up), so tests can
        check that the cache is aliased to the output and never copied."""
        idle, off = np.zeros(self.info.max_batch_size, np.int32), np.zeros(self.info.max_batch_size, bool)
        lowered = self._decode.lower(
            self._weights, self._state, idle, idle, off, off, self._decode_params(), cfg=self.config, attend=attend
        )
        return lowered.compile().as_text()

    def compilations(self) -> int:
        """How many (step, shape) variants have been compiled so far."""
        return self._prefill._cache_size() + self._decode._cache_size()

    def warm_up(self) -> None:
        """Compile every prefill and decode bucket. Only with no request in flight: writes slot 0."""
        assert not self._length.any(), "warm_up with requests in flight"
        b = self.info.max_batch_size
        for size in self._buckets:
            self._run_prefill(0, np.zeros(size, np.int32), 1, np.zeros(self.config.vocab_size, bool), False)
        idle = np.zeros(b, np.int32)
        for size in self._buckets:
            self._run_decode(idle, idle, np.zeros(b, bool), np.zeros(b, bool), size)
        self.release(0)

    def prefill(self, slot: int, prompt_token_ids: Sequence[int], setup: SlotSetup, masked: bool) -> Sample:
        n = len(prompt_token_ids)
        v = self.config.vocab_size
        assert self._length[slot] == 0, f"slot {slot} is in use"
        assert 1 <= n < self.info.max_context_length, n
        assert all(0 <= t < v for t in prompt_token_ids), "prompt id out of vocab"
        assert all(0 <= t < v for t in setup.masked_token_ids), "masked id out of vocab"
        s = setup.sampling
        assert s.seed is not None, "the engine sets a seed for every request"
        self._temperature[slot], self._top_k[slot] = s.temperature, s.top_k
        self._top_p[slot], self._min_p[slot] = s.top_p, s.min_p
        self._seed[slot] = sampling.seed_words(s.seed)
        tokens = np.zeros(_bucket(self._buckets, n), np.int32)
        tokens[:n] = prompt_token_ids
        mask_row = np.zeros(v, bool)
        mask_row[list(setup.masked_token_ids)] = True
        token, logprob = self._run_prefill(slot, tokens, n, mask_row, masked)
        self._length[slot] = n
        return Sample(token, logprob)

    def decode(self, inputs: Sequence[DecodeInput]) -> list[Sample]:
        b = self.info.max_batch_size
        tokens, positions = np.zeros(b, np.int32), np.zeros(b, np.int32)
        active, masked = np.zeros(b, bool), np.zeros(b, bool)
        for i in inputs:
            assert not active[i.slot], f"slot {i.slot} twice in one step"
            assert self._length[i.slot] > 0, f"slot {i.slot} was not prefilled"
            assert i.position == self._length[i.slot], f"slot {i.slot}: position {i.position} is not the next one"
            assert i.position < self.info.max_context_length, f"slot {i.slot}: position {i.position} past context"
            assert 0 <= i.token_id < self.config.vocab_size, "token id out of vocab"
            tokens[i.slot], positions[i.slot] = i.token_id, i.position
            active[i.slot], masked[i.slot] = True, i.masked
        attend = _bucket(self._buckets, int(positions.max()) + 1)
        out_tokens, out_logprobs = self._run_decode(tokens, positions, active, masked, attend)
        for i in inputs:
            self._length[i.slot] += 1
        return [Sample(int(out_tokens[i.slot]), float(out_logprobs[i.slot])) for i in inputs]

    def release(self, slot: int) -> None:
        self._length[slot] = 0
        self._temperature[slot], self._top_k[slot], self._top_p[slot], self._min_p[slot] = 0.0, 0, 1.0, 0.0
        self._seed[slot] = 0

    def _run_prefill(
        self, slot: int, tokens: np.ndarray, length: int, mask_row: np.ndarray, masked: bool
    ) -> tuple[int, float]:
        row = slice(slot, slot + 1)
        params = SlotSampling(
            self._temperature[row], self._top_k[row], self._top_p[row], self._min_p[row], self._seed[row]
        )
        token, logprob, self._state = self._prefill(
            self._weights, self._state, tokens, np.int32(length), np.int32(slot), mask_row, np.bool_(masked),
            params, cfg=self.config,
        )
        token, logprob = jax.device_get((token, logprob))
        return int(token), float(logprob)

    def _run_decode(
        self, tokens: np.ndarray, positions: np.ndarray, active: np.ndarray, masked: np.ndarray, attend: int
    ) -> tuple[np.ndarray, np.ndarray]:
        out_tokens, out_logprobs, self._state = self._decode(
            self._weights, self._state, tokens, positions, active, masked, self._decode_params(),
            cfg=self.config, attend=attend,
        )
        return jax.device_get((out_tokens, out_logprobs))

    def _decode_params(self) -> SlotSampling:
        return SlotSampling(self._temperature, self._top_k, self._top_p, self._min_p, self._seed)
