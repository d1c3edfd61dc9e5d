"""Constrained decoding: output held to a JSON Schema, a regex or a Lark grammar, token by token.

Pure Python over llguidance; no JAX and no gRPC, so both the text service (which checks a
constraint before anything reaches a decoder) and the decode service (which enforces it) use it.
The engine core sees only a compiled `Grammar` (on its Request) and the `Matcher` it hands out.

    vocab = Vocabulary.from_tokenizer_json(path, vocab_size, eos_token_ids)   # once per tokenizer
    grammar = vocab.compile(Constraint("json_schema", schema_text))          # per request, cached
    m = grammar.matcher()
    banned = m.banned()        # [V] bool, the sampler's mask
    m.advance(sampled_id)      # after each emitted token
    m.complete()               # True: finish with STOP now

`lark_term(schema_text)` gives the `%json {...}` term for a Lark grammar that embeds a JSON Schema
(a tool call's arguments), held to the same defaults as a json_schema constraint.
"""

from engine.constraints.matcher import Grammar, Matcher
from engine.constraints.schema import lark_term
from engine.constraints.spec import KINDS, Constraint, ConstraintError
from engine.constraints.vocabulary import Vocabulary

__all__ = ["KINDS", "Constraint", "ConstraintError", "Grammar", "Matcher", "Vocabulary", "lark_term"]
