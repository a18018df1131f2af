"""The ``triggerflow`` root group: each command's module is imported when that command runs
(or shows its help), and whatever a command raises ends in one line.

Exit codes: 0 ok, 1 failure, 2 usage or configuration error, 3 status needs attention.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import click

from triggerflow.cli import failures
from triggerflow.variables import PREFIX

# command -> (where it is defined, its help's first sentence for ``triggerflow --help``).
# A "module:register" adds all of that module's commands; "module:name" is one command.
# tests/test_cli.py checks this table against the commands it loads.
COMMANDS: dict[str, tuple[str, str]] = {
    "airflow": ("triggerflow.airflow.cli:airflow_group",
                "Airflow mode: serve an Airflow 3 metadata database in place of `airflow "
                "triggerer`."),
    "bench": ("triggerflow.cli.tools:register",
              "Benchmark against the real broker and database; prints a table per scenario."),
    "cancel": ("triggerflow.cli.services:register",
               "Take tasks out of 'deferred' and cancel their triggers on the owner "
               "(idempotent)."),
    "consume": ("triggerflow.cli.services:register",
                "Run triggers of one or more team queues (repeat --queue)."),
    "db": ("triggerflow.cli.services:register", "Database schema."),
    "defer": ("triggerflow.cli.services:register",
              "Create COUNT task instances and defer them on a trigger (smoke tests, "
              "operators)."),
    "demo": ("triggerflow.cli.tools:register",
             "Set up, start a writer, two team consumers and a resumer, defer a mix, show "
             "results."),
    "docs": ("triggerflow.cli.tools:register", "Generated documentation."),
    "health": ("triggerflow.cli.status:register",
               "Probe this host's consumer or writer; exit 0 when it works, 1 otherwise, with "
               "a one-line reason."),
    "requeue": ("triggerflow.cli.admin:register",
                "Re-send triggers no live consumer runs (unclaimed, refused by every consumer, "
                "or owned by a dead one) to their queue."),
    "status": ("triggerflow.cli.status:register",
               "Queues (depth, unacked, consumers, running), processes, writers, the events and "
               "dead-letter queues, overdue and quarantined triggers."),
    "topology": ("triggerflow.cli.services:register", "Broker exchanges and queues."),
    "trigger": ("triggerflow.cli.admin:register", "Inspect triggers."),
    "unquarantine": ("triggerflow.cli.admin:register",
                     "Clear a quarantine: defer again the task it failed and re-send the trigger "
                     "(or drop the trigger when that task has moved on)."),
    "writer": ("triggerflow.cli.services:register", "Apply events to task instances in batches."),
}


class LazyGroup(click.Group):
    """A group whose commands are imported on first use, so ``--help`` and a probe do not pay
    for every command's imports."""

    def __init__(self, *args: Any, lazy: dict[str, tuple[str, str]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = lazy

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *self.lazy})

    def get_command(self, ctx: click.Context | None, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in self.lazy:
            self._load(self.lazy[cmd_name][0])
        return self.commands.get(cmd_name)

    def _load(self, target: str) -> None:
        module, _, name = target.partition(":")
        found = getattr(importlib.import_module(module), name)
        if isinstance(found, click.Command):
            self.add_command(found)
        else:
            found(self)
        for command_name, command in self.commands.items():
            give_env_vars(command, [command_name])

    def invoke(self, ctx: click.Context) -> Any:
        refuse_unknown_variables()
        return super().invoke(ctx)

    def load_all(self) -> LazyGroup:
        """Import every command (the docs generator and tests walk the whole tree)."""
        for name in self.lazy:
            self.get_command(None, name)
        return self

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The command list from the table, importing nothing."""
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(len(name) for name in names)
        rows = []
        for name in names:
            command = self.commands.get(name) or click.Command(name, help=self.lazy[name][1])
            if not command.hidden:
                rows.append((name, command.get_short_help_str(limit)))
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True,
             **extra: Any) -> Any:
        """Click's own handling, except that a bad value and any failure are one line."""
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            code = super().main(args, prog_name, complete_var, False, **extra)
        except click.BadParameter as exc:
            code = _bad_parameter(exc)
        except click.ClickException as exc:
            exc.show()
            code = exc.exit_code
        except click.Abort:
            click.echo("Aborted!", err=True)
            code = 1
        except Exception as exc:  # the one place a command's failure becomes its exit
            code = failures.report(exc)
        sys.exit(code if isinstance(code, int) else 0)


def give_env_vars(command: click.Command, path: list[str]) -> None:
    """Every option of ``command`` (and its subcommands) without a variable gets
    ``TRIGGERFLOW_<COMMAND PATH>_<OPTION>`` (``requeue --force``: TRIGGERFLOW_REQUEUE_FORCE),
    shown in its --help. Settings options keep their own (``TRIGGERFLOW_<SETTING>``)."""
    for param in command.params:
        if not isinstance(param, click.Option) or param.is_eager:
            continue  # --help, --version
        if param.envvar is None:
            flag = next(o for o in param.opts if o.startswith("--"))[2:]
            param.envvar = "_".join(["TRIGGERFLOW", *path, flag]).replace("-", "_").upper()
        param.show_envvar = True
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            give_env_vars(sub, [*path, name])


def refuse_unknown_variables(environ: Mapping[str, str] = os.environ) -> None:
    """Before any command runs: a ``TRIGGERFLOW_*`` variable that names nothing is a typo, and
    a typo ignored runs on a default (exit 2, naming the closest variable)."""
    if not any(name.startswith(PREFIX) for name in environ):
        return  # the settings model (pydantic) is not imported for nothing
    from triggerflow.settings import Settings
    from triggerflow.variables import UnknownSetting

    try:
        Settings.check_environment(environ)
    except UnknownSetting as exc:
        raise failures.ConfigError(str(exc)) from None


def _bad_parameter(exc: click.BadParameter) -> int:
    """A value click refused (its message names the flag, or the variable it came from)."""
    where = f"{exc.ctx.command_path}: " if exc.ctx else ""
    click.echo(f"error: {where}{exc.format_message()}", err=True)
    return exc.exit_code


@click.group(cls=LazyGroup, lazy=COMMANDS,
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="triggerflow")
def main() -> None:
    """triggerflow: deferrable triggers on RabbitMQ, with PostgreSQL as the durable record."""
