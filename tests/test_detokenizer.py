"""IncrementalDetokenizer against `decode` on three real tokenizer families.

Reference (the module docstring of tokenizer_svc/detokenizer.py): with prompt P and output O split
into chunks any way, the deltas joined with finish() equal decode(P + O) minus the prompt's text,
`decode(P + O)[lcp(decode(P), decode(P + O)):]`, which is `decode(O)` when P is empty.
"""

from __future__ import annotations


import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from engine.core.errors import InvalidArgument
from support.examples import examples
from support.tokenizer_assets import ASSETS, load_tokenizer as load
from tokenizer_svc import TextTokenizer
from tokenizer_svc.detokenizer import CONTEXT_TOKENS, IncrementalDetokenizer, ends_inside_char

FAMILIES = ["gpt2", "sp-bpe", "qwen3"]


def _common_prefix_len(a: str, b: str) -> int:
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    return i


def reference(tok: TextTokenizer, prompt: list[int], output: list[int], keep: bool) -> str:
    whole = tok.decode(prompt + output, keep)
    return whole[_common_prefix_len(tok.decode(prompt, keep), whole) :]


def split(ids: list[int], cuts: list[int]) -> list[list[int]]:
    points = sorted({c % (len(ids) + 1) for c in cuts})
    bounds = [0, *points, len(ids)]
    return [ids[a:b] for a, b in zip(bounds, bounds[1:])]


def detokenizer(tok: TextTokenizer, prompt: list[int], keep: bool = False) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tok.vocabulary, prompt, keep_special_tokens=keep)


def token_id(name: str, token: str) -> int:
    """The id of an exact token string, read with the tokenizers library itself."""
    return Tokenizer.from_file(str(ASSETS / name / "tokenizer.json")).token_to_id(token)


def stream(tok: TextTokenizer, prompt: list[int], chunks: list[list[int]], keep: bool) -> list[str]:
    detok = detokenizer(tok, prompt, keep)
    return [detok.push(chunk) for chunk in chunks] + [detok.finish()]


# --- strategies -------------------------------------------------------------------------------

PIECES = [
    "a", "Hello", " world", "  ", "\n", "\t", "def f(x):", "café", "naïve", "ñ", "Ω", "—", "中", "文字", "𠜎",
    "日本語", "한국어", "ཀ", "😀", "👩\u200d💻", "🇫🇷", "e\u0301", "\u0301", "\u0308o", "▁", "<0x41>",
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "<s>", "</s>", "<unk>", "\ufffd", "12345",
]
texts = st.lists(st.sampled_from(PIECES), max_size=24).map("".join)
cuts = st.lists(st.integers(0, 10_000), max_size=12)


def interesting_ids(name: str) -> list[int]:
    """Ids that stress boundaries: single bytes (byte-level), <0xHH> (byte fallback), specials."""
    tok = load(name)
    return sorted(set(range(min(tok.vocab_size, 600))) | tok.special_token_ids)


def random_ids(name: str):
    tok = load(name)
    one = st.one_of(st.integers(0, tok.vocab_size - 1), st.sampled_from(interesting_ids(name)))
    return st.lists(one, max_size=40)


def ids_for(name: str):
    tok = load(name)
    from_text = texts.map(lambda t: tok.encode(t))
    return st.one_of(from_text, random_ids(name))


PROPERTY = settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- exactness --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILIES)
def test_chunks_join_to_decode_without_prompt(name):
    tok = load(name)

    @PROPERTY
    @given(ids=ids_for(name), cuts=cuts, keep=st.booleans())
    def check(ids, cuts, keep):
        assert "".join(stream(tok, [], split(ids, cuts), keep)) == tok.decode(ids, keep)

    check()


@pytest.mark.parametrize("name", FAMILIES)
def test_chunks_join_to_decode_after_prompt(name):
    tok = load(name)

    @PROPERTY
    @given(prompt=ids_for(name), ids=ids_for(name), cuts=cuts, keep=st.booleans())
    def check(prompt, ids, cuts, keep):
        assert "".join(stream(tok, prompt, split(ids, cuts), keep)) == reference(tok, prompt, ids, keep)

    check()


