"""The layering the docs describe, checked on the code's real import graph.

The contracts live in pyproject.toml ([tool.importlinter]): the layers from the CLI down to
the pure modules (every module placed, none importing a layer above it), no import cycle
between the modules of any package, nothing in the runtime importing the demo or the bench,
the loops never reaching a driver or an adapter, the pure modules importing no I/O, the
store and transport sides never importing each other.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest
from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    assert lint_imports(no_cache=True) == 0, "an import contract in pyproject.toml is broken"


def test_trigger_api_imports_no_network_client() -> None:
    code = ("import sys, triggerflow.triggers as t; assert 'httpx' not in sys.modules; "
            "t.HttpTrigger; assert 'httpx' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)


def test_the_wheel_carries_the_runtime_and_the_demo_only() -> None:
    """`make demo` installs the package alone, so the demo ships; the bench, the test stack
    and the docs generator stay in the source tree."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for top in ROOT.iterdir() if (top / "__init__.py").is_file()
        for init in top.rglob("__init__.py")
    }
    shipped = {p.partition(".")[0] for p in packages if any(fnmatch(p, i) for i in include)}
    assert shipped == {"triggerflow", "triggerflow_demo"}
    assert {"bench", "tests", "tools"} <= {p.partition(".")[0] for p in packages}


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
