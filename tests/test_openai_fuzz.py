"""Schemathesis against the running front's own OpenAPI document: generated requests for every
operation (valid ones and, by schemathesis's negative mode, invalid ones) never get a 5xx, and
every error body has the OpenAI shape. Bounded: a few examples per operation, no example
database, so a run takes seconds."""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, given, settings

from support.examples import examples
from tests.support.openai_stack import MODEL_NAME, Stack

EXAMPLES = examples(12)  # per operation and mode: 12 under the thorough profile, 3 under "ci" (conftest)


def test_the_schema_fuzzer_finds_no_5xx():
    with Stack() as stack:
        schema = schemathesis.openapi.from_url(stack.root + "/openapi.json")
        operations = [result.ok() for result in schema.get_all_operations()]
        assert {op.path for op in operations} >= {"/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}
        seen: dict[int, int] = {}
        for operation in operations:
            modes = [schemathesis.GenerationMode.POSITIVE]
            if operation.method.upper() == "POST":  # a body to break (nothing to negate in a bare GET)
                modes.append(schemathesis.GenerationMode.NEGATIVE)
            for mode in modes:

                @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
                @given(case=operation.as_strategy(generation_mode=mode))
                def check(case) -> None:
                    if mode == schemathesis.GenerationMode.POSITIVE and isinstance(case.body, dict) and "model" in case.body:
                        case.body["model"] = MODEL_NAME  # valid bodies name the served model, to get past the 404
                    response = case.call(base_url=stack.root, timeout=30)
                    seen[response.status_code] = seen.get(response.status_code, 0) + 1
                    assert response.status_code < 500, (case.method, case.path, case.body, response.text)
                    if response.status_code >= 400:
                        assert set(response.json()["error"]) == {"message", "type", "param", "code"}, response.text

                check()
        assert 200 in seen and 400 in seen, seen  # it reached both the happy path and the refusals
