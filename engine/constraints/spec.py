"""What a request asks its output to be, and the error for asking something we cannot hold to.

A `Constraint` is plain data (it crosses from the protos into the engine unchanged); compiling it
against a tokenizer's vocabulary is `Vocabulary.compile`'s job.
"""

from __future__ import annotations

from dataclasses import dataclass

# The constraint kinds, named as the proto's `Constraint.kind` oneof names them.
KINDS = ("json_schema", "regex", "lark", "json_object")


class ConstraintError(ValueError):
    """A constraint that cannot be compiled, or a token it does not allow.

    `field` is the request field to blame ("constraint.json_schema"), `reason` the one-line
    explanation without it, and str(e) is both: 'constraint.json_schema: unsupported keyword "not"'.
    A caller that names the field differently (an HTTP front's `response_format`) re-prefixes
    `reason` with its own field name.
    """

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


@dataclass(frozen=True)
class Constraint:
    """The language the output must belong to.

    `text` is the JSON Schema (as JSON text), the regular expression, or the Lark grammar; it is
    "" for json_object, which means any JSON object. Whether `text` compiles is checked by
    `Vocabulary.compile`, not here: an unknown `kind` is the only state refused on construction.
    """

    kind: str
    text: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConstraintError("constraint", f"unknown kind {self.kind!r}; expected one of {', '.join(KINDS)}")

    @property
    def field(self) -> str:
        """The request field this constraint came from, for errors: "constraint.regex"."""
        return f"constraint.{self.kind}"
