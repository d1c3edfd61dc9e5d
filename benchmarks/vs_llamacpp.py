"""Side by side with llama.cpp on this machine (issue 15): decode tok/s of our gRPC decode service,
float32 and int8, against llama.cpp's F32 and Q8_0 on the same model, in one run of interleaved
rounds; optionally (`--agreement`) how often greedy ids of each quantized model agree with its
float32 on a fixed prompt set, ours and llama.cpp's.

    python benchmarks/vs_llamacpp.py [--rounds 3] [--batches 1,8,32] [--threads 2,1]
                                     [--llama-dir /work/llama.cpp] [--agreement]

An optional extra, never part of CI. What it does, each step skipped when its output exists:
1. builds llama.cpp from the `llama-cpp-python` sdist on PyPI (its vendored tree; cmake with
   -DGGML_NATIVE=ON, or the CPU's listed instruction sets without AMX where it lists AMX
   (`cpu_flags`); shared libraries, only llama-batched-bench and libllama) under --llama-dir,
   with `nice -n 10` (about 4 minutes of 2 cores on a quiet machine, far longer on a loaded one);
2. makes F32 and Q8_0 GGUFs of the model from the GGUF our pull kept (`model.gguf`; for the
   default model a Q4_1 file): every matrix dequantized to float32 (the values our float32 serves)
   and, for Q8_0, quantized by the `gguf` package (bit-exact with llama.cpp's own quantizer); the
   metadata is copied. llama.cpp also runs that file itself (Q4_1): the bytes our int8 reads for
   it, since int8 keeps a GGUF's 4-bit blocks in 4 bits (engine.jax_backend.quantize);
3. starts one `tokenwire decode-server` per (weights, threads): `--weights float32|int8` with
   `--cpu-threads N` and the process pinned to N CPUs (taskset), so that XLA's own threads are
   held to N too;
4. runs `--rounds` rounds; in each, every configuration at every batch size, in turn: ours
   through gRPC (B concurrent `Decode` streams, random 64-token prompts, greedy, EOS ignored,
   128 new tokens each), and `llama-batched-bench` (-npp 64 -ntg 128 -npl B -t N) for F32, Q8_0
   and the model's own file at each thread count. Each of our servers is followed at once by the
   llama.cpp file it is compared with (float32 by F32, int8 by Q8_0), and every other round runs
   the order reversed (`round_order`).

Figures, medians over the rounds with the range:
- ours "incl. prefill": B x 128 / (last token - requests sent); "decode only": tokens that arrive
  after every request has its first token, over that window (all prompts are in, as llama.cpp's
  S_TG is measured after its prompt phase). llama.cpp: S_TG (decode only) and B x 128 / T (its
  whole run, prompt included).
- Peak RSS of each decode server after the rounds (VmHWM of the server and its engine process).
- Ratios: of the medians, and, for float32 / F32 and int8 / Q8_0, each round's own ratio (median
  and range over the rounds).
The machine is shared: run-to-run noise is large, so compare ratios within one run.

Agreement (`--agreement`): 8 chat prompts x 64 greedy tokens (AGREEMENT_QUESTIONS): free-running
(each model continues its own ids; one near-tie flips the rest of a sequence) and teacher-forced
(each step fed float32's previous id: the share of next-token picks that agree at equal history).
Ours through the decode services; llama.cpp through `llama-cpp-python`'s bindings on the
libllama built in step 1 (they import the pure-Python `diskcache`, which is pip-installed into
--llama-dir/pydeps when missing).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import grpc  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.machine import describe  # noqa: E402
from benchmarks.summary import median_range  # noqa: E402
from engine.model_store.gguf_reader import open_gguf  # noqa: E402

SDIST = "llama-cpp-python==0.3.36"
PROMPT_LEN, NEW_TOKENS = 64, 128
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# The agreement prompt set (tests/test_int8.py gates on it): open-ended answers, so 64 tokens stay
# inside the answer.
AGREEMENT_QUESTIONS = (
    "Write a short story about a robot who learns to paint.",
    "Explain how photosynthesis works, step by step.",
    "What are the main causes of the French Revolution?",
    "Give me five tips for writing clean Python code.",
    "Describe the water cycle to a ten-year-old.",
    "Why is the sky blue? Explain in detail.",
    "Write a poem about the ocean at night.",
    "Compare cats and dogs as pets.",
)
AGREEMENT_TOKENS = 64


def chat_prompt(question: str) -> str:
    """SmolLM2's ChatML with its default system prompt, ready for the assistant's answer."""
    return f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def agreement(reference: list[list[int]], other: list[list[int]]) -> float:
    """The share of positions where two sets of sequences hold the same id."""
    pairs = [(a, b) for ra, rb in zip(reference, other) for a, b in zip(ra, rb)]
    return sum(a == b for a, b in pairs) / len(pairs)


# --- llama.cpp: build, and GGUFs of our model --------------------------------------------------


def build_llamacpp(work: Path, jobs: int) -> Path:
    """llama.cpp's bin directory (llama-batched-bench, libllama.so), built once under `work`."""
    bin_dir = work / "build" / "bin"
    if (bin_dir / "llama-batched-bench").exists() and (bin_dir / "libllama.so").exists():
        return bin_dir
    work.mkdir(parents=True, exist_ok=True)
    name = SDIST.replace("==", "-").replace("-", "_", 2)  # llama_cpp_python-0.3.36
    src = work / name
    if not src.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary=:all:", SDIST, "-d", str(work)], check=True)
        with tarfile.open(work / f"{name}.tar.gz") as tar:
            tar.extractall(work, filter="data")
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON", "-DLLAMA_BUILD_TESTS=OFF",
             "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_CURL=OFF",
             *cpu_flags()]
    print(f"building llama.cpp in {work / 'build'} (nice -n 10, {jobs} jobs)", flush=True)
    subprocess.run(["nice", "-n", "10", "cmake", "-S", str(src / "vendor" / "llama.cpp"), "-B", str(work / "build"), *flags], check=True)
    subprocess.run(["nice", "-n", "10", "cmake", "--build", str(work / "build"), "-j", str(jobs),
                    "--target", "llama-batched-bench", "llama"], check=True)
    return bin_dir


