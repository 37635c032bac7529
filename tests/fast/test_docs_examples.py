"""The docs' self-contained examples (a ```python block marked `<!-- runnable: example -->`, no model and no
server) print exactly the output block the page shows under them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = re.compile(r"<!-- runnable: example -->\n```python\n(?P<code>.*?)```\n\n```\n(?P<shown>.*?)```", re.S)


def examples() -> list[tuple[str, str, str]]:
    pages = [REPO / "README.md", *sorted(REPO.glob("docs/*.md"))]
    return [(f"{page.name}#{i}", m["code"], m["shown"]) for page in pages
            for i, m in enumerate(EXAMPLE.finditer(page.read_text()))]


def test_the_walkthrough_shows_a_sum_in_two_orders():
    code = next(code for name, code, _ in examples() if name.startswith("walkthrough"))
    assert "sum(" in code and len(code.splitlines()) <= 12


@pytest.mark.parametrize("name, code, shown", examples(), ids=[name for name, _, _ in examples()])
def test_an_example_prints_what_its_page_shows(name, code, shown):
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{name}:\n{done.stderr}"
    assert done.stdout == shown, f"{name} printed:\n{done.stdout}\nthe page shows:\n{shown}"
