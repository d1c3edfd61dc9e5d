"""`DevicePrefixPool`: the prefix cache's blocks of KV on the device, and the copies between them
and the slots' cache.

engine.core.prefix_cache decides which prompt blocks the pool keeps (`PrefixPool`, the
bookkeeping); this holds their K and V (L buffers of [N, K, P, D]: N pool blocks of P =
PREFIX_BLOCK positions, laid out as a cache of N "slots"), and copies whole blocks from the pool
into a slot (`load_prefix`) and from a slot into the pool (`save_prefix`), each one compiled loop
whatever the number of blocks. Kept apart from the model's execution: a paged KV cache will
replace it.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import numpy as np

from engine.core.prefix_cache import PrefixPool
from engine.jax_backend import transformer

PREFIX_BLOCK = 16  # positions per prefix-cache block (the unit of prefix matching)


def _load_blocks(
    k_caches: tuple[jax.Array, ...],  # L x [B, K, S, D], donated
    v_caches: tuple[jax.Array, ...],
    k_pool: tuple[jax.Array, ...],  # L x [N, K, P, D]: N pool blocks of P positions
    v_pool: tuple[jax.Array, ...],
    slot: jax.Array,  # []
    pool_blocks: jax.Array,  # [M] the pool block of prefix block i, the first `count` used
    count: jax.Array,  # []
) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """Write pool block pool_blocks[i] at the slot's positions [i*P, (i+1)*P), for i < count."""
    p = k_pool[0].shape[2]

    def one(i, kv):
        at = (slot, 0, i * p, 0)
        put = lambda cache, pool: jax.lax.dynamic_update_slice(cache, pool[pool_blocks[i]][None], at)  # noqa: E731
        return tuple(map(put, kv[0], k_pool)), tuple(map(put, kv[1], v_pool))

    return jax.lax.fori_loop(0, count, one, (k_caches, v_caches))


def _save_blocks(
    k_pool: tuple[jax.Array, ...],  # L x [N, K, P, D], donated
    v_pool: tuple[jax.Array, ...],
    k_caches: tuple[jax.Array, ...],  # L x [B, K, S, D]
    v_caches: tuple[jax.Array, ...],
    slot: jax.Array,  # []
    blocks: jax.Array,  # [M] prefix block numbers, the first `count` used
    pool_blocks: jax.Array,  # [M] the pool block each goes to
    count: jax.Array,  # []
) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """Copy the slot's positions [b*P, (b+1)*P) into pool block pool_blocks[i], b = blocks[i]."""
    _, k, p, d = k_pool[0].shape

    def one(i, pools):
        take = lambda pool, cache: jax.lax.dynamic_update_slice(  # noqa: E731
            pool, jax.lax.dynamic_slice(cache, (slot, 0, blocks[i] * p, 0), (1, k, p, d)), (pool_blocks[i], 0, 0, 0)
        )
        return tuple(map(take, pools[0], k_caches)), tuple(map(take, pools[1], v_caches))

    return jax.lax.fori_loop(0, count, one, (k_pool, v_pool))


class DevicePrefixPool:
    """`tokens` positions of prompt KV (rounded down to whole blocks; 0: none) for a context of
    `context` positions. `jit_options`: the model's compiler options."""

    def __init__(self, config, tokens: int, context: int, dtype, sharding, jit_options: dict) -> None:
        if tokens < 0:
            raise ValueError(f"prefix_cache_tokens must be >= 0, got {tokens}")
        self.pool = PrefixPool(PREFIX_BLOCK, tokens // PREFIX_BLOCK)
        pool = transformer.init_cache(config, self.pool.blocks, PREFIX_BLOCK, dtype, sharding)  # blocks as "slots"
        self._k, self._v = pool.k, pool.v
        self._max_blocks = context // PREFIX_BLOCK
        # a function object of this pool's (functools.partial): jit caches, and so compilations(), are per model
        self._load = jax.jit(functools.partial(_load_blocks), donate_argnums=(0, 1), **jit_options)
        self._save = jax.jit(functools.partial(_save_blocks), donate_argnums=(0, 1), **jit_options)
        self.jitted = (self._load, self._save)

    def _index(self, values: Sequence[int]) -> np.ndarray:
        """Block numbers padded to one shape, the most blocks a context holds, so that every copy
        of any length runs the one compiled loop."""
        index = np.zeros(self._max_blocks, np.int32)
        index[: len(values)] = values
        return index

    def into_slot(self, k: list, v: list, slot: int, pool_blocks: Sequence[int]) -> tuple[list, list]:
        """The slot's cache (k, v: L buffers each, donated) with pool blocks `pool_blocks` at its
        first positions; -> the new buffers."""
        k, v = self._load(
            tuple(k), tuple(v), self._k, self._v, np.int32(slot), self._index(pool_blocks), np.int32(len(pool_blocks))
        )
        return list(k), list(v)

    def from_slot(self, k: list, v: list, slot: int, numbers: Sequence[int], pool_blocks: Sequence[int]) -> None:
        """The slot's blocks `numbers` (of its cache k, v) into pool blocks `pool_blocks`."""
        self._k, self._v = self._save(
            self._k, self._v, tuple(k), tuple(v), np.int32(slot),
            self._index(numbers), self._index(pool_blocks), np.int32(len(pool_blocks)),
        )
