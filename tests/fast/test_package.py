"""What the wheel ships and how the code hangs together: the `app` package is the server alone (no benchmark, no
docs generator, no peer build, no matplotlib, no reading of docs/), `benchmarks/` stays in the repository, and no
module imports, however lazily, a module that imports it back."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from setuptools import find_packages

REPO = Path(__file__).resolve().parents[2]


def modules(*roots: str) -> dict[str, Path]:
    """Every module under the given top-level packages, by dotted name (a package by its own name)."""
    found = {}
    for root in roots:
        for path in sorted((REPO / root).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The known modules that `name` imports anywhere in its file: at the top, in a function, under a condition."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from . import x, from ..core import y
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import app.models.loading as x` -> app.models.loading
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module: each is an import circle."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_a_module_that_imports_it_back():
    known = modules("app", "benchmarks")
    graph = {name: imports(name, path, set(known)) for name, path in known.items()}
    assert not circles(graph), f"import circles: {circles(graph)}"


def test_the_circle_check_finds_a_lazy_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_wheel_packages_the_server_and_leaves_the_benchmarks_in_the_repository():
    """The packages pyproject.toml's find config selects, as setuptools selects them when it builds the wheel."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    packaged = find_packages(str(REPO), include=config["packages"]["find"]["include"])
    assert "app" in packaged and "app.core" in packaged
    # a folder of modules without __init__.py imports from a checkout but is silently missing from the wheel
    folders = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "app").rglob("*.py")
               if "__pycache__" not in p.parts}
    assert folders <= set(packaged), f"no __init__.py, so not in the wheel: {sorted(folders - set(packaged))}"
    assert not [p for p in packaged if not p.startswith("app")], packaged
    assert not any("bench" in pattern for pattern in config["package-data"]["app"])


def test_the_package_draws_no_charts_reads_no_docs_builds_no_peer_and_names_no_issue():
    known = modules("app")
    for name, path in known.items():
        text = path.read_text()
        assert not {"benchmarks", "matplotlib"} & {t.partition(".")[0] for t in imports(name, path, {
            "benchmarks", "matplotlib"})}, f"{name} imports the benchmarks or matplotlib"
        assert not re.search(r"""["'/]docs["'/]""", text), f"{name} names the repository's docs/ folder"
        assert "llama.cpp" not in text or "cmake" not in text.lower(), f"{name} builds llama.cpp"
        assert not re.search(r"\bissues? #?\d", text, re.I), f"{name} names an issue number"


@pytest.mark.full  # a process of its own: 3-4 s on a Zen 3
def test_serve_and_generate_import_no_benchmark():
    """Parsing `serve`'s flags (as every start does) loads the server's modules only."""
    code = ("import sys\nfrom app.__main__ import main\n"
            "try:\n    main(['serve', '--port', 'not-a-port'])\nfinally:\n"
            "    print(sorted(m for m in sys.modules if m.startswith(('benchmarks', 'matplotlib'))))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr
    assert "port" in done.stderr  # the bad value was refused by Settings, naming the setting


@pytest.mark.full  # a process of its own: about 5 s
def test_a_server_without_cuda_never_maps_triton():
    """xgrammar installs triton for its GPU kernels and torch imports it whenever it is installed: 70 MiB of a CPU
    server's memory. `python -m app serve --device cpu` skips it before its imports, and structured outputs' mask
    (xgrammar's CPU kernel) still runs; tests/compile/test_compile_without_triton.py runs torch.compile so."""
    probe = (
        "from app.gpu_only_imports import skip_triton_without_cuda, triton_skipped\n"
        "assert skip_triton_without_cuda('cpu') and triton_skipped()\n"
        "import os, sys, app.server, torch, xgrammar\n"
        "assert sys.modules['triton'] is None  # never loaded, so libtriton.so is not mapped either\n"
        "assert not os.path.exists('/proc/self/maps') or 'libtriton' not in open('/proc/self/maps').read()\n"
        "logits = torch.zeros(1, 64)\n"
        "mask = xgrammar.allocate_token_bitmask(1, 64)\n"
        "mask[0] = 0\n"
        "mask[0, 0] = 0b1010\n"  # tokens 1 and 3 allowed, no other
        "xgrammar.apply_token_bitmask_inplace(logits, mask)\n"
        "assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [1, 3]\n"
        "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600,
                          cwd=REPO)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
