"""`EngineProcess`: the engine and its model in a spawned child, behind the caller API of `Engine`.

Every test runs a real child process with the scripted model (a picklable factory: a partial of
ScriptedModel, or a module-level function of this module, which the child imports by name).
Waits poll or block on a condition with a stated bound (`LIMIT_S`), which only a hung test
reaches; no test asserts how long something took. What a clock would say is read from the
mechanism instead: the child's exit code (stopped, or killed), the parent's own clock replaced by
one the test moves (`stalled_s`), the reader thread blocked on the pipe.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import multiprocessing
import os
import platform
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path
from typing import Callable

import pytest

from engine.core.async_engine import AsyncEngine
from engine.core.engine import Engine, EngineConfig
from engine.core.engine_process import EngineProcess, ModelLoadFailed
from engine.core.errors import EngineStopped, InvalidArgument, QueueFull
from engine.core.events import Finished, FinishReason, Token, Usage
from engine.core.request import Request, StoppingCriteria
from engine.core.scripted_model import ScriptedModel
from tests.support.waiting import read_line, until_sync  # (as the children import this module: from the root)

ROOT = Path(__file__).resolve().parent.parent
LIMIT_S = 10.0  # bound on any one wait: generous for a shared 2-core machine running two test workers, far above the work waited for

MODEL = dict(vocab_size=1000, eos_token_ids=frozenset({2}), max_batch_size=4, max_context_length=256, step_delay_s=0.002)


def factory(**overrides) -> functools.partial:
    return functools.partial(ScriptedModel, **{**MODEL, **overrides})


def long_request(prompt_last: int, n: int | None = None) -> Request:
    """ignore_eos, so it runs to n tokens (or to the context: 254 steps of 2 ms)."""
    return Request(f"r{prompt_last}", (1, prompt_last), stopping=StoppingCriteria(max_output_tokens=n, ignore_eos=True))


# -- factories the child imports from this module by name -------------------------------------


def no_such_model():
    raise ValueError("no such model")


def broken_model():
    raise RuntimeError("the weights are corrupt")


def dying_model():
    os._exit(3)


# -- helpers ------------------------------------------------------------------------------------


class Recorder:
    """A sink for one request (called on the reader thread). Records, per delivery, the index of
    the child's message it came in (with a `MessageCounter`), and anything delivered after the end."""

    def __init__(self, counter: MessageCounter | None = None) -> None:
        self._cond = threading.Condition()
        self._counter = counter
        self.got: list = []  # events, in order
        self.deliveries: list[int] = []  # per events() call: the message it came in (-1 without a counter)
        self.error: BaseException | None = None
        self.late: list = []  # anything delivered after Finished or a failure: must stay empty

    @property
    def ended(self) -> bool:
        return self.error is not None or bool(self.got and isinstance(self.got[-1], Finished))

    def events(self, events) -> None:
        with self._cond:
            if self.ended:
                self.late.append(events)
            self.got.extend(events)
            self.deliveries.append(-1 if self._counter is None else self._counter.count)
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            if self.ended:
                self.late.append(error)
            self.error = error
            self._cond.notify_all()

    def tokens(self) -> list[int]:
        with self._cond:
            return [e.id for e in self.got if isinstance(e, Token)]

    def wait(self, predicate: Callable[[Recorder], bool], limit_s: float = LIMIT_S) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: predicate(self), limit_s), f"not reached in {limit_s} s: {self.got[-3:]}"

    def wait_ended(self, limit_s: float = LIMIT_S) -> None:
        self.wait(lambda r: r.ended, limit_s)


class MessageCounter:
    """after_delivery callback: how many messages from the child have been delivered in full."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> None:
        self.count += 1  # only the reader thread writes it


class Deaths:
    """on_death callback."""

    def __init__(self) -> None:
        self.errors: list[BaseException] = []
        self.called = threading.Event()

    def __call__(self, error: BaseException) -> None:
        self.errors.append(error)
        self.called.set()


def wait_until(predicate: Callable[[], bool], what: str = "the condition", interval_s: float = 0.002) -> None:
    until_sync(predicate, what, LIMIT_S, interval_s)


def exit_code(process: EngineProcess) -> int | None:
    """The child's exit code once the parent has reaped it (negative: the signal that ended it)."""
    return process._process.exitcode