@pytest.mark.parametrize("name", FAMILIES)
def test_text_is_released_as_soon_as_no_token_can_change_it(name):
    """For ids of real text, after each push everything is out except an unfinished last
    character (byte-level) or a run of <0xHH> tokens that may go on (byte fallback)."""
    tok = load(name)
    byte_level = tok.vocabulary.decoder_traits.byte_level

    @PROPERTY
    @given(text=texts, cuts=cuts)
    def check(text, cuts):
        ids = tok.encode(text)
        final = tok.decode(ids)
        detok = detokenizer(tok, [])
        out, seen = "", []
        for chunk in split(ids, cuts):
            out += detok.push(chunk)
            seen += chunk
            so_far = tok.decode(seen)
            kept = [i for i in seen if i not in tok.special_token_ids]
            if byte_level:  # an unfinished character shows as one U+FFFD in decode(seen)
                assert out == (so_far if final.startswith(so_far) else so_far[:-1])
            elif final.startswith(so_far) and not (kept and tok.vocabulary.is_byte_token(kept[-1])):
                assert out == so_far
            assert final.startswith(out)
        assert out + detok.finish() == final

    check()


# --- examples that can be worked out by hand ---------------------------------------------------


def test_sentencepiece_first_delta_gets_its_leading_space_from_the_prompt():
    tok = load("sp-bpe")
    prompt = tok.encode("Say hi:", add_special_tokens=True)
    output = tok.encode("Say hi: Hello world")[len(tok.encode("Say hi:")) :]
    assert tok.decode(output).startswith("Hello")  # alone, the first space is stripped
    deltas = stream(tok, prompt, [[i] for i in output], keep=False)
    assert [d for d in deltas if d][0].startswith(" ")
    assert "".join(deltas) == " Hello world"


def test_byte_fallback_run_is_held_until_a_non_byte_token_and_an_invalid_run_is_all_fffd():
    tok = load("sp-bpe")
    e4, b8, ad, ff = (token_id("sp-bpe", f"<0x{b}>") for b in ("E4", "B8", "AD", "FF"))
    assert tok.decode([e4, b8, ad]) == "中" and all(tok.vocabulary.is_byte_token(i) for i in (e4, b8, ad, ff))
    word = token_id("sp-bpe", "▁x")  # " x" after other text
    detok = detokenizer(tok, tok.encode("Say"))
    assert [detok.push([i]) for i in (e4, b8, ad)] == ["", "", ""]
    assert detok.push([word]) == "中 x"
    detok = detokenizer(tok, tok.encode("Say"))
    assert [detok.push([i]) for i in (e4, b8, ad, ff)] == ["", "", "", ""]
    assert detok.push([word]) == "\ufffd" * 4 + " x"


def test_byte_level_holds_a_split_character_and_finish_flushes_it_as_decode_does():
    tok = load("gpt2")
    ids = tok.encode("𠜎")  # four single-byte tokens in GPT-2
    assert len(ids) == 4 and tok.decode(ids[:1]) == "\ufffd"
    detok = detokenizer(tok, [])
    assert [detok.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1:]) == "𠜎"
    detok = detokenizer(tok, [])
    assert detok.push(ids[:1]) == "" and detok.finish() == "\ufffd" == tok.decode(ids[:1])


def test_characters_that_every_token_boundary_cuts_still_stream_with_window_state():
    """GPT-2 has a token b"\\xb6\\xe6" (end of one 朶 = E6 9C B6, start of the next): streaming
    "朶朶朶..." as E6 | 9C | B6E6 | 9C | B6E6 ... never reaches a token end outside a character,
    yet each 朶 comes out as soon as it is complete and the state stays window-sized."""
    tok = load("gpt2")
    single = {tok.vocabulary.token_bytes(i): i for i in range(256)}
    joint = 35050
    assert tok.vocabulary.token_bytes(joint) == b"\xb6\xe6"
    ids = [single[b"\xe6"]] + [single[b"\x9c"], joint] * 199 + [single[b"\x9c"], single[b"\xb6"]]
    assert tok.decode(ids) == "朶" * 200
    detok = detokenizer(tok, [])
    out = []
    for i in ids:
        out.append(detok.push([i]))
        assert detok.held_token_count <= CONTEXT_TOKENS
    assert out[2:-1:2] == ["朶"] * 199 and out[-1] == "朶" and detok.finish() == ""


