"""The `tokenwire` command line, run as a real subprocess against real servers on loopback; the
flag refusals and --help, which end in the parser, by calling `main` in this process (a real
process proves their wiring once: test_a_refusal_in_a_real_process_is_one_line_and_exit_2)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine.jax_backend import cpu_kernels
from engine.core.scripted_model import ScriptedModel
from services.cli import build_parser, main
from services.config import env_name
from services.decode_server import start_decode_server
from services.text_server import start_text_server
from tokenizer_svc.chat import ChatMessage
from tokenizer_svc.tokenizer import TextTokenizer

TINY = Path(__file__).parent / "assets" / "tiny-llama"
ROOT = Path(__file__).resolve().parent.parent


async def tokenwire(*args: str, env: dict | None = None, stdin: bytes | None = None) -> tuple[int, str, str]:
    """Run `python -m services.cli ARGS` without blocking the event loop that serves the test stack."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.cli", *args,
        cwd=ROOT, env={**os.environ, **(env or {})},
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(stdin), 120)
    return proc.returncode, out.decode(), err.decode()


def in_process(capsys, *argv: str) -> tuple[int, str, str]:
    """`tokenwire ARGV` through `main` in this process (the environment is this process's):
    its exit code, whether returned or raised as SystemExit (argparse's refusals and --help),
    and what it printed."""
    capsys.readouterr()
    try:
        code = main(list(argv))
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
async def text_port():
    model = ScriptedModel(vocab_size=512, eos_token_ids=frozenset({0, 2}), max_context_length=128)
    decode = await start_decode_server(model)
    text = await start_text_server(TextTokenizer.from_dir(TINY), f"127.0.0.1:{decode.port}")
    yield text.port
    await text.stop(None)
    await decode.stop(None)


async def test_generate_json_prints_reason_and_usage(text_port):
    code, out, _ = await tokenwire("generate", "--server", f"127.0.0.1:{text_port}", "--json", "--max-tokens", "3", "hello '")
    assert code == 0
    result = json.loads(out)
    assert result["token_ids"] == [301, 302, 303]  # "hello '" ends in id 300; the scripted model counts
    assert result["reason"] == "length" and result["usage"]["completion_tokens"] == 3
    assert result["text"] == TextTokenizer.from_dir(TINY).decode([301, 302, 303])


async def test_generate_stream_and_plain_print_the_same_text(text_port):
    args = ["generate", "--server", f"127.0.0.1:{text_port}", "--max-tokens", "6", "hello '"]
    plain, streamed = await tokenwire(*args), await tokenwire(*args, "--stream")
    assert plain[0] == streamed[0] == 0
    assert plain[1] == streamed[1] == TextTokenizer.from_dir(TINY).decode(list(range(301, 307))) + "\n"


async def test_flags_come_from_the_environment(text_port):
    env = {"TOKENWIRE_SERVER": f"127.0.0.1:{text_port}", "TOKENWIRE_MAX_TOKENS": "2", "TOKENWIRE_JSON": "1"}
    code, out, _ = await tokenwire("generate", "hello '", env=env)
    assert code == 0 and json.loads(out)["usage"]["completion_tokens"] == 2


async def test_generate_with_a_stop_string(text_port):
    code, out, _ = await tokenwire(
        "generate", "--server", f"127.0.0.1:{text_port}", "--json", "--max-tokens", "20", "--stop", "pionc", "hello '"
    )
    result = json.loads(out)
    assert (code, result["text"], result["stop_string"], result["reason"]) == (0, " b if ", "pionc", "stop")


async def test_bad_request_prints_the_status_and_exits_1(text_port):
    code, out, err = await tokenwire("generate", "--server", f"127.0.0.1:{text_port}", "--max-tokens", "0", "hi")
    assert code == 1 and out == ""
    assert "INVALID_ARGUMENT: stopping.max_output_tokens" in err and "Traceback" not in err