# /proc/cpuinfo flag -> the ggml option that turns its instructions on (with GGML_NATIVE=OFF)
_GGML_ISA = {"avx": "GGML_AVX", "avx2": "GGML_AVX2", "fma": "GGML_FMA", "f16c": "GGML_F16C", "bmi2": "GGML_BMI2",
             "avx_vnni": "GGML_AVX_VNNI", "avx512f": "GGML_AVX512", "avx512vbmi": "GGML_AVX512_VBMI",
             "avx512_vnni": "GGML_AVX512_VNNI", "avx512_bf16": "GGML_AVX512_BF16"}


def cpu_flags() -> list[str]:
    """-DGGML_NATIVE=ON (-march=native), except where the CPU advertises AMX: seen here in a
    Firecracker VM, where -march=native's AMX tile code died with SIGILL (the guest may not use
    the tiles), so there every other instruction set the CPU lists is named and AMX left off."""
    try:
        listed = set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        return ["-DGGML_NATIVE=ON"]
    if not any(f.startswith("amx") for f in listed):
        return ["-DGGML_NATIVE=ON"]
    return ["-DGGML_NATIVE=OFF", *(f"-D{opt}={'ON' if flag in listed else 'OFF'}" for flag, opt in _GGML_ISA.items()),
            "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]


def make_ggufs(source: Path, out: Path) -> dict[str, Path]:
    """F32 and Q8_0 copies of `source` (a GGUF) under `out`: every matrix dequantized to float32,
    then for Q8_0 quantized by `gguf`; vectors stay F32; metadata copied, file type set."""
    import gguf

    paths = {"F32": out / "model-f32.gguf", "Q8_0": out / "model-q8_0.gguf"}
    out.mkdir(parents=True, exist_ok=True)
    reader = open_gguf(source)
    arch = reader.get_field("general.architecture").contents()
    for kind, path in paths.items():
        if path.exists():
            continue
        writer = gguf.GGUFWriter(str(path) + ".partial", arch)
        for f in reader.fields.values():
            if f.name.startswith("GGUF.") or f.name in ("general.architecture", "general.file_type"):
                continue
            sub = f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)
        writer.add_file_type(gguf.LlamaFileType.ALL_F32 if kind == "F32" else gguf.LlamaFileType.MOSTLY_Q8_0)
        for t in reader.tensors:
            values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)  # [rows, ne0]
            values = values.reshape(tuple(int(d) for d in reversed(t.shape)))
            if kind == "Q8_0" and values.ndim == 2:
                writer.add_tensor(t.name, gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0),
                                  raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            else:
                writer.add_tensor(t.name, values)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(str(path) + ".partial", path)
        print(f"wrote {path} ({path.stat().st_size >> 20} MiB)", flush=True)
    return paths


