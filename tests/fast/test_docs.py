"""The README and docs/ as a reader meets them: short README, pages that say what they cover, links that land,
generated tables equal to what `make docs-figures` writes from app/config.py and docs/results/*.json, prose that
repeats no measured figure those tables do not print, and every code block marked `<!-- runnable -->` run against a
live server (the tiny model, served under the default model's id, so the blocks run unchanged but for the port)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import docs
from benchmarks import record, tables
from app.config import DEFAULT_MODEL, Settings

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"
PAGES = sorted(DOCS.glob("*.md"))
RESULTS_INDEX = DOCS / "results" / "README.md"
# Pages that other branches write; the README and the docs link to them ahead of the merge.
PENDING_PAGES = {"limits.md", "anthropic.md", "scaling.md"}
RUNNABLE = re.compile(r"<!-- runnable -->\n```(?P<lang>bash|python)\n(?P<code>.*?)```", re.S)
LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")


def test_readme_is_short_and_starts_with_the_two_commands():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail into docs/"
    head = "\n".join(lines[:40])
    assert "make serve" in head and "make test" in head


def test_a_newcomer_finds_the_api_key_the_k8s_manifests_and_int8_in_one_click():
    text = README.read_text()
    for what, link in (("API_KEY", "docs/configuration.md#settings"), ("QUANT=int8", "docs/configuration.md#settings"),
                       ("docker/k8s/", "docker/k8s/")):
        assert re.search(rf"\[`?{re.escape(what)}`?\]\({re.escape(link)}\)", text), f"README: no link for {what}"
    settings = (DOCS / "configuration.md").read_text()
    assert "| `API_KEY` |" in settings and "| `QUANT` |" in settings and "`int8`" in settings
    assert (REPO / "docker" / "k8s" / "deployment.yaml").is_file()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_page_says_what_it_covers_first(page):
    head = "\n".join(page.read_text().splitlines()[:8])
    assert head.startswith("# ") and re.search(r"What this page covers|This page", head), (
        f"{page.name}: say what the page covers in its first lines")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # `# comments` in code are not headings
    return {slug(m[1]) for m in re.finditer(r"^#{1,6} (.+)$", text, flags=re.M)}


@pytest.mark.parametrize("page", [README, *PAGES, RESULTS_INDEX], ids=lambda p: str(p.relative_to(REPO)))
def test_local_links_land_on_a_file_and_heading(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if dest.name in PENDING_PAGES and dest.parent == DOCS:
            continue
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(target)
    assert not broken, f"{page.name}: links that land nowhere: {broken}"


def test_generated_tables_equal_what_the_generator_writes():
    stale = [page.name for page in docs.pages(DOCS)
             if docs.rewrite(page.read_text(), DOCS / "results", docs.links_from(page)) != page.read_text()]
    assert README in docs.pages(DOCS)  # the README's goals table is generated too
    assert not stale, f"run `make docs-figures`: {stale} differ from what it writes"


def test_every_setting_is_in_the_generated_table_with_its_default():
    table = docs.settings_table()
    for name, field in Settings.model_fields.items():
        row = next(line for line in table.splitlines() if line.startswith(f"| `{name.upper()}` |"))
        assert f"`--{name.replace('_', '-')}`" in row
        if isinstance(field.default, (int, str)) and not isinstance(field.default, bool):
            assert f"`{field.default}`" in row, row


def test_a_changed_figure_in_the_json_changes_the_page(tmp_path):
    """The check has teeth: edit one figure in a copy of the results, and the page no longer matches."""
    results = tmp_path / "results"
    shutil.copytree(DOCS / "results", results)
    page = (DOCS / "performance.md").read_text()
    assert docs.rewrite(page, results) == page
    name = "compare-zen4-2026-11-30-five-servers.json"
    data = json.loads((results / name).read_text())
    data["results"]["8 streams"]["ours-int8"]["output_tokens_per_s"]["aggregate"] = 99.9
    (results / name).write_text(json.dumps(data))
    changed = docs.rewrite(page, results)
    row = next(line for line in changed.splitlines() if line.startswith("| simple-serve, `QUANT=int8` |")
               and "| 99.9 |" in line)
    assert row.split(" | ")[3] == "99.9"  # the 8-stream column


def test_the_readme_summary_and_the_class_table_read_the_latest_scaling_run(tmp_path):
    """Change a figure of the Zen 5's 7B run and both the README's summary and the page's Zen 5 table follow."""
    results = tmp_path / "results"
    shutil.copytree(DOCS / "results", results)
    name = "scaling-zen5-7b.json"
    data = json.loads((results / name).read_text())
    data["sizes"]["7B"]["servers"]["ours-int8"]["1 streams"]["tokens_per_s"] = 77.7
    (results / name).write_text(json.dumps(data))
    readme = docs.rewrite(README.read_text(), results, "docs/")
    zen5 = next(line for line in readme.splitlines() if line.startswith("| [AMD EPYC Zen 5"))
    assert "| 7B | `QUANT=int8` | 77.7 / " in zen5
    page = docs.rewrite((DOCS / "performance.md").read_text(), results)
    assert any(line.startswith("|  | simple-serve, `QUANT=int8` | 77.7 |") for line in page.splitlines())