OUT_OF_RANGE = [
    ("generate", "--max-tokens", "-3", "must be a whole number >= 0, got -3"),
    ("generate", "--top-k", "-1", "must be a whole number >= 0, got -1"),
    ("generate", "--seed", "-5", "must be a whole number >= 0, got -5"),
    ("generate", "--stop-token-id", "-2", "must be a whole number >= 0, got -2"),
    ("generate", "--timeout", "0", "must be a number of seconds > 0, got 0.0"),
    ("decode-server", "--max-batch-size", "0", "must be a whole number >= 1, got 0"),
    ("decode-server", "--max-context-length", "0", "must be a whole number >= 1, got 0"),
    ("decode-server", "--max-queue-size", "-1", "must be a whole number >= 0, got -1"),
    ("decode-server", "--port", "70000", "must be a port in 0..65535, got 70000"),
    ("decode-server", "--stall-timeout", "-1", "must be a number of seconds > 0, got -1.0"),
    ("decode-server", "--grace-period", "nan", "expected a number of seconds >= 0, got 'nan'"),
    ("text-server", "--max-message-bytes", "0", "must be a whole number >= 1, got 0"),
    ("health", "--wait", "soon", "expected a number of seconds >= 0, got 'soon'"),
]


def model_flag(command: str) -> list[str]:
    return [] if command == "health" else ["--model", "m"]


@pytest.mark.parametrize("command, flag, value, message", OUT_OF_RANGE)
def test_an_out_of_range_flag_is_refused_naming_it(command, flag, value, message, capsys):
    code, _, err = in_process(capsys, command, *model_flag(command), flag, value)
    assert code == 2 and f"argument {flag}: {message}" in err, err


@pytest.mark.parametrize("command, flag, value, message", OUT_OF_RANGE[::3])
def test_an_out_of_range_variable_is_refused_naming_it(command, flag, value, message, capsys, monkeypatch):
    variable = env_name(flag)
    monkeypatch.setenv(variable, value)
    code, _, err = in_process(capsys, command, *model_flag(command))
    assert code == 2 and f"{variable}={value!r}: {message}" in err, err


def test_a_bad_list_or_choice_in_the_environment_is_a_one_line_error(capsys, monkeypatch):
    with monkeypatch.context() as env:
        env.setenv("TOKENWIRE_STOP_TOKEN_ID", "3,-1")
        code, _, err = in_process(capsys, "generate", "hi")
    assert code == 2 and "TOKENWIRE_STOP_TOKEN_ID='3,-1': must be a whole number >= 0, got -1" in err
    monkeypatch.setenv("TOKENWIRE_DTYPE", "float16")
    code, _, err = in_process(capsys, "decode-server", "--model", "m")
    assert code == 2 and "TOKENWIRE_DTYPE='float16': choose from float32, bfloat16" in err


async def test_a_refusal_in_a_real_process_is_one_line_and_exit_2():
    """The wiring the in-process refusals above rely on: the installed entry point exits 2 with
    the parser's one-line message and no traceback, for a flag and for a variable."""
    command, flag, value, message = OUT_OF_RANGE[0]
    code, _, err = await tokenwire(command, flag, value)
    assert code == 2 and f"argument {flag}: {message}" in err and "Traceback" not in err, err
    command, flag, value, message = OUT_OF_RANGE[-1]
    code, _, err = await tokenwire(command, env={env_name(flag): value})
    assert code == 2 and f"{env_name(flag)}={value!r}: {message}" in err and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith(f"tokenwire {command}: error: {env_name(flag)}="), err  # after the usage


@pytest.mark.parametrize("value, on", [("on", True), ("off", False)])
def test_cpu_kernels_flag_reaches_the_model(value, on, caplog):
    from services.model_loading import load_model
    from services.config import DecodeServerConfig

    config = DecodeServerConfig.from_args(build_parser().parse_args(["decode-server", "--model", "m", "--cpu-kernels", value]))
    assert config.model_options.cpu_kernels is on
    with caplog.at_level("INFO", logger="engine"):
        model = load_model(ROOT / "tests" / "assets" / "tiny-llama", 1, config.model_options)
    assert model.kernels is (on and cpu_kernels.load() is not None)
    assert ("turned off by configuration" in caplog.text) is not on


