"""`KvPages`, the page allocator of issue 41: hand-written cases for each behaviour, then a
Hypothesis state machine that runs random admissions, growth, writes, publishes, frees and
preemptions in a small pool (so eviction is constant) against a simulated device, whose pages
hold the token ids written into them, and checks every invariant after every step; and a
property that the runs of adjacent pages cost no capacity: call for call, the same outcomes as
the free list (`FreeListPages`)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from benchmarks.kv_pages_layout import runs  # the lengths of a table's runs of adjacent page ids
from engine.core.kv_pages import NULL_PAGE, FreeListPages, KvPages, OutOfPages, PageStats, _FreeRuns
from support.examples import examples


def ids(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


# -- pages, tables, growth -------------------------------------------------------------------


def test_a_fresh_pool_hands_out_every_page_but_the_null_page():
    pool = KvPages(num_pages=5, page_size=4)
    assert pool.stats() == PageStats(total=4, used=0, cached=0, free=4)
    pool.admit("a", ids(16))  # 4 pages: all of them
    assert sorted(pool.pages("a")) == [1, 2, 3, 4]
    assert NULL_PAGE not in pool.pages("a")
    assert pool.stats() == PageStats(total=4, used=4, cached=0, free=0, queried_tokens=16)


def test_grow_takes_the_pages_new_positions_need_and_fails_without_changing_anything():
    pool = KvPages(num_pages=5, page_size=4)
    pool.admit("a", ids(5))  # positions 0..4: 2 pages
    assert len(pool.pages("a")) == 2
    assert pool.grow("a", 8) and len(pool.pages("a")) == 2  # still within page 2
    assert pool.grow("a", 9) and len(pool.pages("a")) == 3
    assert pool.grow("a", 3) and len(pool.pages("a")) == 3  # never shrinks
    before = (pool.pages("a"), pool.stats())
    assert not pool.grow("a", 17)  # needs 5 pages, the pool has 4
    assert (pool.pages("a"), pool.stats()) == before
    assert pool.grow("a", 16) and pool.stats().free == 0


def test_free_returns_unshared_pages_at_once():
    pool = KvPages(num_pages=9, page_size=4)
    pool.admit("a", ids(10))
    pool.admit("b", ids(3, start=500))
    pool.free("a")
    assert pool.stats() == PageStats(total=8, used=1, cached=0, free=7, queried_tokens=13)
    with pytest.raises(KeyError):
        pool.free("a")


def test_the_block_table_is_a_padded_int32_row():
    pool = KvPages(num_pages=9, page_size=4)
    pool.admit("a", ids(9))
    row = pool.table("a", 6)
    assert row.dtype == np.int32 and row.shape == (6,)
    assert row.tolist() == [*pool.pages("a"), 0, 0, 0]
    with pytest.raises(ValueError, match="do not fit"):
        pool.table("a", 2)
    pool.admit("b", ids(1, start=7))
    assert pool.tables(["a", "b"], 4).tolist() == [[*pool.pages("a"), 0], [*pool.pages("b"), 0, 0, 0]]
    assert pool.tables([], 4).shape == (0, 4)


# -- prefix sharing --------------------------------------------------------------------------


def test_a_hit_shares_the_same_physical_pages_without_a_copy():
    pool = KvPages(num_pages=9, page_size=4)
    prompt = ids(10)  # pages [0..3], [4..7], and 2 positions in a third
    assert pool.admit("a", prompt) == 0
    pool.publish("a", prompt)
    assert pool.lookup(prompt) == pool.pages("a")[:2]  # the partial third page is never keyed
    assert pool.admit("b", prompt + [7, 7]) == 8
    assert pool.pages("b")[:2] == pool.pages("a")[:2]
    assert pool.pages("b")[2] != pool.pages("a")[2]  # the page each writes into is its own
    assert pool.stats().used == 3 + 1  # the two shared pages once
    assert (pool.stats().queried_tokens, pool.stats().hit_tokens) == (22, 8)
    pool.free("a")
    assert pool.stats().used == 3 and pool.stats().cached == 0  # b still holds the shared pages


def test_keys_are_exact_and_name_the_whole_prefix():
    pool = KvPages(num_pages=17, page_size=2)
    pool.admit("a", [1, 1, 2, 2, 9])
    pool.publish("a", [1, 1, 2, 2])
    assert len(pool.lookup([3, 3, 2, 2, 9])) == 0  # [2, 2] after [3, 3] is not [2, 2] after [1, 1]
    assert len(pool.lookup([1, 1, 2, 3, 9])) == 1  # one id differs in the second page
    assert len(pool.lookup([1, 1, 2, 2, 9])) == 2
    assert len(pool.lookup([1, 1, 2])) == 1  # the second page is not whole


def test_the_last_prompt_page_is_never_shared():
    """Its last position must be computed, into a page of its own; a prompt cached whole that ends
    on a page boundary recomputes its last page, and publishing it swaps back to the cached one."""
    pool = KvPages(num_pages=17, page_size=4)
    prompt = ids(8)
    pool.admit("a", prompt)
    pool.publish("a", prompt)
    assert pool.admit("b", prompt) == 4  # not 8: page 2 holds position 7, which b computes
    shared, own = pool.pages("b")
    assert shared == pool.pages("a")[0] and own != pool.pages("a")[1]
    assert pool.admit("c", prompt + [1]) == 8  # one position more: both pages are hits
    pool.publish("b", prompt)  # b's copy of page 2 has a key already: b now holds a's page
    assert pool.pages("b") == pool.pages("a")
    assert pool.stats().used == 3  # a's two pages and c's third


def test_only_full_written_pages_are_published():
    pool = KvPages(num_pages=9, page_size=4)
    pool.admit("a", ids(6))
    assert pool.publish("a", ids(3)) == 0
    assert pool.publish("a", ids(6)) == 1
    assert pool.publish("a", ids(6)) == 0  # once
    with pytest.raises(ValueError, match="holds 6 positions"):
        pool.publish("a", ids(8))  # position 6 and 7 are not even reserved


def test_concurrent_computations_of_one_prefix_end_up_held_once():
    pool = KvPages(num_pages=17, page_size=4)
    prompt = ids(13)
    pool.admit("a", prompt)
    pool.admit("b", prompt)  # before a published: no hit, its own copy
    assert pool.stats().used == 8
    pool.publish("a", prompt)
    assert pool.publish("b", prompt) == 3
    assert pool.pages("b")[:3] == pool.pages("a")[:3]
    assert pool.stats().used == 5 and pool.stats().free == 11


# -- eviction ------------------------------------------------------------------------------


def test_a_released_prefix_stays_cached_until_a_page_is_needed():
    pool = KvPages(num_pages=5, page_size=2)
    pool.admit("a", [1, 2, 3, 4, 5])
    pool.publish("a", [1, 2, 3, 4, 5])
    pool.free("a")
    assert pool.stats() == PageStats(total=4, used=0, cached=2, free=2, queried_tokens=5)
    assert pool.admit("b", [1, 2, 3, 4, 6]) == 4  # after its owner ended
    pool.free("b")
    pool.admit("c", [9, 9, 9, 9, 9])  # 3 pages: 2 free, then the LRU leaf, [3, 4]
    assert pool.stats().evicted == 1
    assert len(pool.lookup([1, 2, 3, 4, 5])) == 1  # its key went with it


def test_eviction_is_least_recently_released_first_and_leaves_before_parents():
    pool = KvPages(num_pages=7, page_size=1)
    pool.admit("old", [1, 2, 3, 0])
    pool.publish("old", [1, 2, 3])
    pool.admit("new", [5, 0])
    pool.publish("new", [5])
    pool.free("old")  # released first: [1] [2] [3]; [3] the least recent, its parent after it
    pool.free("new")
    assert pool.stats().cached == 4 and pool.stats().free == 2
    pool.admit("x", [7, 7, 7])  # 2 free pages, then [3] evicted
    assert [len(pool.lookup(p)) for p in ([1, 2, 3, 0], [5, 0])] == [2, 1]
    pool.grow("x", 5)  # [2], then [1]: the leaves of the old chain, before the newer [5]
    assert [len(pool.lookup(p)) for p in ([1, 2, 3, 0], [5, 0])] == [0, 1]
    assert pool.stats().evicted == 3


def test_a_page_in_use_is_never_evicted():
    pool = KvPages(num_pages=4, page_size=2)
    pool.admit("a", [1, 2, 3])
    pool.publish("a", [1, 2])
    pool.admit("b", [1, 2, 7])  # shares [1, 2] and takes the last page
    pool.free("a")  # [1, 2] is still b's; a's second page is free
    assert not pool.grow("b", 7)  # needs 2 more pages: 1 is free, the keyed [1, 2] is in use
    assert pool.grow("b", 6) and pool.pages("b")[0] == pool.lookup([1, 2, 0])[0]


# -- admission and preemption ---------------------------------------------------------------


def test_can_admit_counts_free_and_evictable_pages_less_the_hit_and_the_reserve():
    pool = KvPages(num_pages=7, page_size=2, reserve_pages=1)  # 6 pages
    pool.admit("a", [1, 2, 3, 4, 5])  # 3 pages
    pool.publish("a", [1, 2, 3, 4])
    pool.free("a")  # 2 cached, 4 free
    assert pool.can_admit(ids(10))  # 5 pages: 4 free + 1 evicted, not the reserve...
    assert not pool.can_admit(ids(12))  # ...6 would need it
    assert pool.can_admit(ids(12), reserve_pages=0)
    # a hit's cached pages cover part of the prompt but stop being room once attached:
    # [1, 2, 3, 4] + 8 more = 6 pages, 2 of them the hit, so 4 to take from 6 - 2 free/evictable
    assert pool.can_admit([1, 2, 3, 4, *ids(8)], reserve_pages=0)
    assert not pool.can_admit([1, 2, 3, 4, *ids(8)])  # ...but then not the reserve
    before = pool.stats()
    with pytest.raises(OutOfPages):
        pool.admit("b", [1, 2, 3, 4, *ids(8)])
    assert pool.stats() == before and pool.victim() is None
    assert pool.admit("b", [1, 2, 3, 4, *ids(8)], reserve_pages=0) == 4


def test_a_prompt_that_could_never_fit_is_told_apart():
    pool = KvPages(num_pages=9, page_size=4, reserve_pages=1)  # 8 pages, 32 tokens
    assert pool.could_ever_fit(20, 32)
    assert not pool.could_ever_fit(20, 33)  # its output would outgrow the pool
    assert not pool.could_ever_fit(29, 30)  # its prompt would need the reserve
    assert pool.could_ever_fit(29, 30, reserve_pages=0)  # ...which an admission into an empty pool waives
    assert not pool.could_ever_fit(29, 33, reserve_pages=0)


def test_the_victim_is_the_most_recently_admitted_and_its_prefix_stays_cached():
    pool = KvPages(num_pages=9, page_size=4)
    pool.admit(1, ids(5))
    pool.admit(2, ids(5, start=200))
    pool.admit(3, ids(5, start=300))
    pool.free(2)
    assert pool.victim() == 3
    prompt = ids(5, start=300)
    output = [8, 8, 8, 8, 8]  # sampled; the last one's KV not yet written
    pool.grow(3, 10)
    assert pool.preempt(3, prompt + output[:-1]) == 8
    assert pool.victim() == 1
    assert pool.stats().cached == 2
    assert pool.admit(3, prompt + output) == 8  # the recompute starts from the cache
    assert pool.victim() == 3  # admitted again: the most recent again


def test_the_reserve_must_leave_a_page_to_hold_kv():
    with pytest.raises(ValueError):
        KvPages(num_pages=3, page_size=4, reserve_pages=2)
    with pytest.raises(ValueError):
        KvPages(num_pages=1, page_size=4)


# -- runs of adjacent pages ------------------------------------------------------------------


def test_a_sequence_growing_alone_takes_adjacent_pages():
    pool = KvPages(num_pages=65, page_size=4)
    pool.admit("a", ids(9))  # 3 pages at once
    for length in range(10, 4 * 40 + 1):  # then a decode step at a time
        assert pool.grow("a", length)
    assert pool.pages("a") == tuple(range(1, 41))
    free = FreeListPages(num_pages=65, page_size=4)  # a free list does this too...
    free.admit("a", ids(9))
    free.grow("a", 4 * 40)
    assert free.pages("a") == tuple(range(1, 41))


def test_sequences_growing_in_turn_each_take_a_run_of_their_own():
    pool, free = KvPages(num_pages=65, page_size=1), FreeListPages(num_pages=65, page_size=1)
    for p in (pool, free):
        p.admit("a", [1])
        p.admit("b", [2])
        for length in range(2, 33):  # a decode step each, in turn
            assert p.grow("a", length) and p.grow("b", length)
    # b started halfway into the free pages after a's, leaving a the half before it to grow into
    assert pool.pages("a") == tuple(range(1, 33)) and pool.pages("b") == tuple(range(33, 65))
    assert runs(free.pages("a")) == [1] * 32  # ...where a free list interleaves them (1, 3, 5, ...)
    pool.free("a")  # a's pages free again, one run: c takes it from its start
    pool.admit("c", [3, 3, 3])
    assert pool.pages("c") == (1, 2, 3)


def test_a_run_that_meets_another_goes_on_in_the_largest_free_run():
    pool = KvPages(num_pages=17, page_size=1)
    pool.admit("a", [1])  # page 1
    pool.admit("b", [2, 2, 2])  # the free run 2..16 has a's end before it: b starts at 2 + (15 - 3) // 2
    assert pool.pages("b") == (8, 9, 10)
    assert pool.grow("a", 7) and pool.pages("a") == tuple(range(1, 8))  # a's room, up to b
    assert pool.grow("a", 8)  # page 8 is b's: the largest free run is 11..16, and b ends before it
    assert pool.pages("a")[-1] == 11 + (6 - 1) // 2


def test_a_cached_page_is_never_evicted_to_stay_adjacent():
    pool = KvPages(num_pages=6, page_size=1)
    pool.admit("x", [7, 8, 9])
    assert pool.pages("x") == (1, 2, 3)
    pool.publish("x", [7, 8, 9])
    pool.free("x")  # 1, 2, 3 cached (3 a leaf, evictable), 4 and 5 free
    assert pool.admit("a", [7, 8, 5]) == 2  # shares 1 and 2, and needs a page of its own
    assert pool.pages("a") == (1, 2, 4)  # not the cached 3, though it is next to 2
    assert pool.stats().evicted == 0 and pool.lookup([7, 8, 9, 0]) == (1, 2, 3)
    assert pool.grow("a", 4) and pool.pages("a")[-1] == 5 and pool.stats().evicted == 0
    assert pool.grow("a", 5) and pool.stats().evicted == 1  # none free: only then the LRU leaf, 3
    assert pool.pages("a") == (1, 2, 4, 5, 3) and pool.lookup([7, 8, 9, 0]) == (1, 2)


@settings(max_examples=examples(100), deadline=None)
@given(toggles=st.lists(st.integers(1, 63), max_size=600), every=st.integers(1, 9))
def test_the_free_runs_always_know_the_largest_run(toggles: list[int], every: int):
    """`_FreeRuns` against a scan of its flags, through many splits and merges (so that its heap
    fills with stale entries and is rebuilt), asked for the largest run every `every` changes."""
    runs = _FreeRuns(64)
    runs.add(1, 64)
    for n, page in enumerate(toggles):
        if runs.is_free[page]:
            runs.take(page)
        else:
            runs.add(page, page + 1)
        if n % every == 0:
            free = [p for p in range(64) if runs.is_free[p]]
            spans = runs.runs()
            assert [p for start, end in spans for p in range(start, end)] == free and runs.count == len(free)
            assert all(end < start for (_, end), (start, _) in zip(spans, spans[1:]))  # maximal
            largest = runs.largest()
            assert (largest[1] - largest[0] if largest else 0) == max((e - s for s, e in spans), default=0)
            assert largest is None or largest in spans


_ops = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.lists(st.integers(0, 1), min_size=1, max_size=12), st.integers(0, 2)),
        st.tuples(st.just("grow"), st.integers(0, 7), st.integers(1, 9)),
        st.tuples(st.just("publish"), st.integers(0, 7)),
        st.tuples(st.just("free"), st.integers(0, 7)),
        st.tuples(st.just("preempt")),
    ),
    max_size=60,
)


@settings(max_examples=examples(200), deadline=None)
@given(num_pages=st.integers(2, 24), page_size=st.integers(1, 3), ops=_ops)
def test_runs_cost_no_capacity_whatever_the_traffic(num_pages: int, page_size: int, ops: list[tuple]):
    """Whatever a free list admits or grows, KvPages does too, and the other way round: the same
    operations give the same answers and the same counts, call for call (only the page ids differ).
    Ids from {0, 1}, so that prefixes are shared, swapped and evicted."""
    pools = [KvPages(num_pages, page_size), FreeListPages(num_pages, page_size)]
    tokens: dict[int, list[int]] = {}  # live sequence -> its ids (all reserved, taken as written)
    for n, op in enumerate(ops):
        live = list(tokens)
        if op[0] != "admit" and not live:
            continue
        seq = live[op[1] % len(live)] if op[0] in ("grow", "publish", "free") else n
        if op[0] == "admit":
            reserve = op[2] % (num_pages - 1)
            step = lambda p: (p.can_admit(op[1], reserve) and p.admit(n, op[1], reserve), p.stats().evicted)
        elif op[0] == "grow":
            step = lambda p: p.grow(seq, len(tokens[seq]) + op[2])
        elif op[0] == "publish":
            step = lambda p: p.publish(seq, tokens[seq])
        elif op[0] == "free":
            step = lambda p: p.free(seq)
        else:
            seq = pools[0].victim()
            step = lambda p: (p.victim(), p.preempt(p.victim(), tokens[seq]))
        ours, reference = (step(p) for p in pools)
        assert ours == reference, op
        assert pools[0].stats() == pools[1].stats()
        if op[0] == "admit" and ours[0] is not False:
            tokens[n] = list(op[1])
        elif op[0] == "grow" and ours:
            tokens[seq] += [seq % 2] * op[2]
        elif op[0] in ("free", "preempt"):
            del tokens[seq]
        assert [len(pools[0].pages(s)) for s in tokens] == [len(pools[1].pages(s)) for s in tokens]


# -- the state machine ------------------------------------------------------------------------


class PagesMachine(RuleBasedStateMachine):
    """Random traffic on a small pool; a simulated device (`written`: page -> the id written at
    each offset) shows what a page really holds, so a hit is checked against the data, not
    against the allocator's own keys. Ids come from {0, 1} so that prefixes collide often."""

    @initialize(
        num_pages=st.integers(3, 16),
        page_size=st.integers(1, 3),
        reserve=st.integers(0, 2),
        prompts=st.lists(st.lists(st.integers(0, 1), min_size=1, max_size=8), max_size=3),
    )
    def start(self, num_pages: int, page_size: int, reserve: int, prompts: list[list[int]]) -> None:
        """A pool, and a few sequences in it: Hypothesis leaves some rules out of a run (swarm
        testing), and a run without `admit` would test nothing."""
        self.pool = KvPages(num_pages, page_size, min(reserve, num_pages - 2))
        self.size = page_size
        self.tokens: dict[int, list[int]] = {}  # live sequence -> its ids (all reserved)
        self.done: dict[int, int] = {}  # live sequence -> positions written
        self.order: list[int] = []  # live sequences, in admission order
        self.written: dict[int, list[int | None]] = {}
        self.seen: list[list[int]] = [[0, 1, 0, 1]]  # earlier sequences' ids, to start prompts from
        self.next_seq = 0
        for prompt in prompts:
            self.try_admit(prompt)

    def snapshot(self) -> tuple:
        return self.pool.stats(), {s: self.pool.pages(s) for s in self.order}, dict(self.pool._index)

    @rule(data=st.data())
    def admit(self, data) -> None:
        live = list(self.tokens.values())  # half the time a live prefix: twins computed at once
        base = data.draw(st.sampled_from(live) if live and data.draw(st.booleans()) else st.sampled_from(self.seen))
        prompt = base[: data.draw(st.integers(0, len(base)))] + data.draw(st.lists(st.integers(0, 1), max_size=6))
        if prompt:
            self.try_admit(prompt)

    def try_admit(self, prompt: list[int]) -> None:
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        if not self.pool.can_admit(prompt):
            before = self.snapshot()
            with pytest.raises(OutOfPages):
                self.pool.admit(seq, prompt)
            assert self.snapshot() == before
            event("admit: refused")
            return
        evicted = self.pool.stats().evicted
        hit = self.pool.admit(seq, prompt)
        event(f"admit: {'a hit' if hit else 'no hit'}{', evicting' if self.pool.stats().evicted > evicted else ''}")
        assert hit % self.size == 0 and hit < len(prompt)
        pages = self.pool.pages(seq)
        for i in range(hit // self.size):  # what the shared pages hold is this prompt's start
            assert self.written[pages[i]] == prompt[i * self.size : (i + 1) * self.size]
        self.tokens[seq], self.done[seq] = list(prompt), hit
        self.order.append(seq)

    def pick(self, data) -> int | None:
        """A live sequence, or None: the rule then does nothing (preconditions instead make
        Hypothesis give up on many runs, which start with no sequence)."""
        return data.draw(st.sampled_from(self.order)) if self.order else None

    @rule(data=st.data(), n=st.integers(1, 8), publish=st.booleans())
    def compute(self, data, n: int, publish: bool) -> None:
        """The model writes a sequence's next n positions (a prefill chunk, a decode step), whose
        full pages are then published or not."""
        if (seq := self.pick(data)) is None:
            return
        self.write_to(seq, n)
        if publish:
            before = self.pool.pages(seq)
            self.pool.publish(seq, self.tokens[seq][: self.done[seq]])
            if self.pool.pages(seq) != before:
                event("publish: swapped for a cached twin")

    def write_to(self, seq: int, n: int) -> None:
        end = min(len(self.tokens[seq]), self.done[seq] + n)
        pages = self.pool.pages(seq)
        for position in range(self.done[seq], end):
            page = pages[position // self.size]
            assert self.pool._refs[page] == 1 and page not in self.pool._key  # never into a shared page
            row = self.written.setdefault(page, [None] * self.size)
            row[position % self.size] = self.tokens[seq][position]
        self.done[seq] = end

    @rule(data=st.data(), more=st.lists(st.integers(0, 1), min_size=1, max_size=4))
    def grow(self, data, more: list[int]) -> None:
        """A sequence gets new ids (sampled tokens) and the positions to write them."""
        if (seq := self.pick(data)) is None:
            return
        before = self.snapshot()
        length = len(self.tokens[seq]) + len(more)
        if self.pool.grow(seq, length):
            self.tokens[seq] += more
        else:
            event("grow: refused")
            assert self.snapshot() == before
            stats = self.pool.stats()
            assert self.pool.pages_for(length) - len(self.pool.pages(seq)) > stats.free + stats.cached

    @rule(data=st.data())
    def free(self, data) -> None:
        if (seq := self.pick(data)) is not None:
            self.pool.free(seq)
            self.forget(seq)

    @rule()
    def preempt(self) -> None:
        seq = self.pool.victim()
        assert seq == (self.order[-1] if self.order else None)
        if seq is None:
            return
        written = self.tokens[seq][: self.done[seq]]
        assert self.pool.preempt(seq, written) == len(written) // self.size * self.size
        self.forget(seq)

    def forget(self, seq: int) -> None:
        self.seen.append(self.tokens.pop(seq))
        del self.done[seq]
        self.order.remove(seq)

    @invariant()
    def pages_are_consistent(self) -> None:
        pool = self.pool
        tables = {seq: pool.pages(seq) for seq in self.order}
        held = [page for pages in tables.values() for page in pages]
        free, cached = [p for p in range(pool.num_pages) if pool._runs.is_free[p]], list(pool._lru)
        used = set(held)
        # every page is exactly one of free / used / cached, and the null page is none of them
        assert len(free) == len(set(free)) and NULL_PAGE not in used | set(free) | set(cached)
        assert sorted([*free, *used, *cached]) == list(range(1, pool.num_pages))
        # refcount == the number of block tables holding the page
        assert all(pool._refs[page] == held.count(page) for page in range(pool.num_pages))
        # one key per keyed page, one page per key; free pages are not keyed, cached ones are
        assert len(pool._index) == len(pool._key) == len(set(pool._index.values()))
        assert all(pool._index[key] == page for page, key in pool._key.items())
        assert not set(free) & set(pool._key) and set(cached) <= set(pool._key)
        for page, (parent, ids) in pool._key.items():
            assert self.written[page] == list(ids)  # a keyed page holds what its key says
            assert parent == NULL_PAGE or parent in pool._key  # its parent is still keyed
            assert pool._refs[page] == 0 or parent == NULL_PAGE or pool._refs[parent] > 0
        children = [0] * pool.num_pages
        for parent, _ in pool._key.values():
            children[parent] += 1
        assert children == pool._children
        # a cached page was released after its cached children, so the least recent is a leaf
        # and eviction never orphans a key
        released = {page: i for i, page in enumerate(cached)}
        for page, (parent, _) in pool._key.items():
            if parent in released:
                assert page in released and released[page] < released[parent]
        for seq, pages in tables.items():
            state = pool._seqs[seq]
            assert len(pages) == pool.pages_for(len(self.tokens[seq])) == len(set(pages))
            for i, page in enumerate(pages[: state.published]):
                assert pool._key[page][0] == (pages[i - 1] if i else NULL_PAGE)
        # the free runs are maximal, cover the free pages, and the largest is found
        spans = pool._runs.runs()
        assert [p for start, end in spans for p in range(start, end)] == free
        assert all(end < start for (_, end), (start, _) in zip(spans, spans[1:]))
        longest = max((end - start for start, end in spans), default=None)
        assert (lambda run: run and run[1] - run[0])(pool._runs.largest()) == longest
        lasts = [pages[-1] for pages in tables.values() if pages]  # how many tables end with each page
        assert all(pool._ends[page] == lasts.count(page) for page in range(pool.num_pages))
        stats = pool.stats()
        assert (stats.total, stats.used, stats.cached, stats.free) == (
            pool.num_pages - 1, len(used), len(cached), len(free)
        )


PagesMachine.TestCase.settings = settings(max_examples=examples(100), deadline=None, stateful_step_count=50)
TestPagesMachine = PagesMachine.TestCase