def file_type(path: Path) -> str:
    """The type most of a GGUF's matrix elements have (e.g. "Q4_1")."""
    import collections

    counts: collections.Counter = collections.Counter()
    for t in open_gguf(path).tensors:
        if len(t.shape) == 2:
            counts[t.tensor_type.name] += int(t.n_elements)
    return counts.most_common(1)[0][0]


def llama_batched_bench(bin_dir: Path, gguf_path: Path, batch: int, threads: int) -> dict[str, float]:
    """One llama-batched-bench run: {"s_tg": decode tok/s, "s_all": B x 128 / T (prompt incl.)}."""
    ctx = max(2048, batch * (PROMPT_LEN + NEW_TOKENS) + 64)
    cmd = [str(bin_dir / "llama-batched-bench"), "-m", str(gguf_path), "-c", str(ctx), "-b", "2048", "-ub", "512",
           "-npp", str(PROMPT_LEN), "-ntg", str(NEW_TOKENS), "-npl", str(batch), "-t", str(threads),
           "--output-format", "jsonl"]
    run = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "LD_LIBRARY_PATH": str(bin_dir)})
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    if run.returncode or not rows:
        raise RuntimeError(f"llama-batched-bench failed ({run.returncode}): {run.stderr[-2000:]}")
    row = rows[-1]
    return {"s_tg": float(row["speed_tg"]), "s_all": batch * NEW_TOKENS / float(row["t"])}


# --- ours: decode servers and a gRPC client ----------------------------------------------------


def _threads(n: int) -> str:
    return f"{n} thread{'s' if n > 1 else ''}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """A `tokenwire decode-server` subprocess serving one (weights, threads) configuration."""

    weights: str
    threads: int
    model: str
    max_batch: int
    port: int = 0
    proc: subprocess.Popen | None = None
    log: Path | None = None

    def start(self, log_dir: Path) -> None:
        self.port = _free_port()
        self.log = log_dir / f"decode-{self.weights}-{self.threads}t.log"
        cpus = sorted(os.sched_getaffinity(0))[: self.threads]
        cmd = ["taskset", "-c", ",".join(map(str, cpus)), sys.executable, "-m", "services.cli", "decode-server",
               "--model", self.model, "--port", str(self.port), "--weights", self.weights,
               "--cpu-threads", str(self.threads), "--max-batch-size", str(self.max_batch),
               "--max-context-length", str(PROMPT_LEN + NEW_TOKENS + 64), "--max-queue-size", str(4 * self.max_batch)]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log.open("w"), stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 900) -> None:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"decode-server {self.weights}/{self.threads}t exited: see {self.log}")
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(service="tokenwire.decode.v1.Decoder"), timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(1)
        raise TimeoutError(f"decode-server {self.weights}/{self.threads}t not ready after {timeout} s")

    def peak_rss_mb(self) -> float:
        """Peak RSS (VmHWM) of the server and its descendants (the engine runs in a child process)."""
        total, todo = 0, [self.proc.pid]
        while todo:
            pid = todo.pop()
            try:
                status = Path(f"/proc/{pid}/status").read_text()
                for task in Path(f"/proc/{pid}/task").iterdir():
                    todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            total += next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")), 0)
        return total / 1024

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    @property
    def label(self) -> str:
        return f"ours {self.weights}, {_threads(self.threads)}"


async def _decode(stub, prompt: list[int], new_tokens: int, sent: float, times: list[float], ids: list[int] | None = None) -> None:
    """One greedy Decode stream, EOS ignored: each token's arrival time (s after `sent`) into
    `times`, its id into `ids`."""
    from protos.decode.v1 import decode_pb2 as dpb

    request = dpb.DecodeRequest(prompt_token_ids=prompt, sampling=dpb.SamplingParams(temperature=0.0))
    request.stopping.max_output_tokens = new_tokens
    request.stopping.ignore_eos = True
    async for response in stub.Decode(request):
        now = time.perf_counter() - sent
        got = [e.token.id for e in response.events if e.WhichOneof("event") == "token"]
        times.extend([now] * len(got))
        if ids is not None:
            ids.extend(got)


def ours_round(server: Server, batch: int, seed: int) -> dict[str, float]:
    """B concurrent Decode streams of random 64-token prompts, 128 greedy tokens each."""
    from protos.decode.v1 import decode_pb2_grpc

    rng = np.random.default_rng(seed)
    prompts = [rng.integers(100, 40000, PROMPT_LEN).tolist() for _ in range(batch)]

    async def run() -> list[list[float]]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = decode_pb2_grpc.DecoderStub(channel)
            times: list[list[float]] = [[] for _ in prompts]
            sent = time.perf_counter()
            await asyncio.gather(*(_decode(stub, p, NEW_TOKENS, sent, t) for p, t in zip(prompts, times)))
            return times

    times = asyncio.run(run())
    if any(len(t) != NEW_TOKENS for t in times):
        raise RuntimeError(f"{server.label}: expected {NEW_TOKENS} tokens per request, got {[len(t) for t in times]}")
    end = max(t[-1] for t in times)
    all_in = max(t[0] for t in times)  # every prompt is in: the decode-only window starts
    window = [x for t in times for x in t if x > all_in]
    return {"s_all": batch * NEW_TOKENS / end, "s_tg": len(window) / (end - all_in)}


# --- agreement ---------------------------------------------------------------------------------


def agreement_prompts(model_dir: Path) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return [tok.encode(chat_prompt(q), add_special_tokens=False).ids for q in AGREEMENT_QUESTIONS]


def ours_greedy(server: Server, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Free-running greedy ids through the decode service (all prompts concurrently)."""
    from protos.decode.v1 import decode_pb2_grpc

    async def run() -> list[list[int]]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = decode_pb2_grpc.DecoderStub(channel)
            ids: list[list[int]] = [[] for _ in prompts]
            await asyncio.gather(*(_decode(stub, p, n, time.perf_counter(), [], out) for p, out in zip(prompts, ids)))
            return ids

    return asyncio.run(run())