@pytest.mark.parametrize("budget, smallest", [(None, 8), ("0", 16), ("4", 4), ("5", 8), ("16", 16), ("64", 16)])
def test_a_step_budget_below_16_sets_the_smallest_chunk_shape(budget, smallest):
    """A small --max-step-tokens would gain nothing if its chunks were padded to the 16 shape; the
    CPU's default budget is 8 (0: no budget, the usual shapes)."""
    from services.model_loading import load_model
    from services.config import DecodeServerConfig

    flags = ["decode-server", "--model", "m", "--cpu-kernels", "off"] + ([] if budget is None else ["--max-step-tokens", budget])
    config = DecodeServerConfig.from_args(build_parser().parse_args(flags))
    model = load_model(ROOT / "tests" / "assets" / "tiny-llama", 1, config.model_options)
    assert model.buckets[0] == smallest


async def test_the_log_level_takes_any_case():
    code, _, err = await tokenwire("health", "--server", "127.0.0.1:1", "--timeout", "1", env={"TOKENWIRE_LOG_LEVEL": "debug"})
    assert code == 1 and "UNAVAILABLE" in err and "Traceback" not in err


async def test_chat_streams_replies_and_keeps_history(text_port, caplog):
    """The second turn's request carries the first turn and its reply: the decode service (this
    process's, behind the text service, as the text service in this process) logs each request's prompt length, which is that of the
    whole chat so far through tiny-llama's template, not of the last message alone."""
    with caplog.at_level(logging.INFO, logger="tokenwire.requests"):
        code, out, err = await tokenwire(
            "chat", "--server", f"127.0.0.1:{text_port}", "--max-tokens", "2", stdin=b"hi\nagain\n"
        )
    assert code == 0, err
    assert out.count("assistant> ") == 2
    tokenizer = TextTokenizer.from_dir(TINY)
    last = tokenizer.encode_chat([ChatMessage("user", "hi")])[-1]
    first_reply = tokenizer.decode([last + 1, last + 2])  # the scripted model counts on from the prompt's last id
    assert f"assistant> {first_reply}\n" in out, out
    logged = [re.search(r"request_id=(\w+) .* prompt_tokens=(\d+)", r.getMessage()) for r in caplog.records]
    lengths = list({m[1]: int(m[2]) for m in logged if m}.values())  # per request (both services log it)
    turns = [ChatMessage("user", "hi"), ChatMessage("assistant", first_reply), ChatMessage("user", "again")]
    assert lengths == [len(tokenizer.encode_chat(turns[:1])), len(tokenizer.encode_chat(turns))], (lengths, out)
    assert lengths[1] != len(tokenizer.encode_chat(turns[2:]))  # history dropped would be this


async def test_unreachable_server_is_a_clear_error():
    code, _, err = await tokenwire("generate", "--server", "127.0.0.1:1", "--timeout", "2", "hi")
    assert code == 1 and "UNAVAILABLE" in err


def test_every_command_has_help(capsys):
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    assert set(commands) >= {"decode-server", "text-server", "generate", "chat", "pull"}
    for name in commands:
        code, out, _ = in_process(capsys, name, "--help")
        assert code == 0 and "usage: tokenwire " + name in out


def _flag_actions():
    """(command, action) for every flag and argument of every command, the global ones as "tokenwire"."""
    parser = build_parser()
    commands = [("tokenwire", parser)] + list(parser._subparsers._group_actions[0].choices.items())
    return [(name, a) for name, sub in commands for a in sub._actions if a.help and a.dest not in ("help", "command")]


def test_the_configuration_reference_is_what_the_parser_generates():
    """docs/configuration.md is written from the parser (services.config_reference); a flag added,
    renamed or re-documented without regenerating it fails here. It names every flag."""
    from services.config_reference import reference

    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == reference(), "docs/configuration.md is stale: python -m services.config_reference > docs/configuration.md"
    for command, action in _flag_actions():
        name = action.option_strings[-1] if action.option_strings else action.metavar or action.dest
        assert f"`{name}`" in committed, (command, name)
        if action.option_strings:
            assert f"`{env_name(name)}`" in committed, (command, name)


