"""Chat templates rendered like HF transformers, checked against a golden file it produced.

tests/assets/tokenizers/chat_golden.json names, in its header, the command and the versions
(transformers 5.24.0, torch 2.13.0) that wrote it; CI never needs transformers.

One deliberate difference (tests/test_chat_forgery.py has the rest): special-token text inside a
message is plain text here, a special id in transformers. The golden case that has some is checked
against that rule instead of the golden ids.
"""

from __future__ import annotations

import json
import re
import shutil
from datetime import datetime
from pathlib import Path

import pytest

from tokenizers import Tokenizer

from support.tokenizer_assets import ASSETS, load_tokenizer as load, qwen_dir
from tokenizer_svc import ChatMessage, ChatTemplate, ChatTemplateError, TextTokenizer

GOLDEN = json.loads((ASSETS / "chat_golden.json").read_text(encoding="utf-8"))


def test_golden_header_names_the_command_and_versions():
    header = GOLDEN["header"]
    assert "--chat-golden" in header["command"]
    assert header["versions"]["transformers"] == "5.24.0" and header["versions"]["torch"].startswith("2.13.0")


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda c: f"{c['tokenizer']}-{len(c['messages'])}msg")
def test_render_and_ids_equal_transformers_apply_chat_template(case):
    tok = load(case["tokenizer"])
    messages = [ChatMessage(**m) for m in case["messages"]]
    if "error" in case:
        with pytest.raises(ChatTemplateError, match=case["error"].replace(".", r"\.")):
            tok.render_chat(messages, case["add_generation_prompt"])
        return
    assert tok.render_chat(messages, case["add_generation_prompt"]) == case["text"]
    ids = tok.encode_chat(messages, case["add_generation_prompt"])
    specials = special_texts(tok)
    if not any(t in m.content for m in messages for t in specials):
        assert ids == case["ids"]
        return
    # transformers made special ids of the message's special-token text; we encode it as plain text
    assert ids != case["ids"]
    tokenizer_json = (qwen_dir() if case["tokenizer"] == "qwen3" else ASSETS / case["tokenizer"]) / "tokenizer.json"
    assert ids == template_specials_only(tokenizer_json, tok, case["text"], [m.content for m in messages])
    count = {i: case["ids"].count(i) for i in tok.special_token_ids if i in case["ids"]}
    assert {i: ids.count(i) for i in count} == {i: n - _count_in(tok, i, messages) for i, n in count.items()}


def special_texts(tok: TextTokenizer) -> list[str]:
    return [tok.decode([i], keep_special_tokens=True) for i in tok.special_token_ids]


def _count_in(tok: TextTokenizer, special_id: int, messages: list[ChatMessage]) -> int:
    text = tok.decode([special_id], keep_special_tokens=True)
    return sum(m.content.count(text) for m in messages)


def template_specials_only(tokenizer_json: Path, tok: TextTokenizer, text: str, contents: list[str]) -> list[int]:
    """An independent encoding of `text` in which only special-token text outside `contents` (found
    in order) is a special id: the library tokenizer with special-token matching off encodes the
    pieces between those tokens. Right for byte-level tokenizers (each piece is pre-tokenized on
    its own in a whole-text encode too), which the golden case that needs it uses.
    tests/test_chat_forgery.py uses it too."""
    plain = Tokenizer.from_file(str(tokenizer_json))
    plain.encode_special_tokens = True
    pattern = re.compile("|".join(map(re.escape, sorted(special_texts(tok), key=len, reverse=True))))
    spans, pos = [], 0
    for content in contents:
        start = text.index(content, pos)
        spans.append((start, start + len(content)))
        pos = start + len(content)
    template_specials = [
        m for m in pattern.finditer(text) if not any(a < m.end() and m.start() < b for a, b in spans)
    ]
    ids, pos = [], 0
    for m in template_specials:
        ids += plain.encode(text[pos : m.start()], add_special_tokens=False).ids + tok.encode(m.group())
        pos = m.end()
    return ids + plain.encode(text[pos:], add_special_tokens=False).ids


