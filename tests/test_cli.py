"""The `tokenwire` command line, run as a real subprocess against real servers on loopback."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.scripted_model import ScriptedModel
from services.cli import build_parser
from services.decode_server import start_decode_server
from services.text_server import start_text_server
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


@pytest.mark.parametrize("flag, value", [("--max-tokens", "-3"), ("--top-k", "-1"), ("--seed", "-5"), ("--stop-token-id", "-2")])
def test_a_negative_count_is_refused_naming_the_flag(flag, value):
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "generate", flag, value, "hi"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 2 and f"argument {flag}: must be >= 0, got {value}" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_bad_list_in_the_environment_is_a_one_line_error():
    env = {**os.environ, "TOKENWIRE_STOP_TOKEN_ID": "3,-1"}
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "generate", "hi"], cwd=ROOT, capture_output=True, text=True, env=env
    )
    assert done.returncode == 2 and "TOKENWIRE_STOP_TOKEN_ID='3,-1': must be >= 0, got -1" in done.stderr
    assert "Traceback" not in done.stderr


async def test_chat_streams_replies_and_keeps_history(text_port):
    code, out, err = await tokenwire(
        "chat", "--server", f"127.0.0.1:{text_port}", "--max-tokens", "2", stdin=b"hi\nagain\n"
    )
    assert code == 0
    assert out.count("assistant> ") == 2


async def test_unreachable_server_is_a_clear_error():
    code, _, err = await tokenwire("generate", "--server", "127.0.0.1:1", "--timeout", "2", "hi")
    assert code == 1 and "UNAVAILABLE" in err


def test_every_command_has_help():
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    assert set(commands) >= {"decode-server", "text-server", "generate", "chat", "pull"}
    for name in commands:
        result = subprocess.run([sys.executable, "-m", "services.cli", name, "--help"], cwd=ROOT, capture_output=True, text=True)
        assert result.returncode == 0 and "usage: tokenwire " + name in result.stdout


def test_readme_documents_every_flag_and_its_variable():
    from services.config import env_name

    readme = (ROOT / "README.md").read_text()
    parser = build_parser()
    actions = list(parser._actions)
    for sub in parser._subparsers._group_actions[0].choices.values():
        actions += sub._actions
    flags = {o for a in actions for o in a.option_strings if o.startswith("--") and o != "--help"}
    missing = sorted(f for f in flags if f"`{env_name(f)}` (`{f}`)" not in readme)
    assert not missing, f"README's configuration table lacks {missing}"


async def test_start_up_errors_are_one_line_and_exit_2(tmp_path):
    code, _, err = await tokenwire("text-server", "--model", "no-such-model")
    assert code == 2 and "unknown model 'no-such-model'" in err and "Traceback" not in err
    code, _, err = await tokenwire(
        "text-server", "--model", str(TINY), "--decoder", "127.0.0.1:1", "--connect-timeout", "1", "--port", "0"
    )
    assert code == 2 and "no decode service at 127.0.0.1:1" in err and "Traceback" not in err
