"""Every relative link in README.md and docs/ leads somewhere: the file exists, and an anchor
(`file.md#section`, `#section`) names a heading of that file as GitHub spells it, or an
`<a id="...">` in it."""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*```")


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _prose(text: str) -> list[str]:
    """The lines outside fenced code blocks, where a link is a link."""
    lines, in_code = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            in_code = not in_code
        elif not in_code:
            lines.append(line)
    return lines


def anchor(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(page.read_text()):
        out.update(re.findall(r"<a (?:id|name)=\"([^\"]+)\"", line))  # an HTML anchor, as generated pages set
        m = re.match(r"^#{1,6} (.+)$", line)
        if m:
            base = anchor(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links() -> list[str]:
    broken = []
    for page in _pages():
        for line in _prose(page.read_text()):
            for target in LINK.findall(line):
                if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                    continue
                path, _, fragment = target.partition("#")
                dest = (page.parent / path).resolve() if path else page
                where = f"{page.relative_to(ROOT)}: ({target})"
                if not dest.exists():
                    broken.append(f"{where}: no {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
                elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
                    broken.append(f"{where}: no heading #{fragment} in {dest.relative_to(ROOT)}")
    return broken


def test_every_relative_link_in_the_readme_and_docs_resolves():
    assert broken_links() == []


def test_the_checker_sees_a_missing_file_and_a_missing_heading(tmp_path, monkeypatch):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# Title\n\n## Which JAX\n\n[a](docs/a.md#the-part) [b](#which-jax)\n"
                                        "```\n[not a link](nowhere.md)\n```\n")
    (tmp_path / "docs" / "a.md").write_text("# A\n\n## The part: `x.py`\n\n[up](../README.md#nothing) [gone](b.md)\n"
                                            '<a id="flag-x"></a>\n[x](#flag-x) [y](#flag-y)\n')
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert broken_links() == ["README.md: (docs/a.md#the-part): no heading #the-part in docs/a.md",
                              "docs/a.md: (../README.md#nothing): no heading #nothing in README.md",
                              "docs/a.md: (b.md): no docs/b.md",
                              "docs/a.md: (#flag-y): no heading #flag-y in docs/a.md"]
    assert anchor("The part: `x.py`") == "the-part-xpy" and anchor("Set-up (Python ≥ 3.11)") == "set-up-python--311"
