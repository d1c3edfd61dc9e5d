"""One generation's output text: token ids in, final text out, cut at the first stop string.

Per request, the generation use case (tokenizer_svc/generation.py) feeds each batch of received
ids to `TextStream.push` and, when the decoder finishes, calls `finish`. Ids go through the
incremental detokenizer and then the stop-string matcher one at a time, so when a stop string
matches, `consumed` says exactly how many ids were used: usage counts the ids up to and including
the one that completed the match.

State is the detokenizer's window plus the matcher's held text: bounded, and dropped with the
object when the request ends (finish, error or cancel).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tokenizer_svc.detokenizer import IncrementalDetokenizer
from tokenizer_svc.stop_strings import StopStringMatcher


@dataclass(frozen=True)
class TextChunk:
    text: str  # text that is final now
    consumed: int  # how many of the pushed ids were used (fewer than pushed only after a stop string)
    stop_string: str | None = None  # set when a stop string matched: the stream ends here
    # with `per_token`: the detokenizer's text for each consumed id (before any stop-string
    # holding), so joined they are the output text; from `finish`, the detokenizer's flushed tail
    token_texts: tuple[str, ...] = ()


class TextStream:
    def __init__(self, detokenizer: IncrementalDetokenizer, matcher: StopStringMatcher | None = None) -> None:
        self.detokenizer = detokenizer
        self.matcher = matcher

    def _through_matcher(self, text: str) -> tuple[str, str | None]:
        if self.matcher is None:
            return text, None
        result = self.matcher.push(text)
        return result.text, result.stop_string

    def push(self, token_ids: Sequence[int], per_token: bool = False) -> TextChunk:
        """`per_token`: also say which text each id added (TextChunk.token_texts)."""
        if self.matcher is None and not per_token:  # the whole batch in one detokenizer push
            return TextChunk(self.detokenizer.push(token_ids), len(token_ids))
        text, pieces = "", []
        for n, token_id in enumerate(token_ids, start=1):
            pieces.append(self.detokenizer.push([token_id]))
            piece, stop = self._through_matcher(pieces[-1])
            text += piece
            if stop is not None:
                return TextChunk(text, n, stop, tuple(pieces) if per_token else ())
        return TextChunk(text, len(token_ids), None, tuple(pieces) if per_token else ())

    def finish(self) -> TextChunk:
        """The decoder finished: flush the detokenizer's tail, then what the matcher held back."""
        tail = self.detokenizer.finish()
        text, stop = self._through_matcher(tail)
        if stop is None and self.matcher is not None:
            text += self.matcher.finish()
        return TextChunk(text, 0, stop, (tail,))