def test_a_class_without_a_run_says_unmeasured_until_its_file_lands(tmp_path):
    """The Zen 4 has no scaling run: the README and its section say so, with no figure borrowed from another class;
    a `scaling-zen4-*.json` dropped into docs/results/ fills both at the next `make docs-figures`."""
    results = tmp_path / "results"
    shutil.copytree(DOCS / "results", results)
    section = lambda text: text.split("### AMD EPYC Zen 4")[1].split("\n### ")[0]  # noqa: E731
    page = (DOCS / "performance.md").read_text()
    zen4_row = lambda text: next(line for line in text.splitlines() if line.startswith("| [AMD EPYC Zen 4"))  # noqa: E731
    if not list((DOCS / "results").glob("scaling-zen4*.json")):
        assert "Unmeasured" in section(page) and "| unmeasured |" in zen4_row(README.read_text())
    run = json.loads((results / "scaling-zen5-7b.json").read_text())
    run["machine"]["cpu"], run["date"] = "AMD EPYC Zen 4", "2099-01-01T00:00:00Z"
    (results / "scaling-zen4-zz-test.json").write_text(json.dumps(run))
    filled = section(docs.rewrite(page, results))
    assert "Unmeasured" not in filled and "[2099-01-01, 25ac035](results/scaling-zen4-zz-test.json)" in filled
    assert "| 7B | `QUANT=int8` |" in zen4_row(docs.rewrite(README.read_text(), results, "docs/"))


def test_every_cited_result_says_where_it_came_from():
    for path in sorted((DOCS / "results").glob("*.json")):
        r = json.loads(path.read_text())
        assert r["schema"] == record.SCHEMA and r["bench"] in ("compare", "shortcuts", "quality", "routing", "grammar", "step",
                                                                  "generate", "soak", "serve", "kernels", "scaling",
                                                                  "cited", "models", "vision", "invariance",
                                                                  "perplexity"), path.name
        assert r["source"] and r["machine"]["cpu"] and r["machine"]["cores"], path.name
        assert "date" in r and "settings" in r and "versions" in r, path.name
    cited = {f for page in PAGES for m in docs.MARKED.finditer(page.read_text()) for f in m["args"].split()[1:]
             if "*" not in f}  # a pattern may match nothing yet: its table then says the class is unmeasured
    assert cited and all((DOCS / "results" / f).is_file() for f in cited), cited
    index = RESULTS_INDEX.read_text()  # every file, cited or not, is listed with its date, CPU and command
    assert all(f"[`{path.name}`]({path.name})" in index for path in (DOCS / "results").glob("*.json"))


