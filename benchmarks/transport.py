"""What the transport costs: tokens/s and inter-token latency (ITL) of one fixed-cost model, in
process and through each service, in one run.

    python benchmarks/transport.py [--step-ms 2,0] [--streams 64,1] [--tokens 300] [--rounds 3]
                                   [--paths engine,decode,text] [--client-procs N]
                                   [--text-workers N] [--real-model NAME|DIR] [--json PATH]

With --real-model, each round also times benchmarks/decode.py's engine-only decode steps at the
batch of the most streams (on the in-process model), and a last table gives each path's tok/s over
that figure of the same round (issue 10's real-model target).

The model is the scripted one (engine/core/scripted_model.py), unless --real-model: each decode step sleeps
--step-ms (0 = free) and yields the token after the last, so what differs between the paths is
the transport alone. Each of N streams asks for exactly M tokens (ignore_eos, max_output_tokens)
after a short prompt of its own ("fox I"): the text path sends the text, the engine and decode
paths the ids the text service makes of it (checked against each Finished's prompt_tokens), so
every path prefills the same ids.
  engine  N asyncio streams over AsyncEngine in this process: no gRPC, no other process.
  decode  `services.cli decode-server --model scripted:DIR`, a process on loopback.
  text    `services.cli text-server` in front of that decode server (--text-workers: that many
          processes sharing its port).
The service paths are read by client processes (spawn), each with its own event loop and one
channel per server, running every K-th stream; they are released together, so that one client
process is not what limits.

tok/s: all streams' tokens / (last Finished received - first request sent).
ITL: per stream, the gap before each token as its client sees it (tokens that arrive in one
message: the first gets the gap since the previous token, the others 0); the first token is left
out (its gap is the time to first token). p50 and p99 (nearest rank) over the gaps of all streams
of a measurement, pooled; also in steps of --step-ms.
TTFT: per stream, request sent -> first token received; p50 and p99 over the streams (in the
per-round lines and in --json).
Tokens a message (per-round lines): all tokens / the messages that carried any, all streams: how
much the servers coalesced (1.0 on the engine path: one list per engine step).
CPU: for each measurement, the CPU seconds (user + system, every thread, from /proc) of each
process on its path -- the text service, the decode service, its engine process, the client
processes, or this process for the engine path -- per 1,000 tokens, and the share of the host's
CPU time stolen by other guests meanwhile (benchmarks/cpu_use.py; Linux only). Wall-clock figures
on a shared host move with its neighbours; CPU per token barely does, so it is what tells a
change's cost apart from the host's noise.

Rounds are interleaved (each round measures every configuration and path once), so a noisy
neighbour hits all alike; ratios to in-process are taken within a round, and the tables give the
median over rounds with the range. One decode server (and one text server) per step time stays
up for the whole run; every process started here is stopped at the end (SIGTERM, then kill),
also on error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import multiprocessing
import os
import signal
import socket
import functools
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import grpc  # noqa: E402

from benchmarks import cpu_use  # noqa: E402
from benchmarks.machine import describe  # noqa: E402
from benchmarks.summary import median_range  # noqa: E402
from engine.core.async_engine import AsyncEngine  # noqa: E402
from engine.core.engine import Engine, EngineConfig  # noqa: E402
from engine.core.events import Finished, Token  # noqa: E402
from engine.core.request import Request, StoppingCriteria  # noqa: E402
from engine.core.scripted_model import ScriptedModel  # noqa: E402
from protos.decode.v1 import decode_pb2, decode_pb2_grpc  # noqa: E402
from protos.text.v1 import text_pb2_grpc  # noqa: E402
from services import cli  # noqa: E402
from services.client import decode_request, generate_request  # noqa: E402
from services.health_probe import check_once  # noqa: E402
from tokenizer_svc.tokenizer import TextTokenizer  # noqa: E402

PATHS = {"engine": "engine in-process", "decode": "through the decode service", "text": "through the text service"}
SERVICE_NAMES = {"decode": "tokenwire.decode.v1.Decoder", "text": "tokenwire.text.v1.TextGeneration"}


class StreamFailed(RuntimeError):
    """A stream did not give exactly its M tokens and one Finished{LENGTH}: the run is void."""


# -- the workload and what one stream saw -------------------------------------------------


def token_counts(spec: str, streams: int) -> list[int]:
    """M per stream: "300" for all, or "300-400" spread evenly over the streams (deterministic)."""
    low, _, high = spec.partition("-")
    low, high = int(low), int(high or low)
    if not 1 <= low <= high:
        raise ValueError(f"--tokens {spec!r}: need 1 <= low <= high")
    if streams == 1:
        return [(low + high) // 2]
    return [low + (high - low) * i // (streams - 1) for i in range(streams)]


@dataclass(frozen=True)
class Prompt:
    """One stream's prompt on every path: the text path sends `text`, the engine and decode paths
    send `ids`, the text as the text service encodes it. So every path prefills the same ids and
    what differs between them is the transport alone. (Until 2026-12-05 the id paths sent 3 fixed
    ids and the text path a 20-character text, 8-9 ids on the default model: on a real model the
    text path prefilled ~2.8x the prompt tokens of the others; docs/benchmarks.md.)"""

    text: str
    ids: tuple[int, ...]


def prompts(model_dir: Path, n: int) -> list[Prompt]:
    """N short prompts, different per stream (3-4 ids on the default model), encoded by the
    tokenizer in `model_dir` the way the text service encodes a Generate prompt."""
    tokenizer = TextTokenizer.from_dir(model_dir)
    return [Prompt(text, tuple(tokenizer.encode(text))) for text in (f"fox {i}" for i in range(n))]


class StreamClock:
    """One stream as its client sees it: tokens, the gap before each token after the first, the
    finish. Created just before the request is sent."""

    def __init__(self) -> None:
        self.sent = time.monotonic()
        self.finished_at: float | None = None
        self.first_at: float | None = None  # the first token received
        self.tokens = 0
        self.messages = 0  # messages that carried at least one token
        self.gaps: list[float] = []
        self.finish: tuple[str, int, int] | None = None  # (reason name, usage.completion_tokens, usage.prompt_tokens)
        self._last: float | None = None

    def arrived(self, tokens: int, finish: tuple[str, int, int] | None = None) -> None:
        """One message: `tokens` tokens, then the Finished when `finish` is given."""
        now = time.monotonic()
        if self.finish is not None:
            raise StreamFailed("a message after Finished")
        if tokens:
            if self._last is not None:
                self.gaps.append(now - self._last)
            else:
                self.first_at = now
            self.gaps.extend([0.0] * (tokens - 1))
            self.tokens += tokens
            self.messages += 1
            self._last = now
        if finish is not None:
            self.finish, self.finished_at = finish, now

    def check(self, index: int, expected: int, prompt_tokens: int) -> "StreamClock":
        """Exactly `expected` tokens, finished for LENGTH, with the prompt counted as `prompt_tokens`
        (the ids this stream's prompt is: on the text path, proof that it prefilled what the id
        paths send)."""
        if self.finish != ("LENGTH", expected, prompt_tokens) or self.tokens != expected:
            raise StreamFailed(
                f"stream {index}: {self.tokens} tokens and finish (reason, completion_tokens, prompt_tokens) "
                f"{self.finish}, expected {expected} tokens and ('LENGTH', {expected}, {prompt_tokens})"
            )
        return self


@dataclass(frozen=True)
class Measurement:
    tokens: int
    wall_s: float  # first request sent -> last Finished received
    itl_p50_s: float
    itl_p99_s: float
    ttft_p50_s: float = float("nan")
    ttft_p99_s: float = float("nan")
    cpu_s: dict[str, float] | None = None  # CPU seconds per group of processes (benchmarks/cpu_use.py)
    steal_share: float = float("nan")  # the host's stolen share of its CPU time over the measurement
    messages: int = 0  # messages with tokens, all streams (tokens / messages: how much was coalesced)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s

    def cpu_per_k(self) -> dict[str, float]:
        """CPU ms per 1,000 tokens by group of processes ({} when not measured)."""
        return {group: seconds * 1e6 / self.tokens for group, seconds in (self.cpu_s or {}).items()}


def percentile(ordered: Sequence[float], q: float) -> float:
    """Nearest rank; NaN for no values."""
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered), max(1, math.ceil(q * len(ordered)))) - 1]


def summarize(clocks: Sequence[StreamClock]) -> Measurement:
    gaps = sorted(g for c in clocks for g in c.gaps)
    ttfts = sorted(c.first_at - c.sent for c in clocks if c.first_at is not None)
    wall = max(c.finished_at for c in clocks) - min(c.sent for c in clocks)
    return Measurement(
        sum(c.tokens for c in clocks), wall, percentile(gaps, 0.50), percentile(gaps, 0.99),
        percentile(ttfts, 0.50), percentile(ttfts, 0.99), messages=sum(c.messages for c in clocks),
    )


# -- in process ---------------------------------------------------------------------------


def scripted_model(model_dir: Path, step_ms: float, max_batch_size: int, context: int) -> ScriptedModel:
    """The model `decode-server --model scripted:DIR` serves (services.cli.scripted_model)."""
    return cli.scripted_model(model_dir, max_batch_size=max_batch_size, max_context_length=context, step_ms=step_ms)


@functools.cache
def real_model(model_dir: Path, max_batch_size: int, context: int):
    """The JaxModel the decode server runs for --real-model (same settings: its default weights,
    and the smallest prompt piece its step budget asks for, as services.cli loads it), loaded and
    warmed up once, so no measurement includes a compile."""
    from engine.jax_backend.jax_model import JaxModel

    model = JaxModel.load(model_dir, max_batch_size=max_batch_size, max_context_length=context, weights="auto",
                          min_bucket=None)
    model.warm_up()
    return model


def measure_steps(model, batch: int, steps: int = 16, prompt_len: int = 64) -> float:
    """benchmarks/decode.py's engine-only figure at `batch`, on the same in-process model: decode
    steps alone (no scheduler, no prefill in the window) of `batch` slots prefilled with random
    prompts of `prompt_len` tokens (decode.py's default), host one step behind as the engine runs
    them (decode.Slots.pipelined); -> tok/s. The slots are released after."""
    from benchmarks.decode import Slots

    slots = Slots(model, batch, prompt_len)
    try:
        slots.pipelined(batch, 2)  # untimed
        return batch / slots.pipelined(batch, steps)
    finally:
        slots.release()


async def _engine_streams(engine: AsyncEngine, counts: Sequence[int], prompts: Sequence[Prompt]) -> list[StreamClock]:
    async def one(index: int, m: int) -> StreamClock:
        clock = StreamClock()
        stopping = StoppingCriteria(max_output_tokens=m, ignore_eos=True)
        async for events in engine.stream(Request(f"bench-{index}", prompts[index].ids, stopping=stopping)):
            last = events[-1]
            finish = (last.reason.name, last.usage.completion_tokens, last.usage.prompt_tokens) if isinstance(last, Finished) else None
            clock.arrived(sum(isinstance(e, Token) for e in events), finish)
        return clock.check(index, m, len(prompts[index].ids))

    return await asyncio.gather(*(one(i, m) for i, m in enumerate(counts)))


def measure_engine(model: ScriptedModel, counts: Sequence[int], prompts: Sequence[Prompt], timeout_s: float) -> Measurement:
    """N concurrent asyncio streams over a fresh engine on `model`, in this process; stream i
    sends prompts[i].ids."""
    engine = Engine(model, EngineConfig(max_queue_size=len(counts)))
    engine.start()
    try:
        loop = cli.new_event_loop()  # the servers' loop
        try:
            streams = _engine_streams(AsyncEngine(engine), counts, prompts)
            return summarize(loop.run_until_complete(asyncio.wait_for(streams, timeout_s)))
        finally:
            loop.close()
    finally:
        engine.stop()


# -- client processes ---------------------------------------------------------------------


def _finish(finished) -> tuple[str, int, int]:
    """A Finished (decode) or TextFinished as (reason name, completion_tokens, prompt_tokens), e.g.
    ("LENGTH", 300, 3)."""
    reason = decode_pb2.FinishReason.Name(finished.reason).removeprefix("FINISH_REASON_")
    return reason, finished.usage.completion_tokens, finished.usage.prompt_tokens


async def _service_streams(path: str, channel: grpc.aio.Channel, share, timeout_s: float) -> list[StreamClock]:
    decoder, text = decode_pb2_grpc.DecoderStub(channel), text_pb2_grpc.TextGenerationStub(channel)

    async def one(index: int, m: int, prompt: Prompt) -> StreamClock:
        clock = StreamClock()
        if path == "decode":
            request = decode_request(list(prompt.ids), max_output_tokens=m, ignore_eos=True)
            async for response in decoder.Decode(request, timeout=timeout_s):
                tokens, finish = 0, None
                for event in response.events:
                    if event.HasField("token"):
                        tokens += 1
                    else:
                        finish = _finish(event.finished)
                clock.arrived(tokens, finish)
        else:
            request = generate_request(prompt.text, max_output_tokens=m, ignore_eos=True)
            async for response in text.Generate(request, timeout=timeout_s):
                if response.HasField("delta"):
                    clock.arrived(len(response.delta.token_ids))
                else:
                    clock.arrived(0, _finish(response.finished))
        return clock.check(index, m, len(prompt.ids))

    return await asyncio.gather(*(one(i, m, prompt) for i, m, prompt in share))


def _client_main(conn: Connection) -> None:
    """A client process: jobs (path, target, [(stream index, M, Prompt)], timeout) from `conn` until None.
    For each: connect, answer "ready" (or "error"), wait for "go", run the streams, answer "done"
    with their clocks (or "error" with the traceback)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    loop = cli.new_event_loop()  # the servers' loop
    asyncio.set_event_loop(loop)  # grpc.aio binds a channel to the loop current when it is made
    channels: dict[str, grpc.aio.Channel] = {}
    try:
        while (job := conn.recv()) is not None:
            path, target, share, timeout_s = job
            try:
                if target not in channels:
                    channels[target] = grpc.aio.insecure_channel(target)
                loop.run_until_complete(asyncio.wait_for(channels[target].channel_ready(), timeout_s))
            except Exception:
                conn.send(("error", traceback.format_exc()))
                continue
            conn.send(("ready", None))
            conn.recv()  # go
            try:
                streams = _service_streams(path, channels[target], share, timeout_s)
                conn.send(("done", loop.run_until_complete(asyncio.wait_for(streams, timeout_s))))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    finally:
        for channel in channels.values():
            loop.run_until_complete(channel.close())
        loop.close()


def _receive(conn: Connection, timeout_s: float) -> tuple[str, object]:
    if not conn.poll(timeout_s):
        raise TimeoutError(f"a client process did not answer within {timeout_s:.0f} s")
    return conn.recv()  # EOFError when it died


class ClientPool:
    """Client processes, started once (spawn) and reused by every measurement; `close` stops them."""

    def __init__(self, procs: int) -> None:
        context = multiprocessing.get_context("spawn")
        self._workers: list[tuple[Connection, multiprocessing.Process]] = []
        for i in range(procs):
            parent, child = context.Pipe()
            process = context.Process(target=_client_main, args=(child,), name=f"transport-client-{i}", daemon=True)
            process.start()
            child.close()
            self._workers.append((parent, process))

    def measure(
        self, path: str, target: str, counts: Sequence[int], prompts: Sequence[Prompt], procs: int, timeout_s: float
    ) -> Measurement:
        """Streams i = w, w + procs, ... on client process w; all released at once. Stream i asks
        for counts[i] tokens after prompts[i]."""
        if not 1 <= procs <= len(self._workers):
            raise ValueError(f"{procs} client processes asked of a pool of {len(self._workers)}")
        conns = [conn for conn, _ in self._workers[:procs]]
        for w, conn in enumerate(conns):
            conn.send((path, target, [(i, m, prompts[i]) for i, m in enumerate(counts) if i % procs == w], timeout_s))
        connected = [_receive(conn, timeout_s) for conn in conns]
        for conn, (kind, _) in zip(conns, connected):
            if kind == "ready":
                conn.send("go")
        answers = [_receive(conn, timeout_s + 10) if c[0] == "ready" else c for conn, c in zip(conns, connected)]
        errors = [f"client process {w}:\n{payload}" for w, (kind, payload) in enumerate(answers) if kind != "done"]
        if errors:
            raise StreamFailed(f"{path} at {target}:\n" + "\n".join(errors))
        return summarize([clock for _, clocks in answers for clock in clocks])

    def pids(self) -> list[int]:
        return [process.pid for _, process in self._workers]

    def close(self) -> None:
        for conn, _ in self._workers:
            with contextlib.suppress(OSError):
                conn.send(None)
        for _, process in self._workers:
            process.join(2)
            if process.is_alive():
                process.terminate()
                process.join(2)
            if process.is_alive():
                process.kill()
                process.join()


# -- server processes ---------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m services.cli ARGV --port P` on loopback, waited for until SERVICE is SERVING."""

    def __init__(
        self, argv: Sequence[str], service: str, log_dir: Path, timeout_s: float = 60.0, port: int | None = None
    ) -> None:
        """`port`: bind this one, shared with another process (SO_REUSEPORT); then readiness is
        this process's own "text service on" log line, since a probe could reach the other one."""
        self.shared = port is not None
        self.target = f"127.0.0.1:{port if self.shared else free_port()}"
        self.log = log_dir / f"{argv[0]}-{self.target.rsplit(':', 1)[1]}-{time.monotonic_ns()}.log"
        level = "INFO" if self.shared else "WARNING"
        command = [sys.executable, "-m", "services.cli", "--log-level", level, *argv,
                   "--host", "127.0.0.1", "--port", self.target.rsplit(":", 1)[1], "--grace-period", "1"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENWIRE_")}
        with self.log.open("w") as out:
            self.process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            self._wait_serving(service, timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_serving(self, service: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.log.name} exited with {self.process.returncode}:\n{self._tail()}")
            if self.shared and "text service on" in self.log.read_text(errors="replace"):
                return
            if not self.shared and check_once(self.target, service, timeout=1.0) == "SERVING":
                return
            time.sleep(0.1)
        raise TimeoutError(f"{service} at {self.target} not SERVING after {timeout_s:.0f} s:\n{self._tail()}")

    def _tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


REAL = -1.0  # the step "time" that stands for the real model (--real-model) in tables and keys


def _label(step: float) -> str:
    return "real model" if step == REAL else f"{step:g} ms"


def decode_server(
    model_dir: Path, step_ms: float, max_batch_size: int, max_queue_size: int, context: int, log_dir: Path
) -> ServerProcess:
    model = ["--model", str(model_dir)] if step_ms == REAL else ["--model", f"scripted:{model_dir}", "--step-ms", str(step_ms)]
    argv = ["decode-server", *model, "--max-batch-size", str(max_batch_size), "--max-queue-size", str(max_queue_size),
            "--max-context-length", str(context)]
    return ServerProcess(argv, SERVICE_NAMES["decode"], log_dir, timeout_s=600.0)  # a real model compiles first


def text_server(model_dir: Path, decoder: str, log_dir: Path, port: int | None = None) -> ServerProcess:
    argv = ["text-server", "--model", str(model_dir), "--decoder", decoder]
    return ServerProcess(argv, SERVICE_NAMES["text"], log_dir, port=port)


# -- the run ------------------------------------------------------------------------------


def _rate(v: float) -> str:
    return f"{v / 1000:.1f}k" if v >= 1000 else f"{v:.0f}"


def _ms(v: float) -> str:
    return f"{v * 1e3:.2f}"


def _steps(step_ms: float):
    return lambda v: f"{v * 1e3 / step_ms:.1f}"


def print_tables(results: dict[tuple[float, int, str], list[Measurement]], steps, streams, paths) -> None:
    print("\ntok/s, and the ratio to in-process (median over rounds, range in brackets):")
    print("\n| step time, streams | " + " | ".join(PATHS[p] for p in paths) + " |")
    print("|---" * (len(paths) + 1) + "|")
    for step in steps:
        for n in streams:
            cells = []
            for path in paths:
                runs = results[(step, n, path)]
                cell = median_range([m.tok_s for m in runs], _rate)
                if path != "engine" and "engine" in paths:
                    ratios = [m.tok_s / e.tok_s for m, e in zip(runs, results[(step, n, "engine")])]
                    cell += f", {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
                cells.append(cell)
            print(f"| {_label(step)}, {n} | " + " | ".join(cells) + " |")
    print("\nITL, pooled over the streams of each measurement (median over rounds, range in brackets):")
    print("\n| step time, streams | path | ITL p50 ms | ITL p99 ms | p50 in steps | p99 in steps |")
    print("|---|---|---|---|---|---|")
    for step in steps:
        for n in streams:
            for path in paths:
                runs = results[(step, n, path)]
                p50, p99 = [m.itl_p50_s for m in runs], [m.itl_p99_s for m in runs]
                cells = [median_range(p50, _ms), median_range(p99, _ms)]
                cells += [median_range(p50, _steps(step)), median_range(p99, _steps(step))] if step > 0 else ["-", "-"]
                print(f"| {_label(step)}, {n} | {path} | " + " | ".join(cells) + " |")


CPU_GROUPS = ("text service", "decode service", "engine process", "clients", "benchmark process")


def cpu_groups(path: str, decoder: ServerProcess | None, texts: Sequence[ServerProcess], pool: ClientPool):
    """The processes whose CPU a measurement of `path` counts, by group (benchmarks/cpu_use.py)."""
    if path == "engine":
        return {"benchmark process": cpu_use.this_process}
    groups = {
        "decode service": lambda: [decoder.process.pid],
        "engine process": lambda: cpu_use.process_tree(decoder.process.pid)[1:],  # its children
        "clients": pool.pids,
    }
    if path == "text":
        groups["text service"] = lambda: [t.process.pid for t in texts]
    return groups


def print_cpu_table(results: dict[tuple[float, int, str], list[Measurement]], steps, streams, paths) -> None:
    """CPU ms per 1,000 tokens by group of processes, and the host's steal share (medians)."""
    rows = [(step, n, path, results[(step, n, path)]) for step in steps for n in streams for path in paths]
    if not any(m.cpu_s for *_, runs in rows for m in runs):
        return
    print("\nCPU time per 1,000 tokens in ms, by process (median over rounds, range in brackets), and the "
          "share of the host's CPU time stolen by other guests during the measurement:")
    print("\n| step time, streams | path | " + " | ".join(CPU_GROUPS) + " | all | host steal |")
    print("|---" * (len(CPU_GROUPS) + 4) + "|")
    for step, n, path, runs in rows:
        per_k = [m.cpu_per_k() for m in runs]
        cells = []
        for group in CPU_GROUPS + ("all",):
            values = [sum(p.values()) if group == "all" else p[group] for p in per_k if p and (group == "all" or group in p)]
            cells.append(median_range(values, lambda v: f"{v:.1f}") if values else "-")
        cells.append(median_range([m.steal_share for m in runs], lambda v: f"{v:.0%}"))
        print(f"| {_label(step)}, {n} | {path} | " + " | ".join(cells) + " |")


def print_engine_only(results, engine_only: list[float], batch: int, streams, paths) -> None:
    """--real-model: each path's tok/s over decode.py's engine-only steps of the same round."""
    print(f"\nServed over decode.py's decode steps at batch {batch} in the same round "
          f"({median_range(engine_only, _rate)} tok/s; median over rounds, range in brackets):\n")
    print("| streams | " + " | ".join(PATHS[p] for p in paths) + " |")
    print("|---" * (len(paths) + 1) + "|")
    for n in streams:
        cells = []
        for path in paths:
            ratios = [m.tok_s / e for m, e in zip(results[(REAL, n, path)], engine_only)]
            cells.append(f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")
        print(f"| {n} | " + " | ".join(cells) + " |")


def print_server_output(log_dir: Path) -> None:
    """What the servers wrote (at --log-level WARNING: only warnings and errors), to stderr."""
    for log in sorted(log_dir.glob("*.log")):
        lines = log.read_text(errors="replace").splitlines()
        if lines:
            print(f"\n{log.stem} wrote {len(lines)} lines; the last ones:", *lines[-20:], sep="\n", file=sys.stderr)


def _cpu_line(m: Measurement) -> str:
    if not m.cpu_s:
        return ""
    parts = ", ".join(f"{group} {ms:.1f}" for group, ms in m.cpu_per_k().items())
    return f"; CPU ms per 1k tokens: {parts}; host steal {m.steal_share:.0%}"


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step-ms", type=_floats, default=[2.0, 0.0], help="decode step times in ms, comma-separated; 0 = free")
    parser.add_argument("--streams", type=_ints, default=[64, 1], help="concurrent stream counts, comma-separated")
    parser.add_argument("--tokens", default="300", help="tokens per stream: M, or LOW-HIGH spread over the streams")
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds: every configuration and path once each")
    parser.add_argument("--client-procs", type=int, default=None, help="client processes (default 2 at >= 16 streams, else 1)")
    parser.add_argument("--model-dir", type=Path, default=ROOT / "tests" / "assets" / "tiny-llama",
                        help="model directory; its tokenizer sets the vocabulary and EOS ids")
    parser.add_argument("--paths", default="engine,decode,text", help="which of engine,decode,text to measure")
    parser.add_argument("--text-workers", type=int, default=1,
                        help="text-service processes sharing one port (the kernel spreads client connections); "
                        "give at least as many client processes")
    parser.add_argument("--real-model", default=None, metavar="NAME|DIR",
                        help="measure a real model (e.g. smollm2-135m-instruct, pulled if need be) instead of the "
                        "scripted one; --step-ms is then unused, the engine path runs the same JaxModel in process, and each "
                        "round also times decode.py's decode steps alone at the batch of the most streams on it")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds one measurement may take")
    parser.add_argument("--json", type=Path, default=None, help="also write every measurement to this file as JSON")
    args = parser.parse_args()
    paths = [p for p in PATHS if p in args.paths.split(",")]
    if not paths or set(args.paths.split(",")) - set(PATHS):
        parser.error(f"--paths takes some of {','.join(PATHS)}")
    if args.real_model:
        from engine.model_store.registry import resolve_model

        args.model_dir, args.step_ms = resolve_model(args.real_model, log=lambda line: print(line, file=sys.stderr)), [REAL]
    counts = {n: token_counts(args.tokens, n) for n in args.streams}
    procs = {n: min(n, args.client_procs or (2 if n >= 16 else 1)) for n in args.streams}
    stream_prompts = prompts(args.model_dir, max(args.streams))  # the same ids on every path
    context = max(max(c) for c in counts.values()) + 256  # room for the prompt, and for decode.py's steps
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop what we started on SIGTERM too

    print(f"machine: {describe('grpcio', 'protobuf')}")
    print("load average before: %.2f %.2f %.2f" % os.getloadavg())
    kind = f"real, {args.model_dir}" if args.real_model else f"scripted, vocabulary of {args.model_dir}"
    print(f"text-service processes on one port: {args.text_workers}")
    print(f"model: {kind}, max_batch_size {args.max_batch_size}; tokens per stream "
          f"{args.tokens}; client processes {procs}; paths {','.join(paths)}; rounds: {args.rounds}")
    lengths = sorted({len(p.ids) for p in stream_prompts})
    print(f"prompts: {stream_prompts[0].text!r}, ... -> {lengths[0]}-{lengths[-1]} ids, the same ids on every path")
    results: dict[tuple[float, int, str], list[Measurement]] = {}
    engine_only: list[float] = []  # --real-model: decode.py's engine-only tok/s, one per round
    with contextlib.ExitStack() as stack:
        log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="transport-bench-")))
        stack.callback(print_server_output, log_dir)  # runs after the servers stop
        targets: dict[tuple[float, str], str] = {}
        servers: dict[float, tuple[ServerProcess | None, list[ServerProcess]]] = {}  # step -> (decoder, texts)
        for step in args.step_ms:
            decoder, texts = None, []
            if "decode" in paths or "text" in paths:
                decoder = decode_server(args.model_dir, step, args.max_batch_size, max(args.streams), context, log_dir)
                stack.callback(decoder.stop)
                targets[(step, "decode")] = decoder.target
            if "text" in paths:
                text = text_server(args.model_dir, decoder.target, log_dir)
                stack.callback(text.stop)
                targets[(step, "text")] = text.target
                texts.append(text)
                for _ in range(args.text_workers - 1):  # more text services on the same port
                    texts.append(text_server(args.model_dir, decoder.target, log_dir, int(text.target.rsplit(":", 1)[1])))
                    stack.callback(texts[-1].stop)
            servers[step] = (decoder, texts)
        pool = ClientPool(max(procs.values()))
        stack.callback(pool.close)

        def measure(step: float, n: int, path: str, m_counts: Sequence[int]) -> Measurement:
            meter = cpu_use.CpuMeter(cpu_groups(path, *servers.get(step, (None, [])), pool))
            meter.start()
            m = measure_path(step, n, path, m_counts)
            use = meter.stop()
            return m if use is None else dataclasses.replace(m, cpu_s=dict(use.seconds), steal_share=use.steal_share)

        def measure_path(step: float, n: int, path: str, m_counts: Sequence[int]) -> Measurement:
            if path == "engine":
                if step == REAL:
                    model = real_model(args.model_dir, args.max_batch_size, context)
                else:
                    model = scripted_model(args.model_dir, step, args.max_batch_size, context)
                return measure_engine(model, m_counts, stream_prompts, args.timeout)
            return pool.measure(path, targets[(step, path)], m_counts, stream_prompts, procs[n], args.timeout)

        for step in args.step_ms:  # untimed: connect every client process to every server
            for n in args.streams:
                for path in paths:
                    measure(step, n, path, [4] * n)
        for r in range(1, args.rounds + 1):
            for step in args.step_ms:
                for n in args.streams:
                    for path in paths:
                        m = measure(step, n, path, counts[n])
                        results.setdefault((step, n, path), []).append(m)
                        print(f"round {r}: {_label(step)}, {n} streams, {path}: {m.tok_s:.0f} tok/s ({m.tokens} tokens "
                              f"in {m.wall_s:.2f} s, {m.tokens / max(1, m.messages):.1f} a message), "
                              f"ITL p50 {_ms(m.itl_p50_s)} ms, p99 {_ms(m.itl_p99_s)} ms, "
                              f"TTFT p50 {_ms(m.ttft_p50_s)} ms, p99 {_ms(m.ttft_p99_s)} ms{_cpu_line(m)}", flush=True)
                if step == REAL:  # decode.py's engine-only steps, in the same round
                    batch = min(max(args.streams), args.max_batch_size)
                    engine_only.append(measure_steps(real_model(args.model_dir, args.max_batch_size, context), batch))
                    print(f"round {r}: decode.py's decode steps at batch {batch}: {engine_only[-1]:.0f} tok/s", flush=True)
    print_tables(results, args.step_ms, args.streams, paths)
    print_cpu_table(results, args.step_ms, args.streams, paths)
    if engine_only:
        print_engine_only(results, engine_only, min(max(args.streams), args.max_batch_size), args.streams, paths)
    if args.json:
        rows = [dict(step_ms=step, streams=n, path=path, rounds=[dataclasses.asdict(m) for m in runs])
                for (step, n, path), runs in results.items()]
        document = {"machine": describe("grpcio", "protobuf"), "results": rows}
        if engine_only:  # --real-model: decode.py's engine-only tok/s at this batch, one per round
            document["engine_only"] = {"batch": min(max(args.streams), args.max_batch_size), "tok_s": engine_only}
        args.json.write_text(json.dumps(document, indent=1))
    print("\nload average after: %.2f %.2f %.2f" % os.getloadavg())


if __name__ == "__main__":
    main()
