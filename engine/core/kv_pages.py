"""`KvPages`: which physical KV pages each sequence's block table names, and which full pages
are shared as a cached prefix (issue 41). The scheduler (engine.core.engine) owns one and tells
the model each slot's table (`Model.set_pages`).

The model keeps K and V, per layer, in one pool of `num_pages` pages of `page_size`
positions. A sequence's position p lives in page `table[p // page_size]` at offset
`p % page_size`. Page 0 is the null page: it pads block tables (`table`) and is never handed out.
This class is the bookkeeping alone, pure Python on the engine thread: it hands out and takes
back page ids, counts references and keeps the prefix index; it never touches a device.

Every page but 0 is in exactly one state:
  free    held by no block table, caching nothing;
  used    held by one or more block tables (its refcount is how many);
  cached  held by none but still keyed in the prefix index: evictable, least recently released
          first, and only when a page is needed and none is free.

**Prefix caching by sharing.** Once a sequence has written the KV of a full page, `publish` keys
that page by (its parent: the page before it in the same table, 0 for a first page; its
`page_size` token ids). A key thus names the whole prefix up to the page's end, exactly: the
index is a trie of pages, with no hash that could collide. `lookup` walks a prompt's full pages
from the first and returns the longest chain found; `admit` puts those very pages in the new
table and counts the references, with no copy. A page whose key is already cached when it is
published (two sequences computed the same prefix at once) is swapped for the cached one and
freed, so a prefix is held once.

**What holds, and why sharing is safe.**
  1. Only full pages are keyed, and a sequence writes only at positions >= what it has written,
     so a keyed page is never written again; private pages have refcount 1.
  2. The last prompt page is never shared: a hit covers at most `(len(prompt) - 1) // page_size`
     pages, so the page holding the prompt's last position is the sequence's own. That position
     is always computed (its logits sample the first token) and its KV written; writing it into
     a shared page would change what other tables read. A prompt that is not a whole number of
     pages loses nothing by this (its last page is partial, never keyed). A prompt that ends on
     a page boundary and is cached whole recomputes its whole last page (`page_size` positions,
     not one) into a fresh page; publishing it then finds the cached twin and swaps to it.
     Copy-on-write of that one page (a device copy, then one position computed) would save up to
     `page_size - 1` positions of compute per such hit: not worth a model operation now.
  3. A table that holds a keyed page holds its parent too (hits and publishes go from the first
     page on, and a swap keeps the parent), so a referenced page never has an unreferenced
     parent, and every cached page's subtree is cached too.
  4. Eviction takes leaves first, in LRU order, so a page is never evicted while a child keyed
     under its id is cached: a key's parent id always names its live parent, and a reused page
     id can never make a stale child match. Leaves first costs nothing: by 3, a page is released
     no earlier than its children, and `free` releases a table deepest page first, so a parent
     is always more recent than its cached children and the least recently released page is a
     leaf (checked anyway: evicting a parent would corrupt the index, so it raises). The other
     choice, evicting a parent and dropping its now unreachable children with it, frees pages
     nobody asked to free.

**Admission and preemption.** `can_admit` and `admit` take a whole prompt at once: its hit is
attached and pages for the rest are taken then, so a prompt never stalls half-read for want of
pages. They count free pages plus evictable ones, less the hit's own pages that are evictable
(attaching them makes them used), and leave `reserve_pages` for running sequences to grow
into; `grow`, the decode-time path, may use the reserve. When `grow` fails, the scheduler
preempts `victim()` (the most recently admitted sequence, perhaps the one growing), publishes
what it has written and frees it (`preempt`): its full pages stay cached, so its recompute
(prompt plus the tokens produced so far, as a new prompt) is mostly a hit. The scheduler admits
with no reserve when no sequence is admitted (a pool that is all free or cached has nothing to
grow into it), so `could_ever_fit(..., reserve_pages=0)` is the test of a request that will
run: alone in the pool it is admitted and every page is there to grow into, and while others
run beside it the oldest is never the victim, so the oldest always moves on.

**Which free page: runs of adjacent ids.** The CPU decode kernel reads a row's pages one after
another, and is as fast as over a contiguous cache only when they lie next to each other in
memory, in runs of about 8 pages or more (engine/jax_backend/kernels/decode_attention.cc;
benchmarks/paged_attention_kernel.py). A free list hands the sequences that grow in the same
decode steps their pages in turn, so every table interleaves with the others. Here a table takes
the page right after its last one when that page is free; else it starts a new run inside the
largest run of free pages: at its first page when no table ends just before it, else far enough
in to leave that table half the room to grow into (after the pages asked for now). A prompt's
pages are taken the same way, a run at a time. Only when no page is free is a cached one
evicted, as before (LRU, leaves first): a cached page is never evicted to stay adjacent. Which
free page is taken is all this changes: every call takes a free page exactly when a free list
would, so admissions, growth, evictions and preemptions happen as they would with one
(tests/test_kv_pages.py checks it call for call against `FreeListPages`, the free list kept as
the reference). The free pages are kept as maximal runs (`_FreeRuns`), indexed by both ends and
in a heap by length: taking or freeing pages costs a few dict operations per run touched, and
the largest run comes off the heap (O(log runs) per run made since), never from a scan of the
pool. benchmarks/kv_pages_layout.py measures it: a few microseconds a call.
"""

