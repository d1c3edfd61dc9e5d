"""What issue 47 asked of the JAX backend's code, kept from coming back: JaxModel's file stays
under 400 lines and no function in engine/jax_backend/ over 80 (past that, one person no longer
holds it in mind: split it by concern, docs/architecture.md), and the backend's defaults are asked
of `jax.default_backend()` in one place, the backend profile, not wherever code needs them."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BACKEND = ROOT / "engine" / "jax_backend"
PACKAGES = ("engine", "services", "tokenizer_svc")  # (benchmarks report which backend ran)


def _long_functions(limit: int) -> list[str]:
    found = []
    for path in sorted(BACKEND.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_jax_model_is_under_400_lines_and_no_backend_function_over_80():
    assert len((BACKEND / "jax_model.py").read_text().splitlines()) < 400
    assert _long_functions(80) == []
    assert _long_functions(40), "the walk finds functions at all"  # (a check that could not fail otherwise)


def test_only_the_backend_profile_asks_jax_for_the_default_backend():
    asking = [
        str(path.relative_to(ROOT))
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if re.search(r"jax\.default_backend\(\)", path.read_text())
    ]
    assert asking == ["engine/jax_backend/backend_profile.py"], asking
