"""What the engine streams back: zero or more `Token`, then exactly one `Finished`.

The finish state is one enum; there is no separate "finished" flag to disagree with it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class FinishReason(enum.Enum):
    STOP = 1  # a control token (EOS or a stop id) was sampled; it is not output
    LENGTH = 2  # max_output_tokens (or the context limit) was reached


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int  # always equals the number of Token events sent


@dataclass(frozen=True, slots=True)
class Token:
    id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (id, logprob), best first, when asked


@dataclass(frozen=True)
class Finished:
    reason: FinishReason
    usage: Usage
    stop_token_id: int | None = None  # set exactly when reason is STOP


Event = Token | Finished
