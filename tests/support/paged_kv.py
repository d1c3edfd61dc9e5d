"""Paged KV pools for the attention kernels' tests (tests/test_cpu_kernels.py,
tests/test_chunk_attention_kernel.py): block tables with shuffled pages and shared prefixes, pools
whose every position no sequence holds is NaN (so a read past a sequence's keys shows in its
output), and a float64 reference that gathers each sequence's keys through its table."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def tables(rng: np.random.Generator, lengths: Sequence[int], page_size: int, width: int,
           shared: int = 0) -> tuple[np.ndarray, int]:
    """Block tables for sequences of `lengths` positions: each sequence's pages drawn from a
    shuffled pool (so a table's pages are in no order), entries past its pages 0 (the null page);
    with `shared` > 0 sequence 1 starts with sequence 0's first `shared` pages (a shared prefix).
    -> (tables [R, W] int32, N: pages in the pool, the null page 0 included)."""
    counts = [-(-n // page_size) for n in lengths]
    needed = sum(counts) - (min(shared, counts[1]) if shared else 0)
    order = rng.permutation(np.arange(1, needed + 4)).astype(np.int32)  # 3 pages no table names
    out = np.zeros((len(lengths), width), np.int32)
    taken = 0
    for r, count in enumerate(counts):
        assert count <= width, (count, width)
        reused = min(shared, count) if shared and r == 1 else 0
        out[r, :reused] = out[0, :reused]
        out[r, reused:count] = order[taken : taken + count - reused]
        taken += count - reused
    return out, needed + 4


def pools(rng: np.random.Generator, tables_: np.ndarray, lengths: Sequence[int], kv_heads: int, pages: int,
          page_size: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """K and V pools [K, N, P, D] float32: random values at every position a sequence holds
    (position p of sequence r: page tables_[r, p // P], offset p % P), NaN everywhere else (the
    null page, unwritten page tails, pages no table names)."""
    k = np.full((kv_heads, pages, page_size, head_dim), np.nan, np.float32)
    v = np.full_like(k, np.nan)
    for r, n in enumerate(lengths):
        for p in range(n):
            page, at = tables_[r, p // page_size], p % page_size
            if np.isnan(k[0, page, at, 0]):  # a shared page keeps the values its first sequence wrote
                k[:, page, at] = rng.standard_normal((kv_heads, head_dim), np.float32)
                v[:, page, at] = rng.standard_normal((kv_heads, head_dim), np.float32)
    return k, v


def gather(pool: np.ndarray, table: np.ndarray, n: int) -> np.ndarray:
    """Positions 0..n-1 of one sequence, [K, n, D], read through its table."""
    p = np.arange(n)
    return pool[:, table[p // pool.shape[2]], p % pool.shape[2]]


def attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, seen: int) -> np.ndarray:
    """One query's causal GQA attention in float64: q [H, D], keys / values [K, >= seen, D], over
    positions 0..seen-1 -> [H * D]."""
    heads, d = q.shape
    group = heads // keys.shape[0]
    k = np.repeat(keys[:, :seen].astype(np.float64), group, axis=0)  # [H, seen, D]
    v = np.repeat(values[:, :seen].astype(np.float64), group, axis=0)  # [H, seen, D]
    scores = np.einsum("hd,hsd->hs", q.astype(np.float64), k) / np.sqrt(d)  # [H, seen]
    p = np.exp(scores - scores.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    return np.einsum("hs,hsd->hd", p, v).reshape(heads * d)
