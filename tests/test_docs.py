"""The docs match the code (no services needed): generated pages are what the code
generates, and every command, flag and default the README and docs/ quote exists."""

from __future__ import annotations

import re
from pathlib import Path

import click

from tools.docgen import MAP_END, MAP_START, module_map, with_module_map
from triggerflow.cli import main
from triggerflow.settings import Settings

ROOT = Path(__file__).resolve().parents[1]


def test_architecture_module_map_matches_the_package_tree() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text()
    assert page == with_module_map(page), (
        "regenerate: triggerflow docs modules --page docs/architecture.md")


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
    """(page, command line) for every ``triggerflow …`` the README and docs/ quote."""
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
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
    extras = re.findall(r"[a-z]+", spec.partition("[")[2])
    if not extras:
        return "installs the package alone"
    return "with the " + " and ".join(f"`{e}`" for e in extras) + " extras"


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
