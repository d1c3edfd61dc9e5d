"""The whole stack for the HTTP front's tests, run for real on loopback ports in a background
thread with its own event loop: a decode server (the scripted model), a text server (the tiny
checkpoint's real tokenizer files) and the api-server's app on uvicorn. The tests talk to it from
the main thread with real HTTP clients (the official openai SDK, httpx), as any client would.

The scripted model's vocabulary (512) and EOS ids ({0, 2}) match tests/assets/tiny-llama, so
after a prompt ending in id t the output is t + 1, t + 2, ... up to 511, then EOS (STOP).
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import uvicorn

from engine.core.engine import EngineConfig
from engine.core.scripted_model import ScriptedModel
from services.decode_server import DecodeServer, start_decode_server
from services.openai_api.app import ApiOptions, create_app
from services.openai_api.metrics import ApiMetrics
from services.text_server import TextServer, start_text_server
from tokenizer_svc.tokenizer import TextTokenizer

TINY = Path(__file__).resolve().parents[1] / "assets" / "tiny-llama"
MODEL_NAME = "tiny-llama"


class Stack:
    """Start with `with Stack(...) as stack:`; `stack.url` is the API's base URL (…/v1)."""

    def __init__(
        self, *, step_delay_s: float = 0.0, max_batch_size: int = 4, max_queue_size: int = 8,
        max_in_flight: int | None = None, auth_token: str | None = None, request_timeout_s: float | None = 60.0,
        constrained: bool = False, tool_format: str | None = None, max_context_length: int = 1024,
        tokenizer_dir: Path = TINY,
    ) -> None:
        self.model = ScriptedModel(
            vocab_size=512, eos_token_ids=frozenset({0, 2}), max_batch_size=max_batch_size,
            max_context_length=max_context_length, step_delay_s=step_delay_s,
        )
        self.max_queue_size, self.max_in_flight = max_queue_size, max_in_flight
        self.auth_token, self.request_timeout_s = auth_token, request_timeout_s
        # constrained: the decode server compiles constraints against tiny-llama's tokenizer
        # (the scripted model then writes its scripted id where allowed, else the lowest allowed)
        self.constrained, self.tool_format = constrained, tool_format
        # the text service's tokenizer files: tiny-llama's, or a copy of them with another chat
        # template (tests/support/chat_templates.py)
        self.tokenizer_dir = tokenizer_dir
        self.metrics = ApiMetrics()
        self.loop = asyncio.new_event_loop()
        self.decode: DecodeServer | None = None
        self.text: TextServer | None = None
        self._server: uvicorn.Server | None = None
        self._serving: asyncio.Task | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, name="openai-stack", daemon=True)

    def run(self, coroutine, timeout: float = 30.0):
        """Run a coroutine on the stack's loop, from the test's thread."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def __enter__(self) -> "Stack":
        self._thread.start()
        try:
            self.run(self._start())
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.run(self._stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)

    async def _start(self) -> None:
        tokenizer_json = TINY / "tokenizer.json" if self.constrained else None
        self.decode = await start_decode_server(self.model, EngineConfig(max_queue_size=self.max_queue_size), tokenizer_json=tokenizer_json)
        tokenizer = TextTokenizer.from_dir(self.tokenizer_dir)
        self.text = await start_text_server(tokenizer, f"127.0.0.1:{self.decode.port}", max_in_flight=self.max_in_flight)
        options = ApiOptions(
            f"127.0.0.1:{self.text.port}", MODEL_NAME, auth_token=self.auth_token, request_timeout_s=self.request_timeout_s,
            tool_format=self.tool_format,
        )
        self.app = create_app(options, self.metrics)
        self._server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0, log_config=None, access_log=False))
        self._serving = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._serving.done():
                self._serving.result()  # raises what stopped it
            await asyncio.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            await asyncio.gather(self._serving, return_exceptions=True)
        if self.text is not None:
            await self.text.stop(None)
        if self.decode is not None:
            await self.decode.stop(None)
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in rest:  # what the servers leave waiting (e.g. a readiness event)
            task.cancel()
        await asyncio.gather(*rest, return_exceptions=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _leftovers(self) -> dict[str, int]:
        engine = self.decode.engine.stats()
        return {
            "api_in_flight": int(self.metrics.in_flight._value.get()),
            "text_admitted": self.text.admission.in_flight,
            "decode_slots": engine.slots_in_use,
            "decode_queue": engine.queue_depth,
            "model_slots": self.model.slots_held,
            "tasks": len([t for t in asyncio.all_tasks() if not t.done()]),
        }

    def leftovers(self) -> dict[str, int]:
        """What the stack holds for requests right now: nothing, once every request has ended."""
        return self.run(self._leftovers())

    def requests_seen(self, path: str) -> dict[str, int]:
        """The api-server's own count of responses on `path`, by HTTP status."""
        return {
            s.labels["status"]: int(s.value)
            for metric in self.metrics.requests.collect() for s in metric.samples
            if s.name.endswith("_total") and s.labels["path"] == path
        }


def sdk_client(stack: Stack):
    """The official SDK against the stack, validating every response strictly."""
    import openai

    return openai.OpenAI(base_url=stack.url, api_key="unused", _strict_response_validation=True, timeout=30)


def json_ask(text: str) -> list[dict]:
    """Chat messages asking, in the user turn, for an answer in JSON."""
    return [{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": text}]


def post_chat(stack: Stack, body: dict):
    """POST /chat/completions as a raw request (for what the SDK would refuse to send or read)."""
    import httpx2 as httpx

    return httpx.post(stack.url + "/chat/completions", json=body, timeout=30)