def test_special_tokens_are_skipped_by_default_and_shown_when_kept():
    tok = load("qwen3")
    prompt = tok.encode("<|im_start|>assistant\n")
    output = tok.encode("Hi 😀<|im_end|>")
    assert "".join(stream(tok, prompt, [[i] for i in output], keep=False)) == "Hi 😀"
    assert "".join(stream(tok, prompt, [[i] for i in output], keep=True)) == "Hi 😀<|im_end|>"


def test_prompt_ending_inside_a_character_gives_the_completed_character_to_the_output():
    tok = load("gpt2")
    ids = tok.encode("ab中")
    prompt, output = ids[:-1], ids[-1:]  # the prompt ends with part of 中
    assert "".join(stream(tok, prompt, [output], keep=False)) == "中" == reference(tok, prompt, output, False)


def test_state_stays_window_sized_over_a_long_stream():
    tok = load("qwen3")
    ids = tok.encode("Grüße, 世界! 😀 " * 400)
    detok = detokenizer(tok, tok.encode("prompt " * 100))
    peak, out = 0, []
    for i in ids:
        out.append(detok.push([i]))
        peak = max(peak, detok.held_token_count)
    out.append(detok.finish())
    assert "".join(out) == tok.decode(ids)
    assert peak <= CONTEXT_TOKENS + 3 and detok.held_token_count == 0


def test_bad_ids_and_push_after_finish_are_refused():
    tok = load("gpt2")
    detok = detokenizer(tok, [])
    with pytest.raises(InvalidArgument, match=rf"^token_ids\[1\]: {tok.vocab_size} is not in the vocabulary"):
        detok.push([1, tok.vocab_size])
    with pytest.raises(InvalidArgument, match=r"^token_ids\[0\]: -1 "):
        detok.push([-1])
    with pytest.raises(InvalidArgument, match=r"^prompt_token_ids\[2\]: "):
        detokenizer(tok, [1, 2, tok.vocab_size])
    detok.finish()
    assert detok.finish() == ""
    with pytest.raises(RuntimeError):
        detok.push([1])


@pytest.mark.parametrize(
    "tail, inside",
    [
        (b"", False), (b"a", False), (b"\xe4", True), (b"\xe4\xb8", True), (b"\xe4\xb8\xad", False),
        (b"\xf0\x9f\x98", True), (b"\xc0", False), (b"\xff", False), (b"\x80", False), (b"\xed\xa0", False),
        (b"\xed\x9f", True), (b"\xe0\x80", False), (b"\xf4\x90", False), (b"\xf4\x8f", True), (b"\xe4a", False),
        (b"a\xc3", True),
    ],
)
def test_ends_inside_char_by_hand(tail, inside):
    assert ends_inside_char(tail) is inside


@settings(max_examples=examples(300), deadline=None)
@given(head=st.binary(max_size=5), rest=st.binary(max_size=5))
def test_a_boundary_splits_the_tokenizers_own_lossy_utf8(head, rest):
    """The boundary rule, checked against the Rust ByteLevel decoder: after bytes that do not end
    inside a character, the text of what follows does not depend on them; otherwise some
    continuation (the smallest valid one) changes it."""
    tok = load("gpt2")
    byte_id = {tok.vocabulary.token_bytes(i): i for i in range(256)}  # GPT-2 ids 0..255 are the 256 single bytes
    ids = lambda data: [byte_id[bytes([b])] for b in data]  # noqa: E731
    if not ends_inside_char(head[-3:]):
        assert tok.decode(ids(head + rest)) == tok.decode(ids(head)) + tok.decode(ids(rest))
    else:
        lead = next(b for b in reversed(head) if b >= 0xC0)
        completion = b"\x80" * 3 if lead not in (0xE0, 0xF0) else b"\xa0\x80\x80" if lead == 0xE0 else b"\x90\x80\x80"
        whole = tok.decode(ids(head + completion))
        assert whole != tok.decode(ids(head)) + tok.decode(ids(completion))
