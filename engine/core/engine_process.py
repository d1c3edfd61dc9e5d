"""`EngineProcess`: the engine loop in a child process, behind the caller API of `Engine`.

Why: in one process, the engine thread waits for the GIL behind whatever Python the serving
path runs (protobuf, gRPC's event loop), and when the OS deschedules the thread holding the GIL
the engine waits for a whole time slice. Each step stretches, and a serving process that is busy
slows the model that feeds it. In its own process the engine steps at the model's pace; a
serving process that falls behind receives several steps at once and sends them together
(`AsyncEngine` coalesces), so it catches up with fewer, larger messages.

Data flow (multiprocessing, spawn; one duplex pipe):
  parent                                         child (`_child_main`)
  submit/abort -> ("submit", key, request) ----> command loop -> Engine.submit / Engine.abort
                  ("abort", key)
  reader thread <- ("batch", deliveries, steps,  <- after each prefill and step, what the engine
                    queue_depth, slots, pages,       delivered: sent by the engine thread itself
                    preemptions, speculation)
    -> each key's sink, then after_delivery          when the pipe takes it at once, else by the
                                                     sender thread, with everything delivered
                                                     since (several steps when the parent is behind)
The child loads and warms up the model from `factory` (a picklable callable: spawn starts a
fresh interpreter; `engine.core.model.load`), and a draft model's proposer where it is given one
(`proposer`), then answers ("ready", info, kernel state, KV layout) or ("failed", the
ModelLoadFailed, which `start` raises again).

What holds, as with the in-process `Engine`:
  * submit refuses synchronously: the stop rule is resolved here (ValueError), a request the KV
    cache could never hold is refused here (InvalidArgument, from the child's KV layout), and QueueFull when
    requests not yet ended reach max_batch_size + max_queue_size (the in-process bound).
  * abort: no event is delivered for the request after it, and the child frees the slot before
    its next step.
  * The child never waits for the parent: what the parent has not read waits in the child's
    outbox, which holds at most the live requests' remaining output.
  * If the child dies (a crash, the OOM killer), every request not yet ended fails with
    EngineStopped and `on_death` is called. If the parent dies, the child reads end-of-file and
    exits. The child ignores SIGINT: a Ctrl-C reaches the whole process group, and the parent
    drains before it stops the child.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import multiprocessing
import os
import signal
import socket
import struct
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Callable

from engine.core.admission import admit
from engine.core.engine import Engine, EngineConfig, EngineStats, EventSink
from engine.core.errors import DecoderFault, EngineStopped, InvalidArgument, ModelLoadFailed, QueueFull
from engine.core.events import Event, FinishReason, Finished, Token, Usage
from engine.core.kv_pages import PageStats
from engine.core.model import KvLayout, Model, ModelFactory, ModelInfo, load
from engine.core.speculation.policy import SpeculationStats
from engine.core.speculation.proposer import Proposer
from engine.core.request import Request

log = logging.getLogger(__name__)

# -- events across the pipe: ints and tuples, much cheaper to pickle than the dataclasses ------
# (docs/benchmarks.md, 'Figures behind code comments')
# A token without log-probabilities (the common case) is its id; one with them (id, logprob, top);
# a Finished (reason, prompt_tokens, completion_tokens, stop_token_id).

def _encode(events: list[Event]) -> list[int | tuple]:
    return [
        (e.id if e.logprob is None and not e.top_logprobs else (e.id, e.logprob, e.top_logprobs)) if type(e) is Token
        else (e.reason.value, e.usage.prompt_tokens, e.usage.completion_tokens, e.stop_token_id)
        for e in events
    ]


def _decode(items: list[int | tuple]) -> list[Event]:
    return [
        Token(item) if type(item) is int
        else Token(*item) if len(item) == 3 else Finished(FinishReason(item[0]), Usage(item[1], item[2]), item[3])
        for item in items
    ]


# -- child ---------------------------------------------------------------------------------


def _frame(message: object) -> bytes:
    """The bytes `Connection.send(message)` writes: multiprocessing.connection's format, a 4-byte
    big-endian length (or -1 and an 8-byte one) and the pickle, which the parent's `recv` reads.
    Built here because a send that must not block has to keep what the pipe did not take, and
    `Connection` offers no such send."""
    body = ForkingPickler.dumps(message)
    if len(body) > 0x7FFFFFFF:
        return struct.pack("!i", -1) + struct.pack("!Q", len(body)) + body
    return struct.pack("!i", len(body)) + body


class _Outbox:
    """Child side: what the engine delivered, sent to the parent so that the engine thread never
    blocks on the pipe.

    After each prefill and step the engine thread sends the step itself, when no earlier message
    is being written and the pipe takes the whole message at once (a send that does not wait):
    no thread hand-off, the common case when the parent keeps up. Otherwise the sender thread
    writes, blocking: first what the pipe did not take, then everything delivered since, as one
    message (a parent that is behind gets the steps it missed together). One writer at a time
    (`_writing`), and what is taken is written before anything taken later, so messages keep
    their order; what waits is bounded as before, by the live requests' remaining output."""

    def __init__(self, conn: Connection) -> None:
        # The pipe's socket again (a duplicate descriptor, still blocking): its send takes
        # MSG_DONTWAIT per call, and its sendall blocks (the sender's writes).
        self._socket = socket.socket(fileno=os.dup(conn.fileno()))
        self.stats: Callable[[], EngineStats] | None = None  # the engine's, set once it exists
        # One lock: taken bare (C-level) by the engine's per-request calls, through the Condition
        # by the sender's wait and the wakes.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._deliveries: list[tuple] = []  # (key, events) or (key, (error class name, message))
        self._steps: list[float] = []
        self._ready = False  # delivered since the last take, for the sender to send
        self._writing = True  # a thread is writing to the pipe (only it may); the child's, until `open`
        self._unsent = b""  # the tail of a message the pipe did not take at once (the sender's)
        self._closed = False
        self.direct_sends = 0  # messages the engine thread sent itself (tests read it)

    def events(self, key: int, events: list[Event]) -> None:
        with self._lock:  # encoded when sent, while the engine thread waits for the model
            self._deliveries.append((key, events))

    def fail(self, key: int, error: BaseException) -> None:
        with self._lock:
            self._deliveries.append((key, (type(error).__name__, str(error))))

    def step(self, seconds: float) -> None:
        with self._lock:
            self._steps.append(seconds)

    def _take(self) -> tuple[list[tuple], list[float]]:
        """Under the lock: what was delivered, and nothing ready any more."""
        deliveries, self._deliveries = self._deliveries, []
        steps, self._steps = self._steps, []
        self._ready = False
        return deliveries, steps

    def _message(self, deliveries: list[tuple], steps: list[float]) -> bytes:
        stats = self.stats()  # not under the lock: the engine's own lock is taken inside
        deliveries = [(key, _encode(p) if isinstance(p, list) else p) for key, p in deliveries]
        return _frame((
            "batch", deliveries, steps, stats.queue_depth, stats.slots_in_use, stats.pages, stats.preemptions,
            stats.speculation,
        ))

    def flush(self) -> None:
        """After each prefill and step (even an empty step, which the parent counts as progress):
        send it now if that cannot block, else leave it to the sender."""
        with self._cond:
            if self._writing or self._ready or self._unsent or self._closed:
                self._ready = True
                self._cond.notify()
                return
            self._writing = True
            deliveries, steps = self._take()
        data, sent = b"", 0
        try:
            data = self._message(deliveries, steps)
            sent = self._socket.send(data, socket.MSG_DONTWAIT)
        except BlockingIOError:
            pass  # the parent is behind and the pipe is full: the sender writes it
        except OSError:  # the parent is gone (the command loop sees it and exits)
            sent = len(data)
        finally:
            with self._cond:
                self._unsent = data[sent:]
                self._writing = False
                self.direct_sends += not self._unsent
                if self._unsent or self._ready or self._closed:  # (closed while this wrote: the sender,
                    self._cond.notify()  # which waited for this write to end, has its last look now)

    def open(self) -> None:
        """Once the child has sent "ready": from now on the outbox writes the pipe."""
        with self._cond:
            self._writing = False
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def run(self) -> None:
        """The sender thread: until closed and everything is sent (then no one writes but the
        child's last words, through the Connection, so the duplicate descriptor is closed)."""
        with self._socket:
            while True:
                with self._cond:
                    while self._writing or not (self._ready or self._unsent or self._closed):
                        self._cond.wait()
                    if not (self._ready or self._unsent):  # closed, and everything sent
                        return
                    self._writing = True
                    unsent, self._unsent = self._unsent, b""
                    taken = self._take() if self._ready else None
                try:
                    self._socket.sendall(unsent + (self._message(*taken) if taken is not None else b""))
                except OSError:  # the parent is gone
                    return
                with self._cond:
                    self._writing = False


