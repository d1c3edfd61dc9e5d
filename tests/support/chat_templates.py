"""Real models' chat templates on the tiny checkpoint's tokenizer: a copy of tests/assets/tiny-llama
without its weights, whose chat_template.jinja (which wins over tokenizer_config.json's) is one
of tests/assets/chat_templates. Qwen's and Llama's templates write their markup as text this
tokenizer has no special tokens for (but for ChatML's <|im_start|> and <|im_end|>), which is all a
template's tool section needs: the tests read what the template writes, not what a model makes of it."""

from __future__ import annotations

import shutil
from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "assets"
TINY = ASSETS / "tiny-llama"
TEMPLATES = ASSETS / "chat_templates"
QWEN25 = "Qwen-Qwen2.5-7B-Instruct.jinja"
LLAMA31 = "meta-llama-Llama-3.1-8B-Instruct.jinja"
LLAMA32 = "meta-llama-Llama-3.2-3B-Instruct.jinja"
SMOLLM2_CALLS = "smollm2-tool-calls.jinja"  # written for the tests (its README says why)


def tiny_with_template(template: str, into: Path) -> Path:
    """`into`, made a copy of tiny-llama's tokenizer and configs with the chat template `template`
    (a file name under tests/assets/chat_templates)."""
    into.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"):
        shutil.copyfile(TINY / name, into / name)
    shutil.copyfile(TEMPLATES / template, into / "chat_template.jinja")
    return into
