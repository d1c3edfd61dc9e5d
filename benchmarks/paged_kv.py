"""The paged KV cache's three claims on the real model, through a real decode server (issue 41).

    python benchmarks/paged_kv.py [--only capacity,overcommit,prefix] [--json OUT]

One `decode-server` with the default model (int8 on the CPU kernels, as served) and
`--max-batch-size 64 --max-context-length 2048 --kv-cache-tokens 16384`: the KV of 16,384
positions, what the slot cache's CPU default (8 x 2,048) reserved.

  capacity    64 streams of 240 positions (a 40-id prompt, 200 tokens, ignore_eos) at once: each
              of the 64 gets its first token before any of them finishes (with slots, 8 ran at once).
  overcommit  64 streams of 600 positions (100 + 500) in the same 16,384: 38,400 positions asked
              for, so sequences are preempted and recomputed. Each stream's ids must equal what a
              server with room for all of them (kv 131,072, no preemption) gives, and those of 3
              streams run alone; no stream sees a duplicate or a missing token (the count is exact),
              and the preemptions show in the metrics.
  prefix      two requests sharing a 1,000-id prefix, the second sent once the first has its first
              token: the pages in use while both decode (the shared prefix held once), and the
              second's time to first token against the first's.

Greedy decoding throughout; prompts are random ids from a fixed seed (their meaning is beside
the point). Prints a table per claim and exits 1 when a claim fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.transport import free_port  # noqa: E402
from protos.decode.v1 import decode_pb2, decode_pb2_grpc  # noqa: E402
from engine.model_store.registry import DEFAULT_MODEL  # noqa: E402
from services.health_probe import check_once  # noqa: E402

SERVICE = "tokenwire.decode.v1.Decoder"
POOL = ["--model", DEFAULT_MODEL, "--max-batch-size", "64", "--max-context-length", "2048", "--kv-cache-tokens", "16384"]
ROOMY = ["--model", DEFAULT_MODEL, "--max-batch-size", "64", "--max-context-length", "2048", "--kv-cache-tokens", str(64 * 2048)]


@dataclass
class Stream:
    ids: list[int] = field(default_factory=list)
    sent_s: float = 0.0
    first_s: float | None = None
    done_s: float | None = None
    reason: str = ""
    completion_tokens: int = -1


class Server:
    """`decode-server` on loopback with the real model, its log in a file, its metrics on a port."""

    def __init__(self, flags: list[str], log: Path) -> None:
        self.port, self.metrics_port = free_port(), free_port()
        self.log = log
        command = [sys.executable, "-m", "services.cli", "decode-server", *flags, "--host", "127.0.0.1",
                   "--port", str(self.port), "--metrics-port", str(self.metrics_port), "--grace-period", "1"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENWIRE_")}
        with log.open("w") as out:
            self.process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 900  # a first start compiles every shape
        while check_once(f"127.0.0.1:{self.port}", SERVICE, timeout=1.0) != "SERVING":
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"decode-server did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)

    def metrics(self) -> dict[str, float]:
        """Each tokenwire_ sample's value by its name (labels dropped: these are unlabelled)."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(tokenwire_\w+)(?:\{[^}]*\})? (\S+)$", text, re.M)}

    def memory_plan(self) -> str:
        return next((line for line in self.log.read_text().splitlines() if "memory plan" in line.lower()), "(no memory-plan line)")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def prompts(n: int, length: int, seed: int, prefix: list[int] | None = None) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    head = prefix or []
    return [head + rng.integers(1000, 40000, length).tolist() for _ in range(n)]


