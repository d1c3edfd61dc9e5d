"""A decode-server process backed by the scripted model, for tests that kill or signal it.

    python tests/support/scripted_decoder.py --port N [--host H] [--step-delay S] [--max-queue-size Q] [--fail-at-step K]
        [--max-connection-age S]

Runs the same server and shutdown code as `tokenwire decode-server` (start_decode_server,
serve_until_signal); only the model differs. Prints "READY <port>" once serving.
Its vocabulary and EOS ids match tests/assets/tiny-llama's tokenizer.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.core.engine import EngineConfig  # noqa: E402
from engine.core.scripted_model import ScriptedModel  # noqa: E402
from services.decode_server import start_decode_server  # noqa: E402
from services.server import ServerOptions  # noqa: E402


async def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--max-connection-age", type=float, default=0.0)
    parser.add_argument("--step-delay", type=float, default=0.0)
    parser.add_argument("--max-batch-size", type=int, default=4)
    parser.add_argument("--max-queue-size", type=int, default=16)
    parser.add_argument("--grace-period", type=float, default=10.0)
    parser.add_argument("--fail-at-step", type=int, default=None)
    a = parser.parse_args()
    model = ScriptedModel(
        vocab_size=512, eos_token_ids=frozenset({0, 2}), max_batch_size=a.max_batch_size,
        max_context_length=256, step_delay_s=a.step_delay, fail_at_step=a.fail_at_step,
    )
    server = await start_decode_server(model, EngineConfig(a.max_queue_size), ServerOptions(host=a.host, port=a.port, max_connection_age_s=a.max_connection_age))
    print(f"READY {server.port}", flush=True)
    return await server.serve_until_signal(a.grace_period)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    sys.exit(asyncio.run(main()))
