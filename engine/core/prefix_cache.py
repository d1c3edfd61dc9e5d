"""`PrefixCache`: which prompt prefixes have their KV kept in the model's prefix pool.

Automatic prefix caching. A prompt is cut into blocks of `block_tokens` ids; block i of a prompt
is cached under (the pool block holding block i-1, the ids of block i), so a key names the
whole prefix up to its end, exactly (a trie over blocks, no hashes, so no collisions). The model
keeps each cached block's KV in a pool block of its own (`Model.save_prefix` / `load_prefix`
copy between a slot and the pool); this class only decides which pool block holds what.

Eviction is least recently used, and only ever takes a leaf: every lookup and insert touches
its chain from the deepest block up to the first, so a block is always more recent than the
blocks below it, and a block with children is never the victim (checked anyway: a parent's pool
block reused while children still point at it would hand them another prefix's KV).

Pure bookkeeping on the engine thread; nothing here touches a device.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Sequence

_ROOT = -1  # the parent of a prompt's first block


@dataclass(frozen=True)
class PrefixPool:
    """What a model offers for prefix caching: `blocks` pool blocks of `block_tokens` positions
    each (`blocks == 0`: no prefix cache)."""

    block_tokens: int
    blocks: int

    def __post_init__(self) -> None:
        if self.block_tokens < 1 or self.blocks < 0:
            raise ValueError(f"a prefix pool needs block_tokens >= 1 and blocks >= 0, got {self}")

    @property
    def tokens(self) -> int:
        return self.block_tokens * self.blocks


@dataclass
class _Node:
    key: tuple[int, tuple[int, ...]]  # (parent's pool block or _ROOT, this block's ids)
    children: int = 0


class PrefixCache:
    def __init__(self, pool: PrefixPool) -> None:
        if pool.blocks < 1:
            raise ValueError("a prefix cache needs at least one pool block")
        self.block_tokens = pool.block_tokens
        self.capacity = pool.blocks
        self._index: dict[tuple[int, tuple[int, ...]], int] = {}  # key -> pool block
        self._lru: collections.OrderedDict[int, _Node] = collections.OrderedDict()  # pool block -> node, oldest first
        self._free = list(range(pool.blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...

    def __len__(self) -> int:
        """Pool blocks holding a cached prefix block."""
        return len(self._lru)

    def _blocks(self, ids: Sequence[int], n: int) -> list[tuple[int, ...]]:
        b = self.block_tokens
        return [tuple(ids[i * b : (i + 1) * b]) for i in range(n)]

    def match(self, ids: Sequence[int], max_blocks: int) -> list[int]:
        """The pool blocks holding the longest cached prefix of `ids`, in whole blocks, at most
        `max_blocks` of them (the caller keeps at least one prompt token to compute); marks them
        used."""
        chain, parent = [], _ROOT
        for block in self._blocks(ids, min(max_blocks, len(ids) // self.block_tokens)):
            found = self._index.get((parent, block))
            if found is None:
                break
            chain.append(found)
            parent = found
        self._touch(chain)
        return chain

    def insert(self, ids: Sequence[int], n_blocks: int) -> list[tuple[int, int]]:
        """Cache the first `n_blocks` whole blocks of `ids` (all their positions are in a slot).
        -> (block number in the prompt, pool block) for each block the caller must now copy into
        the pool; blocks already cached are reused and not listed. When the pool is full the least
        recently used leaves make room; if none can (every block is on this prompt's chain), the
        rest of the prompt is not cached."""
        chain, to_copy, parent = [], [], _ROOT
        for i, block in enumerate(self._blocks(ids, min(n_blocks, len(ids) // self.block_tokens))):
            key = (parent, block)
            found = self._index.get(key)
            if found is None:
                found = self._take(protect=set(chain))
                if found is None:
                    break
                self._index[key] = found
                self._lru[found] = _Node(key)
                if parent != _ROOT:
                    self._lru[parent].children += 1
                to_copy.append((i, found))
            chain.append(found)
            parent = found
        self._touch(chain)
        return to_copy

    def _touch(self, chain: list[int]) -> None:
        for block in reversed(chain):  # deepest first, so every parent ends more recent than its children
            self._lru.move_to_end(block)

    def _take(self, protect: set[int]) -> int | None:
        """A free pool block, evicting the least recently used leaf outside `protect` if needed."""
        if self._free:
            return self._free.pop()
        victim = next((b for b, node in self._lru.items() if node.children == 0 and b not in protect), None)
        if victim is None:
            return None
        node = self._lru.pop(victim)
        del self._index[node.key]
        parent = node.key[0]
        if parent != _ROOT:
            self._lru[parent].children -= 1
        return victim
