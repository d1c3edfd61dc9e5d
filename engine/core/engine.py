"""The engine core: a bounded admission queue, a slot table, a KV page pool and one scheduler loop.

The KV cache is a pool of pages (engine.core.kv_pages, `KvPages`, sized by `Model.kv`): a request
holds pages for the positions it has, not a whole context, so more requests run than the pool
holds contexts, and full prompt pages are shared by prompts that start alike (prefix caching,
with no copy). The scheduler decides every page; the model only reads and writes through the
tables it is given (`Model.set_pages`).

Data flow, on the engine thread, once per iteration:
  1. take aborts and admissions under the lock: waiting requests, oldest first (a preempted one
     is at the front), each into a free slot while the pool takes its prompt
     (`KvPages.can_admit`, leaving the reserve free for running requests to grow into; with
     none running, no reserve); the first that does not fit stops the rest (FIFO). Admission
     (`KvPages.admit`) shares the pages of the prompt's longest cached prefix and takes pages
     for the rest of the prompt, so no prefill ever waits for a page; the slot gets its table
     (`model.set_pages`). Slots are held from here, so the queue bound never counts a promised
     slot as free. A request that could never fit in the pool, even alone, was refused at
     submit (InvalidArgument naming the field and the pool's size: engine.core.admission);
  2. for each aborted request: release its slot and free its pages;
  3. prefill: requests whose prompt is not yet all in the cache, oldest admission first, from
     the end of the prefix hit (those positions' KV is in the shared pages), in
     `model.prefill_chunk` calls of at most `step_tokens` (the config's `max_step_tokens`, or
     the model's default) prompt tokens in all this iteration while other requests decode
     (chunked prefill: a long prompt is read over several iterations, each followed by a
     decode step, so running streams keep their pace; with nothing decoding, nobody waits, and
     a prompt is read whole). The budget protects the streams that decode from the prompts
     that wait, so it holds only while those that decode are at least as many: when, at the
     start of an iteration, more requests wait for their first token than decode (a burst of
     arrivals), that iteration reads every waiting prompt whole (TGI pauses its running
     requests for waiting ones on a similar rule, its waiting_served_ratio). A burst of 32
     short prompts is then read in one iteration, instead of trickling in at `step_tokens` a
     step while the first requests run to their end. In such an iteration (and with no budget
     at all) the prompts not yet started and with no prefix hit go, in admission order, as
     many as fit in the model's `packed_prefill_tokens`, into one `model.prefill_packed` call
     (at least two; `_prefill_packed`): one pass over the weights and one read of the samples
     for all of them, where an accelerator's fixed cost a call would otherwise be paid a
     prompt. A prompt whose rest is under the
     iteration's remaining budget plus one more budget is read to its end in that iteration:
     a short prompt beside running streams gets its first token a step sooner, rather than a
     chunk now and a small last call a step later (an iteration thus reads under twice the
     budget). A chunk that does not complete its prompt goes with the decode
     step of step 4 instead (`model.dispatch(inputs, chunk)`) when the model takes one along
     (`Model.fused_chunk_tokens`): one pass over the weights for the step and the chunk, so the
     running streams wait for one step, not a chunk and then a step (at most one chunk a step;
     with no step to carry it, it is a `prefill_chunk` call). The chunk that completes a prompt
     publishes its full pages for later prompts to share (`KvPages.publish`; a page another
     request computed meanwhile is swapped for that one, and the table sent again) and samples
     its first token -> `decide` -> events; a request that finishes there (a control token, or
     max_output_tokens = 1) releases its slot and pages at once and never joins a decode step;
  4. growth: each request of the next step whose position starts a new page gets one
     (`KvPages.grow`, evicting cached pages if need be) and its table is sent again. When none
     is left, the step in flight is read first (finished requests free theirs), then the most
     recently admitted request is preempted until every row has its page (`_make_room`): its
     slot is released, its written full pages stay cached (`KvPages.preempt`), and it goes back
     to the front of the queue with its prompt and the tokens it produced as a new prompt.
     Readmitted (mostly a prefix hit), its prefill samples its next token, and its counts and
     stop rule go on: its client sees no duplicate, no gap, only the time it waited;
  5. dispatch one decode step (`model.dispatch`) for every active slot whose prompt is complete
     and whose output may still grow, then read the previous iteration's step (`model.collect`)
     -> `decide` per slot -> events; finished slots are released (and their pages freed) in the
     same iteration. The host thus runs one step behind the device: step N+1 is enqueued before
     step N is read, and its inputs (each slot's last sample) never leave the device. A request
     that step N finished was also in step N+1; that sample is discarded (never decided, never
     sent), and a request is never dispatched a step that could only pass its length cap.
     Positions, and so growth, follow the steps dispatched, not the steps read.
A request cancelled between or during its chunks is released at step 2 or at the end of its
chunk, with no events, before the next step.
Constrained requests (issue 43; engine.core.constrained): each sample is drawn under a row of
banned ids that its matcher (`Request.constraint.matcher()`) computes from the output so far. The
prefill's row goes with the slot (`SlotSetup.banned`); every emitted token advances the matcher
(`decide`, which finishes with STOP once the output is whole); before each decode step samples,
the constrained requests' next rows are computed together (`banned_rows`, one call into the
grammar library) and sent in one `model.ban`. A row depends on the token just sampled, so a step
whose batch holds a constrained request needs the step in flight read before it samples
(engine.core.constrained_step). Where the model samples the step apart from its layers
(`Model.samples_apart`: every step on an accelerator, a stream alone on the CPU), the step's
layers are dispatched first, the step in flight is read and the rows computed while they run,
then the step's sampling is dispatched with them (`_dispatch_constrained`): the host's grammar
work hides behind the device's layers, and a request that the read finished has its sample of
the new step discarded, as above. Elsewhere the step in flight is read BEFORE the step is
dispatched: for that step the host does not run one behind (the device idles while the host
reads and computes the rows). A batch with no constrained request runs as above, unchanged. The step's sampling waits for every
row; a slow one is bounded by the grammar library's per-step limits, past which its request
fails alone (docs/constraints.md, "A late row"). A row that allows no token fails
its request with InvalidArgument, not the engine.
Speculative decoding (issue 45; engine.core.speculative_step), when the config turns it on and
the model verifies: a step of few unconstrained rows whose guesses are worth checking asks the
proposer for each row's guesses (the n-gram proposer past the step in flight, which stays in
flight; another proposer after that step is read), takes pages for their positions and runs
`model.verify` (synchronous); each row's run of samples goes through `decide` one by one
(`_advance_run`: what follows a finish is dropped) and its tokens go to the sink as one list.
Otherwise the step is a plain one, as above.
After each completed prefill and each step (and after aborts freed slots), the `after_delivery` callbacks
run (AsyncEngine sends the step's events for all its requests to the event loop with one wake-up
there; the engine process sends them, and its stats, to its parent).
This loop is the only place that touches a request per step. Events for one request are
handed to its `EventSink` as one list per iteration (coalesced), on the engine thread.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from engine.core.admission import admit, reserve_pages
from engine.core.constrained import banned_row
from engine.core.constrained_step import ConstrainedSteps
from engine.core.errors import DecoderFault, EngineStopped, InvalidArgument, QueueFull
from engine.core.events import Event, Finished, Token, Usage
from engine.core.kv_pages import KvPages, PageStats
from engine.core.model import ChunkInput, DecodeInput, Model, ModelInfo, PromptInput, Sample, SlotSetup
from engine.core.request import Request
from engine.core.speculation.policy import RowSpeculation, SpeculationStats
from engine.core.speculation.proposer import SPECULATION_MODES, Proposer
from engine.core.speculative_step import SpeculativeSteps
from engine.core.stopping import StopRule, decide

log = logging.getLogger(__name__)


class EventSink(Protocol):
    """Receives one request's events. Called on the engine thread: must not block."""

    def events(self, events: list[Event]) -> None: ...

    def fail(self, error: BaseException) -> None: ...


