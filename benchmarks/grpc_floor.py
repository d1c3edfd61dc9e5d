"""The floor under benchmarks/transport.py: what bare grpc.aio costs per token on this host.

    python benchmarks/grpc_floor.py [--streams 64] [--tokens 300] [--per-message 1,5] [--rounds 3]

A server with no model and no logic (a `TextGeneration.Generate` that yields a `TextDelta` of
`--per-message` ids to every open stream on each tick, a tick every `--per-message` x 2 ms, the
pace of 2 ms engine steps coalesced into messages of that many tokens), read by two client
processes that do what transport.py's clients do with each message. It prints tok/s, and the CPU
time a token costs the server and the clients (from /proc, benchmarks/cpu_use.py), median and
range over interleaved rounds.

Why: on a host where every process shares the same cores (the 2-vCPU machine of issue 10), tok/s
through the text service is set by the CPU each token costs all processes together. This script
measures the part no server of ours can avoid: gRPC's own work for one hop, server and client,
at the message sizes the text service sends. What the text path spends beyond it
(transport.py's CPU table) is the engine, the decode service, the DecodeStream hop, and our
Python per request and per message.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import grpc  # noqa: E402

from benchmarks.cpu_use import process_cpu_s  # noqa: E402
from benchmarks.machine import describe  # noqa: E402
from benchmarks.summary import median_range  # noqa: E402
from protos.decode.v1 import decode_pb2  # noqa: E402
from protos.text.v1 import text_pb2, text_pb2_grpc  # noqa: E402
from services import cli  # noqa: E402

STEP_S = 0.002  # the engine step this paces, as transport.py's default --step-ms 2
CLIENTS = 2


class Ticking(text_pb2_grpc.TextGenerationServicer):
    """Every tick, each open stream gets one TextDelta of `per` ids, then a TextFinished after
    `tokens` ids; the streams share one tick, as the engine's steps are shared."""

    def __init__(self, tokens: int, per: int) -> None:
        self.tokens, self.per = tokens, per
        self.tick: asyncio.Event | None = None

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(STEP_S * self.per)
            tick, self.tick = self.tick, asyncio.Event()
            tick.set()

    async def Generate(self, request, context):
        if self.tick is None:
            self.tick = asyncio.Event()
            asyncio.get_running_loop().create_task(self._ticker())
        sent = 0
        while sent < self.tokens:
            await self.tick.wait()
            n = min(self.per, self.tokens - sent)
            yield text_pb2.GenerateResponse(delta=text_pb2.TextDelta(text=" w" * n, token_ids=range(sent, sent + n)))
            sent += n
        finished = text_pb2.TextFinished(reason=decode_pb2.FINISH_REASON_LENGTH)
        finished.usage.completion_tokens = sent
        yield text_pb2.GenerateResponse(finished=finished)


def _serve(port: int, tokens: int, per: int) -> None:
    loop = cli.new_event_loop()  # the servers' loop

    async def main() -> None:
        server = grpc.aio.server()
        text_pb2_grpc.add_TextGenerationServicer_to_server(Ticking(tokens, per), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    loop.run_until_complete(main())


def _client(port: int, streams: int, go, results) -> None:
    """`streams` Generate calls on one channel; per message what transport.py's client does (the
    delta's ids counted, a clock read); puts (tokens, messages, seconds, CPU seconds)."""
    loop = cli.new_event_loop()
    asyncio.set_event_loop(loop)

    async def main() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await channel.channel_ready()
            stub = text_pb2_grpc.TextGenerationStub(channel)

            async def one() -> tuple[int, int]:
                tokens = messages = 0
                async for response in stub.Generate(text_pb2.GenerateRequest(prompt="x")):
                    if response.HasField("delta"):
                        tokens += len(response.delta.token_ids)
                        messages += 1
                        time.monotonic()
                return tokens, messages

            go.wait()
            started, cpu = time.monotonic(), time.process_time()
            done = await asyncio.gather(*(one() for _ in range(streams)))
            results.put((sum(t for t, _ in done), sum(m for _, m in done), time.monotonic() - started,
                         time.process_time() - cpu))

    loop.run_until_complete(main())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(server_pid: int, port: int, streams: int) -> dict[str, float]:
    ctx = multiprocessing.get_context("spawn")
    go, results = ctx.Event(), ctx.Queue()
    procs = min(CLIENTS, streams)  # (fewer streams than client processes: one stream each)
    shares = [streams // procs + (w < streams % procs) for w in range(procs)]
    clients = [ctx.Process(target=_client, args=(port, share, go, results)) for share in shares]
    for c in clients:
        c.start()
    time.sleep(1.0)  # connected and waiting
    before = process_cpu_s(server_pid)
    go.set()
    out = [results.get(timeout=120) for _ in clients]
    server_cpu = process_cpu_s(server_pid) - before
    for c in clients:
        c.join()
    tokens = sum(o[0] for o in out)
    return {
        "tokens": tokens,
        "tok_s": tokens / max(o[2] for o in out),
        "per_message": tokens / sum(o[1] for o in out),
        "server_us": 1e6 * server_cpu / tokens,
        "clients_us": 1e6 * sum(o[3] for o in out) / tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=300, help="ids per stream")
    parser.add_argument("--per-message", default="1,5", help="ids a message, comma-separated (5: what the text service sends at 64 streams here)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    sizes = [int(n) for n in args.per_message.split(",")]
    ctx = multiprocessing.get_context("spawn")
    servers = {}
    for per in sizes:
        port = _free_port()
        proc = ctx.Process(target=_serve, args=(port, args.tokens, per), daemon=True)
        proc.start()
        servers[per] = (proc, port)
    time.sleep(2.0)
    print(describe("grpcio"), flush=True)
    runs: dict[int, list[dict[str, float]]] = {per: [] for per in sizes}
    try:
        for r in range(args.rounds):
            for per in sizes:
                proc, port = servers[per]
                m = measure(proc.pid, port, args.streams)
                runs[per].append(m)
                print(f"round {r + 1}, {per} a message: {m['tok_s']:.0f} tok/s, CPU us a token: server "
                      f"{m['server_us']:.1f}, clients {m['clients_us']:.1f}", flush=True)
    finally:
        for proc, _ in servers.values():
            proc.kill()
    print(f"\n{args.streams} streams x {args.tokens} ids, a tick every (ids a message) x {STEP_S * 1000:.0f} ms, "
          f"{args.rounds} rounds: median (range)")
    print("| ids a message | tok/s | server CPU us a token | clients CPU us a token |")
    print("|---|---|---|---|")
    for per in sizes:
        rs = runs[per]
        cells = [median_range([m[k] for m in rs], f) for k, f in (("tok_s", "{:.0f}"), ("server_us", "{:.1f}"), ("clients_us", "{:.1f}"))]
        print(f"| {statistics.median(m['per_message'] for m in rs):.1f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