def test_the_reference_ignores_variables_set_in_the_shell(monkeypatch):
    """A TOKENWIRE_* variable changes a flag's default, but not the reference's defaults."""
    from services.config_reference import reference

    before = reference()
    monkeypatch.setenv("TOKENWIRE_MAX_BATCH_SIZE", "3")
    assert build_parser()._subparsers._group_actions[0].choices["decode-server"].get_default("max_batch_size") == 3
    assert reference() == before and "| `8` |" in before


def test_every_help_is_one_short_line():
    """--help prints one line per flag; the long explanations are the reference's details."""
    actions = _flag_actions()
    assert all(hasattr(a, "summary") for _, a in actions if a.option_strings)  # every flag came through add_flag
    helps = {(command, a.option_strings[-1] if a.option_strings else a.dest): getattr(a, "summary", a.help) for command, a in actions}
    long = {flag: text for flag, text in helps.items() if len(text) > 100 or "\n" in text}
    assert not long, long
    reference = (ROOT / "docs" / "configuration.md").read_text()
    detailed = [a for _, a in actions if getattr(a, "details", "")]
    assert len(detailed) >= 20 and all(a.details in reference for a in detailed)  # the long texts went there


async def test_start_up_errors_are_one_line_and_exit_2(tmp_path):
    code, _, err = await tokenwire("text-server", "--model", "no-such-model")
    assert code == 2 and "unknown model 'no-such-model'" in err and "Traceback" not in err
    code, _, err = await tokenwire(
        "text-server", "--model", str(TINY), "--decoder", "127.0.0.1:1", "--connect-timeout", "1", "--port", "0"
    )
    assert code == 2 and "no decode service at 127.0.0.1:1" in err and "Traceback" not in err


QUICK_START = ["--port", "0", "--cpu-kernels", "off", "--compilation-cache", "off"]


@pytest.mark.parametrize("argv, reason", [
    # the engine process refuses at load (a model that does not fit in memory, the case, is
    # refused the same way through the real entry point in tests/test_memory_plan.py:
    # test_decode_server_refuses_an_impossible_configuration_in_one_line)
    (["--tensor-parallel", "3"], "refusing to serve: --tensor-parallel 3 does not divide the model's 4 attention heads"),
    # flags that the parser takes one by one but that do not go together, refused before loading
    (["--weights", "int8", "--tensor-parallel", "2"], "--weights int8 runs on one device: it cannot be combined with --tensor-parallel 2"),
], ids=["tensor-parallel", "flags"])
async def test_a_configuration_that_cannot_work_exits_2_with_its_reason_last(argv, reason):
    """Through the real entry point: exit 2, the reason as the last line printed, and no word of a
    restart anywhere (a supervisor would restart it forever)."""
    code, _, err = await tokenwire("decode-server", "--model", str(TINY), *QUICK_START, *argv)
    lines = err.strip().splitlines()
    assert code == 2 and reason in lines[-1], err
    assert "supervisor" not in err and "Traceback" not in err, err


def test_a_missing_extra_exits_2_naming_the_extra():
    """api-server without the `api` extra (fastapi, uvicorn): one line saying what to install."""
    for module in ("fastapi", "uvicorn"):
        script = (f"import sys; sys.modules[{module!r}] = None  # as if the extra were not installed\n"
                  "from services.cli import main; sys.exit(main(sys.argv[1:]))")
        result = subprocess.run([sys.executable, "-c", script, "api-server", "--port", "0"],
                                cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip().splitlines() == [
            f"tokenwire api-server: api-server needs the `api` extra ({module} is missing): pip install 'tokenwire[api]' "
            "(--log-level DEBUG shows the traceback)"
        ], result.stderr


async def test_a_crash_at_load_keeps_exit_1_and_the_restart_message(tmp_path):
    """Weights that cannot be read are not a setting to change: exit 1, for a supervisor to restart
    the service, and the last line says so."""
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (TINY / name).is_file():
            (tmp_path / name).write_bytes((TINY / name).read_bytes())
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 4096)  # no header a reader can take
    code, _, err = await tokenwire("decode-server", "--model", str(tmp_path), *QUICK_START)
    last = err.strip().splitlines()[-1]
    assert code == 1 and "loading the model failed: " in last, err
    assert last.endswith("exiting so a supervisor can restart the service"), err


