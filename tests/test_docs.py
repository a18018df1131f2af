"""The docs match the code (no services needed): generated pages are what the code
generates, and every command, flag and default the README and docs/ quote exists."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest
from rich.table import Table

from bench.results import PAGE, RESULTS, record, render
from tools.docgen import MAP_END, MAP_START, module_map, with_module_map
from triggerflow.cli import main
from triggerflow.settings import Settings

ROOT = Path(__file__).resolve().parents[1]


def test_the_module_map_matches_the_package_tree() -> None:
    page = (ROOT / "docs" / "modules.md").read_text()
    assert page == with_module_map(page), (
        "regenerate: triggerflow docs modules --page docs/modules.md")


def test_module_map_lists_every_module_with_its_docstring() -> None:
    table = module_map()
    assert table.startswith(MAP_START) and table.endswith(MAP_END)
    for path in (ROOT / "triggerflow").rglob("*.py"):
        rel = path.relative_to(ROOT / "triggerflow")
        if "versions" in rel.parts or rel.name in ("__main__.py", "env.py"):
            continue
        name = f"{rel.parent}/" if rel.name == "__init__.py" else str(rel)
        if name == "./":
            continue  # the package itself
        row = next((line for line in table.splitlines() if line.startswith(f"| `{name}` |")), None)
        assert row is not None, f"{name} missing from the module map"
        assert not row.endswith("|  |"), f"{name} has no docstring to describe it"


# -- every command line the docs quote is one the CLI takes

# `triggerflow …` in inline code, and lines of code blocks that start with it (or `$ `).
_INLINE = re.compile(r"`(triggerflow [^`]+)`")
_BLOCK_LINE = re.compile(r"^\s*(?:\$ )?(triggerflow (?:[^#\n])+)", re.M)
_FENCE = re.compile(r"```[^\n]*\n(.*?)```", re.S)


def quoted_command_lines() -> list[tuple[str, str]]:
    """(page, command line) for every ``triggerflow …`` the README, the changelog and docs/
    quote."""
    found = []
    for page in [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text()
        blocks = _FENCE.findall(text)
        lines = [m for block in blocks for m in _BLOCK_LINE.findall(block)]
        prose = _FENCE.sub("", text)
        found += [(page.name, line.strip()) for line in [*_INLINE.findall(prose), *lines]]
    return found


def _walk(words: list[str]) -> tuple[click.Command, list[str], str]:
    """The command ``words`` name (``triggerflow`` first), the words after it, its path."""
    command: click.Command = main
    path = "triggerflow"
    rest = words[1:]
    while isinstance(command, click.Group) and rest and re.fullmatch(r"[a-z][a-z-]*", rest[0]):
        sub = command.get_command(click.Context(command), rest[0])
        assert sub is not None, f"{path} has no command {rest[0]!r}"
        command, path, rest = sub, f"{path} {rest[0]}", rest[1:]
    return command, rest, path


def _check_line(line: str) -> None:
    words = line.replace("[", " ").replace("]", " ").replace("…", " ").split()
    command, rest, path = _walk(words)
    options: dict[str, click.Option | None] = {
        opt: p for p in command.params if isinstance(p, click.Option)
        for opt in (*p.opts, *p.secondary_opts)}
    options.update({"--help": None, "-h": None})
    for i, word in enumerate(rest):
        if not word.startswith("--"):
            continue
        flag, _, value = word.partition("=")
        assert flag in options, f"{path} has no option {flag} ({line!r})"
        option = options[flag]
        # A default quoted in a synopsis (`[--batch 1000]`) is the option's default.
        after = value or (rest[i + 1] if i + 1 < len(rest) else "")
        in_brackets = f"[{flag} {after}]" in line
        if option is not None and in_brackets and not option.is_flag and after \
                and not after.isupper() and "|" not in after:
            default = option.get_default(click.Context(command), call=True)
            assert str(default) == after, f"{path} {flag}: docs say {after}, code {default}"


def test_every_quoted_command_and_flag_exists_with_the_quoted_default() -> None:
    lines = quoted_command_lines()
    assert len(lines) > 40  # the pages were read
    problems = []
    for page, line in lines:
        try:
            _check_line(line)
        except AssertionError as exc:
            problems.append(f"{page}: {exc}")
    assert problems == []


def test_option_tables_name_the_options_variable_and_default() -> None:
    """Rows like | `--heartbeat` | `TRIGGERFLOW_HEARTBEAT` | `10` … in docs/cli.md."""
    rows = re.findall(r"^\| `(--[a-z-]+)[^|]*\| `(TRIGGERFLOW_[A-Z_]+)`[^|]*\| `([^`]*)`",
                      (ROOT / "docs" / "cli.md").read_text(), re.M)
    assert len(rows) >= 5
    for flag, env, default in rows:
        field = flag[2:].replace("-", "_")
        assert Settings.env_name(field) == env, flag
        value = Settings.model_fields[field].get_default(call_default_factory=True)
        if hasattr(value, "get_secret_value"):
            value = value.get_secret_value()
        assert str(value) == default, f"{flag}: docs say {default}, code {value}"


def test_flags_in_a_command_section_of_the_cli_page_are_that_commands() -> None:
    """In docs/cli.md, every `--flag` under ``### `triggerflow CMD …` `` is an option of CMD."""
    sections = re.split(r"^### `", (ROOT / "docs" / "cli.md").read_text(), flags=re.M)[1:]
    assert len(sections) >= 10
    for section in sections:
        heading, _, body = section.split("\n## ")[0].partition("\n")
        command, _, path = _walk(heading.split("`")[0].replace("[", " ").split())
        flags = {opt for p in command.params for opt in (*p.opts, *p.secondary_opts)}
        for flag in re.findall(r"`(--[a-z][a-z-]*)", body):
            assert flag in flags, f"{path}: docs/cli.md quotes {flag}, which it does not take"


