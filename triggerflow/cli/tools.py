"""``demo``, ``bench`` and ``docs``: the commands that are not part of running triggerflow.

The demo is installed with the package (``triggerflow_demo``, beside ``triggerflow`` in the
wheel); the bench (``bench/``) and the docs generator (``tools/docgen.py``) ship with the
source tree only, so those commands run from a checkout.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import click

from triggerflow.cli.options import CONNECTION, build_settings, settings_options


def from_checkout(module: str) -> ModuleType:
    """Import ``module`` from the source tree this package was installed from (an editable
    install) or from ``sys.path``; a wheel has no such tree, and the error says so."""
    root = Path(__file__).resolve().parents[2]
    top = module.partition(".")[0]
    if (root / top / "__init__.py").is_file() and (root / "pyproject.toml").is_file() \
            and str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != top:
            raise
        raise click.UsageError(f"{module} ships with the source tree, not the wheel: run this "
                               "from a checkout (pip install -e '.[dev,airflow]')") from None


def register(main: click.Group) -> None:
    """Add ``demo``, ``bench`` and ``docs config`` to ``main``."""
    connection = CONNECTION

    @main.command()
    @click.option("--tasks", type=int, default=24, show_default=True,
                  help="Timer tasks per team (plus one task of each other kind).")
    @click.option("--keep-running", is_flag=True, help="Leave the processes up at the end.")
    @settings_options(*connection)
    def demo(tasks: int, keep_running: bool, **values: Any) -> None:
        """Set up, start a writer, two team consumers and a resumer, defer a mix, show results."""
        from triggerflow_demo.run import run_demo

        # the demo's processes get these settings: it reads every variable
        sys.exit(run_demo(build_settings(values, every_variable=True), tasks, keep_running))

    @main.command()
    @click.argument("scenarios", nargs=-1)
    @click.option("--quick", is_flag=True, help="Tiny sizes (smoke test).")
    @click.option("--zone-triggers", type=click.IntRange(min=10), default=None,
                  help="Timers the `zone` scenario's consumers hold (default 100,000; "
                  "--quick: 2,000).")
    @click.option("--repeats", type=click.IntRange(min=1), default=None,
                  help="Runs of each size in `reference`, `burst`, `held` and `wide` (a burst "
                  "run right after a reference run); medians are printed (default 3; "
                  "--quick: 1).")
    @click.option("--seed", type=int, default=None,
                  help="`chaos`: the seed its schedule is drawn from (default: a random one, "
                  "printed).")
    @click.option("--minutes", type=click.FloatRange(min=0.1), default=5.0, show_default=True,
                  help="`chaos`: minutes of faults before the drain.")
    @click.option("--mode", type=click.Choice(["native", "airflow"]), default="native",
                  show_default=True, help="`chaos`: which mode it runs (airflow: against a fresh Airflow "
                  "metadata database).")
    @click.option("--topology", type=click.Choice(["single", "cluster"]), default="single",
                  show_default=True, help="`chaos`: the servers it starts (cluster: a "
                  "PostgreSQL standby and 3 RabbitMQ nodes, and faults that promote the "
                  "standby and stop a node).")
    @settings_options(*connection)
    def bench(scenarios: tuple[str, ...], quick: bool, zone_triggers: int | None,
              repeats: int | None, seed: int | None, minutes: float, mode: str,
              topology: str, **values: Any) -> None:
        """Benchmark against the real broker and database; prints a table per scenario."""
        run_bench = from_checkout("bench").run_bench
        sys.exit(run_bench(build_settings(values, every_variable=True), list(scenarios), quick,
                           zone_triggers=zone_triggers, repeats=repeats, seed=seed,
                           minutes=minutes, mode=mode, topology=topology))

    @main.group()
    def docs() -> None:
        """Generated documentation."""

    @docs.command("config")
    @click.option("--output", type=click.Path(dir_okay=False), default="-",
                  help="File to write (default stdout).")
    def docs_config(output: str) -> None:
        """Print the configuration reference generated from the settings model."""
        configuration_reference = from_checkout("tools.docgen").configuration_reference
        root = click.get_current_context().find_root().command
        assert isinstance(root, click.Group)
        text = configuration_reference(root)
        if output == "-":
            click.echo(text, nl=False)
        else:
            with open(output, "w") as fh:
                fh.write(text)

    @docs.command("modules")
    @click.option("--page", type=click.Path(dir_okay=False, exists=True),
                  default="docs/modules.md", show_default=True,
                  help="Page whose module map is rewritten in place.")
    def docs_modules(page: str) -> None:
        """Rewrite the module map of the modules page from the package tree."""
        with_module_map = from_checkout("tools.docgen").with_module_map
        path = Path(page)
        path.write_text(with_module_map(path.read_text()))
