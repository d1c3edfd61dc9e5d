"""Structured outputs: the chat API's `response_format` as the text request's `constraint`.

  * `{"type": "text"}` (or no response_format): no constraint;
  * `{"type": "json_object"}`: any JSON object (decode.v1 Constraint.json_object);
  * `{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`: the
    schema as JSON text (Constraint.json_schema). The schema is enforced with or without
    `strict`: a constrained decoder has no cheaper "best effort" to offer. Either way the
    compiler (engine.constraints.schema) closes every object schema that lists `properties`
    and says nothing of `additionalProperties`, the rule OpenAI's strict mode holds to.
What is checked here is the shape of `response_format`; a 400 names the field that is wrong.
Whether the schema's keywords are supported is decided where it is compiled, by the text
service against its tokenizer, before anything reaches the decoder: its INVALID_ARGUMENT
("constraint.json_schema: unsupported keyword ...") comes back as a 400 whose param is
`response_format.json_schema.schema` (services.openai_api.errors).
"""

from __future__ import annotations

import json
import re
from typing import Any

from protos.decode.v1 import decode_pb2
from services.openai_api.errors import ApiError

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a json_schema's name
FORMAT_TYPES = ("text", "json_object", "json_schema")


def _invalid(param: str, why: str) -> ApiError:
    return ApiError(400, f"{param} {why}", param=param, code="invalid_value")


def constraint_of(response_format: Any) -> decode_pb2.Constraint | None:
    """The constraint `response_format` asks for (None: free text). Raises ApiError (400)."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise _invalid("response_format", "must be an object with a `type`")
    kind = response_format.get("type")
    if kind not in FORMAT_TYPES:
        raise _invalid("response_format.type", f"must be one of {', '.join(FORMAT_TYPES)} (got {json.dumps(kind)})")
    if kind == "text":
        return None
    if kind == "json_object":
        return decode_pb2.Constraint(json_object=True)
    return decode_pb2.Constraint(json_schema=json.dumps(_schema(response_format.get("json_schema")), separators=(",", ":")))


def _schema(spec: Any) -> dict:
    if not isinstance(spec, dict):
        raise _invalid("response_format.json_schema", "must be an object with `name` and `schema`")
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise _invalid("response_format.json_schema.name", "must be 1 to 64 letters, digits, '_' or '-'")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _invalid("response_format.json_schema.strict", "must be true, false or null")
    description = spec.get("description")
    if description is not None and not isinstance(description, str):
        raise _invalid("response_format.json_schema.description", "must be a string")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise _invalid("response_format.json_schema.schema", "must be a JSON Schema object")
    return schema