async def run(port: int, prompt: list[int], max_tokens: int, stream: Stream) -> None:
    request = decode_pb2.DecodeRequest(
        prompt_token_ids=prompt,
        stopping=decode_pb2.StoppingCriteria(max_output_tokens=max_tokens, ignore_eos=True),
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stream.sent_s = time.monotonic()
        async for response in decode_pb2_grpc.DecoderStub(channel).Decode(request):
            for event in response.events:
                if event.HasField("token"):
                    stream.first_s = stream.first_s or time.monotonic()
                    stream.ids.append(event.token.id)
                else:
                    stream.done_s = time.monotonic()
                    stream.reason = decode_pb2.FinishReason.Name(event.finished.reason)
                    stream.completion_tokens = event.finished.usage.completion_tokens


async def run_all(port: int, batch: list[list[int]], max_tokens: int) -> list[Stream]:
    streams = [Stream() for _ in batch]
    await asyncio.gather(*(run(port, p, max_tokens, s) for p, s in zip(batch, streams)))
    return streams


def exact(streams: list[Stream], max_tokens: int) -> bool:
    """Every stream ended LENGTH with exactly max_tokens ids, counted as many in its usage."""
    return all(s.reason == "FINISH_REASON_LENGTH" and len(s.ids) == s.completion_tokens == max_tokens for s in streams)


def capacity(server: Server) -> dict:
    batch = prompts(64, 40, seed=1)
    streams = asyncio.run(run_all(server.port, batch, 200))
    last_first = max(s.first_s for s in streams)
    first_done = min(s.done_s for s in streams)
    return {"memory_plan": server.memory_plan(), "streams": 64, "positions_each": 240,
            "all_started_before_any_finished": last_first < first_done, "exact": exact(streams, 200),
            "last_first_token_s": last_first - min(s.sent_s for s in streams),
            "first_finish_s": first_done - min(s.sent_s for s in streams)}


def overcommit(server: Server, roomy: Server) -> dict:
    batch = prompts(64, 100, seed=2)
    before = server.metrics().get("tokenwire_preemptions_total", 0.0)
    paged = asyncio.run(run_all(server.port, batch, 500))
    preempted = server.metrics().get("tokenwire_preemptions_total", 0.0) - before
    reference = asyncio.run(run_all(roomy.port, batch, 500))
    alone = [asyncio.run(run_all(roomy.port, [batch[i]], 500))[0] for i in (0, 31, 63)]
    same = sum(p.ids == r.ids for p, r in zip(paged, reference))
    same_alone = sum(paged[i].ids == a.ids for i, a in zip((0, 31, 63), alone))
    return {"streams": 64, "positions_each": 600, "preemptions": preempted, "exact": exact(paged, 500),
            "same_ids_as_roomy": f"{same}/64", "same_ids_as_alone": f"{same_alone}/3"}


def prefix(server: Server) -> dict:
    shared = prompts(1, 1000, seed=3)[0]
    first, second = prompts(2, 10, seed=4, prefix=shared)
    a, b = Stream(), Stream()

    async def both() -> dict:
        task_a = asyncio.create_task(run(server.port, first, 300, a))
        while a.first_s is None:
            await asyncio.sleep(0.005)
        base = server.metrics()
        task_b = asyncio.create_task(run(server.port, second, 300, b))
        while b.first_s is None:
            await asyncio.sleep(0.005)
        during = server.metrics()
        await asyncio.gather(task_a, task_b)
        return {"used_with_a": base.get("tokenwire_kv_pages_used"), "used_with_both": during.get("tokenwire_kv_pages_used")}

    pages = asyncio.run(both())
    ttft_a, ttft_b = a.first_s - a.sent_s, b.first_s - b.sent_s
    return {"prefix_tokens": 1000, **pages, "ttft_first_s": ttft_a, "ttft_second_s": ttft_b,
            "ttft_ratio": ttft_b / ttft_a, "exact": exact([a, b], 300)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="capacity,overcommit,prefix")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--logs", type=Path, default=Path("/tmp"))
    args = parser.parse_args()
    only = set(args.only.split(","))
    results: dict[str, dict] = {}
    server = Server(POOL, args.logs / "paged-kv-server.log")
    try:
        if "capacity" in only:
            results["capacity"] = capacity(server)
        if "prefix" in only:
            results["prefix"] = prefix(server)
        if "overcommit" in only:
            roomy = Server(ROOMY, args.logs / "paged-kv-roomy.log")
            try:
                results["overcommit"] = overcommit(server, roomy)
            finally:
                roomy.stop()
    finally:
        server.stop()
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    ok = all(r.get("exact", True) for r in results.values())
    ok &= results.get("capacity", {}).get("all_started_before_any_finished", True)
    ok &= results.get("overcommit", {}).get("same_ids_as_roomy", "64/64") == "64/64"
    ok &= results.get("prefix", {}).get("ttft_ratio", 0.0) <= 0.1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