@dataclass(frozen=True)
class EngineConfig:
    # requests waiting for a slot: submit raises QueueFull only when every slot is taken (or
    # promised to an earlier request) and this many already wait
    max_queue_size: int = 64
    # prompt tokens prefilled per scheduler iteration while requests are decoding, over all
    # requests still reading their prompt; a longer prompt is prefilled in chunks over several
    # iterations, a decode step of the running requests after each, and its rest in one call once
    # less than two budgets are left. When no request decodes,
    # prompts are prefilled whole. 0: every admitted prompt whole in its admission iteration.
    # None: the model's `default_step_tokens` (what its hardware reads in a few decode steps' time).
    max_step_tokens: int | None = None
    # speculative decoding (engine.core.speculative_step): "off", or the proposer that guesses
    # ("ngram"; "draft": a draft model's, which the engine is handed, `Engine(proposer=...)`);
    # it runs where the model verifies (`Model.max_guesses` > 0)
    speculation: str = "off"
    speculative_tokens: int = 4  # the most ids a row guesses a step (the model's max_guesses caps it)
    speculation_max_batch: int = 1  # no speculation in a step of more rows than this (docs/speculative.md: why 1)

    def __post_init__(self) -> None:
        if self.max_step_tokens is not None and self.max_step_tokens < 0:
            raise ValueError(f"max_step_tokens must be >= 0, got {self.max_step_tokens}")
        if self.speculation not in SPECULATION_MODES:
            raise ValueError(f"speculation must be one of {', '.join(SPECULATION_MODES)}, got {self.speculation!r}")
        if self.speculative_tokens < 1 or self.speculation_max_batch < 1:
            raise ValueError(
                f"speculative_tokens and speculation_max_batch must be >= 1, got "
                f"{self.speculative_tokens}, {self.speculation_max_batch}"
            )