from __future__ import annotations

import collections
import heapq
from dataclasses import dataclass, field
from typing import Hashable, Sequence

import numpy as np

NULL_PAGE = 0  # pads block tables; also the parent of a sequence's first page in a key

SeqId = Hashable  # the scheduler's name for a sequence (its request ticket)
_Key = tuple[int, tuple[int, ...]]  # (parent page or NULL_PAGE, the page's token ids)


class OutOfPages(Exception):
    """Not enough free or evictable pages for what was asked; nothing was changed."""


@dataclass(frozen=True)
class PageStats:
    """Pages now (`total` = used + cached + free, the null page not counted) and prefix-cache
    counts since start (hit rate = hit_tokens / queried_tokens)."""

    total: int
    used: int  # held by a block table, shared pages once
    cached: int  # held by none, kept for a later prefix hit, evictable
    free: int
    queried_tokens: int = 0  # prompt tokens looked up by `admit`
    hit_tokens: int = 0  # of them, found cached
    evicted: int = 0  # cached pages taken back for another use


@dataclass(slots=True)
class _Sequence:
    pages: list[int] = field(default_factory=list)  # its block table
    length: int = 0  # positions its pages are reserved for (len(pages) == ceil(length / page_size))
    published: int = 0  # its first `published` pages are keyed (cached and shared)


class _FreeRuns:
    """The free pages, as the maximal runs of adjacent ids they form: each run indexed by its
    first and its last page, and in a max-heap by length. The heap is brought up to date only
    when asked for the largest run (a table freed page by page makes one run, not one heap entry
    a page); entries of runs since split or merged are dropped when they reach the top, and all
    of them when they outnumber the runs."""

    def __init__(self, num_pages: int) -> None:
        self.is_free = bytearray(num_pages)  # page -> 1 if free
        self.count = 0
        self._end: dict[int, int] = {}  # run's first page -> its end (exclusive)
        self._start: dict[int, int] = {}  # run's last page -> its first page
        self._heap: list[tuple[int, int]] = []  # (-length, first page), some stale
        self._new: set[int] = set()  # first pages of runs made since the heap was brought up to date

    def runs(self) -> list[tuple[int, int]]:
        """Every run as (first page, end), in page order."""
        return sorted(self._end.items())

    def largest(self) -> tuple[int, int] | None:
        """The longest run as (first page, end), or None when no page is free."""
        ends, heap = self._end, self._heap
        if len(heap) + len(self._new) > 2 * len(ends) + 64:  # mostly stale: rebuild
            heap[:] = [(start - end, start) for start, end in ends.items()]
            heapq.heapify(heap)
        else:
            for start in self._new:
                if start in ends:
                    heapq.heappush(heap, (start - ends[start], start))
        self._new.clear()
        while heap and ends.get(heap[0][1]) != heap[0][1] - heap[0][0]:
            heapq.heappop(heap)
        return (heap[0][1], heap[0][1] - heap[0][0]) if heap else None

    def add(self, first: int, stop: int) -> None:
        """Pages first..stop-1, none of them free, become free, joining the runs on either side."""
        start, end = self._start.pop(first - 1, first), self._end.pop(stop, stop)
        self._set(start, end)  # overwrites the joined runs' other ends
        self.is_free[first:stop] = b"\x01" * (stop - first)
        self.count += stop - first

    def take(self, page: int, count: int = 1, start: int | None = None) -> int:
        """Up to `count` free pages from `page` on, as far as its run goes, are taken, splitting
        the run; `start`: the run's first page if known (else found by walking left from `page`).
        -> how many were taken."""
        if start is None:
            start = page
            while self.is_free[start - 1]:  # page 0 is never free, so this stops
                start -= 1
        end = self._end.pop(start)
        del self._start[end - 1]
        stop = min(end, page + count)
        if start < page:
            self._set(start, page)
        if stop < end:
            self._set(stop, end)
        self.is_free[page:stop] = bytes(stop - page)
        self.count -= stop - page
        return stop - page

    def _set(self, start: int, end: int) -> None:
        self._end[start], self._start[end - 1] = end, start
        self._new.add(start)


