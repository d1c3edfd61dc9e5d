"""The text service and chat templates' tools, over gRPC (a real text server in front of a real
decode server running the scripted model, as in tests/test_text_service.py): DescribeChat
reports the tool format the template writes and whether it shows tools, and Chat.tools are
shown through the template, refused where it does not show them.

The templates are real ones on tiny-llama's tokenizer (tests/support/chat_templates.py).
"""

from __future__ import annotations

import contextlib
import json

import grpc
import pytest

from engine.core.engine import EngineConfig
from engine.core.scripted_model import ScriptedModel
from protos.text.v1 import text_pb2 as pb
from protos.text.v1 import text_pb2_grpc
from services.decode_server import start_decode_server
from services.text_server import start_text_server
from support.chat_templates import LLAMA31, QWEN25, SMOLLM2_CALLS, TINY, tiny_with_template
from tokenizer_svc.chat import ChatMessage
from tokenizer_svc.tokenizer import TextTokenizer

PARAMETERS = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
ADD = pb.ChatTool(name="add", description="Add one.", parameters=json.dumps(PARAMETERS))


@contextlib.asynccontextmanager
async def tokenizer_stub(model_dir, max_input_chars: int = 10_000):
    """A Tokenizer stub of a text service on `model_dir`'s tokenizer files."""
    model = ScriptedModel(vocab_size=512, eos_token_ids=frozenset({0, 2}), max_batch_size=2, max_context_length=2048)
    decode = await start_decode_server(model, EngineConfig(max_queue_size=4))
    text = await start_text_server(TextTokenizer.from_dir(model_dir), f"127.0.0.1:{decode.port}", max_input_chars=max_input_chars)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{text.port}") as channel:
            yield text_pb2_grpc.TokenizerStub(channel)
    finally:
        await text.stop(None)
        await decode.stop(None)


@pytest.mark.parametrize(
    "template, tool_format, renders_tools",
    [
        (None, pb.TOOL_FORMAT_UNSPECIFIED, False),  # tiny-llama's own ChatML template
        (QWEN25, pb.TOOL_FORMAT_QWEN, True),
        (LLAMA31, pb.TOOL_FORMAT_LLAMA3, True),
        (SMOLLM2_CALLS, pb.TOOL_FORMAT_SMOLLM2, False),
    ],
)
async def test_describe_chat_reports_what_the_template_writes(tmp_path, template, tool_format, renders_tools):
    model_dir = TINY if template is None else tiny_with_template(template, tmp_path)
    async with tokenizer_stub(model_dir) as stub:
        described = await stub.DescribeChat(pb.DescribeChatRequest())
    assert described == pb.ChatDescription(has_template=True, tool_format=tool_format, renders_tools=renders_tools)


def _chat(*tools: pb.ChatTool) -> pb.Chat:
    chat = pb.Chat(tools=tools)
    chat.messages.add(role="user", content="add one to 1")
    return chat


async def test_chat_tools_are_shown_by_the_template(tmp_path):
    model_dir = tiny_with_template(QWEN25, tmp_path)
    tokenizer = TextTokenizer.from_dir(model_dir)
    async with tokenizer_stub(model_dir) as stub:
        ids = list((await stub.Tokenize(pb.TokenizeRequest(chat=_chat(ADD)))).token_ids)
        without = list((await stub.Tokenize(pb.TokenizeRequest(chat=_chat()))).token_ids)
        bare = list((await stub.Tokenize(pb.TokenizeRequest(chat=_chat(pb.ChatTool(name="ping"))))).token_ids)
        deepest = '{"a":' * 127 + "{}" + "}" * 127  # 128 levels: the most allowed
        assert (await stub.Tokenize(pb.TokenizeRequest(chat=_chat(pb.ChatTool(name="deep", parameters=deepest))))).token_ids
    tool = {"type": "function", "function": {"name": "add", "description": "Add one.", "parameters": PARAMETERS}}
    assert ids == tokenizer.encode_chat([ChatMessage("user", "add one to 1")], tools=[tool])
    assert f"<tools>\n{json.dumps(tool)}\n</tools>" in tokenizer.decode(ids, keep_special_tokens=True)
    assert without == tokenizer.encode_chat([ChatMessage("user", "add one to 1")])
    no_arguments = {"type": "function", "function": {"name": "ping", "description": "", "parameters": {"type": "object", "properties": {}}}}
    assert json.dumps(no_arguments) in tokenizer.decode(bare, keep_special_tokens=True)  # empty parameters: none


@pytest.mark.parametrize(
    "tool, field",
    [
        (pb.ChatTool(name="", parameters="{}"), "chat.tools[0].name"),
        (pb.ChatTool(name="f", parameters="{"), "chat.tools[0].parameters"),
        (pb.ChatTool(name="f", parameters="[1]"), "chat.tools[0].parameters"),
        (pb.ChatTool(name="f", parameters='{"a":' * 128 + "{}" + "}" * 128), "chat.tools[0].parameters"),  # 129 levels
        (pb.ChatTool(name="f", description="x" * 2000), "chat.messages"),  # tools count toward max_input_chars
    ],
)
async def test_bad_chat_tools_are_invalid_argument_naming_the_field(tmp_path, tool, field):
    async with tokenizer_stub(tiny_with_template(QWEN25, tmp_path), max_input_chars=1500) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Tokenize(pb.TokenizeRequest(chat=_chat(tool)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"{field}:"), err.value.details()


async def test_tools_for_a_template_that_does_not_show_them_are_refused():
    """Rather than dropped from the prompt unseen: the caller writes them into a message."""
    async with tokenizer_stub(TINY) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Tokenize(pb.TokenizeRequest(chat=_chat(ADD)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("chat.tools:"), err.value.details()
