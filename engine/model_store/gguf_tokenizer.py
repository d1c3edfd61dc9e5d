"""A SentencePiece-style GGUF vocabulary (`tokenizer.ggml.model` "llama") as a `tokenizers` BPE.

Data flow: `gguf_gemma.convert` -> `build_sentencepiece_tokenizer(reader)` -> tokenizer.json.

llama.cpp stores a SentencePiece BPE vocabulary as its pieces, their scores and their types, with
no merges and no tokenizer pipeline. What must hold for the result to tokenize as the model was
trained (checked against transformers' own GGUF conversion, tests/test_pull_gemma3.py):
- Spaces are pieces' "\u2581" (normalizer), and a byte missing from the vocabulary is its <0xNN>
  piece (byte fallback); decoding undoes both.
- The merges are not stored: each piece that two other pieces concatenate to gives one merge per
  such split. Gemma's scores do not follow its merge order, the pieces' order in the file does: a
  merge ranks by the id of the piece it makes, then by the longer left part first.
- A piece made only of spaces is stored with real spaces ("  "), while the normalized text holds
  "\u2581\u2581": it is respelled, or such runs would never merge.
- Control pieces (<bos>, <start_of_turn>, ...) are special added tokens; user-defined pieces
  ("\\n\\n", "<b>", ...) are plain added tokens, matched whole in the text, except the respelled
  space runs, which the normalizer and the merges already produce.
"""

from __future__ import annotations

import gguf
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

from engine.model_store.gguf_convert import GGUFConversionError, field_value, read_special_tokens

SPACE = "\u2581"  # SentencePiece's visible space
_TOKEN_TYPE_CONTROL = 3  # gguf.TokenType.CONTROL
_TOKEN_TYPE_USER_DEFINED = 4  # gguf.TokenType.USER_DEFINED


def respelled_pieces(tokens: list[str]) -> list[str]:
    """The pieces as the normalized text spells them: a run of spaces as a run of SPACE."""
    return [SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]


def merges_from_order(pieces: list[str]) -> list[tuple[str, str]]:
    """Every (left, right) whose concatenation is a piece, ranked by that piece's id, then the
    longer `left` first. Linear in the vocabulary's characters (~2 M lookups for Gemma's 262k)."""
    ids = {piece: i for i, piece in enumerate(pieces)}
    merges = []
    for piece in pieces:  # in id order: the rank
        merges.extend((piece[:k], piece[k:]) for k in range(len(piece) - 1, 0, -1) if piece[:k] in ids and piece[k:] in ids)
    return merges


def build_sentencepiece_tokenizer(reader: gguf.GGUFReader) -> Tokenizer:
    """The GGUF's SentencePiece BPE vocabulary as a byte-fallback `tokenizers` BPE, with a BOS
    prefix when the file asks for one (`tokenizer.ggml.add_bos_token`)."""
    kind = field_value(reader, "tokenizer.ggml.model")
    if kind != "llama":
        raise GGUFConversionError(f"tokenizer model {kind!r} is not a SentencePiece ('llama') vocabulary")
    tokens: list[str] = field_value(reader, "tokenizer.ggml.tokens")
    types: list[int] = field_value(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    pieces = respelled_pieces(tokens)
    vocab = {piece: i for i, piece in enumerate(pieces)}
    if len(vocab) != len(pieces):
        raise GGUFConversionError("GGUF vocabulary has duplicate pieces (after spelling spaces as \u2581)")
    specials = read_special_tokens(reader)
    unk = None if specials.unk_id is None else pieces[specials.unk_id]

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges_from_order(pieces), unk_token=unk, fuse_unk=True,
                               byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])

    control = [i for i, ty in enumerate(types) if ty == _TOKEN_TYPE_CONTROL]
    user = [i for i, ty in enumerate(types) if ty == _TOKEN_TYPE_USER_DEFINED and pieces[i] == tokens[i]]
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in control])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user])

    if specials.add_bos and specials.bos_id is not None:
        bos = tokens[specials.bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, specials.bos_id)]
        )
    return tok
