"""The decode service process: a gRPC server that comes up at once, then a model that loads
and compiles off the event loop, then an engine; readiness follows all of it.

`tokenwire decode-server` runs the engine and its model in a child process (`spawn_model`,
engine.core.engine_process), so that no Python of the serving path shares the engine's
interpreter; tests and `--local` may run it on a thread of this process (`model`, `load_model`).

Readiness (`tokenwire.decode.v1.Decoder` in grpc.health.v1, and once the model is loaded the
model's own name, `tokenwire.decode.v1.Decoder/model:<digest>`, which the text service's
balancer checks) is NOT_SERVING until every shape is compiled, whenever the engine has made no
progress for `stall_timeout_s` while work is pending, and while draining. Liveness ("") stays
SERVING while the process lives. If the model does not load or the engine loop dies, `died` is
set and the process should exit (`serve_until_signal`): 2 for a model or settings that can never
run (ModelRefused: a restart would fail the same way), 1 otherwise, for a supervisor to restart it;
either way with the reason as its last log line.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from engine.core.async_engine import AsyncEngine
from engine.core.engine import Engine, EngineConfig
from engine.core.engine_process import EngineProcess
from engine.core.errors import ModelLoadFailed, ModelRefused
from engine.core.model import Model, ModelFactory, load
from engine.core.speculation.proposer import Proposer
from protos.decode.v1 import decode_pb2_grpc
from services.admission import Admission
from services.decode_service import DecoderServicer
from services.metrics import Metrics
from services.replicas import model_service_name
from services.service_names import DECODER_SERVICE
from services.server import RunningServer, ServerOptions, drain, start_server, wait_for_signal

log = logging.getLogger("tokenwire.decode")

FLUSH_S = 1.0  # after a drain, what open calls get to send their last responses and end

@dataclass
class DecodeServer:
    running: RunningServer
    servicer: DecoderServicer
    admission: Admission
    metrics: Metrics
    stall_timeout_s: float
    engine: Engine | EngineProcess | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # set once warm
    died: asyncio.Event = field(default_factory=asyncio.Event)  # set if loading or the engine loop failed
    load_failure: ModelLoadFailed | None = None  # why loading failed, once it has
    draining: bool = False
    loading: asyncio.Task | None = None  # the load, a task of `running`'s (cancelled at stop)

    @property
    def port(self) -> int:
        return self.running.port

    async def until_ready(self) -> None:
        """Wait until serving; raises ModelLoadFailed (or ModelRefused) with the reason if loading
        failed."""
        waits = [asyncio.ensure_future(self.ready.wait()), asyncio.ensure_future(self.died.wait())]
        try:
            # the load task too: cancelled by a stop before its first step, it sets neither event
            await asyncio.wait([*waits, *filter(None, [self.loading])], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        if self.load_failure is not None:
            raise self.load_failure
        if not self.ready.is_set():
            raise ModelLoadFailed("the server stopped while the model was loading")

    async def _load(
        self, load_model: Callable[[], Model] | None, spawn_model: ModelFactory | None,
        engine_config: EngineConfig, log_setup: Callable[[], None] | None,
        proposer: Callable[[Model], Proposer] | None,
    ) -> None:
        loop = asyncio.get_running_loop()

        def on_death(error: BaseException) -> None:
            loop.call_soon_threadsafe(self.died.set)

        on_step = self.metrics.engine_step_seconds.observe
        try:
            if spawn_model is not None:
                engine = EngineProcess(spawn_model, engine_config, on_death, on_step, log_setup, proposer)
                await _start_or_stop(engine)
            else:
                model = await asyncio.to_thread(load, load_model)
                guesser = None if proposer is None else await asyncio.to_thread(proposer, model)
                engine = Engine(model, engine_config, on_death=on_death, on_step=on_step, proposer=guesser)
                engine.start()
        except ModelLoadFailed as error:  # why, sorted by engine.core.model.load
            self.load_failure = error
        except Exception as error:  # starting the engine, not the model, failed
            log.exception("starting the engine failed")
            self.load_failure = ModelLoadFailed(f"{type(error).__name__}: {error}")
        if self.load_failure is not None:
            self.died.set()
            return
        self.engine = engine
        self.metrics.watch_engine(engine.stats)
        kernel_state = engine.kernel_state if isinstance(engine, EngineProcess) else getattr(engine.model, "kernel_state", None)
        if kernel_state is not None:  # "on: ...", "off: <reason>", "not applicable: <reason>"
            self.metrics.cpu_kernels.labels(kernel_state.split(":", 1)[0]).set(1)
        self.servicer.attach(AsyncEngine(engine), engine.info)
        # readiness under the model's own name too: the text service's balancer checks that one,
        # so a replica with another model never gets its traffic (services.replicas)
        self.running.service_names.append(model_service_name(engine.info))
        if not self.draining:
            self.admission.open()
            await self.running.set_ready(True)
        self.ready.set()
        info = engine.info
        log.info(
            "model %s ready: vocab %d, context %d, batch %d; health name %s",
            info.model_id, info.vocab_size, info.max_context_length, info.max_batch_size, model_service_name(info),
        )

    async def _monitor(self, interval_s: float) -> None:
        """Keep readiness (and admission, after a death) in line with the engine, every interval."""
        while True:
            stats = self.engine.stats() if self.engine is not None else None
            if self.died.is_set():
                self.admission.close("the decode engine is down")
            healthy = (
                stats is not None
                and stats.alive
                and not self.draining
                and not self.died.is_set()
                and stats.stalled_s <= self.stall_timeout_s
            )
            await self.running.set_ready(healthy)  # logs each change, e.g. a stall and its end
            await asyncio.sleep(interval_s)

    async def drain(self, grace_s: float) -> bool:
        """Stop taking requests (UNAVAILABLE), go NOT_SERVING, let in-flight ones finish within
        `grace_s`, then stop. Returns whether everything finished in time."""
        self.draining = True
        finished = await drain(self.running, self.admission, grace_s)
        # A DecodeStream's request is over (and admitted no more) once its last response is made,
        # a moment before gRPC has sent it: stopping at once could cut that response off. Open
        # calls get FLUSH_S to end (a text service closes its stream to a draining replica once
        # the stream's requests are done); then they are cancelled.
        await self.stop(FLUSH_S if finished else 0)
        return finished

    async def serve_until_signal(self, grace_s: float) -> int:
        """Serve until SIGTERM/SIGINT (then drain; exit code 0), until the model fails to load
        (`exit_code`'s 2 or 1, the reason last), or until the engine dies (exit code 1, so a
        supervisor restarts the process)."""
        await wait_for_signal(self.died)
        if not self.died.is_set():
            await self.drain(grace_s)
            return 0
        if self.load_failure is not None:
            await self.stop(0)
            return exit_code(self.load_failure)
        log.critical("the decode engine died; exiting so a supervisor can restart the service")
        await self.stop(0)
        return 1

    async def stop(self, grace_s: float | None = None) -> None:
        await self.running.stop(grace_s)
        if self.engine is not None:
            await asyncio.to_thread(self.engine.stop)  # an engine process may take a moment to exit


async def _start_or_stop(engine: EngineProcess) -> None:
    """Start the engine process on a thread; if the caller is cancelled meanwhile (the server stops
    while the child loads), the engine is stopped as soon as its start returns, not left running
    with no one to stop it."""
    lock, state = threading.Lock(), {"cancelled": False, "started": False}

    def start() -> None:
        engine.start()
        with lock:
            state["started"] = True
            stop = state["cancelled"]
        if stop:
            engine.stop()

    try:
        await asyncio.to_thread(start)
    except asyncio.CancelledError:
        with lock:
            state["cancelled"] = True
            started = state["started"]
        if started:  # it started just as the cancel came: stopped off the event loop (it waits for the child)
            threading.Thread(target=engine.stop, name="tokenwire-engine-stop", daemon=True).start()
        raise


def exit_code(failure: ModelLoadFailed) -> int:
    """Log why the model did not load, as the process's last line, and the exit code that says
    whether a restart can help: 2 for ModelRefused (a configuration error: the same model and
    settings fail the same way), 1 for anything else (a supervisor restarts the process)."""
    if isinstance(failure, ModelRefused):
        log.critical("refusing to serve: %s", failure)
        return 2
    log.critical("loading the model failed: %s; exiting so a supervisor can restart the service", failure)
    return 1


async def start_decode_server(
    model: Model | None = None,
    engine_config: EngineConfig = EngineConfig(),
    options: ServerOptions = ServerOptions(),
    metrics: Metrics | None = None,
    *,
    stall_timeout_s: float = 30.0,
    health_interval_s: float = 0.5,
    wait_until_ready: bool = True,
    load_model: Callable[[], Model] | None = None,
    spawn_model: ModelFactory | None = None,
    log_setup: Callable[[], None] | None = None,
    tokenizer_json: str | Path | None = None,
    proposer: Callable[[Model], Proposer] | None = None,
) -> DecodeServer:
    """Serve at once (liveness SERVING, readiness NOT_SERVING), load and warm up the model off
    the event loop, then start the engine and become ready. The model: `model`, or what
    `load_model()` returns (the engine on a thread of this process), or what `spawn_model()`
    returns in an engine process (a picklable callable; `log_setup()` configures its logging).
    `tokenizer_json`: the model's tokenizer file, which requests' constraints compile against
    (None: constraints are refused). `proposer(model)`: the engine's speculative proposer, built
    where the model is, after it (a draft model's, `--draft-model`; picklable with `spawn_model`)."""
    if sum(x is not None for x in (model, load_model, spawn_model)) != 1:
        raise TypeError("give exactly one of model, load_model and spawn_model")
    if model is not None:
        load_model = lambda: model  # noqa: E731
    metrics = metrics or Metrics()
    admission = Admission("the model is still loading")
    servicer = DecoderServicer(admission, metrics, tokenizer_json)
    running = await start_server(
        lambda server: decode_pb2_grpc.add_DecoderServicer_to_server(servicer, server), [DECODER_SERVICE], options, metrics
    )
    server = DecodeServer(running, servicer, admission, metrics, stall_timeout_s)
    server.loading = asyncio.create_task(server._load(load_model, spawn_model, engine_config, log_setup, proposer))
    server.running.tasks += [server.loading, asyncio.create_task(server._monitor(health_interval_s))]
    if wait_until_ready:
        await server.until_ready()
    return server
