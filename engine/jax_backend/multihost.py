"""One model over several hosts: `jax.distributed`, one process leading, every process stepping.

The mesh (engine.jax_backend.mesh) spans every process's devices, so every jitted call is a
collective: each process must make the same calls, with the same host arguments, in the same
order. Process 0 runs the gRPC server and the scheduler; its model is wrapped in a `Leader`,
which publishes each call the scheduler makes (set_pages, prefill, decode, ban, dispatch_sampling, ...) to JAX's
coordination key-value store (the service `jax.distributed.initialize` starts in process 0) under
a numbered key, then makes it. Every other process runs `follow`: it reads key 0, 1, 2, ... and
makes the same call on its own copy of the model. The per-step decisions thus travel through
JAX's own facility; the step data (activations, all-reduces) through XLA's collectives.

Why the key-value store rather than multihost_utils.broadcast_one_to_all: a broadcast is a
collective with no timeout (a dead peer can hang it), and a call's arguments change shape from
step to step (a broadcast compiles per shape); a store read takes a timeout and any bytes.

Failure, and the bound on it (T = the group's `timeout_s`):
- every wait has a timeout: start-up (`initialization_timeout`), each store read (a follower
  waits at most `poll_s` at a time; a read fails at once if process 0, which hosts the store,
  is gone), heartbeats;
- a process that dies stops sending heartbeats; within T the coordination service reports it and
  JAX terminates every other process's JAX (absl FATAL: SIGABRT). That is the engine process
  (engine.core.engine_process), so its parent sees its engine die, turns readiness NOT_SERVING and
  exits 1. The stated bound, `wait_s`: 2T + 5 s (on loopback with T = 3 s, seen: 2.9 s).
- an orderly stop (the leader's process exits) publishes "stop", and followers return from
  `follow`.

Keys are deleted once every process is known to have read them: after a call whose result came
back from the devices (a prompt's sample), that collective has completed everywhere, so every
follower has read its key and every earlier one. A decode step's samples are read (`collect`)
after the next step is dispatched, and a follower may not have read that dispatch yet: a collect
shows only that the keys up to its own step's dispatch were read.
"""

from __future__ import annotations

import atexit
import collections
import inspect
import logging
import os
import pickle
import threading
from dataclasses import dataclass
from typing import Any, Callable

import jax

from engine.core.model import Model, ModelUsageError
from engine.jax_backend import mesh

log = logging.getLogger(__name__)

STEP_KEY = "tokenwire/step/"
STOP = "stop"
# Every method of the Model contract steps the devices or changes what later steps do, so every
# process makes them (a method added to the contract is published too: set_pages changes no device
# array, but every later call reads the table it sets, so followers replay it); anything else
# (info, kv, kernel_state, compilations, ...) is read locally.
STEPS = frozenset(name for name, value in vars(Model).items() if not name.startswith("_") and inspect.isfunction(value))


@dataclass(frozen=True)
class Group:
    """A multi-host group: `--coordinator HOST:PORT --num-processes P --process-id I`."""

    coordinator: str
    num_processes: int
    process_id: int
    timeout_s: float = 30.0  # start-up, heartbeats, and every wait for another process

    @property
    def leads(self) -> bool:
        return self.process_id == 0


def initialize(group: Group, local_devices: int) -> None:
    """Join the group (before any other JAX use in this process): `local_devices` CPU devices
    on a CPU host (accelerators are what the host has), then `jax.distributed.initialize`,
    which process 0 answers as the coordinator. Raises after `group.timeout_s` without the others."""
    mesh.request_cpu_devices(local_devices)
    seconds = max(1, round(group.timeout_s))
    jax.distributed.initialize(
        group.coordinator, group.num_processes, group.process_id,
        initialization_timeout=seconds, heartbeat_timeout_seconds=seconds, shutdown_timeout_seconds=seconds,
    )
    log.info(
        "process %d of %d joined %s: %d local devices, %d in all",
        group.process_id, group.num_processes, group.coordinator, jax.local_device_count(), jax.device_count(),
    )


def _store():
    """The coordination service's key-value client. JAX exposes it only as this module-level
    object (multihost_utils itself reads it from there); there is no public accessor yet."""
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized")
    return client


