"""Stop strings: cut a stream of text deltas at the first stop string, across chunk boundaries.

Data flow: per generation stream, each delta from the IncrementalDetokenizer goes through
`StopStringMatcher.push` (in `TextStream`); the generation use case sends `result.text` and, when
`result.stop_string` is set, ends the stream with finish reason STOP (and cancels generation). At
the engine's Finished, the detokenizer's `finish()` text is pushed too, then
`StopStringMatcher.finish()` releases what was held back.

What holds (property-tested in tests/test_stop_strings.py):
  * Which match wins: the first stop string to be *completed* in the text; if several complete at
    the same character, the one that starts earliest (the longest). That is the match that can stop
    generation soonest, and it does not depend on how the text was split into chunks.
  * The text released in total is the text before that match (plus the stop string itself when
    `include_stop_string`), or all of it when nothing matched. Text after a match is dropped, and
    after a match nothing more is accepted.
  * Held back is exactly the longest suffix of the text so far that is a proper prefix of some stop
    string (it may still become a match); everything before it is released at once.
  * Bounded state: the held text is shorter than the longest stop string.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class StopResult:
    """What one push produced: `text` is safe to send now; `stop_string` is the stop string that
    matched (the stream ends), or None."""

    text: str
    stop_string: str | None = None


def _first_match(text: str, stop_strings: Sequence[str]) -> tuple[int, str] | None:
    """(start, stop string) of the match that ends first in `text`, ties to the earliest start."""
    best: tuple[int, int, str] | None = None  # (end, start, stop)
    for stop in stop_strings:
        start = text.find(stop)
        if start >= 0:
            key = (start + len(stop), start, stop)
            if best is None or key[:2] < best[:2]:
                best = key
    return None if best is None else (best[1], best[2])


def _held_suffix_len(text: str, stop_strings: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stop_strings:
        window = text[-(len(stop) - 1) :] if len(stop) > 1 else ""
        # The longest candidate starts at the first place in the window where stop's first char is.
        i = window.find(stop[0]) if window else -1
        while i >= 0:
            if stop.startswith(window[i:]):
                longest = max(longest, len(window) - i)
                break
            i = window.find(stop[0], i + 1)
    return longest


class StopStringMatcher:
    """Per-stream state; `held_text` is all it keeps."""

    def __init__(self, stop_strings: Sequence[str], include_stop_string: bool = False) -> None:
        if any(not s for s in stop_strings):
            raise ValueError("stop strings must be non-empty")
        self.stop_strings: tuple[str, ...] = tuple(dict.fromkeys(stop_strings))
        self.include_stop_string = include_stop_string
        self._held = ""
        self._stop: str | None = None

    @property
    def held_text(self) -> str:
        """Text received but not yet released, because a stop string may begin in it."""
        return self._held

    @property
    def stop_string(self) -> str | None:
        """The stop string that matched, once one has."""
        return self._stop

    def push(self, text: str) -> StopResult:
        """Take the next piece of text; raises RuntimeError after a match."""
        if self._stop is not None:
            raise RuntimeError(f"stop string {self._stop!r} already matched")
        pending = self._held + text
        match = _first_match(pending, self.stop_strings)
        if match is not None:
            start, stop = match
            self._held, self._stop = "", stop
            return StopResult(pending[: start + len(stop)] if self.include_stop_string else pending[:start], stop)
        keep = _held_suffix_len(pending, self.stop_strings)
        self._held = pending[len(pending) - keep :]
        return StopResult(pending[: len(pending) - keep])

    def finish(self) -> str:
        """End of stream without a (further) match: release what was held back."""
        held, self._held = self._held, ""
        return held
