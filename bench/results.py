"""The latest full result of each scenario, kept in the repository, and the page made from it.

A full (not ``--quick``) run of a scenario replaces that scenario's entry in
``bench/results.json`` (its tables as printed, with the commit, date, machine and command) and
rewrites ``docs/performance-results.md`` from the file, so the docs show one current table set
per scenario and cannot drift from the data; earlier results stay in git history.
``python -m bench.results`` rewrites the page alone (after editing the file by hand).
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.common import CHECKOUT, SCENARIOS

if TYPE_CHECKING:
    from rich.table import Table

RESULTS = CHECKOUT / "bench" / "results.json"
PAGE = CHECKOUT / "docs" / "performance-results.md"
# The page's order: the native scenarios as `triggerflow bench` runs them, then Airflow
# mode's, then the fault schedule's check (`bench chaos`, run alone).
ORDER = (*SCENARIOS, "airflow", "airflow-million", "airflow-waits", "chaos", "chaos-cluster",
         "chaos-airflow")


def _plain(cell: Any) -> str:
    """A cell, title or caption as plain text (rich markup such as ``[green]met`` dropped)."""
    from rich.text import Text

    if cell is None:
        return ""
    text = cell if isinstance(cell, Text) else Text.from_markup(cell) if isinstance(cell, str) \
        else Text(str(cell))
    return " ".join(text.plain.split())


def table_data(table: Table) -> dict[str, Any]:
    """A printed rich table as data: title, column headers, rows of plain text, caption."""
    columns = [list(c.cells) for c in table.columns]
    rows = [[_plain(col[i]) for col in columns] for i in range(table.row_count)]
    return {"title": _plain(table.title), "columns": [_plain(c.header) for c in table.columns],
            "rows": rows, "caption": _plain(table.caption)}


def machine() -> dict[str, Any]:
    """What the numbers were measured on: CPU count and model, memory, Python."""
    model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    memory = None
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        memory = f"{kb / 1024 / 1024:.0f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    return {"cpus": os.cpu_count(), "model": model, "memory": memory,
            "python": platform.python_version()}


def commit() -> str | None:
    """The checkout's commit, ``-dirty`` when tracked files differ from it; None outside git."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(CHECKOUT), *args], capture_output=True,
                              text=True, check=True, timeout=10).stdout.strip()
    try:
        head = git("rev-parse", "--short", "HEAD")
        return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return None


def command_line() -> str:
    """The command as typed: ``triggerflow bench …`` with the arguments this process got."""
    return "triggerflow " + shlex.join(sys.argv[1:])


def record(scenario: str, tables: list[Table], *, path: Path = RESULTS, page: Path = PAGE,
           command: str | None = None, at: str | None = None, rev: str | None = None,
           host: dict[str, Any] | None = None) -> None:
    """Replace ``scenario``'s entry in the results file with these tables, then rewrite the
    page. The keyword arguments default to this run's command, date, commit and machine."""
    results = json.loads(path.read_text()) if path.exists() else {}
    results[scenario] = {
        "command": command or command_line(),
        "date": at or datetime.now(UTC).strftime("%Y-%m-%d"),
        "commit": rev if rev is not None else commit(),
        "machine": host or machine(),
        "tables": [table_data(t) for t in tables],
    }
    path.write_text(dumps(results))
    page.write_text(render(results))


def dumps(results: dict[str, Any]) -> str:
    """The results file's text: scenarios in the page's order, stable for diffs."""
    ordered = {k: results[k] for k in sorted(results, key=_rank)}
    return json.dumps(ordered, indent=1, ensure_ascii=False) + "\n"


def _rank(scenario: str) -> tuple[int, str]:
    return (ORDER.index(scenario) if scenario in ORDER else len(ORDER), scenario)


def _cell(text: str) -> str:
    return text.replace("|", "\\|") or " "


def _table(t: dict[str, Any]) -> list[str]:
    lines = [f"**{t['title']}**", ""] if t.get("title") else []
    lines += ["| " + " | ".join(_cell(c) for c in t["columns"]) + " |",
              "|" + "---|" * len(t["columns"])]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in t["rows"]]
    if t.get("caption"):
        lines += ["", t["caption"]]
    return [*lines, ""]


def _where(entry: dict[str, Any]) -> str:
    host = entry.get("machine") or {}
    what = [f"{host['cpus']} CPUs"] if host.get("cpus") else []
    what += [host[k] for k in ("model", "memory") if host.get(k)]
    rev = f"commit `{entry['commit']}`" if entry.get("commit") else "commit not recorded"
    return f"`{entry['command']}`, {rev}, {entry['date']}; machine: {', '.join(what) or 'not recorded'}."


def render(results: dict[str, Any]) -> str:
    """The results page: an index, then each scenario's tables under a heading of its name."""
    out = ["# Performance results", "",
           "<!-- Generated from bench/results.json by `python -m bench.results`; do not edit. -->", "",
           "The latest full run of each `triggerflow bench` scenario, as it printed its tables. "
           "What each scenario does, how it measures and the targets are in "
           "[Performance](performance.md). A full run of a scenario (not `--quick`) replaces its "
           "entry in `bench/results.json` and rewrites this page; earlier results are in that "
           "file's history.", "",
           "| scenario | command | commit | date |", "|---|---|---|---|"]
    names = sorted(results, key=_rank)
    out += [f"| [`{n}`](#{n}) | `{results[n]['command']}` | "
            f"{'`' + results[n]['commit'] + '`' if results[n].get('commit') else '-'} | "
            f"{results[n]['date']} |" for n in names]
    out.append("")
    for name in names:
        entry = results[name]
        out += [f"## {name}", "", _where(entry), ""]
        if entry.get("note"):
            out += [entry["note"], ""]
        for t in entry["tables"]:
            out += _table(t)
    return "\n".join(out).rstrip("\n") + "\n"


def main() -> int:
    PAGE.write_text(render(json.loads(RESULTS.read_text())))
    print(f"wrote {PAGE.relative_to(CHECKOUT)} from {RESULTS.relative_to(CHECKOUT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