READ_SYSCALL = {"x86_64": 0, "aarch64": 63}.get(platform.machine())


def reader_blocked_on_the_pipe(process: EngineProcess) -> bool:
    """The parent's reader thread sits in read(2) on the child's pipe: it has delivered all that
    arrived, and delivers nothing more until the child writes. (Linux: /proc/.../syscall.)"""
    fields = Path(f"/proc/self/task/{process._reader.native_id}/syscall").read_text().split()
    return fields[0] == str(READ_SYSCALL) and int(fields[1], 16) == process._conn.fileno()


class Clock:
    """The parent's `time.monotonic`, moved only by the test (the child has its own `time`)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def exited(pid: int) -> bool:
    """The process is gone or a zombie (it exited; nobody reaped it yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.fixture
def spawn():
    """Start EngineProcesses; each is stopped (and so its child gone) after the test."""
    started: list[EngineProcess] = []

    def make(
        config: EngineConfig = EngineConfig(max_queue_size=4), on_step: Callable[[float], None] | None = None, **model
    ) -> tuple[EngineProcess, Deaths]:
        deaths = Deaths()
        process = EngineProcess(factory(**model), config, on_death=deaths, on_step=on_step)
        started.append(process)
        process.start()
        return process, deaths

    yield make
    for process in started:
        if process.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGCONT)  # in case a test left it stopped
        process.stop()
        assert process.pid is None or exited(process.pid)


# -- the same streams as the in-process engine ----------------------------------------------------


PARITY = [  # (request, expected token ids, expected finish); the model: token after t is t + 1, EOS 2
    (Request("length", (1, 100), stopping=StoppingCriteria(max_output_tokens=5, ignore_eos=True)),
     list(range(101, 106)), Finished(FinishReason.LENGTH, Usage(2, 5))),
    (Request("wraps-past-eos", (1, 995), stopping=StoppingCriteria(max_output_tokens=10, ignore_eos=True),
             return_logprobs=True),
     [996, 997, 998, 999, 0, 1, 2, 3, 4, 5], Finished(FinishReason.LENGTH, Usage(2, 10))),
    (Request("eos", (7, 0)), [1], Finished(FinishReason.STOP, Usage(2, 1), 2)),
    (Request("eos-at-prefill", (7, 1)), [], Finished(FinishReason.STOP, Usage(2, 0), 2)),
    (Request("stop-id", (1, 500), stopping=StoppingCriteria(max_output_tokens=50, stop_token_ids=frozenset({504}))),
     [501, 502, 503], Finished(FinishReason.STOP, Usage(2, 3), 504)),
    (Request("stop-id-masked-below-min", (1, 500),
             stopping=StoppingCriteria(stop_token_ids=frozenset({501, 503}), min_output_tokens=1)),
     [502], Finished(FinishReason.STOP, Usage(2, 1), 503)),
    (Request("stop-beats-the-cap", (1, 600), stopping=StoppingCriteria(max_output_tokens=1, stop_token_ids=frozenset({601}))),
     [], Finished(FinishReason.STOP, Usage(2, 0), 601)),
    (Request("one-token", (1, 300), stopping=StoppingCriteria(max_output_tokens=1)),
     [301], Finished(FinishReason.LENGTH, Usage(2, 1))),
    (Request("to-the-context", tuple(range(3, 43)), stopping=StoppingCriteria(ignore_eos=True)),  # 40 + 24 = 64
     list(range(43, 67)), Finished(FinishReason.LENGTH, Usage(40, 24))),
]


