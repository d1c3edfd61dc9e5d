"""The scheduler with the scripted model, no gRPC: batching, queueing, aborts, failures."""

from __future__ import annotations

import threading
import time as time_module

import pytest

from engine.core.engine import Engine, EngineConfig
from engine.core.errors import EngineStopped, QueueFull
from engine.core.events import FinishReason
from engine.core.request import Request, StoppingCriteria
from engine.core.scripted_model import ScriptedModel
from support.recording_sink import Recorder
from support.waiting import until_sync




def make_request(prompt, n=None, **kw) -> Request:
    return Request("r", tuple(prompt), stopping=StoppingCriteria(n, **kw))


@pytest.fixture
def engine():
    model = ScriptedModel(vocab_size=100, max_batch_size=2, max_context_length=32)
    engine = Engine(model, EngineConfig(max_queue_size=8))
    engine.start()
    yield engine
    engine.stop()


def test_requests_beyond_the_slots_wait_then_complete(engine):
    sinks = [Recorder() for _ in range(5)]
    for i, sink in enumerate(sinks):
        engine.submit(make_request([10 * i + 3], 4), sink)
    for i, sink in enumerate(sinks):
        assert sink.done.wait(5)
        assert sink.tokens == list(range(10 * i + 4, 10 * i + 8))
    assert engine.stats().slots_in_use == 0 and engine.model.slots_held == 0


def test_each_step_coalesces_one_list_per_request(engine):
    sink = Recorder()
    engine.submit(make_request([10], 3), sink)
    assert sink.done.wait(5)
    assert [len(b) for b in sink.batches] == [1, 1, 2]  # prefill, step, step + Finished
    assert sink.batches[-1][-1].reason == FinishReason.LENGTH


def test_queue_bound_raises_queue_full(engine):
    engine.model.step_delay_s = 0.05
    sinks = [Recorder() for _ in range(10)]
    for sink in sinks[:2]:
        engine.submit(make_request([10], 20), sink)
    for sink in sinks[:2]:  # both slots busy from their prefill for 19 steps (~1 s)
        assert sink.started.wait(5)
    assert engine.stats().slots_in_use == 2
    for sink in sinks[2:]:  # 8 waiting: the bound
        engine.submit(make_request([10], 20), sink)
    with pytest.raises(QueueFull):
        engine.submit(make_request([10], 20), Recorder())
    for sink in sinks:
        assert sink.done.wait(10)