def ours_forced(server: Server, prompts: list[list[int]], reference: list[list[int]]) -> list[list[int]]:
    """Teacher-forced picks through the service: for step i, the prompt plus reference[:i] is
    sent for one greedy token (the prefix cache, when on, keeps this cheap)."""
    from protos.decode.v1 import decode_pb2_grpc

    async def run() -> list[list[int]]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = decode_pb2_grpc.DecoderStub(channel)

            async def one(p: list[int], ref: list[int]) -> list[int]:
                picks = []
                for i in range(len(ref)):
                    got: list[int] = []
                    await _decode(stub, p + ref[:i], 1, time.perf_counter(), [], got)
                    picks.extend(got)
                return picks

            return list(await asyncio.gather(*(one(p, r) for p, r in zip(prompts, reference))))

    return asyncio.run(run())


def llamacpp_greedy(bin_dir: Path, gguf_path: Path, prompts: list[list[int]], n: int, threads: int,
                    fed: list[list[int]] | None = None) -> list[list[int]]:
    """Greedy ids from llama.cpp (argmax of its logits), free-running or fed `fed`'s ids."""
    work = bin_dir.parent.parent
    os.environ["LLAMA_CPP_LIB_PATH"] = str(bin_dir)
    sys.path[:0] = [str(next(p for p in work.glob("llama_cpp_python-*") if p.is_dir())), str(work / "pydeps")]
    try:
        import diskcache  # noqa: F401  (the bindings import it)
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", "--target", str(work / "pydeps"), "diskcache"], check=True)
        importlib.invalidate_caches()  # the directory did not exist when it went on sys.path
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf_path), n_ctx=512, n_batch=512, n_threads=threads, logits_all=True, verbose=False)
    out = []
    for s, prompt in enumerate(prompts):
        llm.reset()
        llm.eval(prompt)
        ids = []
        for i in range(n):
            ids.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            if i + 1 < n:
                llm.eval([fed[s][i] if fed else ids[-1]])
        out.append(ids)
    return out


# --- main --------------------------------------------------------------------------------------


