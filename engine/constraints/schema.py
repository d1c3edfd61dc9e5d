"""A JSON Schema made ready for llguidance: parsed, checked, and with objects closed.

Two defaults differ from plain JSON Schema, both because the output is sampled, not validated:

- An object schema that lists `properties` and says nothing of `additionalProperties` gets
  `additionalProperties: false`, as OpenAI's strict mode requires of every schema. Left open, the
  grammar would let a model wander into keys the caller never asked for. Output held to the closed
  schema still validates against the schema as written. `allOf` members (and the `$defs` an
  `allOf` member refers to) are left open, because closing each part of an intersection would
  forbid the other parts' keys.
- llguidance's own options (`x-guidance` at the top) are refused: the service fixes them
  (`JSON_OPTIONS`), so a caller cannot turn unbounded whitespace back on.
"""

from __future__ import annotations

import json
from typing import Any

from engine.constraints.spec import ConstraintError

FIELD = "constraint.json_schema"

# llguidance's JSON compiler options, the same for every schema (docs/constraints.md says why):
# compact JSON with no free whitespace, and a keyword it does not implement refused, not ignored.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":", "lenient": False}

# Keywords whose value is one subschema, a list of them, or a map of name -> subschema.
_ONE = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "contains",
        "propertyNames", "not", "if", "then", "else", "additionalItems")
_LIST = ("prefixItems", "anyOf", "oneOf")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def prepare(text: str) -> dict[str, Any]:
    """Parse `text` as a JSON Schema object and apply this module's defaults (a new dict)."""
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConstraintError(FIELD, f"not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None
    if not isinstance(schema, dict):
        raise ConstraintError(FIELD, f"the schema must be a JSON object, not {type(schema).__name__}")
    if "x-guidance" in schema:
        raise ConstraintError(FIELD, 'unsupported keyword "x-guidance" (the service sets the compiler\'s options)')
    open_defs = _defs_named_by_all_of(schema)
    return _closed(schema, close=True, open_defs=open_defs)


def lark_term(text: str) -> str:
    """The Lark term `%json {...}` for the JSON Schema `text`, held to the same defaults as a
    json_schema constraint (compact, objects closed), for a grammar that embeds JSON, such as a
    tool call's arguments between its format's tags. A bare `%json` term in a Lark grammar gets
    llguidance's own defaults instead, free whitespace among them.
    """
    return "%json " + json.dumps({**prepare(text), "x-guidance": JSON_OPTIONS}, separators=(",", ":"))


def _defs_named_by_all_of(schema: Any) -> set[str]:
    """The "#/$defs/X" (and "#/definitions/X") refs that appear as `allOf` members anywhere."""
    found: set[str] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for member in node.get("allOf", []) if isinstance(node.get("allOf"), list) else []:
                if isinstance(member, dict) and isinstance(member.get("$ref"), str):
                    found.add(member["$ref"])
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return found


def _closed(node: Any, *, close: bool, open_defs: set[str], path: str = "#") -> Any:
    """A copy of the subschema `node` with `additionalProperties: false` where it lists properties.

    `close` is False for an `allOf` member itself; its own subschemas are closed as usual.
    """
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _ONE:
            out[key] = _closed(value, close=True, open_defs=open_defs, path=f"{path}/{key}")
        elif key in _LIST and isinstance(value, list):
            out[key] = [_closed(v, close=True, open_defs=open_defs, path=f"{path}/{key}/{i}") for i, v in enumerate(value)]
        elif key == "allOf" and isinstance(value, list):
            out[key] = [_closed(v, close=False, open_defs=open_defs, path=f"{path}/{key}/{i}") for i, v in enumerate(value)]
        elif key in _MAP and isinstance(value, dict):
            out[key] = {
                name: _closed(sub, close=f"{path}/{key}/{name}" not in open_defs, open_defs=open_defs,
                              path=f"{path}/{key}/{name}")
                for name, sub in value.items()
            }
        else:
            out[key] = value
    if close and "properties" in out and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out