class GatedPrefill(ScriptedModel):
    """The scripted model, with each prefill held until the test opens the gate."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.entered = threading.Event()
        self.gate = threading.Event()

    def prefill(self, *args, **kw):
        self.entered.set()
        assert self.gate.wait(10)
        return super().prefill(*args, **kw)


def test_a_request_is_refused_only_when_every_slot_is_taken_and_the_queue_is_full():
    """Capacity is slots + queue. Requests submitted before the loop admits them (here: while it
    is busy prefilling) wait for the free slot; they do not count against the queue bound."""
    model = GatedPrefill(vocab_size=100, max_batch_size=2, max_context_length=32)
    engine = Engine(model, EngineConfig(max_queue_size=1))
    engine.start()
    try:
        sinks = [Recorder() for _ in range(3)]
        engine.submit(make_request([10], 2), sinks[0])
        assert model.entered.wait(5)  # slot 0 is prefilling; slot 1 is free
        engine.submit(make_request([20], 2), sinks[1])  # will take slot 1
        engine.submit(make_request([30], 2), sinks[2])  # the one queued request
        assert engine.stats().queue_depth == 2
        with pytest.raises(QueueFull):
            engine.submit(make_request([40], 2), Recorder())
        model.gate.set()
        for i, sink in enumerate(sinks):
            assert sink.done.wait(5) and sink.error is None
            assert sink.tokens == [10 * i + 11, 10 * i + 12]
    finally:
        model.gate.set()
        engine.stop()


def test_abort_waiting_and_live_requests_frees_everything(engine):
    engine.model.step_delay_s = 0.05
    sinks = [Recorder() for _ in range(4)]
    tickets = [engine.submit(make_request([10], 25), s) for s in sinks]
    for sink in sinks[:2]:  # the first two hold the slots (24 steps each, 1.2 s); two wait
        assert sink.started.wait(5)
    assert (engine.stats().slots_in_use, engine.stats().queue_depth) == (2, 2)
    for t in tickets:
        engine.abort(t)
    # The waiting two leave the queue at once, the live two at the end of the current step. An
    # abort that did nothing would run all four: 48 steps, every sink Finished.
    until_sync(lambda: not (engine.stats().slots_in_use or engine.stats().queue_depth), "every slot and place freed",
               interval_s=0.001)
    assert engine.model.slots_held == 0 and engine.model.prefills == 2
    assert engine.model.decode_steps < 24  # far fewer than one request's own length
    assert not any(s.done.is_set() for s in sinks)  # aborted streams get no Finished


def test_a_dead_model_fails_every_request_and_the_engine_refuses_more():
    deaths = []
    model = ScriptedModel(vocab_size=100, max_batch_size=2, max_context_length=32, fail_at_step=1)
    engine = Engine(model, on_death=deaths.append)
    engine.start()
    sink = Recorder()
    engine.submit(make_request([10], 5), sink)
    assert sink.done.wait(5)
    assert isinstance(sink.error, EngineStopped)
    engine._thread.join(5)
    assert not engine.stats().alive
    assert [str(e) for e in deaths] == ["scripted failure at decode step 1"]
    with pytest.raises(EngineStopped):
        engine.submit(make_request([10], 5), Recorder())


def test_the_host_reads_a_step_only_after_the_next_one_is_enqueued(engine):
    """The engine dispatches step N+1 before it reads step N, and never dispatches a step that
    could only pass the length cap: with 20 tokens wanted, the prefill gives the first and steps
    1..19 the rest, each read with the next already dispatched, the last with nothing after it."""
    sink = Recorder()
    engine.submit(make_request([10], 20, ignore_eos=True), sink)
    assert sink.done.wait(5)
    assert sink.tokens == [(11 + i) % 100 for i in range(20)]
    reads = engine.model.reads
    assert [step for step, _ in reads] == list(range(1, 20))
    assert all(dispatched == step + 1 for step, dispatched in reads[:-1]), reads
    assert reads[-1] == (19, 19)


def test_a_step_dispatched_after_the_stop_is_discarded_and_its_slot_reused():
    """A request that its step N finishes (its EOS) was also in step N+1, dispatched before N
    was read: that sample is never sent or counted, and the slot serves the next request whole."""
    model = ScriptedModel(vocab_size=1000, max_batch_size=1, max_context_length=64)
    engine = Engine(model, EngineConfig(max_queue_size=8))
    engine.start()
    try:
        first, second = Recorder(), Recorder()
        engine.submit(make_request([995]), first)  # 996, 997, 998, 999, 0, 1, then 2: the EOS
        engine.submit(make_request([40], 5), second)  # waits for the one slot
        assert first.done.wait(5) and second.done.wait(5)
        assert first.tokens == [996, 997, 998, 999, 0, 1]
        end, end2 = first.batches[-1][-1], second.batches[-1][-1]
        assert (end.reason, end.usage.completion_tokens, end.stop_token_id) == (FinishReason.STOP, 6, 2)
        assert second.tokens == [41, 42, 43, 44, 45] and end2.reason == FinishReason.LENGTH
        assert model.decode_steps == 7 + 4  # the first's 6 and the one dispatched after its EOS; the second's 4
    finally:
        engine.stop()


def test_a_stopped_engine_leaves_no_step_in_flight_and_no_slot_held_for_the_next_engine_on_its_model():
    """Stopped mid-stream, the engine reads the step it had dispatched and frees its requests'
    slots before its thread ends: a model outlives its engine (a restart on the same weights, a
    test's module-scoped model), and a step left in flight would be read by the next engine as its
    own first step (the old request's samples handed to the new one's rows), a slot left held
    would refuse the next prompt put in it."""
    model = ScriptedModel(vocab_size=100, max_batch_size=2, max_context_length=64, step_delay_s=0.002)
    engine = Engine(model, EngineConfig(max_queue_size=8))
    engine.start()
    engine.submit(make_request([10], 50, ignore_eos=True), Recorder())
    until_sync(lambda: model.decode_steps >= 3, "a few decode steps")
    engine.stop()
    assert not engine._thread.is_alive()
    assert model.reads[-1][0] == model.decode_steps and model.slots_held == 0  # every step read, every slot free
    again = Engine(model, EngineConfig(max_queue_size=8))
    again.start()
    try:
        sink = Recorder()
        again.submit(make_request([60, 61], 5, ignore_eos=True), sink)
        assert sink.done.wait(5)
        assert sink.tokens == [62, 63, 64, 65, 66]
    finally:
        again.stop()


class DeviceClock:
    """`time` for the engine and the scripted model: perf_counter moves only when the model waits
    for its "device" (sleep), so a step's time is exactly the model's step_delay_s."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.monotonic = time_module.monotonic  # the engine's stall clock stays real

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_on_step_gets_each_decode_steps_time_on_the_device(monkeypatch):
    """What `on_step` reports (the step-time metric, and what an engine process passes on): the
    time from a step's dispatch (or the host's previous read, if later) to its samples, one value
    per decode step, none for a step during which a prompt's first token was read."""
    import engine.core.engine as engine_module
    import engine.core.scripted_model as scripted_module

    clock = DeviceClock()
    monkeypatch.setattr(engine_module, "time", clock)
    monkeypatch.setattr(scripted_module, "time", clock)
    steps: list[float] = []
    model = ScriptedModel(vocab_size=100, max_batch_size=2, max_context_length=64, step_delay_s=0.25)
    engine = Engine(model, EngineConfig(max_queue_size=8), on_step=steps.append)
    engine.start()
    try:
        sink = Recorder()
        engine.submit(make_request([10], 12), sink)  # the prefill's token and 11 decode steps
        assert sink.done.wait(5)
    finally:
        engine.stop()
    assert model.decode_steps == 11
    assert steps == [0.25] * 11, steps