def test_qwen3_renders_chatml_with_a_generation_prompt():
    tok = load("qwen3")
    messages = [ChatMessage("system", "Be brief."), ChatMessage("user", "Hi 😀")]
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 😀<|im_end|>\n<|im_start|>assistant\n"
    assert tok.render_chat(messages) == expected
    assert tok.render_chat(messages, add_generation_prompt=False) == expected.removesuffix("<|im_start|>assistant\n")
    ids = tok.encode_chat(messages)
    assert ids[:1] == [151644] and ids[-3:] == [151644, tok.encode("assistant")[0], tok.encode("\n")[0]]


def test_missing_template_is_a_clear_error():
    tok = load("gpt2")
    assert tok.chat_template is None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.render_chat([ChatMessage("user", "hi")])
    with pytest.raises(ValueError):  # ChatTemplateError is a ValueError
        tok.encode_chat([ChatMessage("user", "hi")])


def test_raise_exception_carries_the_templates_message():
    tok = load("sp-bpe")
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        tok.render_chat([ChatMessage("assistant", "first")])


def test_sp_bpe_template_uses_bos_and_eos_tokens():
    tok = load("sp-bpe")
    text = tok.render_chat([ChatMessage("user", "a"), ChatMessage("assistant", "b"), ChatMessage("user", "c")])
    assert text == "<s>[INST] a [/INST] b</s><s>[INST] c [/INST]"
    assert tok.encode_chat([ChatMessage("user", "a")])[0] == 1  # <s> written by the template, not added twice


def _dir_with(tmp_path: Path, tokenizer_config: dict, jinja: str | None = None) -> Path:
    shutil.copy(ASSETS / "sp-bpe" / "tokenizer.json", tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if jinja is not None:
        (tmp_path / "chat_template.jinja").write_text(jinja)
    return tmp_path


def test_chat_template_jinja_wins_over_tokenizer_config(tmp_path: Path):
    tok = TextTokenizer.from_dir(_dir_with(tmp_path, {"chat_template": "config"}, jinja="jinja file"))
    assert tok.render_chat([ChatMessage("user", "x")]) == "jinja file"


def test_a_list_of_named_templates_uses_default(tmp_path: Path):
    templates = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "{{ messages[0].content }}"}]
    tok = TextTokenizer.from_dir(_dir_with(tmp_path, {"chat_template": templates}))
    assert tok.render_chat([ChatMessage("user", "x")]) == "x"


def test_a_template_that_does_not_compile_fails_at_load(tmp_path: Path):
    with pytest.raises(ChatTemplateError, match="does not compile"):
        TextTokenizer.from_dir(_dir_with(tmp_path, {"chat_template": "{% for %}"}))


def test_tojson_keeps_non_ascii_and_html_characters():
    template = ChatTemplate("{{ messages[0] | tojson }}")
    assert template.render([ChatMessage("user", "<b>中</b> & 'q'")]) == '{"role": "user", "content": "<b>中</b> & \'q\'"}'


def test_strftime_now_and_loop_controls():
    year = ChatTemplate("{{ strftime_now('%Y') }}").render([])
    assert year == str(datetime.now().year)
    source = "{% for m in messages %}{% if loop.index0 == 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}"
    assert ChatTemplate(source).render([ChatMessage("user", "a"), ChatMessage("user", "b")]) == "a"


def test_trim_and_lstrip_blocks_like_transformers():
    source = "{% for m in messages %}\n    {% if true %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}"
    assert ChatTemplate(source).render([ChatMessage("user", "a"), ChatMessage("user", "b")]) == "a\nb\n"


@pytest.mark.parametrize(
    "source", ["{{ messages.append(1) }}", "{% set ns = namespace(_x=1) %}", "{{ ''.__class__.__mro__[1].__subclasses__() }}"]
)
def test_the_sandbox_refuses_unsafe_templates(source):
    with pytest.raises(ChatTemplateError):
        ChatTemplate(source).render([ChatMessage("user", "x")])
