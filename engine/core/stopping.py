"""The one decision: given a sampled id, emit it? finish? why?

Every path that produces a token (prefill, batched decode) calls `decide`; nothing
else decides. Precedence, written once:

1. A control token (the model's EOS ids unless `ignore_eos`, plus the request's
   `stop_token_ids`) is never emitted and never counted: finish with STOP.
   This wins even when the token would also have reached the length cap.
2. Otherwise the token is emitted. A constrained request's matcher consumes it; if the
   output is then whole (nothing but EOS may follow: `Matcher.complete`), finish with STOP
   and no stop token. This wins over the cap: a whole output is not cut.
3. Otherwise, if it brings the output to `max_output_tokens`, finish with LENGTH; the token
   that reaches the cap is real output (so an unfinished constrained output cut there is LENGTH).
4. Otherwise emit and continue.

Below `min_output_tokens` the model masks the control ids at sampling time, so a
control token cannot be sampled there; if one were, rule 1 still holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from engine.core.events import FinishReason
from engine.core.request import StoppingCriteria


@dataclass(frozen=True)
class StopRule:
    """A request's stopping criteria resolved against the model, once, at admission."""

    control_token_ids: frozenset[int]
    max_output_tokens: int  # >= 1; an unset cap becomes the room left in the context
    min_output_tokens: int = 0

    def masks_control_tokens(self, emitted: int) -> bool:
        """Whether control ids must be masked when sampling output token number `emitted`."""
        return emitted < self.min_output_tokens and bool(self.control_token_ids)


def resolve(
    stopping: StoppingCriteria, eos_token_ids: frozenset[int], prompt_len: int, max_context_length: int
) -> StopRule:
    """Turn a validated request's criteria into the rule `decide` applies."""
    control = frozenset(stopping.stop_token_ids) | (frozenset() if stopping.ignore_eos else eos_token_ids)
    room = max_context_length - prompt_len
    cap = room if stopping.max_output_tokens is None else min(stopping.max_output_tokens, room)
    if cap < 1:
        raise ValueError(f"prompt of {prompt_len} tokens leaves no room in a context of {max_context_length}")
    return StopRule(control, cap, min(stopping.min_output_tokens, cap))


@dataclass(frozen=True, slots=True)
class Decision:
    emit: bool
    finish: FinishReason | None = None
    stop_token_id: int | None = None


_EMIT = Decision(emit=True)  # the common decision, made once (it is immutable)
_EMIT_LAST = Decision(emit=True, finish=FinishReason.LENGTH)
_EMIT_WHOLE = Decision(emit=True, finish=FinishReason.STOP)


class Matcher(Protocol):
    """A constrained request's state (engine.constraints): what `decide` needs of it."""

    def advance(self, token_id: int) -> None: ...

    def complete(self) -> bool: ...


def decide(token_id: int, emitted: int, rule: StopRule, matcher: Matcher | None = None) -> Decision:
    """Decide for `token_id`, sampled when `emitted` tokens have been output so far; a
    constrained request's `matcher` consumes the token when it is emitted (rule 2)."""
    if token_id in rule.control_token_ids:
        return Decision(emit=False, finish=FinishReason.STOP, stop_token_id=token_id)
    if matcher is not None:
        matcher.advance(token_id)
        if matcher.complete():
            return _EMIT_WHOLE
    if emitted + 1 >= rule.max_output_tokens:
        return _EMIT_LAST
    return _EMIT
