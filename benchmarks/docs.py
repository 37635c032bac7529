"""`python -m benchmarks docs-figures` (`make docs-figures`): the generated parts of the docs, rewritten in place, and
the charts, redrawn.

A generated part sits between `<!-- figures:begin KIND [FILE ...] -->` and `<!-- figures:end -->` in a page; the
text outside the markers is the authors'. KIND `settings` is the table of every field of `app.config.Settings`
(so docs/configuration.md cannot drift from the code), `index` lists every file of docs/results/, and the other kinds
are tables of the named result files (benchmarks/tables.py, by_class.py, models_table.py). A FILE may be a pattern
(`scaling-zen4*.json`): the table takes whatever files match, and says so plainly when none does, so a run that lands
in docs/results/ fills its table at the next `make docs-figures`. `--check` writes nothing and exits 1 naming each
page that differs, which is what tests/fast/test_docs.py runs. Without `--check` the PNG charts are drawn too
(matplotlib, from the `docs` extra).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import typing
from pathlib import Path

from app.config import Settings
from app.flags import flag
from benchmarks import by_class, charts, models_table, tables

DOCS = Path(__file__).resolve().parents[1] / "docs"
MARKED = re.compile(r"(<!-- figures:begin (?P<args>[^>]*?) -->\n)(?P<body>.*?)(<!-- figures:end -->)", re.S)
FILE_TABLES = {"cited": None, "compare": tables.compare_table, "quality": tables.quality_table,
               "shortcuts": tables.shortcuts_table, "floor": tables.floor_table, "perplexity": tables.perplexity_table,
               "long-context": tables.long_context_table,
               "grammar-decode": tables.grammar_decode_table, "routing": tables.routing_table, **models_table.TABLES}


def settings_table() -> str:
    """Every Settings field: its env var, its flag (as app/flags.py makes it), what it takes, its default and its
    description."""
    rows = ["| Variable | Flag | Takes | Default | Description |", "| --- | --- | --- | --- | --- |"]
    for name, field in Settings.model_fields.items():
        description = field.description or "see [what each setting does](#what-each-setting-does)"
        description = description.replace("|", "\\|")
        rows.append(f"| `{name.upper()}` | `{flag(name)}` | {takes(field.annotation)} | "
                    f"{default(field)} | {description} |")
    return "\n".join(rows)


def takes(annotation: object) -> str:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if args and typing.get_origin(annotation) is not list:  # Optional[X] / X | None / Annotated[X, ...]
        return takes(args[0])
    if typing.get_origin(annotation) is list:
        return "comma-separated list"
    return {str: "text", int: "integer", float: "number", Path: "path"}.get(annotation, str(annotation))


def default(field) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        return "empty" if value in ([], {}, "") else f"`{value}`"
    value = field.default
    if value is None:
        return "unset"
    if isinstance(value, Path):  # the home directory of whoever runs the generator is nobody's default
        return f"`{str(value).replace(str(Path.home()), '~', 1)}`"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and value >= 2**20 and value % 2**20 == 0:
        return f"`{value}` ({value // 2**20} MiB)"
    return f"`{value}`"


def matching(results: Path, pattern: str) -> list[str]:
    return sorted(p.name for p in results.glob(pattern)) if any(c in pattern for c in "*?[") else [pattern]


def index_table(results: Path) -> str:
    """Every result file: its bench, date, CPU, commit and the command that wrote it."""
    rows = []
    for path in sorted(results.glob("*.json")):
        r = json.loads(path.read_text())
        commit = (r.get("versions") or {}).get("commit")
        rows.append([f"[`{path.name}`](results/{path.name})", r["bench"], str(r.get("date") or "not recorded"),
                     r["machine"]["cpu"], commit[:7] if commit else "-", r["source"].replace("|", "\\|")])
    return tables.markdown(["file", "bench", "date", "CPU", "commit", "command"], rows)


def generate(args: str, results: Path) -> str:
    kind, *names = args.split()
    if kind == "settings":
        return settings_table()
    if kind == "index":
        return index_table(results)
    if kind == "class":
        (pattern,) = names
        return by_class.class_table(pattern, tables.load(results, matching(results, pattern)))
    if kind == "summary":
        return by_class.summary_table([(p, tables.load(results, matching(results, p))) for p in names])
    if kind not in FILE_TABLES:
        raise ValueError(f"unknown figures kind {kind!r}; pick from settings, index, class, summary, "
                         f"{', '.join(FILE_TABLES)}")
    runs = tables.load(results, [n for pattern in names for n in matching(results, pattern)])
    if kind == "cited":  # its cells read other files in the same results folder
        return tables.cited_table(runs, results)
    return FILE_TABLES[kind](runs)


def rewrite(text: str, results: Path, links_from: str = "") -> str:
    """`links_from`: where docs/ sits relative to the page ("" for docs/ itself, "docs/" for the README,
    "../" for docs/results/), so that the links to each result file and to the performance page land."""
    def block(m) -> str:
        table = generate(m["args"], results).rstrip("\n")
        for target in ("results/", "performance.md", "benchmarking.md"):
            table = table.replace(f"]({target}", f"]({links_from}{target}")
        return m[1] + table.replace("](../results/", "](") + "\n" + m[4]

    return MARKED.sub(block, text)


def pages(docs: Path) -> list[Path]:
    """Every page with generated blocks: docs/*.md, the results' index and the README."""
    return sorted(docs.glob("*.md")) + [docs / "results" / "README.md", docs.parent / "README.md"]


def links_from(page: Path) -> str:
    return {"README.md": "docs/"}.get(page.name, "") if page.parent.name != "results" else "../"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page differs")


def run(args: argparse.Namespace) -> int:
    return main(["--check"] if args.check else [])


def main(argv: list[str]) -> int:
    check = "--check" in argv
    results, stale = DOCS / "results", []
    for page in pages(DOCS):
        text = page.read_text()
        new = rewrite(text, results, links_from(page))
        if new != text:
            stale.append(page)
            if not check:
                page.write_text(new)
    if check:
        for page in stale:
            print(f"{page} differs from what `make docs-figures` writes", file=sys.stderr)
        return 1 if stale else 0
    for path in charts.draw_all(results, DOCS / "figures"):
        print(f"wrote {path}")
    for page in stale:
        print(f"rewrote {page}")
    return 0