def test_a_bench_envelope_names_this_machine():
    import argparse

    head = record.envelope("compare", argparse.Namespace(servers="ours", dtype="float32"))
    assert head["machine"]["cores"] >= 1 and head["machine"]["cpu"] and isinstance(head["machine"]["flags"], list)
    assert head["versions"]["torch"] and head["versions"]["python"] == ".".join(map(str, sys.version_info[:3]))
    assert head["settings"] == {"servers": "ours", "dtype": "float32"} and re.fullmatch(r"\d{4}-.*Z", head["date"])
    assert tables.ms(0.273) == "273 ms" and tables.ms(67.454) == "67,454 ms"


def runnable_blocks() -> list[tuple[str, str, str]]:
    blocks = []
    for page in [README, *PAGES]:
        for i, m in enumerate(RUNNABLE.finditer(page.read_text())):
            blocks.append((f"{page.name}#{i}", m["lang"], m["code"]))
    return blocks


def test_the_readme_and_api_page_have_runnable_blocks():
    names = [name for name, _, _ in runnable_blocks()]
    assert sum(n.startswith("README.md") for n in names) >= 2 and sum(n.startswith("api.md") for n in names) >= 2


@pytest.fixture(scope="module")
def docs_server(tiny_lm):
    from app.main import create_app

    from conftest import ThreadServer

    app = create_app(Settings(model="tiny", served_model_name=DEFAULT_MODEL, max_active=4), lm=tiny_lm)
    with ThreadServer(app) as server:
        yield server


@pytest.mark.server
@pytest.mark.parametrize("name,lang,code", runnable_blocks(), ids=[b[0] for b in runnable_blocks()])
def test_runnable_block_runs_against_a_live_server(docs_server, name, lang, code):
    code = re.sub(r"(localhost|127\.0\.0\.1):8000", f"127.0.0.1:{docs_server.port}", code)
    command = ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{name} failed:\n{code}\n{done.stdout}\n{done.stderr}"
    assert done.stdout.strip(), f"{name} printed nothing"
    assert '"error"' not in done.stdout, f"{name} got an error:\n{done.stdout}"


# The walkthrough's commands run the real SmolLM2 on this machine, with the page's output block under them.
REAL_MODEL_BLOCK = re.compile(r"<!-- runnable: real model -->\n```bash\n(?P<code>.*?)```(?:\n\n```\n(?P<shown>.*?)```)?",
                              re.S)


@pytest.mark.real_model
def test_the_walkthroughs_commands_run_and_its_fp32_ones_print_what_the_page_shows():
    """Each command of walkthrough.md runs (exit 0, prints). The ones that load in fp32 print exactly the output the
    page shows under them; the others run in this CPU's default dtype, so their figures are this CPU's own."""
    from concurrent.futures import ThreadPoolExecutor

    blocks = [(m["code"], m["shown"]) for m in REAL_MODEL_BLOCK.finditer((DOCS / "walkthrough.md").read_text())]
    assert len(blocks) >= 7

    def run(code: str) -> subprocess.CompletedProcess:
        code = code.replace(".venv/bin/python", sys.executable)
        return subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=REPO, capture_output=True, text=True,
                              timeout=300)

    with ThreadPoolExecutor(2) as pool:  # each is mostly its own start: two at a time
        done = list(pool.map(run, [code for code, _ in blocks]))
    for (code, shown), result in zip(blocks, done):
        assert result.returncode == 0 and result.stdout.strip(), f"{code}\n{result.stdout}\n{result.stderr[-2000:]}"
        if 'dtype="float32"' in code:
            assert shown and result.stdout == shown, f"{code}\nprinted:\n{result.stdout}\npage shows:\n{shown}"


