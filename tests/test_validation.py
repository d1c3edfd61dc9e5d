"""Each bad DecodeRequest field gets INVALID_ARGUMENT naming the field, through a real server."""

from __future__ import annotations

import grpc
import pytest

from protos.decode.v1 import decode_pb2 as pb


def req(prompt=(10,), sampling=None, stopping=None, request_id="") -> pb.DecodeRequest:
    return pb.DecodeRequest(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        sampling=pb.SamplingParams(**(sampling or {})),
        stopping=pb.StoppingCriteria(**(stopping or {})),
    )


CASES = [
    ("empty prompt", req(prompt=()), "prompt_token_ids"),
    ("id >= vocab", req(prompt=(10, 1000)), "prompt_token_ids[1]"),
    ("prompt fills the context", req(prompt=[5] * 64), "prompt_token_ids"),
    ("max_output_tokens = 0", req(stopping={"max_output_tokens": 0}), "stopping.max_output_tokens"),
    ("prompt + max > context", req(prompt=[5] * 60, stopping={"max_output_tokens": 5}), "stopping.max_output_tokens"),
    ("NaN temperature", req(sampling={"temperature": float("nan")}), "sampling.temperature"),
    ("negative temperature", req(sampling={"temperature": -0.5}), "sampling.temperature"),
    ("infinite temperature", req(sampling={"temperature": float("inf")}), "sampling.temperature"),
    ("top_p > 1", req(sampling={"top_p": 1.5}), "sampling.top_p"),
    ("top_p < 0", req(sampling={"top_p": -0.1}), "sampling.top_p"),
    ("top_p NaN", req(sampling={"top_p": float("nan")}), "sampling.top_p"),
    ("min_p > 1", req(sampling={"min_p": 2.0}), "sampling.min_p"),
    ("min > max", req(stopping={"max_output_tokens": 3, "min_output_tokens": 4}), "stopping.min_output_tokens"),
    ("min > room", req(prompt=[5] * 60, stopping={"min_output_tokens": 5}), "stopping.min_output_tokens"),
    ("stop id >= vocab", req(stopping={"stop_token_ids": [3, 5000]}), "stopping.stop_token_ids[1]"),
    ("request_id too long", req(request_id="x" * 200), "request_id"),
    ("request_id unprintable", req(request_id="a\nb"), "request_id"),
]


@pytest.mark.parametrize("name,bad,field", CASES, ids=[c[0] for c in CASES])
async def test_invalid_argument_names_the_field(decoder, decode_server, name, bad, field):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in decoder.Decode(bad):
            pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"{field}:"), err.value.details()
    assert "Traceback" not in err.value.details()
    assert decode_server.engine.stats().slots_in_use == 0


async def test_edge_values_are_accepted(decoder):
    ok = req(prompt=[5] * 60, sampling={"top_p": 1.0, "min_p": 0.0, "top_k": 10**6}, stopping={"max_output_tokens": 4})
    responses = [r async for r in decoder.Decode(ok)]
    assert responses[-1].events[-1].finished.usage.completion_tokens == 4


def test_a_missing_request_id_gets_a_fresh_one_and_a_given_one_is_kept():
    """Generated ids (128 random bits in hex) differ from request to request; a given id stays."""
    from services.validation import request_id_of

    made = {request_id_of("") for _ in range(1000)}
    assert len(made) == 1000 and all(len(i) == 32 and int(i, 16) >= 0 for i in made)
    assert request_id_of("mine-1") == "mine-1"