@dataclass(frozen=True)
class EngineStats:
    queue_depth: int  # waiting for a slot and pages, preempted requests included
    slots_in_use: int
    alive: bool
    stalled_s: float  # seconds since the loop last made progress while work was pending; 0 when idle
    # the KV page pool now, and its prefix-cache counts since start (engine.core.kv_pages)
    pages: PageStats = PageStats(0, 0, 0, 0)
    preemptions: int = 0  # requests preempted since start (each recomputed, unseen by its client)
    speculation: SpeculationStats = SpeculationStats()  # guesses proposed and accepted since start


@dataclass(slots=True)
class _Live:
    """A request the engine holds: waiting (slot -1), or in a slot. Freed (dropped from the
    table) the step it ends.

    `filling` is read for every request on every iteration, so it is kept as a field, set with
    `prefilled` by `fill_to` alone (a property recomputing it stood out in the loop's profile).
    After a preemption `prompt` is the request's prompt and its output so far (`resumed` ids of
    it): the recompute writes their KV again and samples the next token, so the stop rule, the
    counts and the client's stream go on where they were."""

    ticket: int
    request: Request
    rule: StopRule
    sink: EventSink
    prompt: tuple[int, ...]  # what the slot's prefill writes
    slot: int = -1
    emitted: int = 0
    output: list[int] = dataclasses.field(default_factory=list)  # the ids emitted (a recompute's prompt)
    resumed: int = 0  # output ids at the end of `prompt` (0 until preempted)
    cached: int = 0  # prompt positions its prefix hit covers (their KV is in shared pages)
    prefilled: int = 0  # prompt positions in the cache; the request decodes once all are
    steps: int = 0  # decode steps dispatched for it since its prefill (read or in flight)
    filling: bool = True  # prefilled < the prompt's length (a prompt has at least one id)
    matcher: object | None = None  # a constrained request's state (its output so far consumed)
    speculation: RowSpeculation | None = None  # its proposer history and acceptance, once it speculated

    def fill_to(self, positions: int) -> None:
        self.prefilled = positions
        self.filling = positions < len(self.prompt)

    @property
    def next_index(self) -> int:
        """The output index of the sample its next decode step draws: the prefill's token is 0
        (after a preemption, `resumed` ids came before it), and each step dispatched since,
        read or in flight, one more."""
        return self.resumed + 1 + self.steps