@pytest.mark.full
def test_the_charts_are_drawn_from_the_results(tmp_path):
    from benchmarks import charts

    written = charts.draw_all(DOCS / "results", tmp_path)
    assert {p.name for p in written} >= {"headline.png", "scaling-zen2.png", "scaling-zen5.png", "scaling-amx.png"}
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size < 200_000 for p in written)
    assert {p.name for p in written} <= {p.name for p in (DOCS / "figures").glob("*.png")}, "commit the new charts"
    shown = {m for page in [README, *PAGES] for m in re.findall(r"figures/([\w.-]+\.png)", page.read_text())}
    assert shown <= {p.name for p in written}, "a chart the docs show that no result draws"


# Every measured figure in the docs comes from a committed JSON through `make docs-figures`. A figure typed
# into prose drifts from the run it came from (and loses its CPU and date), so prose may repeat only a figure that a
# generated block of the same page prints. The rule reads "a number with a unit of time, speed, size or ratio" as a
# measurement; counts, versions, shapes (`896 x 4864`) and products (`24 × 2 × 64`) carry no such unit.
FIGURE = re.compile(
    r"(?<![\w.,/+-])(?P<a>\d[\d,]*(?:\.\d+)?)(?:(?:-|–|\s+to\s+)(?P<b>\d[\d,]*(?:\.\d+)?))?"
    r"(?P<unit>\s?(?:x|×)(?!\s*\d)|%|\s?(?:ms|us|µs|GB/s|GFLOP/s|tok/s|KiB|MiB|GiB|KB|MB|GB)"
    r"|\s(?:tokens/s|minutes|min|seconds|hours|s))(?![\w/])")
# Prose that holds no measurement although it has such figures (arithmetic, a manifest's settings): each span says
# why in its marker, where the next author sees it.
UNMEASURED = re.compile(r"<!-- not measured: (?P<why>[^>]*?) -->.*?<!-- not measured:end -->", re.S)
# Figures that are not measurements and are not a Settings default (those are allowed below): a rule of the code, a
# setting of a manifest or a bench, a limit of another program. Each with its reason.
NOT_MEASURED = {
    ("anthropic.md", "5 s"): "the Messages stream's ping interval, PING_S in app/anthropic/serving.py",
    ("architecture.md", "10%"): "the share of the card the default KV budget leaves free, a rule (vLLM's 0.9)",
    ("configuration.md", "10%"): "the same rule, in KV_CACHE_BYTES' description",
    ("limits.md", "10%"): "the same rule, in the limits table",
    ("limits.md", "256 MiB"): "the grammar cache's byte bound, a constant in app/structured/grammars.py",
    ("limits.md", "100 ms"): "bench soak's default --health-p99-ms and the adversarial test's bound; the flood test's "
                             "simulated step (STEP_S in tests/test_body_flood.py)",
    ("limits.md", "200 ms"): "the flood test's bound on /health's p99, the Done-when of issue 34",
    ("limits.md", "64 KiB"): "how much of a body json_shape reads at a time, CHUNK in app/body.py",
    ("deployment.md", "20 min"): "the startupProbe's budget in docker/k8s/deployment.yaml",
    ("deployment.md", "5 s"): "the preStop sleep in docker/k8s/deployment.yaml",
    ("deployment.md", "10 s"): "the margin in terminationGracePeriodSeconds, docker/k8s/deployment.yaml",
    ("benchmarking.md", "5%"): "bench soak's RSS-growth threshold, a rule of the bench",
    ("benchmarking.md", "6 s"): "how long tests/tooling/test_bench_soak.py runs the soak, a setting of the test",
    ("benchmarking.md", "10 minutes"): "make gpu-check's time budget, stated in scripts/gpu_check.sh's header",
    ("README.md", "10 minutes"): "the same budget of make gpu-check",
    ("configuration.md", "1.8 GiB"): "the default model's linears in fp32, a size fixed by the weights, not a reading",
    ("scaling.md", "30 s"): "how long torchrun waits after passing on a SIGTERM, torchrun's own rule",
    ("scaling.md", "600 s"): "the HTTPRoute's request timeout in the manifests",
    ("scaling.md", "15 s"): "a common gateway default timeout, cited as the reason for the one above",
    ("scaling.md", "50 ms"): "the picker's scrape interval, which bench routing copies",
    ("scaling.md", "56 KiB"): "Qwen2.5-7B's KV per token, arithmetic from its config.json (deployment.md)",
    ("scaling.md", "12 MiB"): "the replicas' PREFIX_CACHE_BYTES in bench routing, a setting of the bench",
}