@pytest.mark.parametrize("argv", [["decode-server", "--model", str(TINY), "--port", "0"],
                                  ["generate", "--local", "--model", str(TINY), "hi"]])
def test_commands_that_run_the_model_say_how_to_get_jax_when_it_is_missing(argv):
    """The text-side install (tokenwire[text]) has no JAX: those commands say so in one line."""
    script = ("import sys; sys.modules['jax'] = None  # as if JAX were not installed\n"
              "from services.cli import main; sys.exit(main(sys.argv[1:]))")
    result = subprocess.run([sys.executable, "-c", script, *argv], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "tokenwire[cpu]" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_step_ms_is_refused_without_the_scripted_model(capsys):
    code, _, err = in_process(capsys, "decode-server", "--model", str(TINY), "--step-ms", "2", "--port", "0")
    assert code == 2 and "--step-ms" in err and "scripted:DIR" in err and "Traceback" not in err


def test_a_kv_cache_too_small_for_the_batch_is_refused_in_one_line(capsys):
    """A pool of 8 pages cannot keep a page free for each of 8 sequences and admit one: refused
    before anything loads, naming the flags and the least that works; 9 pages start loading."""
    code, _, err = in_process(capsys, "decode-server", "--model", "m", "--kv-cache-tokens", "128", "--max-batch-size", "8")
    last = err.strip().splitlines()[-1]
    assert code == 2 and "--kv-cache-tokens 128" in last and "--max-batch-size 8" in last and "144 tokens" in last, err
    code, _, err = in_process(capsys, "decode-server", "--model", "no-such-model", "--kv-cache-tokens", "144", "--max-batch-size", "8")
    assert code == 2 and "unknown model 'no-such-model'" in err and "kv-cache" not in err, err


def test_a_kv_cache_of_one_page_is_said_as_one_page(capsys):
    code, _, err = in_process(capsys, "decode-server", "--model", "m", "--kv-cache-tokens", "16", "--max-batch-size", "1")
    last = err.strip().splitlines()[-1]
    assert code == 2 and "--kv-cache-tokens 16 is 1 page of 16 tokens; --max-batch-size 1 needs at least 2 pages (32 tokens)" in last, err


@pytest.mark.parametrize("argv, reason", [
    (["--kv-cache-memory-fraction", "0.9", "--kv-cache-tokens", "4096"],
     "--kv-cache-tokens 4096 and --kv-cache-memory-fraction 0.9 both size the KV cache: give one of them"),
    (["--kv-cache-memory-fraction", "1.5"], "argument --kv-cache-memory-fraction: must be a fraction in (0, 1], got 1.5"),
    (["--kv-cache-memory-fraction", "0"], "argument --kv-cache-memory-fraction: must be a fraction in (0, 1], got 0.0"),
    (["--kv-cache-memory-fraction", "nan"], "argument --kv-cache-memory-fraction: expected a fraction in (0, 1], got 'nan'"),
    (["--model", "scripted:m", "--kv-cache-memory-fraction", "0.5"],
     "--model scripted:DIR has no device memory to take a fraction of: size its KV cache with --kv-cache-tokens"),
])
def test_a_kv_cache_memory_fraction_that_cannot_work_is_refused_before_loading(capsys, argv, reason):
    """Refused by the flags alone, before any model is looked for (the model named does not
    exist); a fraction that the device's memory refuses is refused at load (test_memory_plan)."""
    code, _, err = in_process(capsys, "decode-server", "--model", "no-such-model", *argv)
    last = err.strip().splitlines()[-1]
    assert code == 2 and reason in last and "no-such-model" not in last, err