async def test_streams_through_the_process_are_those_of_the_in_process_engine(spawn):
    model = dict(max_context_length=64)
    config = EngineConfig(max_queue_size=8)  # 9 requests on 4 slots: some wait in the queue
    in_thread = Engine(ScriptedModel(**{**MODEL, **model}), config)
    in_thread.start()
    try:
        steps: list[float] = []
        in_process, deaths = await asyncio.to_thread(spawn, config, steps.append, **model)
        assert in_process.info == in_thread.info

        async def run(engine) -> list[list]:
            async_engine = AsyncEngine(engine)

            async def one(request: Request) -> list:
                return [e async for events in async_engine.stream(request) for e in events]

            return await asyncio.gather(*(one(request) for request, _, _ in PARITY))

        by_thread, by_process = await asyncio.wait_for(asyncio.gather(run(in_thread), run(in_process)), LIMIT_S)
    finally:
        in_thread.stop()
    assert by_process == by_thread
    for (request, tokens, finished), events in zip(PARITY, by_process, strict=True):
        assert [e.id for e in events[:-1]] == tokens, request.request_id
        assert events[-1] == finished, request.request_id
        assert all(isinstance(e, Token) for e in events[:-1])  # one Finished, the last event
        assert finished.usage.completion_tokens == len(tokens)  # a control token is never counted...
        assert finished.stop_token_id is None or finished.stop_token_id not in tokens  # ...nor emitted
        if request.return_logprobs:
            assert [e.logprob for e in events[:-1]] == [-(t % 10) / 10 for t in tokens]
        else:
            assert all(e.logprob is None for e in events[:-1])
    assert in_process.stats().slots_in_use == 0 and in_process.stats().queue_depth == 0
    assert not deaths.called.is_set()
    # on_step: once per timed decode step (the longest request needs 23 after its prefill; steps
    # while a prompt's first token was read are not timed, at most one per admission), each the
    # child's figure for a step (what the figure is: test_engine's test of on_step, on a clock of
    # the device's steps)
    assert len(steps) >= 23 - len(PARITY) and all(isinstance(s, float) and s > 0 for s in steps)


# -- submit refuses synchronously -------------------------------------------------------------------


def test_submit_refuses_at_the_admission_bound_counting_requests_until_they_end(spawn):
    # bound: 2 slots + 2 waiting; the long requests run to the context (1022 steps of 2 ms)
    process, _ = spawn(EngineConfig(max_queue_size=2), max_batch_size=2, max_context_length=1024)
    short = Recorder()
    process.submit(long_request(400, 20), short)  # runs, ends after 20 steps
    process.submit(long_request(100), Recorder())  # runs
    waiting = process.submit(long_request(200), Recorder())
    process.submit(long_request(300), Recorder())
    with pytest.raises(QueueFull):
        process.submit(long_request(500), Recorder())
    wait_until(lambda: process.stats().slots_in_use == 2 and process.stats().queue_depth == 2)

    process.abort(waiting)  # an aborted request no longer counts, at once
    process.submit(long_request(600), Recorder())
    with pytest.raises(QueueFull):
        process.submit(long_request(700), Recorder())

    short.wait_ended()  # a finished request no longer counts
    assert short.tokens() == list(range(401, 421)) and short.error is None
    process.submit(long_request(800), Recorder())
    with pytest.raises(QueueFull):
        process.submit(long_request(900), Recorder())


def test_submit_refuses_a_prompt_that_leaves_no_room_and_any_request_once_stopped(spawn):
    process, _ = spawn()
    full = Request("full", tuple(range(1, 257)))  # 256 tokens in a context of 256
    with pytest.raises(ValueError, match="no room"):
        process.submit(full, Recorder())
    assert process.stats().stalled_s == 0.0  # nothing was queued
    last_place = Recorder()
    process.submit(Request("fits", tuple(range(1, 256))), last_place)  # 255: room for one token
    last_place.wait_ended()
    assert last_place.got == [Token(256), Finished(FinishReason.LENGTH, Usage(255, 1))]

    process.stop()
    assert not process.stats().alive
    with pytest.raises(EngineStopped):
        process.submit(long_request(100, 3), Recorder())


# -- abort ----------------------------------------------------------------------------------------