def settings_defaults() -> set[str]:
    """Each Settings default as prose writes it (`30 s`, `512 MiB`, `1 MiB`): a default is a choice, not a reading."""
    said = set()
    for name, field in Settings.model_fields.items():
        value = field.default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if name.endswith("_bytes") and value % 2**20 == 0:
            said.add(f"{value // 2**20} MiB")
        elif name.endswith("_s"):
            said.add(f"{value:g} s")
    return said


def figures_in(text: str) -> list[str]:
    """Each figure as `1.27x`, `1,092 ms`, `+1.65%`; a range `2.7-2.95x` gives both ends."""
    found = []
    for m in FIGURE.finditer(text):
        unit = m["unit"].strip()
        unit = unit if unit in ("x", "×", "%") else " " + unit
        found += [f"{number}{unit}" for number in (m["a"], m["b"]) if number]
    return found


def prose(page: str, name: str) -> str:
    """The page less its generated blocks, its not-measured spans, code (commands, settings' own values, program
    output) and comments."""
    text = docs.MARKED.sub("", page)
    assert all(m["why"].strip() for m in UNMEASURED.finditer(text)), f"{name}: a span without its reason"
    for pattern in (UNMEASURED, re.compile(r"```.*?```", re.S), re.compile(r"<!--.*?-->", re.S),
                    re.compile(r"`[^`\n]*`")):
        text = pattern.sub("", text)
    return text


def typed_figures(page: str, name: str) -> list[str]:
    """The figures of a page's prose that no generated block of the page prints, nor the allowances above."""
    cited = set(figures_in("\n".join(m["body"] for m in docs.MARKED.finditer(page))))
    allowed = cited | settings_defaults() | {f for page_name, f in NOT_MEASURED if page_name == name}
    return [f for f in figures_in(prose(page, name)) if f not in allowed]


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: p.name)
def test_prose_repeats_only_figures_its_generated_blocks_print(page):
    typed = typed_figures(page.read_text(), page.name)
    assert not typed, (f"{page.name}: measured figures typed into prose: {typed}; put them in a "
                       "docs/results/cited-*.json and a generated block, or point to the block that prints them")


def test_the_prose_check_catches_a_typed_figure():
    page = ("# T\n\n<!-- figures:begin cited x.json -->\n| a | 1.27x | 1,092 ms |\n<!-- figures:end -->\n\n"
            "Ours ran 1.27x faster (1,092 ms); `MAX_ACTIVE=8`, 30 s of grace.\n")
    assert typed_figures(page, "t.md") == []
    assert typed_figures(page + "Then 1.31x, in 2.7-2.95x, at 40 tokens/s and 12.5%.\n", "t.md") == [
        "1.31x", "2.7x", "2.95x", "40 tokens/s", "12.5%"]
    assert typed_figures("# T\n\nShapes 896 x 4864 and 24 × 2 × 64 bytes; HTTP 429s; version 5.24.\n", "t.md") == []


def test_every_allowance_is_still_needed():
    """An entry whose figure left its page would let a measurement of the same value in later: drop it instead."""
    path = lambda name: README if name == README.name else DOCS / name  # noqa: E731
    stale = [key for key in NOT_MEASURED if key[1] not in figures_in(prose(path(key[0]).read_text(), key[0]))]
    assert not stale, f"NOT_MEASURED entries no page needs any more: {stale}"