def _installed_by(target: str) -> str:
    """What ``make TARGET`` pip-installs: ``.`` or ``.[extra,…]``, read from the Makefile."""
    make = (ROOT / "Makefile").read_text()

    def prerequisites(name: str) -> list[str]:
        found = re.search(rf"^{name}:([^\n]*)", make, re.M)
        assert found is not None, name
        return found.group(1).split()

    deps = prerequisites(target)
    if "venv" in deps:
        deps += prerequisites("venv")
    stamp = next(d for d in deps if d.startswith("$(STAMP"))
    recipe = re.search(rf"^{re.escape(stamp)}:[^\n]*\n((?:\t[^\n]*\n)+)", make, re.M)
    assert recipe is not None, stamp
    spec = re.search(r"pip install -e (\S+)", recipe.group(1))
    assert spec is not None, stamp
    return spec.group(1).strip("'")


def _what_is_installed(spec: str) -> str:
    extras = [f"`{e}`" for e in re.findall(r"[a-z]+", spec.partition("[")[2])]
    if not extras:
        return "installs the package alone"
    listed = extras[0] if len(extras) == 1 else ", ".join(extras[:-1]) + " and " + extras[-1]
    return f"with the {listed} extras"


def test_the_docs_say_what_make_demo_and_make_test_install() -> None:
    readme = " ".join((ROOT / "README.md").read_text().split())
    demo, test = _what_is_installed(_installed_by("demo")), _what_is_installed(_installed_by("test"))
    assert f"`make demo` {demo}" in readme
    assert f"`make test` installs it {test}" in readme
    started = " ".join((ROOT / "docs" / "getting-started.md").read_text().split())
    assert f"creates `.venv` and {demo}" in started


def test_bench_scenarios_in_the_cli_page_are_the_benchmarks() -> None:
    from bench.common import SCENARIOS

    page = (ROOT / "docs" / "cli.md").read_text()
    section = page[page.index("### `triggerflow bench"):page.index("### `triggerflow docs config")]
    listed = re.findall(r"`([a-z]+)`", section.split("Scenarios:")[1].split(".")[0])
    assert listed == [*SCENARIOS, "airflow"]