def test_abort_frees_the_slot_and_nothing_is_delivered_after_it(spawn):
    process, _ = spawn(max_batch_size=2)
    messages = MessageCounter()
    process.after_delivery(messages)
    aborted, other = Recorder(messages), Recorder(messages)
    ticket = process.submit(long_request(100), aborted)
    process.submit(long_request(500, 250), other)  # 250 steps of 2 ms: still running when the abort lands
    aborted.wait(lambda r: len(r.tokens()) >= 3)
    wait_until(lambda: process.stats().slots_in_use == 2)

    process.abort(ticket)
    in_flight = messages.count  # the message being delivered now (if any) is the last that may carry events
    other_then = len(other.tokens())
    wait_until(lambda: process.stats().slots_in_use == 1)
    assert len(other.tokens()) < 250, "the slot is freed while the other request still runs"
    other.wait_ended()
    assert other.tokens() == list(range(501, 751)) and len(other.tokens()) > other_then + 10
    assert max(aborted.deliveries) <= in_flight, "an event arrived in a message read after the abort"
    assert aborted.error is None and not aborted.ended  # aborted: no Finished, no failure
    assert aborted.tokens() == list(range(101, 101 + len(aborted.tokens())))
    wait_until(lambda: process.stats().slots_in_use == 0)
    process.abort(ticket)  # again, and an unknown ticket: nothing happens
    process.abort(10_000)
    assert process.stats().alive and not aborted.late


def test_stats_show_the_slot_freed_by_an_abort_that_no_step_follows(spawn):
    """An abort that lands between steps of the last live request frees the slot with no prefill
    or step after it; the child still reports it (the slot gauge must not stay at 1)."""
    process, _ = spawn(step_delay_s=0.0, max_context_length=100_000)
    for attempt in range(8):
        sink = Recorder()
        ticket = process.submit(long_request(100 + attempt), sink)
        sink.wait(lambda r: len(r.tokens()) >= 1)
        process.abort(ticket)
        wait_until(lambda: process.stats().slots_in_use == 0, "the aborted slot shows free")


def test_the_page_counts_reach_the_parent(spawn):
    """The KV pool's stats cross the pipe: a prompt's two full pages found cached the second
    time, kept cached after; and two requests that outgrow a pool of 8 pages (5 pages each), one
    of them preempted and recomputed, each with exactly its own ids."""
    process, _ = spawn(max_batch_size=2)
    prompt = tuple(range(3, 40))  # two full pages of 16 and 5 more
    for _ in range(2):
        sink = Recorder()
        process.submit(Request("p", prompt, stopping=StoppingCriteria(max_output_tokens=2)), sink)
        sink.wait_ended()
    wait_until(lambda: process.stats().pages.hit_tokens == 32)
    pages = process.stats().pages
    assert (pages.queried_tokens, pages.total, pages.used, pages.cached) == (74, 2 * 256 // 16, 0, 2)

    process, _ = spawn(max_batch_size=2, kv_cache_tokens=128)
    sinks = [Recorder() for _ in range(2)]
    for last, sink in zip((100, 500), sinks):
        process.submit(long_request(last, 70), sink)
    for last, sink in zip((100, 500), sinks):
        sink.wait_ended()
        assert sink.tokens() == list(range(last + 1, last + 71))
    wait_until(lambda: process.stats().preemptions >= 1 and process.stats().pages.used == 0)
    with pytest.raises(InvalidArgument, match="KV cache of 128 tokens"):  # refused in the parent, from the child's layout
        process.submit(long_request(7, 127), Recorder())


def test_aborting_a_waiting_request_delivers_nothing_for_it(spawn):
    """The parent drops the aborted request's events whatever the child does, so what shows the
    child dropped it too is the work: on one slot, the waiting request would run 253 decode steps
    once the running one's 99 end. The child's stats never show the engine idle while a request
    is still queued or running, so once they do, the child's step count says what it ran."""
    steps: list[float] = []  # on_step: one per decode step of the child
    process, _ = spawn(EngineConfig(max_queue_size=2), on_step=steps.append, max_batch_size=1)
    running, waiting = Recorder(), Recorder()
    process.submit(long_request(100, 100), running)  # the prefill and 99 steps of 2 ms
    ticket = process.submit(long_request(200), waiting)  # to the context: the prefill and 253 steps
    running.wait(lambda r: len(r.tokens()) >= 2)
    wait_until(lambda: process.stats().queue_depth == 1)  # it waits for the slot the running one holds
    process.abort(ticket)
    running.wait_ended()
    assert running.tokens() == list(range(101, 201))
    wait_until(lambda: process.stats().queue_depth == 0 and process.stats().slots_in_use == 0)
    ran = len(steps)
    assert ran <= 99, f"{ran} decode steps: the child ran the aborted request after the running one"
    assert waiting.got == [] and waiting.error is None


# -- failures ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model_factory", "message"),
    [
        (no_such_model, "no such model"),
        (broken_model, "RuntimeError: the weights are corrupt"),
        (dying_model, "exited with code 3 while loading"),
    ],
)
def test_a_model_that_cannot_load_fails_start_with_its_reason_and_the_child_exits(model_factory, message):
    deaths = Deaths()
    process = EngineProcess(model_factory, EngineConfig(), on_death=deaths)
    with pytest.raises(ModelLoadFailed, match=message):
        process.start()
    assert exited(process.pid)
    assert not process.stats().alive
    process.stop()  # harmless after a failed start
    assert not deaths.called.is_set()  # start raised: on_death is for an engine that ran


