"""The engine's events as the decode contract's protobuf, and back: one reason table, both ways.

The decode service sends `event_to_pb` of each engine event; the text service turns what a remote
decoder sent back into engine events with `event_from_pb`, so the text use case
(tokenizer_svc.generation) sees the same events whether the engine is remote or in-process.
"""

from __future__ import annotations

from typing import Sequence

from engine.core.events import Event, Finished, FinishReason, Token, Usage
from protos.decode.v1 import decode_pb2

_REASONS = {FinishReason.STOP: decode_pb2.FINISH_REASON_STOP, FinishReason.LENGTH: decode_pb2.FINISH_REASON_LENGTH}
_REASONS_FROM_PB = {pb: reason for reason, pb in _REASONS.items()}


def event_to_pb(event: Event) -> decode_pb2.DecodeEvent:
    if isinstance(event, Token):
        top = [decode_pb2.TopLogprob(id=i, logprob=p) for i, p in event.top_logprobs]
        return decode_pb2.DecodeEvent(token=decode_pb2.Token(id=event.id, logprob=event.logprob, top_logprobs=top))
    return decode_pb2.DecodeEvent(
        finished=decode_pb2.Finished(
            reason=_REASONS[event.reason],
            usage=decode_pb2.Usage(
                prompt_tokens=event.usage.prompt_tokens, completion_tokens=event.usage.completion_tokens
            ),
            stop_token_id=event.stop_token_id,
        )
    )


def add_events_pb(events: Sequence[Event], into) -> None:
    """Append `event_to_pb` of each event to the repeated field `into` (a DecodeResponse's or a
    DecodeStream entry's `events`), building tokens in place: a fraction of the cost of making
    each message and copying it in (docs/benchmarks.md, 'Figures behind code comments'), which
    matters once per token on the serving path."""
    for event in events:
        if isinstance(event, Token):
            token = into.add().token
            token.id = event.id
            if event.logprob is not None:
                token.logprob = event.logprob
            for i, p in event.top_logprobs:
                token.top_logprobs.add(id=i, logprob=p)
        else:
            into.append(event_to_pb(event))


def event_from_pb(pb: decode_pb2.DecodeEvent) -> Event:
    """The inverse of `event_to_pb`: what a remote Decoder streamed, as the engine's own event.
    ValueError for an event the stream contract rules out (unset, or an UNSPECIFIED reason)."""
    kind = pb.WhichOneof("event")
    if kind == "token":
        token = pb.token
        return Token(
            token.id,
            token.logprob if token.HasField("logprob") else None,
            tuple((top.id, top.logprob) for top in token.top_logprobs),
        )
    if kind != "finished":
        raise ValueError("the decoder sent an event that is neither a token nor a finish")
    finished = pb.finished
    if finished.reason not in _REASONS_FROM_PB:
        raise ValueError(f"the decoder sent finish reason {finished.reason}, which is neither STOP nor LENGTH")
    return Finished(
        _REASONS_FROM_PB[finished.reason],
        Usage(finished.usage.prompt_tokens, finished.usage.completion_tokens),
        finished.stop_token_id if finished.HasField("stop_token_id") else None,
    )
