"""What a caller asks the engine for: a prompt, how to sample, when to stop.

These are the engine's own types; `services/` converts protobuf into them after
validation, so everything here is already known to be in range.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.constraints.matcher import Grammar

# Alternatives one token may report (SamplingParams.top_logprobs); the OpenAI API's limit too.
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. temperature 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = no top-k cut
    top_p: float = 1.0  # 1 = no nucleus cut
    min_p: float = 0.0  # 0 = no min-p cut
    seed: int | None = None  # None = the engine draws one per request
    # not a cut: how many of the most likely ids each step reports (Sample.top_logprobs), up to
    # MAX_TOP_LOGPROBS; 0 = none
    top_logprobs: int = 0


@dataclass(frozen=True)
class StoppingCriteria:
    """When generation ends. Control tokens end it and are never output."""

    max_output_tokens: int | None = None  # None = up to the context limit
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    min_output_tokens: int = 0


@dataclass(frozen=True)
class Request:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stopping: StoppingCriteria = field(default_factory=StoppingCriteria)
    return_logprobs: bool = False
    # the output held to a language, token by token (compiled by engine.core.constrained); None: free
    constraint: Grammar | None = None