def test_the_model_failing_mid_decode_fails_requests_in_flight_and_calls_on_death(spawn):
    process, deaths = spawn(fail_at_step=3, step_delay_s=0.01)
    recorders = [Recorder() for _ in range(3)]
    for i, recorder in enumerate(recorders, start=1):
        process.submit(long_request(100 * i), recorder)
    for recorder in recorders:
        recorder.wait_ended()
        assert isinstance(recorder.error, EngineStopped), recorder.got
        assert "RuntimeError" in str(recorder.error)
        assert len(recorder.tokens()) <= 3  # the prefill's token and the two steps before the failure
    assert deaths.called.wait(LIMIT_S)
    assert isinstance(deaths.errors[0], EngineStopped) and "scripted failure at decode step 3" in str(deaths.errors[0])
    assert not process.stats().alive
    wait_until(lambda: exited(process.pid))
    with pytest.raises(EngineStopped):
        process.submit(long_request(100, 3), Recorder())
    assert all(not r.late for r in recorders)


def test_a_killed_child_fails_requests_in_flight_naming_the_exit(spawn):
    process, deaths = spawn()
    streams = [Recorder() for _ in range(2)]
    for i, recorder in enumerate(streams, start=1):
        process.submit(long_request(100 * i), recorder)
    streams[0].wait(lambda r: len(r.tokens()) >= 3)
    os.kill(process.pid, signal.SIGKILL)
    for recorder in streams:
        recorder.wait_ended()
        assert isinstance(recorder.error, EngineStopped)
        assert "exited" in str(recorder.error) and str(-signal.SIGKILL) in str(recorder.error)
    assert deaths.called.wait(LIMIT_S) and "exited" in str(deaths.errors[0])
    assert not process.stats().alive and process.stats().stalled_s == 0.0
    with pytest.raises(EngineStopped):
        process.submit(long_request(100, 3), Recorder())


def test_stop_with_requests_in_flight_fails_them_and_the_child_exits(spawn):
    process, deaths = spawn(EngineConfig(max_queue_size=4), max_batch_size=2)
    streams = [Recorder() for _ in range(4)]  # two running, two waiting
    for i, recorder in enumerate(streams, start=1):
        process.submit(long_request(100 * i), recorder)
    streams[0].wait(lambda r: len(r.tokens()) >= 3)
    process.stop()  # (its default timeout, 5 s, before it would kill the child)
    assert exit_code(process) == 0, "the child did not end on the stop message: it was killed"
    for recorder in streams:
        assert recorder.ended and isinstance(recorder.error, EngineStopped) and not recorder.late
    assert exited(process.pid)
    assert not process.stats().alive and not deaths.called.is_set()  # a stop is not a death
    with pytest.raises(EngineStopped):
        process.submit(long_request(100, 3), Recorder())
    process.stop()  # twice: nothing happens


def test_stop_kills_a_child_that_does_not_answer_within_the_timeout(spawn):
    process, deaths = spawn()
    recorder = Recorder()
    process.submit(long_request(100), recorder)
    recorder.wait(lambda r: len(r.tokens()) >= 2)
    os.kill(process.pid, signal.SIGSTOP)  # it cannot read the stop
    try:
        stopping = threading.Thread(target=process.stop, kwargs=dict(timeout=0.2), daemon=True)
        stopping.start()
        stopping.join(LIMIT_S)  # the reader's and the child's timeouts, then a kill
        assert not stopping.is_alive(), "stop waits on a child that cannot answer"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGCONT)
    assert exit_code(process) == -signal.SIGKILL  # killed, not ended by the stop message
    assert exited(process.pid)
    assert isinstance(recorder.error, EngineStopped) and not recorder.late
    assert not deaths.called.is_set()