@dataclass
class Results:
    rows: dict[str, dict[int, dict[str, list[float]]]] = field(default_factory=dict)

    def add(self, label: str, batch: int, figures: dict[str, float]) -> None:
        cell = self.rows.setdefault(label, {}).setdefault(batch, {})
        for key, value in figures.items():
            cell.setdefault(key, []).append(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="registered name or a directory converted from a GGUF (with model.gguf)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--threads", default="2,1", help="thread counts, each for ours and llama.cpp (the first is the main comparison)")
    parser.add_argument("--llama-dir", type=Path, default=Path("/work/llama.cpp"), help="where llama.cpp is built and the GGUFs go")
    parser.add_argument("--jobs", type=int, default=2, help="parallel compile jobs for llama.cpp")
    parser.add_argument("--agreement", action="store_true", help="also measure greedy agreement with float32 (ours and llama.cpp)")
    parser.add_argument("--no-speed", action="store_true", help="skip the speed rounds (with --agreement)")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    threads = [int(t) for t in args.threads.split(",")]

    from engine.model_store.gguf_convert import GGUF_NAME
    from engine.model_store.registry import resolve_model

    model_dir = resolve_model(args.model)
    if not (model_dir / GGUF_NAME).exists():
        sys.exit(f"{model_dir} has no {GGUF_NAME}: pull the model again (tokenwire pull) or convert it from a GGUF")
    bin_dir = build_llamacpp(args.llama_dir, args.jobs)
    ggufs = make_ggufs(model_dir / GGUF_NAME, args.llama_dir / "models" / model_dir.name)
    own = file_type(model_dir / GGUF_NAME)
    if own not in ggufs:  # the model's own file (the default model's: Q4_1), as llama.cpp serves it
        ggufs[own] = model_dir / GGUF_NAME
    print(describe("jax", "grpcio"), flush=True)
    print(f"load average at start: {os.getloadavg()}", flush=True)

    log_dir = args.llama_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    servers = [Server(w, t, str(model_dir), max(batches) if not args.agreement else max(max(batches), len(AGREEMENT_QUESTIONS)))
               for t in threads for w in ("float32", "int8")]
    try:
        for s in servers:
            s.start(log_dir)
        for s in servers:
            s.wait_ready()
        if args.agreement:
            agreement_table(servers, bin_dir, ggufs, model_dir, threads[0])
        if not args.no_speed:
            speed(args, servers, bin_dir, ggufs, batches, threads)
    finally:
        for s in servers:
            s.stop()
    print(f"load average at end: {os.getloadavg()}", flush=True)


def round_order(servers: list[Server], ggufs: dict[str, Path], thread_counts: list[int]) -> list[tuple[str, object]]:
    """What one round measures at a batch size, in order: each server, then at once the llama.cpp
    file it is compared with (float32 with F32, int8 with Q8_0, same threads), then the files and
    thread counts no server is paired with. Rounds alternate this order and its reverse, so that
    neither side of a pair is always first, and a pair is measured seconds apart: the host's
    memory bandwidth moves by up to 1.6x over tens of seconds (docs/benchmarks.md, run Q), which a
    fixed order turns into a bias. Items: (label, Server) or (label, (gguf path, threads))."""
    partner = {"float32": "F32", "int8": "Q8_0"}
    order: list[tuple[str, object]] = []
    for s in servers:
        order.append((s.label, s))
        kind = partner.get(s.weights)
        if kind in ggufs:
            order.append((f"llama.cpp {kind}, {_threads(s.threads)}", (ggufs[kind], s.threads)))
    for t in thread_counts:
        for kind, path in ggufs.items():
            label = f"llama.cpp {kind}, {_threads(t)}"
            if all(label != have for have, _ in order):
                order.append((label, (path, t)))
    return order