# -- every `page.md#anchor` pointer resolves

_HEADING = re.compile(r"^#{1,6} (.+)$", re.M)
_POINTER = re.compile(r"\b([a-z][a-z0-9_-]*\.md)#([A-Za-z0-9_-]+)")


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the page's headings: lower case, punctuation dropped, each
    space a hyphen (not collapsed: ``[--a] [--b]`` gives ``--a---b``)."""
    text = _FENCE.sub("", page.read_text())
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in _HEADING.findall(text)}


def test_every_pointer_to_a_docs_section_names_one_that_exists() -> None:
    """``operations.md#helm`` in a values file, a stale anchor in a page: each fails here."""
    pages = {p.name: p for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]}
    sources = [ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md"),
               *(p for p in (ROOT / "deploy").rglob("*") if p.is_file()
                 and p.suffix in (".yaml", ".json", ".tpl", ".py") and "schemas" not in p.parts)]
    found, broken = 0, []
    for source in sources:
        for page, anchor in _POINTER.findall(source.read_text()):
            found += 1
            if page not in pages or anchor not in anchors(pages[page]):
                broken.append(f"{source.relative_to(ROOT)}: {page}#{anchor}")
    assert found > 20
    assert broken == []
    assert "--queue-q----json---ids" in " ".join(anchors(ROOT / "docs" / "cli.md"))


# -- the site builds with no warning, and the results page is what the results file renders


def test_the_docs_site_builds_strictly_with_no_warning(tmp_path: Path) -> None:
    """``mkdocs build --strict`` (mkdocs.yml): a page missing from the nav, a link to a file
    outside docs/ or to a missing page or anchor is a warning, and a warning fails the build."""
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    if mkdocs is None:
        pytest.fail("mkdocs is not installed: pip install -e '.[docs]' (make venv installs it)")
    done = subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"PATH": str(Path(sys.executable).parent), "NO_MKDOCS_2_WARNING": "1"})
    warnings = [line for line in done.stderr.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert done.returncode == 0 and warnings == [], done.stderr[-3000:]
    assert (tmp_path / "site" / "performance-results" / "index.html").is_file()


def test_the_results_page_is_what_the_results_file_renders() -> None:
    assert PAGE.read_text() == render(json.loads(RESULTS.read_text())), (
        "regenerate: python -m bench.results")


def test_a_full_run_replaces_its_scenarios_record_and_rewrites_the_page(tmp_path: Path) -> None:
    results, page = tmp_path / "results.json", tmp_path / "page.md"
    results.write_text(RESULTS.read_text())
    before = json.loads(results.read_text())
    table = Table(title="Burst: N at one instant")
    for column in ("N", "all applied", ""):
        table.add_column(column)
    table.add_row("1,000", "20.0 ms", "[green]met")
    record("burst", [table], path=results, page=page, command="triggerflow bench burst",
           at="2030-01-02", rev="abc1234", host={"cpus": 2, "model": "Some CPU"})
    after = json.loads(results.read_text())
    assert after["burst"] == {
        "command": "triggerflow bench burst", "date": "2030-01-02", "commit": "abc1234",
        "machine": {"cpus": 2, "model": "Some CPU"},
        "tables": [{"title": "Burst: N at one instant", "columns": ["N", "all applied", ""],
                    "rows": [["1,000", "20.0 ms", "met"]], "caption": ""}]}
    assert {k: v for k, v in after.items() if k != "burst"} == \
        {k: v for k, v in before.items() if k != "burst"}
    assert page.read_text() == render(after)
    assert "| 1,000 | 20.0 ms | met |" in page.read_text()
    assert "`triggerflow bench burst`, commit `abc1234`, 2030-01-02" in page.read_text()


def test_the_results_name_only_scenarios_the_bench_runs() -> None:
    from bench.chaos import RESULT_NAMES
    from bench.common import SCENARIOS

    assert set(json.loads(RESULTS.read_text())) <= {*SCENARIOS, "airflow", "airflow-million",
                                                    "airflow-waits", *RESULT_NAMES.values()}