# -- the parent dying, and signals --------------------------------------------------------------


def _orphan_parent() -> None:
    """Run in a subprocess by the test below: start an engine process with a request in flight,
    print the child's pid, then wait to be killed."""
    process = EngineProcess(factory(max_context_length=100_000))
    process.start()
    recorder = Recorder()
    process.submit(long_request(100), recorder)  # ~50 s of steps: in flight when the parent dies
    recorder.wait(lambda r: len(r.tokens()) >= 2)
    print(process.pid, flush=True)
    time.sleep(60)


def test_the_child_exits_when_its_parent_dies():
    parent = subprocess.Popen(
        [sys.executable, "-c", "import tests.test_engine_process as m; m._orphan_parent()"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )
    child = None
    try:
        child = int(read_line(parent, limit_s=30))  # the parent starts an engine process first
        assert not exited(child)
        parent.kill()
        parent.wait(LIMIT_S)
        wait_until(lambda: exited(child), "the orphan exits", interval_s=0.01)  # it reads end-of-file and exits
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()
        if child is not None and not exited(child):
            os.kill(child, signal.SIGKILL)


def test_sigint_to_the_child_is_ignored(spawn):
    process, deaths = spawn()
    first = Recorder()
    process.submit(long_request(100, 40), first)
    first.wait(lambda r: len(r.tokens()) >= 2)
    os.kill(process.pid, signal.SIGINT)
    first.wait_ended()
    assert first.tokens() == list(range(101, 141)) and first.error is None
    after = Recorder()
    process.submit(long_request(300, 3), after)  # still serving after the signal
    after.wait_ended()
    assert after.tokens() == [301, 302, 303]
    assert not exited(process.pid) and process.stats().alive and not deaths.called.is_set()


@pytest.mark.skipif(READ_SYSCALL is None or not sys.platform.startswith("linux"), reason="reads /proc/<tid>/syscall")
def test_stalled_s_grows_while_the_child_makes_no_progress_and_is_zero_when_idle(spawn, monkeypatch):
    """stalled_s is the parent's clock since the child's last message while a request is pending,
    0 with none. The parent's clock here is one the test moves, so every value is exact."""
    import engine.core.engine_process as engine_process

    clock = Clock()
    monkeypatch.setattr(engine_process, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    process, deaths = spawn(max_context_length=100_000)  # its request runs until aborted
    clock.now += 100
    assert process.stats().stalled_s == 0.0  # idle, however long
    recorder = Recorder()
    ticket = process.submit(long_request(100), recorder)
    recorder.wait(lambda r: len(r.tokens()) >= 2)
    clock.now += 100
    wait_until(lambda: process.stats().stalled_s == 0.0, "a message after the clock moved")  # it makes progress
    os.kill(process.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: state(process.pid) == "T", "the child stopped", interval_s=0.001)
        # what the child sent before it stopped is delivered; nothing more comes
        wait_until(lambda: reader_blocked_on_the_pipe(process), "the reader waits on the pipe")
        clock.now += 7
        assert process.stats().stalled_s == 7  # the clock since its last message
        clock.now += 5
        assert process.stats().stalled_s == 12  # still growing, with the clock
        assert process.stats().alive  # stalled, not dead
    finally:
        os.kill(process.pid, signal.SIGCONT)
    wait_until(lambda: process.stats().stalled_s == 0.0, "a message after SIGCONT")  # progress again
    process.abort(ticket)
    clock.now += 100
    assert process.stats().stalled_s == 0.0  # nothing pending: idle
    assert not deaths.called.is_set()


# -- the child's outbox, on a real pipe ----------------------------------------------------------


@contextlib.contextmanager
def outbox_on_a_pipe():
    """An opened `_Outbox` on one end of a real multiprocessing pipe (the parent's end is
    yielded with it), its sender thread running; closed and joined after."""
    from engine.core.engine import EngineStats
    from engine.core.engine_process import _Outbox

    parent, child = multiprocessing.Pipe()
    outbox = _Outbox(child)
    outbox.stats = lambda: EngineStats(0, 1, True, 0.0)
    outbox.open()
    sender = threading.Thread(target=outbox.run, daemon=True)
    sender.start()
    try:
        yield outbox, parent
    finally:
        outbox.close()
        sender.join(LIMIT_S)
        assert not sender.is_alive()
        parent.close()
        child.close()


def test_the_engine_thread_sends_a_step_itself_when_the_pipe_takes_it():
    """The common case: no hand-off to the sender thread; the parent's Connection reads the frame."""
    with outbox_on_a_pipe() as (outbox, parent):
        for step in range(3):
            outbox.events(7, [Token(100 + step)])
            outbox.step(0.01)
            outbox.flush()
            assert parent.poll(LIMIT_S)
            kind, deliveries, steps, queue_depth, slots, *_ = parent.recv()
            assert (kind, deliveries, steps, queue_depth, slots) == ("batch", [(7, [100 + step])], [0.01], 0, 1)
        assert outbox.direct_sends == 3


def test_a_close_while_the_engine_thread_writes_still_ends_the_sender():
    """The child's stop (or the engine's death) closes the outbox while the engine thread may be
    sending a step itself: the sender, which waits for that write to end, must then see the close
    and end, or the child waits for it forever. The close is made from inside the write (the
    stats read as the message is built)."""
    from engine.core.engine import EngineStats
    from engine.core.engine_process import _Outbox

    parent, child = multiprocessing.Pipe()
    outbox = _Outbox(child)

    def stats_then_close() -> EngineStats:
        outbox.close()  # wakes the sender (its waiter leaves the condition's queue), which sees the
        # write under way and waits again (a new waiter): only then does this write end
        until_sync(lambda: len(outbox._cond._waiters) == 1, "the sender back to waiting for the write")
        return EngineStats(0, 1, True, 0.0)

    outbox.stats = stats_then_close
    outbox.open()
    sender = threading.Thread(target=outbox.run, daemon=True)
    sender.start()
    try:  # (the sender's innermost frame is Condition.wait once it waits for work)
        until_sync(lambda: getattr(sys._current_frames().get(sender.ident), "f_code", None) is threading.Condition.wait.__code__,
                   "the sender waiting")
        outbox.step(0.01)
        outbox.flush()  # sends it itself, closing the outbox on the way
        assert parent.poll(LIMIT_S) and parent.recv()[0] == "batch"
        sender.join(LIMIT_S)
        assert not sender.is_alive(), "the sender missed the close"
    finally:
        outbox.close()
        sender.join(LIMIT_S)
        parent.close()
        child.close()


def test_a_parent_that_stops_reading_never_blocks_the_engine_thread_and_loses_nothing():
    """Steps of 4,000 tokens each (12-20 KB pickled), enough of them to hold four times what the
    pipe's two socket buffers take: every flush still returns at once (the watchdog), the rest
    goes through the sender thread, coalesced, and the parent then reads every token in order."""
    sent: list[int] = []
    with outbox_on_a_pipe() as (outbox, parent):
        with socket.socket(fileno=os.dup(parent.fileno())) as end:
            buffered = end.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) + end.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        steps = 4 * buffered // 12_000 + 1

        def engine_thread() -> None:
            for step in range(steps):
                ids = list(range(step * 4000, (step + 1) * 4000))
                sent.extend(ids)
                outbox.events(1, [Token(i) for i in ids])
                outbox.flush()

        worker = threading.Thread(target=engine_thread, daemon=True)
        worker.start()
        worker.join(LIMIT_S)
        assert not worker.is_alive(), "a flush blocked on the pipe the parent does not read"
        received, messages = [], 0
        while len(received) < len(sent):
            assert parent.poll(LIMIT_S)
            _, deliveries, *_ = parent.recv()
            messages += 1
            received += [i for _, payload in deliveries for i in payload]
    assert received == sent
    assert outbox.direct_sends < steps and messages < steps, (outbox.direct_sends, messages, steps)