def speed(args, servers: list[Server], bin_dir: Path, ggufs: dict[str, Path], batches: list[int], thread_counts: list[int]) -> None:
    """Interleaved rounds of every server and every llama.cpp file (F32, Q8_0 and the model's own),
    at each batch size; the table and the ratios of medians."""
    results = Results()
    llama_threads = thread_counts[0]
    for s in servers:  # one untimed request each (the servers compiled every shape at warm-up)
        ours_round(s, 1, seed=0)

    def take(label: str, batch: int, figures: dict[str, float]) -> None:
        results.add(label, batch, figures)
        print(f"  {label}, B={batch}: decode only {figures['s_tg']:.1f}, prefill incl. {figures['s_all']:.1f} tok/s", flush=True)

    order = round_order(servers, ggufs, thread_counts)
    for r in range(args.rounds):
        for b in batches:
            for label, target in (order if r % 2 == 0 else order[::-1]):
                if isinstance(target, Server):
                    take(label, b, ours_round(target, b, seed=r + 1))
                else:
                    take(label, b, llama_batched_bench(bin_dir, target[0], b, target[1]))
        print(f"round {r + 1}/{args.rounds} done, load average {os.getloadavg()}", flush=True)

    print(f"\nSmolLM2-135M, prompt {PROMPT_LEN}, {NEW_TOKENS} new tokens, {args.rounds} interleaved rounds: "
          "tok/s, median (range); cells are decode only / prefill included")
    print("| tok/s | " + " | ".join(f"B={b}" for b in batches) + " |")
    print("|---|" + "---|" * len(batches))
    for label, cells in results.rows.items():
        line = " | ".join(f"{median_range(cells[b]['s_tg'], '{:.1f}')} / {median_range(cells[b]['s_all'], '{:.1f}')}" for b in batches)
        print(f"| {label} | {line} |")
    print("\nRatios of medians (decode only):")
    first = _threads(llama_threads)
    pairs = [(f"ours float32, {first}", f"llama.cpp F32, {first}"),
             (f"ours int8, {first}", f"llama.cpp Q8_0, {first}"),
             *((f"ours int8, {first}", f"llama.cpp {kind}, {first}") for kind in ggufs if kind not in ("F32", "Q8_0")),
             (f"ours int8, {first}", f"ours float32, {first}")]
    for t in thread_counts[1:]:
        pairs.append((f"ours float32, {_threads(t)}", f"llama.cpp F32, {_threads(t)}"))
        pairs.append((f"ours int8, {_threads(t)}", f"llama.cpp Q8_0, {_threads(t)}"))
        for who, w in (("ours", "float32"), ("ours", "int8"), ("llama.cpp", "F32"), ("llama.cpp", "Q8_0")):
            pairs.append((f"{who} {w}, {first}", f"{who} {w}, {_threads(t)}"))
    for a, b in pairs:
        if a in results.rows and b in results.rows:
            ratios = [statistics.median(results.rows[a][n]["s_tg"]) / statistics.median(results.rows[b][n]["s_tg"]) for n in batches]
            print(f"- {a} / {b}: " + ", ".join(f"B={n} {x:.2f}x" for n, x in zip(batches, ratios)))
    print("\nPer-round ratios, each over the same round's figures (median and range over the rounds; decode only):")
    for a, b in pairs[:2]:
        if a in results.rows and b in results.rows:
            cells = [median_range([x / y for x, y in zip(results.rows[a][n]["s_tg"], results.rows[b][n]["s_tg"])], "{:.2f}")
                     for n in batches]
            print(f"- {a} / {b}: " + ", ".join(f"B={n} {c}" for n, c in zip(batches, cells)))
    print("\nPeak RSS of each decode server (VmHWM): " + ", ".join(f"{s.label} {s.peak_rss_mb():.0f} MB" for s in servers))


def agreement_table(servers: list[Server], bin_dir: Path, ggufs: dict[str, Path], model_dir: Path, threads: int) -> None:
    prompts = agreement_prompts(model_dir)
    n = AGREEMENT_TOKENS
    f32 = next(s for s in servers if s.weights == "float32" and s.threads == threads)
    int8 = next(s for s in servers if s.weights == "int8" and s.threads == threads)
    ours_ref = ours_greedy(f32, prompts, n)
    ours_q = ours_greedy(int8, prompts, n)
    ours_q_forced = ours_forced(int8, prompts, ours_ref)
    print(f"ours int8 vs ours float32: free-running {agreement(ours_ref, ours_q):.3f}, "
          f"teacher-forced {agreement(ours_ref, ours_q_forced):.3f}", flush=True)
    ref = llamacpp_greedy(bin_dir, ggufs["F32"], prompts, n, threads)
    q8 = llamacpp_greedy(bin_dir, ggufs["Q8_0"], prompts, n, threads)
    q8_forced = llamacpp_greedy(bin_dir, ggufs["Q8_0"], prompts, n, threads, fed=ref)
    print(f"\nGreedy agreement with float32, {len(prompts)} prompts x {n} tokens (free-running / teacher-forced):")
    print(f"- ours int8 vs ours float32: {agreement(ours_ref, ours_q):.3f} / {agreement(ours_ref, ours_q_forced):.3f}")
    print(f"- llama.cpp Q8_0 vs llama.cpp F32: {agreement(ref, q8):.3f} / {agreement(ref, q8_forced):.3f}")
    print(f"- llama.cpp F32 vs ours float32 (same weights): {agreement(ours_ref, ref):.3f}")


if __name__ == "__main__":
    main()
