"""The layering the docs describe, checked on the code's real import graph.

The contracts live in pyproject.toml ([tool.importlinter]): the loops never reach a driver
or an adapter, the pure modules import no I/O, the store and transport sides never import
each other. Cycles between modules are checked here with grimp (the graph import-linter uses).
"""

from __future__ import annotations

import sys
from pathlib import Path

import grimp
import pytest
from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    assert lint_imports(no_cache=True) == 0, "an import contract in pyproject.toml is broken"


def _cycles(graph: grimp.ImportGraph, modules: set[str]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        for n in graph.find_modules_directly_imported_by(m) & modules:
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            group = []
            while True:
                n = stack.pop()
                group.append(n)
                if n == m:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    sys.setrecursionlimit(10_000)
    for m in sorted(modules):
        if m not in index:
            visit(m)
    return found


def test_no_import_cycles_between_modules() -> None:
    graph = grimp.build_graph("triggerflow", exclude_type_checking_imports=True, cache_dir=None)
    # A package's __init__ re-exporting its children is not a cycle worth naming.
    modules = {m for m in graph.modules if not graph.find_children(m)}
    assert _cycles(graph, modules) == []


def test_trigger_api_imports_no_network_client() -> None:
    import subprocess

    code = ("import sys, triggerflow.triggers as t; assert 'httpx' not in sys.modules; "
            "t.HttpTrigger; assert 'httpx' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)


def test_native_mode_imports_no_airflow_code() -> None:
    """Airflow mode is reached only through ``modes.mode_for`` (the import contract checks
    the code); a native process built the way ``wiring`` builds it imports none of it."""
    import subprocess

    code = ("import sys, triggerflow.wiring, triggerflow.queue_gauges; "
            "from triggerflow.modes import mode_for; from triggerflow.settings import Settings; "
            "mode = mode_for(Settings.without_environment({})); mode.loader(); mode.encoder(); "
            "assert mode.name == 'native'; "
            "loaded = [m for m in sys.modules if m.split('.')[0] == 'airflow' "
            "or m.startswith('triggerflow.airflow')]; assert not loaded, loaded")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)