class KvPages:
    def __init__(self, num_pages: int, page_size: int, reserve_pages: int = 0) -> None:
        """`num_pages` includes the null page, so `num_pages - 1` hold KV. `reserve_pages`: what
        `can_admit` leaves free by default for running sequences to grow into."""
        if num_pages < 2 or page_size < 1 or not 0 <= reserve_pages < num_pages - 1:
            raise ValueError(
                f"need num_pages >= 2, page_size >= 1 and 0 <= reserve_pages < num_pages - 1; got "
                f"{num_pages}, {page_size}, {reserve_pages}"
            )
        self.num_pages = num_pages
        self.page_size = page_size
        self.reserve_pages = reserve_pages
        self._refs = [0] * num_pages  # page -> how many block tables hold it
        self._runs = _FreeRuns(num_pages)  # the free pages
        self._ends = [0] * num_pages  # page -> how many block tables end with it
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, refs 0; oldest first
        self._index: dict[_Key, int] = {}  # key -> page
        self._key: dict[int, _Key] = {}  # page -> its key (keyed pages only)
        self._children = [0] * num_pages  # page -> keyed pages whose parent it is
        self._seqs: dict[SeqId, _Sequence] = {}  # in admission order (victim: the last)
        self._queried = self._hit = self._evicted = 0
        self._put_free(range(num_pages - 1, 0, -1))  # a free list then hands out 1, 2, 3, ...

    # -- questions -------------------------------------------------------------------------

    @property
    def usable_pages(self) -> int:
        return self.num_pages - 1

    def pages_for(self, tokens: int) -> int:
        """Pages a sequence of `tokens` positions holds."""
        return -(-tokens // self.page_size)

    def spare_pages(self) -> int:
        """Pages `grow` could take now (free, or cached and evictable) beyond the admission
        reserve: what a speculative step may spend on its guesses' positions without taking
        the room running sequences grow into (engine.core.speculative_step)."""
        return max(0, self._runs.count + len(self._lru) - self.reserve_pages)

    def could_ever_fit(self, prompt_tokens: int, total_tokens: int, reserve_pages: int | None = None) -> bool:
        """Whether a sequence alone in the pool could be admitted with `prompt_tokens` (leaving
        `reserve_pages`, default the pool's) and grow to `total_tokens` (prompt + max output):
        one that could not must be refused at admission, since no preemption would ever make room
        for it."""
        reserve = self.reserve_pages if reserve_pages is None else reserve_pages
        return (
            self.pages_for(prompt_tokens) + reserve <= self.usable_pages
            and self.pages_for(total_tokens) <= self.usable_pages
        )

    def lookup(self, prompt_token_ids: Sequence[int]) -> tuple[int, ...]:
        """The pages holding the longest cached prefix of the prompt, in whole pages, and never
        its last position's page (module docstring, 2). Changes nothing."""
        chain: list[int] = []
        parent, size = NULL_PAGE, self.page_size
        for i in range((len(prompt_token_ids) - 1) // size):
            page = self._index.get((parent, tuple(prompt_token_ids[i * size : (i + 1) * size])))
            if page is None:
                break
            chain.append(page)
            parent = page
        return tuple(chain)

    def can_admit(self, prompt_token_ids: Sequence[int], reserve_pages: int | None = None) -> bool:
        """Whether `admit` would succeed with `reserve_pages` (default: the pool's) left over."""
        return self._admission(prompt_token_ids, reserve_pages)[1]

    def victim(self) -> SeqId | None:
        """The sequence to preempt when one cannot grow: the most recently admitted (the least
        work lost, and the oldest requests keep their progress). None when there is none."""
        return next(reversed(self._seqs), None)

    def pages(self, seq: SeqId) -> tuple[int, ...]:
        """`seq`'s block table."""
        return tuple(self._seqs[seq].pages)

    def table(self, seq: SeqId, width: int) -> np.ndarray:
        """`seq`'s block table as the device reads it: (width,) int32, padded with the null page."""
        pages = self._seqs[seq].pages
        if len(pages) > width:
            raise ValueError(f"{len(pages)} pages do not fit a block table {width} wide")
        row = np.zeros(width, np.int32)  # (W,)
        row[: len(pages)] = pages
        return row

    def tables(self, seqs: Sequence[SeqId], width: int) -> np.ndarray:
        """The block tables of `seqs`, one row each: (B, width) int32."""
        return np.stack([self.table(seq, width) for seq in seqs]) if seqs else np.zeros((0, width), np.int32)

    def stats(self) -> PageStats:
        free, cached = self._runs.count, len(self._lru)
        total = self.usable_pages
        return PageStats(total, total - free - cached, cached, free, self._queried, self._hit, self._evicted)

    # -- changes ---------------------------------------------------------------------------

    def admit(self, seq: SeqId, prompt_token_ids: Sequence[int], reserve_pages: int | None = None) -> int:
        """Start `seq` with its prompt: the cached prefix's pages are shared into its table and
        pages for the rest of the prompt are taken (evicting cached ones if need be). -> the
        prompt positions already cached (a multiple of page_size, < len(prompt)): prefill starts
        there. Raises OutOfPages, changing nothing, where `can_admit` says no."""
        if seq in self._seqs:
            raise ValueError(f"sequence {seq!r} is already admitted")
        if not prompt_token_ids:
            raise ValueError("a prompt has at least one token")
        hit, fits = self._admission(prompt_token_ids, reserve_pages)
        if not fits:
            raise OutOfPages(f"no room for a prompt of {len(prompt_token_ids)} tokens")
        state = self._seqs[seq] = _Sequence()
        for page in hit:  # first the shared pages, so that making room below cannot evict them
            self._hold(page)
        state.pages.extend(hit)
        if hit:
            self._ends[hit[-1]] += 1  # the table's last page for now, which _grow moves on
        state.published = len(hit)
        state.length = len(hit) * self.page_size
        self._grow(state, len(prompt_token_ids))
        self._queried += len(prompt_token_ids)
        self._hit += len(hit) * self.page_size
        return len(hit) * self.page_size

    def grow(self, seq: SeqId, length: int) -> bool:
        """Reserve pages for `seq`'s positions up to `length` (a prefill chunk's end, a decode
        step's position + 1), evicting cached pages if need be; the admission reserve may be
        used. False, changing nothing, when there are not enough: the scheduler then preempts
        (`victim`, `preempt`). A length within what is reserved is a no-op."""
        state = self._seqs[seq]
        if self.pages_for(length) - len(state.pages) > self._runs.count + len(self._lru):
            return False
        self._grow(state, length)
        return True

    def publish(self, seq: SeqId, token_ids: Sequence[int]) -> int:
        """Key every full page of `seq` that `token_ids` (its ids from position 0, all of them
        written to its pages) covers and that is not yet keyed, so later prompts share it. A page
        whose key another page already has is replaced in `seq`'s table by that page and freed
        (the same KV, held once): `seq`'s device block table must then be refreshed.
        -> pages newly keyed or replaced."""
        state = self._seqs[seq]
        if len(token_ids) > state.length:
            raise ValueError(f"{len(token_ids)} ids, but {seq!r} holds {state.length} positions")
        size, done = self.page_size, 0
        for i in range(state.published, len(token_ids) // size):
            key = (state.pages[i - 1] if i else NULL_PAGE, tuple(token_ids[i * size : (i + 1) * size]))
            own, cached = state.pages[i], self._index.get(key)
            if cached is None:
                self._index[key], self._key[own] = own, key
                self._children[key[0]] += 1
            else:  # computed twice (admitted before the other published it): keep one
                self._hold(cached)
                state.pages[i] = cached
                if i == len(state.pages) - 1:
                    self._ends[own] -= 1
                    self._ends[cached] += 1
                self._put_free([own] if self._release(own) else [])
            state.published = i + 1
            done += 1
        return done

    def free(self, seq: SeqId) -> None:
        """`seq` ended (finished, cancelled or preempted): its table goes. Its keyed pages stay
        cached while another table holds them or until evicted; the others are free at once."""
        pages = self._seqs.pop(seq).pages
        if pages:
            self._ends[pages[-1]] -= 1
        # deepest first: parents end more recent
        self._put_free([page for page in reversed(pages) if self._release(page)])

    def preempt(self, seq: SeqId, written_token_ids: Sequence[int]) -> int:
        """Publish what `seq` has written, then free it: its recompute starts from the cache.
        `written_token_ids`: its ids whose KV is in its pages (prompt and outputs, not the last
        sample, whose KV the next step would have written). -> positions that stay cached."""
        self.publish(seq, written_token_ids)
        cached = self._seqs[seq].published * self.page_size
        self.free(seq)
        return cached

    # -- inside ----------------------------------------------------------------------------

    def _admission(self, prompt_token_ids: Sequence[int], reserve_pages: int | None) -> tuple[tuple[int, ...], bool]:
        """The prompt's hit, and whether the rest fits (the hit's evictable pages do not count as
        room: attaching them makes them used)."""
        reserve = self.reserve_pages if reserve_pages is None else reserve_pages
        hit = self.lookup(prompt_token_ids)
        room = self._runs.count + len(self._lru) - sum(1 for page in hit if self._refs[page] == 0)
        return hit, self.pages_for(len(prompt_token_ids)) - len(hit) + reserve <= room

    def _grow(self, state: _Sequence, length: int) -> None:
        """Take the pages up to `length`, and keep `_ends` naming the table's last page."""
        pages, want = state.pages, self.pages_for(length)
        if len(pages) < want:
            if pages:
                self._ends[pages[-1]] -= 1
            while len(pages) < want:
                for page in self._take(pages[-1] if pages else NULL_PAGE, want - len(pages)):
                    self._refs[page] = 1
                    pages.append(page)
            self._ends[pages[-1]] += 1
        state.length = max(state.length, length)

    def _hold(self, page: int) -> None:
        if self._refs[page] == 0:
            del self._lru[page]
        self._refs[page] += 1

    def _release(self, page: int) -> bool:
        """A table lets go of `page`. -> whether it is now free (the caller puts it there)."""
        self._refs[page] -= 1
        if self._refs[page] == 0:
            if page not in self._key:
                return True
            self._lru[page] = None
        return False

    def _put_free(self, pages: Sequence[int]) -> None:
        """`pages` become free, a run of adjacent ids at a time (a table's, deepest first, mostly
        are: one change to the runs each)."""
        i = 0
        while i < len(pages):
            j = i + 1
            while j < len(pages) and pages[j] == pages[j - 1] - 1:
                j += 1
            self._runs.add(pages[j - 1], pages[i] + 1)
            i = j

    def _take_free(self, last: int, need: int) -> Sequence[int]:
        """Free pages (there is one) for a table whose last page is `last` (NULL_PAGE if none)
        and that wants `need` pages now: one run of adjacent ids, as many of the `need` as it
        holds (the module docstring says where it is)."""
        runs = self._runs
        if last != NULL_PAGE and last + 1 < self.num_pages and runs.is_free[last + 1]:
            first = start = last + 1  # the page after a used one starts its run
        else:
            start, end = runs.largest()
            first = start
            if self._ends[start - 1]:  # a table ends just before: leave it half the room
                first += max(0, (end - start - need) // 2)
        return range(first, first + runs.take(first, need, start))

    def _take(self, last: int, need: int) -> Sequence[int]:
        """Pages for a table, at least one: free ones, else the least recently released cached
        leaf."""
        if self._runs.count:
            return self._take_free(last, need)
        page, _ = self._lru.popitem(last=False)
        if self._children[page]:
            raise RuntimeError(f"page {page}, the least recently released, has cached children")
        key = self._key.pop(page)
        del self._index[key]
        self._children[key[0]] -= 1
        self._evicted += 1
        return (page,)


class FreeListPages(KvPages):
    """`KvPages` handing out free pages as a free list does (the most recently freed first, and
    1, 2, 3, ... from a fresh pool), whatever page a table ends with: the allocator before runs,
    kept as the reference that tests (same outcomes, call for call) and benchmarks (its tables
    against `KvPages`'s) compare with."""

    def __init__(self, num_pages: int, page_size: int, reserve_pages: int = 0) -> None:
        self._stack: list[int] = []  # the free pages; pop() takes the most recently freed
        super().__init__(num_pages, page_size, reserve_pages)

    def _put_free(self, pages: Sequence[int]) -> None:
        for page in pages:
            self._stack.append(page)
            self._runs.add(page, page + 1)

    def _take_free(self, last: int, need: int) -> Sequence[int]:
        page = self._stack.pop()
        self._runs.take(page)
        return (page,)