class _Tickets:
    """Child side: the engine's ticket for each parent key of a request not yet ended."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # held across submit, so an end never precedes its entry
        self._tickets: dict[int, int] = {}

    def submit(self, engine: Engine, key: int, request: Request, sink: EventSink) -> None:
        with self._lock:
            self._tickets[key] = engine.submit(request, sink)

    def pop(self, key: int) -> int | None:
        with self._lock:
            return self._tickets.pop(key, None)


class _KeySink:
    def __init__(self, outbox: _Outbox, key: int, tickets: _Tickets) -> None:
        self._outbox, self._key, self._tickets = outbox, key, tickets

    def events(self, events: list[Event]) -> None:
        if isinstance(events[-1], Finished):
            self._tickets.pop(self._key)
        self._outbox.events(self._key, events)

    def fail(self, error: BaseException) -> None:
        self._tickets.pop(self._key)
        self._outbox.fail(self._key, error)


def _child_main(
    conn: Connection, factory: ModelFactory, config: EngineConfig, log_setup: Callable[[], None] | None,
    proposer_factory: Callable[[Model], Proposer] | None = None,
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent drains, then stops us
    if log_setup is not None:
        log_setup()
    try:
        model = load(factory)
        proposer = None if proposer_factory is None else proposer_factory(model)  # (a draft model: load's errors too)
    except ModelLoadFailed as error:  # the parent raises it again, to say why as it exits
        conn.send(("failed", error))
        return

    def on_death(error: BaseException) -> None:
        outbox.close()
        sender.join()
        with contextlib.suppress(OSError):
            conn.send(("dead", f"{type(error).__name__}: {error}"))
        os._exit(1)

    # The parent enforces the admission bound; this one only keeps the child's queue bounded by
    # it, plus the aborted slots not yet freed (at most one batch).
    outbox = _Outbox(conn)
    engine = Engine(
        model, dataclasses.replace(config, max_queue_size=config.max_queue_size + model.info.max_batch_size),
        on_death=on_death, on_step=outbox.step, proposer=proposer,
    )
    outbox.stats = engine.stats
    engine.after_delivery(outbox.flush)
    sender = threading.Thread(target=outbox.run, name="tokenwire-engine-sender", daemon=True)
    engine.start()
    # before the outbox opens: one thread writes at a time
    conn.send(("ready", model.info, getattr(model, "kernel_state", None), model.kv))
    outbox.open()
    sender.start()
    tickets = _Tickets()
    try:
        while True:
            command = conn.recv()
            if command[0] == "submit":
                _, key, request = command
                try:
                    tickets.submit(engine, key, request, _KeySink(outbox, key, tickets))
                except Exception as error:  # (the parent checked the bound: not expected)
                    outbox.fail(key, error)
                    outbox.flush()
            elif command[0] == "abort":
                ticket = tickets.pop(command[1])
                if ticket is not None:
                    engine.abort(ticket)
            else:  # "stop"
                break
    except (EOFError, OSError):  # the parent is gone: nobody to deliver to
        os._exit(0)
    engine.stop()
    outbox.close()
    sender.join()


# as the child's engine raised them (an InvalidArgument: a constrained request whose grammar
# allows no token, engine.core.constrained.banned_row; a DecoderFault: the model sampled an id
# its constraint bans)
_FAILURES = {
    "QueueFull": QueueFull, "EngineStopped": EngineStopped, "DecoderFault": DecoderFault,
    "InvalidArgument": lambda message: InvalidArgument(*message.split(": ", 1)) if ": " in message else InvalidArgument("constraint", message),
}


# -- parent --------------------------------------------------------------------------------


class EngineProcess:
    """The engine in a child process; `start` blocks until the model is loaded and warm."""

    def __init__(
        self,
        factory: ModelFactory,
        config: EngineConfig = EngineConfig(),
        on_death: Callable[[BaseException], None] | None = None,
        on_step: Callable[[float], None] | None = None,
        log_setup: Callable[[], None] | None = None,
        proposer: Callable[[Model], Proposer] | None = None,
    ) -> None:
        """`factory` builds the model in the child (picklable: a module-level function or a
        functools.partial of one). `on_death(error)` is called on the reader thread if the child
        dies; `on_step(seconds)` for each decode step. `log_setup` configures logging in the child.
        `proposer(model)` (picklable too) builds the engine's speculative proposer in the child,
        after the model: a draft model's (engine.core.speculation.draft), loaded there; it raises
        as `engine.core.model.load` does."""
        self._factory = factory
        self._proposer = proposer
        self.config = config
        self._on_death = on_death
        self._on_step = on_step
        self._log_setup = log_setup
        self.info: ModelInfo | None = None
        self.kernel_state: str | None = None  # the model's `kernel_state`, if it has one (JaxModel)
        self.kv: KvLayout | None = None  # the model's page pool (submit refuses what could never fit)
        self._conn: Connection | None = None
        self._process: multiprocessing.Process | None = None
        self._reader: threading.Thread | None = None
        # Guards the fields below and sends on the pipe; held while sinks are called, so that no
        # event reaches a sink after `abort` returns (reentrant: a sink may abort).
        self._lock = threading.RLock()
        self._sinks: dict[int, EventSink] = {}  # key -> sink of a request not yet ended
        self._keys = itertools.count(1)
        self._delivered: list[Callable[[], None]] = []
        self._progress_at = time.monotonic()
        self._queue_depth = 0
        self._slots_in_use = 0
        self._pages = PageStats(0, 0, 0, 0)
        self._preemptions = 0
        self._speculation = SpeculationStats()
        self._running = False
        self._dead: BaseException | None = None

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def start(self) -> None:
        """Start the child and wait for its model. Raises ModelLoadFailed, or its ModelRefused
        (`engine.core.model.load`), when the child has exited without it."""
        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        self._process = context.Process(
            target=_child_main, args=(child, self._factory, self.config, self._log_setup, self._proposer),
            name="tokenwire-engine", daemon=True,
        )
        self._process.start()
        child.close()
        self._conn = parent
        try:
            answer = parent.recv()
        except EOFError:
            self._process.join()
            raise ModelLoadFailed(f"the engine process exited with code {self._process.exitcode} while loading") from None
        if answer[0] != "ready":
            self._process.join()
            raise answer[1]
        self.info, self.kernel_state, self.kv = answer[1], answer[2], answer[3]
        with self._lock:
            self._running = True
        self._reader = threading.Thread(target=self._read, name="tokenwire-engine-reader", daemon=True)
        self._reader.start()

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop the child: requests not yet ended fail with EngineStopped."""
        with self._lock:
            was_running, self._running = self._running, False
            if was_running and self._dead is None:
                with contextlib.suppress(OSError):
                    self._conn.send(("stop",))
        if self._reader is not None:
            self._reader.join(timeout)
        if self._process is not None:
            self._process.join(timeout)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
        self._fail_all(EngineStopped("the engine stopped"))

    def submit(self, request: Request, sink: EventSink) -> int:
        """Queue a validated request; returns a ticket for `abort`. Raises QueueFull, EngineStopped,
        ValueError when the prompt leaves no room in the context, and InvalidArgument when the
        request could never fit in the KV cache."""
        if self.info is None:
            raise EngineStopped("the engine is not running")
        request, _ = admit(request, self.info, self.kv)
        with self._lock:
            if self._dead is not None or not self._running:
                raise EngineStopped("the engine is not running")
            if len(self._sinks) >= self.config.max_queue_size + self.info.max_batch_size:
                raise QueueFull(f"admission queue is full ({self.config.max_queue_size} waiting)")
            key = next(self._keys)
            if not self._sinks:
                self._progress_at = time.monotonic()  # an idle engine is not stalled
            self._sinks[key] = sink
            try:
                self._conn.send(("submit", key, request))
            except OSError:
                del self._sinks[key]
                raise EngineStopped("the engine process is gone") from None
        return key

    def abort(self, ticket: int) -> None:
        """No further events for the request; the child frees its slot before its next step."""
        with self._lock:
            if self._sinks.pop(ticket, None) is not None and self._running:
                with contextlib.suppress(OSError):
                    self._conn.send(("abort", ticket))

    def after_delivery(self, callback: Callable[[], None]) -> None:
        """Call `callback()` on the reader thread after each message's events are in their sinks."""
        self._delivered.append(callback)

    def stats(self) -> EngineStats:
        with self._lock:
            pending = bool(self._sinks)
            stalled = time.monotonic() - self._progress_at if pending else 0.0
            alive = self._running and self._dead is None
            return EngineStats(
                self._queue_depth, self._slots_in_use, alive, stalled, self._pages, self._preemptions, self._speculation
            )

    # -- reader thread ---------------------------------------------------------------------

    def _read(self) -> None:
        try:
            while True:
                message = self._conn.recv()
                if message[0] == "dead":
                    raise EngineStopped(f"the engine loop died: {message[1]}")
                _, deliveries, steps, queue_depth, slots, pages, preemptions, speculation = message
                self._deliver(deliveries, queue_depth, slots, pages, preemptions, speculation)
                if self._on_step is not None:
                    for seconds in steps:
                        self._on_step(seconds)
        except (EOFError, OSError, EngineStopped) as error:
            with self._lock:
                stopping = not self._running
                if not stopping:
                    if not isinstance(error, EngineStopped):
                        self._process.join(1)
                        error = EngineStopped(f"the engine process exited (code {self._process.exitcode})")
                    self._dead = error
                    self._running = False
            if stopping:
                return
            log.error("%s", error)
            self._fail_all(error)
            if self._on_death is not None:
                self._on_death(error)

    def _deliver(
        self, deliveries: list[tuple], queue_depth: int, slots: int, pages: PageStats, preemptions: int,
        speculation: SpeculationStats,
    ) -> None:
        with self._lock:
            self._progress_at = time.monotonic()
            self._queue_depth, self._slots_in_use = queue_depth, slots
            self._pages, self._preemptions, self._speculation = pages, preemptions, speculation
            for key, payload in deliveries:
                sink = self._sinks.get(key)
                if sink is None:
                    continue  # aborted: nothing more is delivered for it
                if isinstance(payload, tuple) or type(payload[-1]) is tuple and len(payload[-1]) == 4:  # a failure, or Finished
                    del self._sinks[key]
                if isinstance(payload, tuple):
                    sink.fail(_FAILURES.get(payload[0], EngineStopped)(payload[1]))
                else:
                    sink.events(_decode(payload))
        for callback in self._delivered:
            callback()

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            doomed, self._sinks = list(self._sinks.values()), {}
        for sink in doomed:
            sink.fail(error)
        if doomed:
            for callback in self._delivered:
                callback()
