"""Every code excerpt the docs quote from app/ is the code as it is: an unmarked ```python block (one that is not
a command to run) must appear, line for line, in some file of the package."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "docs" / "walkthrough.md", REPO / "docs" / "architecture.md", REPO / "README.md"]
# A quoted excerpt: a python block not marked runnable (those are commands whose output the page shows).
EXCERPT = re.compile(r"(?<!-->\n)```python\n(?P<code>.*?)```", re.S)


def lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


def package_lines() -> list[list[str]]:
    return [lines(path.read_text()) for path in sorted((REPO / "app").rglob("*.py"))]


def excerpts() -> list[tuple[str, str]]:
    return [(f"{page.name}#{i}", m["code"]) for page in PAGES for i, m in enumerate(EXCERPT.finditer(page.read_text()))]


def test_the_walkthrough_quotes_code():
    assert len([name for name, _ in excerpts() if name.startswith("walkthrough")]) >= 2


@pytest.mark.parametrize("name, code", excerpts(), ids=[name for name, _ in excerpts()])
def test_a_quoted_excerpt_is_the_code_as_it_is(name, code):
    quoted = lines(code)
    found = any(source[i : i + len(quoted)] == quoted for source in package_lines()
                for i in range(len(source) - len(quoted) + 1))
    assert found, f"{name} quotes lines that no file in app/ holds in that order:\n{code}"
