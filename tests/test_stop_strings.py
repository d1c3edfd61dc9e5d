"""StopStringMatcher against a brute-force reference, for random texts split at random points."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support.examples import examples
from tokenizer_svc.stop_strings import StopResult, StopStringMatcher

ALPHABET = "ab c\n中😀é"
stop_lists = st.lists(
    st.one_of(st.text(ALPHABET, min_size=1, max_size=5), st.text("ab", min_size=20, max_size=60)),
    min_size=1,
    max_size=4,
)
texts = st.text(ALPHABET, max_size=80)
cuts = st.lists(st.integers(0, 200), max_size=20)


def reference(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Walk the text one character at a time; the first stop string to be completed wins, and of
    those completed at the same character the longest (earliest starting)."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            stop = max(done, key=len)
            return (text[:end] if include else text[: end - len(stop)]), stop
    return text, None


def minimal_held(text: str, stops: list[str]) -> str:
    """The longest suffix of `text` that is a proper prefix of a stop string, by brute force."""
    best = ""
    for stop in stops:
        for n in range(1, min(len(stop) - 1, len(text)) + 1):
            if stop.startswith(text[-n:]) and n > len(best):
                best = text[-n:]
    return best


def pieces(text: str, cut_points: list[int]) -> list[str]:
    bounds = [0, *sorted({c % (len(text) + 1) for c in cut_points}), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=examples(400), deadline=None)
@given(text=texts, stops=stop_lists, cut_points=cuts, include=st.booleans())
def test_joined_output_is_the_text_cut_at_the_first_stop_and_nothing_is_held_needlessly(text, stops, cut_points, include):
    matcher = StopStringMatcher(stops, include_stop_string=include)
    out, seen, stop = "", "", None
    for piece in pieces(text, cut_points):
        result = matcher.push(piece)
        out += result.text
        seen += piece
        if result.stop_string is not None:
            stop = result.stop_string
            break
        held = minimal_held(seen, stops)
        assert matcher.held_text == held and out == seen[: len(seen) - len(held)]
        assert len(matcher.held_text) < max(map(len, stops))
    out += matcher.finish()
    assert (out, stop) == reference(text, stops, include)


@settings(max_examples=examples(200), deadline=None)
@given(text=texts, stops=stop_lists, include=st.booleans())
def test_one_character_at_a_time_equals_one_chunk(text, stops, include):
    def run(chunks):
        matcher = StopStringMatcher(stops, include_stop_string=include)
        out = ""
        for chunk in chunks:
            result = matcher.push(chunk)
            out += result.text
            if result.stop_string is not None:
                return out, result.stop_string
        return out + matcher.finish(), None

    assert run(list(text)) == run([text])


def test_earliest_match_in_the_text_wins_not_the_first_listed():
    matcher = StopStringMatcher(["world", "hello"])
    assert matcher.push("say hello world") == StopResult("say ", "hello")


def test_a_stop_string_split_across_chunks_is_held_then_cut():
    matcher = StopStringMatcher(["<|end|>", "\n\n"], include_stop_string=False)
    assert matcher.push("Answer: 4<|") == StopResult("Answer: 4")
    assert matcher.held_text == "<|"
    assert matcher.push("en") == StopResult("")
    assert matcher.push("d|> trailing") == StopResult("", "<|end|>")
    with pytest.raises(RuntimeError):
        matcher.push("more")
    assert matcher.finish() == ""


def test_a_false_start_is_released_and_include_stop_string_keeps_it():
    matcher = StopStringMatcher(["STOP"], include_stop_string=True)
    assert matcher.push("ST") == StopResult("")
    assert matcher.push("ART ST") == StopResult("START ")
    assert matcher.push("OP!") == StopResult("STOP", "STOP")


def test_held_text_is_released_at_finish():
    matcher = StopStringMatcher(["</answer>"])
    assert matcher.push("42 </ans") == StopResult("42 ")
    assert matcher.finish() == "</ans"


def test_empty_stop_string_is_refused():
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""])
