"""Whether and how a request can run, decided before the scheduler takes it: its stop rule
against the model, a refusal when the KV page pool could never hold it, its seed; and the pages
admission keeps free for running sequences (engine.core.engine's scheduler; the engine process
asks the same of a request in its parent, before it crosses the pipe)."""

from __future__ import annotations

import dataclasses
import random

from engine.core.errors import InvalidArgument
from engine.core.model import KvLayout, ModelInfo
from engine.core.request import Request
from engine.core.stopping import StopRule, resolve


def admit(request: Request, info: ModelInfo, kv: KvLayout) -> tuple[Request, StopRule]:
    """A request as the engine runs it: its stop rule resolved against the model (ValueError
    when the prompt leaves no room), refused with InvalidArgument when its prompt and output
    could never fit in the KV page pool (`kv`) even alone, and a seed drawn if it has none."""
    rule = resolve(request.stopping, info.eos_token_ids, len(request.prompt_token_ids), info.max_context_length)
    check_fits(len(request.prompt_token_ids), rule.max_output_tokens, request.stopping.max_output_tokens, kv)
    if request.sampling.seed is None:
        request = dataclasses.replace(request, sampling=dataclasses.replace(request.sampling, seed=random.getrandbits(63)))
    return request, rule


def check_fits(prompt_tokens: int, max_output: int, asked: int | None, kv: KvLayout) -> None:
    """Refuse a request the pool could never hold: alone in it (admitted with no reserve), its
    prompt and all its output must fit (`KvPages.could_ever_fit` with no reserve), or no
    preemption would ever make room and it would wait forever. The error names the field to
    change and the pool's size in tokens; `asked` is the request's own max_output_tokens (None:
    up to the context)."""
    tokens = (kv.num_pages - 1) * kv.page_size  # the pool, the null page not counted
    if prompt_tokens + max_output <= tokens:  # (whole pages: the pool is a whole number of them)
        return
    if prompt_tokens >= tokens:
        raise InvalidArgument(
            "prompt_token_ids", f"{prompt_tokens} tokens leave no room for output in the KV cache of {tokens} tokens"
        )
    wanted = "unset (up to the context)" if asked is None else str(asked)
    raise InvalidArgument(
        "stopping.max_output_tokens",
        f"{wanted}: prompt ({prompt_tokens} tokens) + {max_output} output tokens exceed the KV cache of {tokens} "
        f"tokens; at most {tokens - prompt_tokens} fit",
    )


def reserve_pages(kv: KvLayout, max_batch_size: int) -> int:
    """Pages admission leaves free for running sequences to grow into: one for each sequence
    that may decode, so that every running sequence can take its next page before anyone is
    preempted (at most all but one page of a pool too small for that)."""
    return min(max_batch_size, kv.num_pages - 2)
