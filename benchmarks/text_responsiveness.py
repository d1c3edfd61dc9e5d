"""A small stream's worst gap between messages while large requests are tokenized or refused.

The text service keeps large tokenizer work off its event loop (tests/test_text_responsiveness.py
checks where that work runs; this measures what it buys). A small stream (a scripted decode step
every 5 ms) runs through a real text server while another process sends six large requests at
once: three at the 1 Mi limit (tokenize, generate, detokenize) and three 4 MiB prompts over it.
Prints the stream's worst and median gap while they ran, with the machine's description; compare
runs from one session, the machine is shared and noisy.

Usage: python benchmarks/text_responsiveness.py [--repeats N]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import grpc  # noqa: E402

from benchmarks.machine import describe  # noqa: E402
from engine.core.scripted_model import ScriptedModel  # noqa: E402
from protos.text.v1 import text_pb2_grpc  # noqa: E402
from services.client import generate_request  # noqa: E402
from services.decode_server import start_decode_server  # noqa: E402
from services.text_server import start_text_server  # noqa: E402
from tokenizer_svc.tokenizer import TextTokenizer  # noqa: E402

TINY = ROOT / "tests" / "assets" / "tiny-llama"  # about one id per character: as costly as any
LIMIT = 1024 * 1024  # the default max_input_chars and max_detokenize_ids
STEP_S = 0.005  # the small stream's scripted decode step

# The large requests come from another process (threads of a blocking client), so that only the
# server's costs fall on this process's event loop, not a client's building and parsing of them.
LARGE_CLIENT = r"""
import json, sys, threading
import grpc
from protos.text.v1 import text_pb2 as pb, text_pb2_grpc
from services.client import generate_request

target, limit = sys.argv[1], int(sys.argv[2])
at_limit = ("hello world, " * (limit // 13 + 1))[:limit]
over = "y" * (4 * 1024 * 1024 - 1024)  # just under the 4 MiB message limit
ids = pb.DetokenizeRequest(token_ids=[3 + i % 500 for i in range(limit)])
channel = grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", 16 * 1024 * 1024)])
gen, tok = text_pb2_grpc.TextGenerationStub(channel), text_pb2_grpc.TokenizerStub(channel)
calls = {
    "tokenize at the limit": lambda: len(tok.Tokenize(pb.TokenizeRequest(text=at_limit)).token_ids),
    "generate at the limit": lambda: gen.Complete(generate_request(at_limit, max_output_tokens=1)),
    "detokenize at the limit": lambda: len(tok.Detokenize(ids).text),
    "tokenize over": lambda: tok.Tokenize(pb.TokenizeRequest(text=over)),
    "complete over": lambda: gen.Complete(generate_request(over, max_output_tokens=1)),
    "generate over": lambda: list(gen.Generate(generate_request(over, max_output_tokens=1))),
}
outcomes = {}
def run(name, call):
    try:
        outcomes[name] = ["OK", call()]
    except grpc.RpcError as error:
        outcomes[name] = [error.code().name, error.details()]
channel_ready = grpc.channel_ready_future(channel).result(timeout=10)
print("ready", flush=True)
sys.stdin.readline()
threads = [threading.Thread(target=run, args=item) for item in calls.items()]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps(outcomes, default=lambda o: type(o).__name__), flush=True)
"""


async def gaps_while_large_requests(port: int, prompt: str) -> tuple[list[float], dict]:
    """The small stream's gaps between messages from its last one before the large requests
    started to the moment they were all answered, and their outcomes."""
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    gen = text_pb2_grpc.TextGenerationStub(channel)
    client = await asyncio.create_subprocess_exec(
        sys.executable, "-c", LARGE_CLIENT, f"127.0.0.1:{port}", str(LIMIT),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, cwd=ROOT,
    )
    try:
        assert await asyncio.wait_for(client.stdout.readline(), 30) == b"ready\n"
        stream = gen.Generate(generate_request(prompt, max_output_tokens=2000, ignore_eos=True))
        assert (await stream.read()).HasField("delta")
        arrivals = [time.perf_counter()]

        async def read() -> None:
            while await stream.read() is not grpc.aio.EOF:
                arrivals.append(time.perf_counter())

        reader = asyncio.create_task(read())
        await asyncio.sleep(0.05)  # the stream at its pace
        start = time.perf_counter()
        client.stdin.write(b"go\n")
        await client.stdin.drain()
        outcomes = json.loads(await asyncio.wait_for(client.stdout.readline(), 120))
        end = time.perf_counter()
        if reader.done():
            raise SystemExit("the small stream ended before the large requests did: make it longer")
        stream.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await reader
    finally:
        if client.returncode is None:
            client.kill()
        await client.wait()
        await channel.close()
    during = [t for t in arrivals if start <= t <= end]
    times = [max(t for t in arrivals if t < start), *during, end]
    return [b - a for a, b in zip(times, times[1:])], outcomes


async def run(repeats: int) -> None:
    tokenizer = TextTokenizer.from_dir(TINY)
    model = ScriptedModel(vocab_size=512, eos_token_ids=frozenset({0, 2}), max_batch_size=4,
                          max_context_length=4096, step_delay_s=STEP_S)
    decode = await start_decode_server(model)
    text = await start_text_server(tokenizer, f"127.0.0.1:{decode.port}")
    prompt = "hello " + tokenizer.decode([20], keep_special_tokens=True)
    try:
        print(describe())
        for _ in range(repeats):
            gaps, outcomes = await gaps_while_large_requests(text.port, prompt)
            codes = {name: outcome[0] for name, outcome in outcomes.items()}
            print(f"worst gap {max(gaps) * 1e3:.0f} ms, median {statistics.median(gaps) * 1e3:.1f} ms "
                  f"over {len(gaps)} gaps; {codes}")
    finally:
        await text.stop(None)
        await decode.stop(None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    asyncio.run(run(parser.parse_args().repeats))


if __name__ == "__main__":
    main()