class Engine(ConstrainedSteps, SpeculativeSteps):
    def __init__(
        self,
        model: Model,
        config: EngineConfig = EngineConfig(),
        on_death: Callable[[BaseException], None] | None = None,
        on_step: Callable[[float], None] | None = None,
        proposer: Proposer | None = None,
    ) -> None:
        """`on_death` is called on the engine thread if the loop dies (a server exits on it);
        `on_step(seconds)` after each decode step (metrics): the wall time from the later of its
        dispatch and the host's previous read of the device to its samples' arrival, which is
        the step's time on the device when the host runs behind it. A step during which the host
        read a prompt's first token is not timed (the prompt's time on the device is in it).
        Both must not block. `proposer` stands in for the one `config.speculation` names (tests,
        and proposers that are not built in)."""
        self.model = model
        self.config = config
        self._on_death = on_death
        self._on_step = on_step
        self._delivered: list[Callable[[], None]] = []  # see after_delivery
        self._progress_at = time.monotonic()  # last prefill or step, or when work arrived at an idle engine
        self._cond = threading.Condition()
        self._waiting: collections.OrderedDict[int, _Live] = collections.OrderedDict()
        self._aborts: set[int] = set()
        self._active: dict[int, _Live] = {}  # slot -> live request
        self._in_flight: list[_Live] = []  # the requests of the dispatched step not yet read (engine thread)
        self._chunk: ChunkInput | None = None  # a prompt chunk the next decode step takes along (engine thread)
        self._dispatched_at = 0.0  # when the step in flight was dispatched
        self._read_at = 0.0  # when the host last read the device's samples (a step, or a prompt's first token)
        self._read_in_flight = False  # whether the host read a prompt's sample while the step was in flight
        self._tickets = itertools.count(1)
        self._running = False
        self._dead: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.step_tokens = model.default_step_tokens if config.max_step_tokens is None else config.max_step_tokens
        kv = model.kv
        self._pages = KvPages(kv.num_pages, kv.page_size, reserve_pages(kv, model.info.max_batch_size))  # engine thread
        self._page_stats = self._pages.stats()  # a snapshot for other threads, taken on the engine thread
        self._preemptions = 0
        self._init_speculation(config, proposer)
        log.info(
            "prefill budget: %s prompt tokens a step while requests decode; KV cache: %d pages of %d tokens "
            "(%d kept free at admission)",
            self.step_tokens or "unlimited", self._pages.usable_pages, kv.page_size, self._pages.reserve_pages,
        )

    # -- caller side (any thread) -------------------------------------------------------

    def start(self) -> None:
        with self._cond:
            self._running = True
        self._thread = threading.Thread(target=self._run, name="tokenwire-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 5.0) -> None:
        with self._cond:
            self._running = False
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def info(self) -> ModelInfo:
        return self.model.info

    def submit(self, request: Request, sink: EventSink) -> int:
        """Queue a validated request; returns a ticket for `abort`. Raises QueueFull, EngineStopped,
        ValueError when the prompt leaves no room in the context, and InvalidArgument when the
        request could never fit in the KV cache."""
        info = self.model.info
        request, rule = admit(request, info, self.model.kv)
        with self._cond:
            if self._dead is not None or not self._running:
                raise EngineStopped("the engine is not running")
            free = info.max_batch_size - len(self._active)  # slots the next admission fills
            if len(self._waiting) >= self.config.max_queue_size + free:
                raise QueueFull(f"admission queue is full ({self.config.max_queue_size} waiting)")
            ticket = next(self._tickets)
            if not (self._waiting or self._active):
                self._progress_at = time.monotonic()  # an idle engine is not stalled
            matcher = None if request.constraint is None else request.constraint.matcher()
            self._waiting[ticket] = _Live(ticket, request, rule, sink, request.prompt_token_ids, matcher=matcher)
            self._cond.notify_all()
        return ticket

    def abort(self, ticket: int) -> None:
        """Drop a request: a waiting one at once, a live one at the end of the current prefill or
        step, before the next step. No further events are sent for it. Aborting a finished or
        unknown ticket does nothing."""
        with self._cond:
            waiting = self._waiting.pop(ticket, None)
            if waiting is None:
                self._aborts.add(ticket)
                self._cond.notify_all()
            elif waiting.speculation is not None:  # preempted after it speculated: its proposer
                self._unfollowed.append(waiting)  # history is closed on the engine thread

    def after_delivery(self, callback: Callable[[], None]) -> None:
        """Call `callback()` on the engine thread after each prefill and each decode step, once
        that step's events are all in their sinks: a sink that batches deliveries (one wake-up of
        an event loop for every request of a step) sends its batch then. Must not block."""
        self._delivered.append(callback)

    def stats(self) -> EngineStats:
        with self._cond:
            pending = bool(self._waiting or self._active)
            stalled = time.monotonic() - self._progress_at if pending else 0.0
            return EngineStats(
                len(self._waiting), len(self._active), self._dead is None and self._running, stalled,
                self._page_stats, self._preemptions, self._speculation_stats,
            )

    def _progressed(self) -> None:
        with self._cond:
            self._progress_at = time.monotonic()

    # -- engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while self._running and not (self._waiting or self._active or self._aborts):
                        self._cond.wait()
                    if not self._running:
                        break
                    aborts, self._aborts = self._aborts, set()
                    admitted = self._admit()
                for live in admitted:
                    self.model.set_pages(live.slot, self._pages.pages(live.ticket))
                if self._drop(aborts):
                    self._after_delivery()  # nothing to deliver, but a slot was freed: stats changed
                budget = self.step_tokens or None  # None: no limit
                filling = [live for live in self._active.values() if live.filling]  # admission order
                if budget is not None and len(filling) > len(self._active) - len(filling):
                    budget = None  # more requests wait for a first token than decode: prompts first
                if budget is None and len(filling) > 1 and self.model.packed_prefill_tokens:
                    packed = self._prefill_packed(filling)
                    filling = [live for live in filling if live not in packed]
                for live in filling:  # (a budget left means that as many decode as wait: it binds)
                    if budget is not None and budget <= 0:
                        break
                    done = self._prefill(live, budget)
                    if budget is not None:
                        budget -= done
                    if not live.filling or live.slot not in self._active:  # a first token, or a cancel
                        self._after_delivery()
                    self._progressed()
                if self._in_flight or any(not live.filling for live in self._active.values()):
                    seconds = self._decode_step()
                    self._after_delivery()
                    self._progressed()
                    if self._on_step is not None and seconds is not None:
                        self._on_step(seconds)
        except BaseException as error:  # a dead loop must not leave callers hanging
            log.exception("engine loop died")
            with self._cond:
                self._dead = error
                doomed = list(self._active.values()) + list(self._waiting.values())
                self._active.clear()
                self._waiting.clear()
            for live in doomed:
                live.sink.fail(EngineStopped(f"the engine loop died: {type(error).__name__}"))
            self._after_delivery()
            if self._on_death is not None:
                self._on_death(error)
        finally:
            if self._in_flight:  # a dispatched step is the model's until read: read it (and drop its
                self._in_flight = []  # samples), so that the next engine on this model starts with none
                try:
                    self.model.collect()
                except Exception:  # the model failed: the loop is done with it either way
                    log.exception("reading the last dispatched step as the engine stopped")
            running = list(self._active.values())
            for live in running:  # their slots and pages freed in the model, which outlives the engine
                try:
                    self._release(live)
                except Exception:
                    log.exception("freeing slot %d as the engine stopped", live.slot)
            with self._cond:
                stopped = running + list(self._waiting.values())
                self._active.clear()
                self._waiting.clear()
            for live in stopped:
                live.sink.fail(EngineStopped("the engine stopped"))
            self._after_delivery()

    def _after_delivery(self) -> None:
        stats = self._pages.stats()
        with self._cond:
            self._page_stats = stats
        for callback in self._delivered:
            callback()

    def _admit(self) -> list[_Live]:
        """Under the lock: waiting requests, oldest first (preempted ones are at the front), into
        free slots while the pool can take their prompts (`KvPages.admit`: a prefix hit's pages
        shared, pages for the rest taken); the first that cannot wait stops the rest (FIFO, so a
        long prompt is not starved by short ones behind it). Into an empty engine a request is
        admitted with no reserve: nothing runs that could need it, and a recompute's prompt may
        be nearly the pool. The slot is held from here, so submit never counts it free."""
        admitted = []
        while self._waiting and len(self._active) < self.model.info.max_batch_size:
            live = next(iter(self._waiting.values()))
            reserve = None if self._active else 0
            if not self._pages.can_admit(live.prompt, reserve):
                break
            del self._waiting[live.ticket]
            live.slot = self._free_slot()
            live.cached = self._pages.admit(live.ticket, live.prompt, reserve)
            live.fill_to(live.cached)
            self._active[live.slot] = live
            admitted.append(live)
        return admitted

    def _free_slot(self) -> int:
        return next(s for s in range(self.model.info.max_batch_size) if s not in self._active)

    def _drop(self, tickets: set[int]) -> bool:
        """Release the slots of aborted requests; whether any was released. (A waiting request,
        preempted ones included, left the queue in `abort`; one preempted after its abort, in
        `_preempt`.)"""
        dropped = False
        for slot, live in list(self._active.items()):
            if live.ticket in tickets:
                self._release(live)
                dropped = True
        return dropped

    def _release(self, live: _Live) -> None:
        del self._active[live.slot]
        self.model.release(live.slot)
        self._pages.free(live.ticket)
        if live.speculation is not None:
            self._close_speculation(live)

    def _prefill(self, live: _Live, budget: int | None) -> int:
        """Prefill the next chunk of `live`'s prompt, at most `budget` tokens (None: the rest),
        or the rest when that is under `budget` plus one more budget (after any cached prefix):
        its last piece would otherwise wait a step for a call of its own, so an iteration reads
        under twice the budget. The first chunk starts after the prefix hit, on pages that
        already hold its KV. The chunk that ends the prompt samples its first token. A chunk
        that does not end the prompt, under a budget (others decode), goes with the next decode
        step when the model takes one along (`Model.fused_chunk_tokens`): one pass over the
        weights for both, so the streams decoding beside a long prompt wait for one step, not a
        chunk and a step. Every chunk's pages were taken at admission.
        -> tokens prefilled."""
        prompt = live.prompt
        setup = self._setup(live)
        if setup is None:
            return 0
        start = live.prefilled
        if budget is not None and len(prompt) - start < budget + self.step_tokens:
            budget = None  # less than two budgets left: to its end now, in one call
        end = len(prompt) if budget is None else min(len(prompt), start + budget)
        masked = live.rule.masks_control_tokens(live.resumed) or live.matcher is not None
        sample: Sample | None = None
        if budget is not None and end < len(prompt) and self._chunk is None and end - start <= self.model.fused_chunk_tokens:
            self._chunk = ChunkInput(live.slot, prompt, start, end, setup)
        elif start == 0 and end == len(prompt):  # the whole prompt at once
            sample = self.model.prefill(live.slot, prompt, setup, masked)
        else:
            sample = self.model.prefill_chunk(live.slot, prompt, start, end, setup, masked)
        if sample is not None:
            self._read_at = time.perf_counter()
            self._read_in_flight = bool(self._in_flight)
        self._read_to(live, end, sample)
        return end - start

    def _setup(self, live: _Live) -> SlotSetup | None:
        """What `live`'s slot holds from its take: its sampling and masked ids, and for a
        constrained request the row its first sample (of this run: a recompute's too) is drawn
        under. None when that row allows nothing: the request was failed and its slot freed."""
        banned = None
        if live.matcher is not None:
            banned = self._row(live, live.rule.masks_control_tokens(live.resumed))
            if banned is None:
                return None
        return SlotSetup(live.request.sampling, live.rule.control_token_ids, banned)

    def _row(self, live: _Live, mask_control: bool):
        """A constrained request's next row of banned ids (engine.core.constrained.banned_row),
        or None when it allows nothing: the request then fails and its slot is freed."""
        try:
            return banned_row(live.matcher, self.model.info.vocab_size, live.rule.control_token_ids, mask_control)
        except ValueError as error:  # InvalidArgument, or the matcher's ConstraintError
            self._release(live)
            live.sink.fail(error if isinstance(error, InvalidArgument) else InvalidArgument("constraint", str(error)))
            return None

    def _read_to(self, live: _Live, end: int, sample: Sample | None) -> None:
        """`live`'s prompt is in its slot up to `end` (`sample`: the first token, when that is its
        end): its full pages are published as a cached prefix once all of it is there; a request
        aborted meanwhile is freed and sent nothing; otherwise its first token is decided."""
        live.fill_to(end)
        if end == len(live.prompt):
            self._publish(live)
        with self._cond:  # aborted while prefilling: free the slot, send nothing
            aborted = live.ticket in self._aborts
            if aborted:
                self._aborts.discard(live.ticket)
                if self._chunk is not None and self._chunk.slot == live.slot:
                    self._chunk = None  # (its chunk never reaches the model)
                self._release(live)
        if not aborted and sample is not None:
            self._advance(live, sample)

    def _publish(self, live: _Live) -> None:
        """Key the full pages of `live`'s prompt, all written, for later prompts to share; a page
        another request computed first is swapped for that one (`KvPages.publish`), so the
        slot's table is sent again."""
        before = self._pages.pages(live.ticket)
        self._pages.publish(live.ticket, live.prompt)
        after = self._pages.pages(live.ticket)
        if after != before:
            self.model.set_pages(live.slot, after)

    def _prefill_packed(self, filling: list[_Live]) -> list[_Live]:
        """Read whole, in one `model.prefill_packed` call, the prompts of an iteration that reads
        every prompt whole: from the oldest, while they fit in `packed_prefill_tokens` and until
        one that has started (a chunk read earlier), those with no prefix hit (at least two,
        else none: one prompt is a plain `prefill`; one with a hit is a `prefill_chunk` from
        its hit's end). Each then goes on as after `_prefill` of its whole prompt (its pages
        published, a cancel honoured, its first token decided), and the iteration's deliveries
        go out once. -> the requests read."""
        group: list[tuple[_Live, SlotSetup]] = []
        tokens = 0
        for live in filling:
            if live.prefilled > live.cached or tokens + len(live.prompt) > self.model.packed_prefill_tokens:
                break
            if live.cached or live.matcher is not None:  # (a constrained prompt: `_prefill`, its row checked there)
                continue
            group.append((live, SlotSetup(live.request.sampling, live.rule.control_token_ids)))
            tokens += len(live.prompt)
        if len(group) < 2:
            return []
        samples = self.model.prefill_packed([
            PromptInput(live.slot, live.prompt, setup, live.rule.masks_control_tokens(live.resumed))
            for live, setup in group
        ])
        self._read_at = time.perf_counter()
        self._read_in_flight = bool(self._in_flight)
        for (live, _), sample in zip(group, samples, strict=True):
            self._read_to(live, len(live.prompt), sample)
        self._after_delivery()
        self._progressed()
        return [live for live, _ in group]

    def _decoding(self) -> list[_Live]:
        """The requests the next step is for: prompt complete, and a token left to produce after
        the one each has in flight or holds (1: the prefill's token)."""
        return [
            live for live in self._active.values()
            if not live.filling and live.next_index < live.rule.max_output_tokens
        ]

    def _grow(self, lives: list[_Live]) -> bool:
        """Pages for each row's position in the next step: a row whose position starts a page
        gets one (`KvPages.grow`) and its table is sent again. False when one could not (the
        rows before it got theirs)."""
        size = self._pages.page_size
        for live in lives:
            position = len(live.prompt) + live.steps  # its pages hold 0..position-1, ceil(position / size) of them
            if position % size == 0:
                if not self._pages.grow(live.ticket, position + 1):
                    return False
                self.model.set_pages(live.slot, self._pages.pages(live.ticket))
        return True

    def _make_room(self) -> list[_Live]:
        """With no step in flight: preempt the most recently admitted request (`KvPages.victim`)
        until every row of the next step has its page. -> the rows left."""
        while True:
            lives = self._decoding()
            if self._grow(lives):
                return lives
            ticket = self._pages.victim()
            self._preempt(next(live for live in self._active.values() if live.ticket == ticket))

    def _preempt(self, live: _Live) -> None:
        """Free `live`'s slot and pages and queue it first, to recompute its prompt and output so
        far as a new prompt (mostly a prefix hit: `KvPages.preempt` keeps its full pages cached).
        Its client sees only the time: the recompute's prefill samples the next token, and its
        counts (`emitted`, the stop rule's) go on."""
        end = live.prefilled
        if self._chunk is not None and self._chunk.slot == live.slot:
            end, self._chunk = self._chunk.start, None  # its chunk never reaches the model
        if live.filling:
            written = live.prompt[:end]
        else:  # the prompt, then every output id fed to a step (not the last sample: no step wrote it)
            written = live.prompt + tuple(live.output[live.resumed : live.resumed + live.steps])
        del self._active[live.slot]
        self.model.release(live.slot)
        self._pages.grow(live.ticket, len(written))  # (the length its pages hold: `_grow` asks only at page starts)
        self._pages.preempt(live.ticket, written)
        live.prompt = live.request.prompt_token_ids + tuple(live.output)
        live.resumed, live.slot, live.cached, live.steps = len(live.output), -1, 0, 0
        live.fill_to(0)
        with self._cond:
            self._preemptions += 1
            if live.ticket in self._aborts:  # aborted meanwhile: it goes now, with no events
                self._aborts.discard(live.ticket)
            else:
                self._waiting[live.ticket] = live
                self._waiting.move_to_end(live.ticket, last=False)
        log.debug("preempted request %s after %d tokens: no KV page left", live.request.request_id, live.emitted)

    def _decode_step(self) -> float | None:
        """Dispatch the next step, then read the one dispatched before it (see the module
        docstring). Each request's next step is predicted from what is dispatched: the step in
        flight emits a token unless it finishes the request, in which case the new step's sample
        is discarded, so positions and masking follow from the count of steps alone. When a row
        cannot get a page, the step in flight is read first (it may finish requests, freeing
        theirs), then requests are preempted until every row has one (`_make_room`). A step
        with a constrained row needs the step in flight's samples for its rows of banned ids:
        where the model samples apart, its layers go first and its sampling after the rows
        (`_dispatch_constrained`); elsewhere the step in flight is read before it.
        -> the read step's time (see `on_step`), or None when none was read or it cannot be told apart."""
        seconds = None
        if self._policy is not None:  # speculation on: a verify step, where one pays
            verified, seconds = self._verify_step()
            if verified:
                return seconds
        lives = self._decoding()
        constrained = any(live.matcher is not None for live in lives)
        apart = constrained and self._samples_apart(lives)
        if self._in_flight and constrained and not apart:
            seconds = self._read(*self._take_in_flight())  # a constrained row's next ban needs its token
            lives = self._decoding()
        if not self._grow(lives):
            if self._in_flight:
                seconds = self._read(*self._take_in_flight())
            lives = self._make_room()
        chunk, self._chunk = self._chunk, None
        if apart and lives:
            return self._dispatch_constrained(lives, chunk)
        inputs = self._inputs(lives)
        lives = [live for live in lives if self._active.get(live.slot) is live]  # (less any whose row failed)
        dispatched_at = time.perf_counter()
        if lives:
            self.model.dispatch(inputs, chunk)
            for live in lives:
                live.steps += 1
        elif chunk is not None:  # no step to take it along (every decoding request has its last in flight)
            c = chunk
            self.model.prefill_chunk(c.slot, c.prompt_token_ids, c.start, c.end, c.setup, False)
        previous, started, timed = self._take_in_flight()
        self._in_flight, self._dispatched_at = lives, dispatched_at
        if previous:
            seconds = self._read(previous, started, timed)
        return seconds

    def _inputs(self, lives: list[_Live]) -> list[DecodeInput]:
        """The step's rows; the constrained requests' next rows of banned ids are sent first
        (`_bans`: none has a step in flight, so their counts are exact), and one whose row
        allows nothing, or whose matcher failed, is failed and left out, alone."""
        masked = {live.slot: live.rule.masks_control_tokens(live.next_index) for live in lives}
        held = [live for live in lives if live.matcher is not None]
        if held:
            masked.update((slot, True) for slot in self._bans(held, masked))
        # token_id None: the slot's last sample, still on the device
        return [
            DecodeInput(slot=live.slot, token_id=None, position=len(live.prompt) + live.steps, masked=masked[live.slot])
            for live in lives if self._active.get(live.slot) is live
        ]

    def _take_in_flight(self) -> tuple[list[_Live], float, bool]:
        """The step in flight (no longer in flight once this returns), when its time started (its
        dispatch, or the host's later read), and whether its time can be told apart."""
        previous, self._in_flight = self._in_flight, []
        started, timed = max(self._dispatched_at, self._read_at), not self._read_in_flight
        self._read_in_flight = False
        return previous, started, timed

    def _read(self, previous: list[_Live], started: float, timed: bool) -> float | None:
        """Read the step of `previous` (`model.collect`) and decide each request's sample.
        -> the step's time (see `on_step`), or None."""
        samples = self.model.collect()
        self._read_at = time.perf_counter()
        with self._cond:  # requests aborted during the step are freed now, with no more events
            aborted = {live.ticket for live in previous} & self._aborts
            self._aborts -= aborted
        for live, sample in zip(previous, samples, strict=True):
            if self._active.get(live.slot) is not live:
                continue  # finished by the step before, or aborted: the sample is discarded
            if live.ticket in aborted:
                self._release(live)
            else:
                self._advance(live, sample)
        return self._read_at - started if timed else None

    def _advance(self, live: _Live, sample: Sample) -> None:
        """Apply the one decision to a sampled token and send the resulting events."""
        self._advance_run(live, (sample,))

    def _advance_run(self, live: _Live, samples: Sequence[Sample]) -> None:
        """Apply the one decision to each sample in turn (a verify step's run: several) and send
        the emitted tokens, and the finish if one came, as one list: one message. What follows
        a finish is dropped. A constrained request whose matcher refuses an id (the model
        sampled past its banned row: a model bug, not the caller's) fails alone, with
        DecoderFault; the engine goes on."""
        events: list[Event] = []
        for sample in samples:
            try:
                decision = decide(sample.token_id, live.emitted, live.rule, live.matcher)
            except ValueError as error:  # engine.constraints.ConstraintError, from Matcher.advance
                if live.matcher is None:
                    raise
                log.error("request %s: the model sampled id %d, which its constraint bans: %s",
                          live.request.request_id, sample.token_id, error)
                self._release(live)
                live.sink.fail(DecoderFault(f"the model sampled id {sample.token_id}, which the request's constraint bans"))
                return
            if decision.emit:
                live.emitted += 1
                live.output.append(sample.token_id)
                if live.request.return_logprobs:
                    events.append(Token(sample.token_id, sample.logprob, sample.top_logprobs))
                else:
                    events.append(Token(sample.token_id))
            if decision.finish is not None:
                usage = Usage(len(live.request.prompt_token_ids), live.emitted)
                events.append(Finished(decision.finish, usage, decision.stop_token_id))
                self._release(live)
                break
        live.sink.events(events)
