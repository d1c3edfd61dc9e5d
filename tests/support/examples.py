"""How many examples a property test runs: its full count, scaled by the loaded Hypothesis profile.

A test states its full count, `@settings(max_examples=examples(750))`; the profile that conftest
loads (HYPOTHESIS_PROFILE) sets `max_examples`, FULL under "thorough" and fewer under "ci", and
each test runs that share of its own count. A per-test `@settings(max_examples=...)` with a
literal count would override any profile, which is why the count goes through here.
"""

from __future__ import annotations

from hypothesis import settings

FULL = 100  # the thorough profile's max_examples (Hypothesis's default): every test at its full count


def examples(full: int) -> int:
    """`full` scaled by the loaded profile (settings.default.max_examples / FULL), at least 1."""
    return max(1, round(full * settings.default.max_examples / FULL))