class Leader:
    """Process 0's model: each step call is published for the followers, then made here.
    Everything else is the wrapped model's."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self._store = _store()
        self._next = 0  # the next call's number
        self._unread = 0  # calls below this number are deleted from the store
        self._dispatched: collections.deque[int] = collections.deque()  # numbers of steps not yet collected
        self._stopped = False
        atexit.register(self.stop)  # before jax.distributed's own shutdown (atexit runs newest first)

    def __getattr__(self, name: str):
        attr = getattr(self._model, name)
        if name not in STEPS:
            return attr

        def call(*args, **kwargs):
            number = self._publish((name, args, kwargs))
            result = attr(*args, **kwargs)
            if name == "dispatch":
                self._dispatched.append(number)
            elif name == "collect":  # that step ran everywhere: its dispatch, and all before, were read
                self._forget(self._dispatched.popleft())
            elif result or name == "warm_up":  # samples came back from the devices: everyone has read
                self._forget(number)  # (None or [] did not: a release, a chunk)
            return result

        return call

    def _publish(self, message: tuple) -> int:
        """Store the call under the next number; -> that number."""
        # pickle: the store is the group's own (its port must be reachable by the group alone,
        # as jax.distributed's coordinator always must), and every process runs this same code.
        self._store.key_value_set_bytes(f"{STEP_KEY}{self._next}", pickle.dumps(message))
        self._next += 1
        return self._next - 1

    def _forget(self, read: int) -> None:
        """Delete the calls up to number `read`, which every process has read."""
        for n in range(self._unread, read + 1):
            self._store.key_value_delete(f"{STEP_KEY}{n}")
        self._unread = max(self._unread, read + 1)

    def stop(self) -> None:
        """Tell the followers to return from `follow` (an orderly stop; once)."""
        if not self._stopped:
            self._stopped = True
            try:
                self._publish((STOP, (), {}))
            except Exception:  # the group is already gone: nobody to tell
                pass


class LeaderGone(RuntimeError):
    """Process 0 is no longer in the group."""


def follow(model: Any, group: Group, on_warm: Callable[[], None] | None = None, poll_s: float = 1.0) -> None:
    """Make, on `model`, every call process 0's Leader publishes, in order, until it publishes
    "stop". `on_warm()` after the warm-up call. Each read waits at most `poll_s`, then reads
    again (an idle leader); a read that fails otherwise raises LeaderGone. A call
    the model refuses (ModelUsageError) was refused the same way on the leader, which reports
    it; the follower goes on."""
    store = _store()
    n = 0
    while True:
        try:
            blob = store.blocking_key_value_get_bytes(f"{STEP_KEY}{n}", int(poll_s * 1000))
        except jax.errors.JaxRuntimeError as error:
            if "DEADLINE_EXCEEDED" not in str(error):
                raise LeaderGone(f"the group's coordination service failed: {error}") from error
            # An idle leader. (A dead one fails the next read: its process hosts the service,
            # and JAX's heartbeats end this process within the timeout in any case. Not
            # get_live_nodes: that call is a barrier across the live processes.)
            continue
        name, args, kwargs = pickle.loads(blob)
        if name == STOP:
            log.info("process 0 stopped; following ends")
            return
        try:
            getattr(model, name)(*args, **kwargs)
        except ModelUsageError as error:
            log.debug("call %d (%s) refused here as on the leader: %s", n, name, error)
        if name == "warm_up" and on_warm is not None:
            on_warm()
        n += 1


def wait_s(group: Group) -> float:
    """How long after one process dies the others have exited: the heartbeat timeout, plus a
    margin for the coordination service's detection and the parent's reaction."""
    return max(1, round(group.timeout_s)) * 2 + 5


class Follower:
    """What a follower's engine process holds in place of a model: `warm_up` starts `follow` on
    a thread and returns once the leader's warm-up has run here; from then on the thread makes
    the leader's calls. The engine in front of it gets no requests (a follower serves health
    only); a step called here directly is refused. When following ends the process exits: 0
    after an orderly stop (having left the group), 1 on any failure, which the parent sees as
    its engine dying (NOT_SERVING, then exit)."""

    def __init__(self, model: Any, group: Group) -> None:
        self._model, self._group = model, group

    def warm_up(self) -> None:
        warm = threading.Event()

        def run() -> None:
            try:
                follow(self._model, self._group, warm.set)
            except BaseException:
                log.exception("process %d stops following", self._group.process_id)
                os._exit(1)
            jax.distributed.shutdown()
            os._exit(0)

        thread = threading.Thread(target=run, name="tokenwire-follower", daemon=True)
        thread.start()
        while not warm.wait(self._group.timeout_s) and thread.is_alive():
            pass  # the leader compiles for as long as its model needs; the thread dies if it does

    def __getattr__(self, name: str):  # what the engine reads (info, ...) is the model's own
        if name in STEPS:
            raise ModelUsageError(f"process {self._group.process_id} follows process 0; requests go to process 0")
        return getattr(self._model, name)


__all__ = ["Follower", "Group", "Leader", "LeaderGone", "STEPS", "follow", "initialize", "wait_s"]
