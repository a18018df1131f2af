"""The command line without services: what starting a command imports, that every option
has a variable the docs list, and that a bad value is one line naming where it came from
and stops only the commands that use it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import pytest

from triggerflow import logs
from triggerflow.cli.commands import COMMANDS, LazyGroup, main
from triggerflow.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
CLOSED_DB = "postgresql://postgres:pw@127.0.0.1:1/nowhere"  # nothing listens on port 1

# What a probe or --help must not pay for: drivers, ORM, telemetry, rendering, Airflow.
HEAVY = ("asyncpg", "aio_pika", "aiormq", "sqlalchemy", "alembic", "opentelemetry", "rich",
         "pydantic_settings", "airflow", "httpx", "prometheus_client", "uvloop")

# Runs the CLI in-process and writes the imported modules when it exits (it always sys.exits).
PROBE = """
import atexit, json, sys
atexit.register(lambda: open(sys.argv[1], "w").write(json.dumps(sorted(sys.modules))))
from triggerflow.cli import main
main(sys.argv[2:], prog_name="triggerflow")
"""


def run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TRIGGERFLOW_")}
    environ["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "triggerflow", *args], env={**environ, **env},
                          cwd=ROOT, capture_output=True, text=True, timeout=60)


def imported_by(tmp_path: Path, *args: str, **env: str) -> tuple[set[str], int]:
    out = tmp_path / "modules.json"
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TRIGGERFLOW_")}
    environ["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-c", PROBE, str(out), *args], env={**environ, **env},
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    return {m.split(".")[0] for m in json.loads(out.read_text())}, done.returncode


@pytest.mark.parametrize("args", [["--help"], ["status", "--help"], ["health", "--help"],
                                  ["defer", "--help"], ["consume", "--help"]])
def test_help_imports_no_driver_orm_telemetry_or_airflow(tmp_path: Path, args: list[str]) -> None:
    modules, code = imported_by(tmp_path, *args)
    assert code == 0
    assert modules.isdisjoint(HEAVY), sorted(modules & set(HEAVY))
    if args == ["--help"]:
        assert "pydantic" not in modules and "triggerflow.settings" not in modules


@pytest.mark.parametrize("command", [["status"], ["health"],
                                     ["defer", "--queue", "q", "--trigger", "x.Y"]])
def test_commands_start_without_heavy_imports(tmp_path: Path, command: list[str]) -> None:
    """Up to validated settings (here refused, exit 2) a command imports nothing heavy: what
    it needs beyond that is imported when it uses it."""
    modules, code = imported_by(tmp_path, *command, TRIGGERFLOW_HEARTBEAT="0")
    assert code == 2
    assert modules.isdisjoint(HEAVY), sorted(modules & set(HEAVY))


def test_the_lazy_table_is_the_commands_with_their_help() -> None:
    """``triggerflow --help`` lists commands from COMMANDS without importing them: the table
    must name every command the modules register, with its help's first sentence."""
    group = LazyGroup(name="triggerflow", lazy=COMMANDS).load_all()
    fix = "update COMMANDS in triggerflow/cli/commands.py"
    assert set(group.commands) == set(COMMANDS), fix
    for name, (_, first_sentence) in COMMANDS.items():
        loaded = group.commands[name].get_short_help_str(500)
        assert loaded == click.Command(name, help=first_sentence).get_short_help_str(500), \
            f"{name}: {fix}"


def _options() -> list[tuple[str, click.Option]]:
    found: list[tuple[str, click.Option]] = []

    def walk(command: click.Command, path: str) -> None:
        found.extend((path, p) for p in command.params
                     if isinstance(p, click.Option) and not p.is_eager)
        if isinstance(command, click.Group):
            ctx = click.Context(command)
            for name in command.list_commands(ctx):
                sub = command.get_command(ctx, name)
                assert sub is not None
                walk(sub, f"{path} {name}".strip())

    walk(main, "")
    return found


def test_every_option_has_a_variable_shown_in_help_and_listed_in_the_docs() -> None:
    cli_page = (ROOT / "docs" / "cli.md").read_text()
    config_page = (ROOT / "docs" / "configuration.md").read_text()
    options = _options()
    assert len(options) > 100  # the whole tree was walked
    for path, option in options:
        where = f"{path} {option.opts[0]}"
        assert isinstance(option.envvar, str) and option.envvar.startswith("TRIGGERFLOW_"), where
        assert option.show_envvar, where
        assert f"`{option.envvar}`" in config_page, where
        if option.name in Settings.model_fields:
            assert option.envvar == Settings.env_name(option.name), where
        else:  # a command's own option: its section of cli.md names the variable
            assert f"`{option.envvar}`" in cli_page, where


def test_every_setting_is_an_option_of_some_command() -> None:
    """Only declared settings are checked at start: a setting no command declares would
    never be (a bad value would pass unnoticed everywhere)."""
    declared = {option.name for _, option in _options()}
    assert set(Settings.model_fields) - declared == set()


def test_the_variable_of_a_command_option_is_used(tmp_path: Path) -> None:
    out = tmp_path / "config.md"
    done = run("docs", "config", TRIGGERFLOW_DOCS_CONFIG_OUTPUT=str(out))
    assert done.returncode == 0 and done.stdout == ""
    assert out.read_text().startswith("# Configuration reference")


def test_a_source_tree_command_outside_a_checkout_says_where_it_runs() -> None:
    from triggerflow.cli.tools import from_checkout

    assert from_checkout("bench").__name__ == "bench"  # this checkout has it
    with pytest.raises(click.UsageError, match="source tree, not the wheel"):
        from_checkout("no_such_source_tree")


# -- configuration errors


def one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("error: "), done.stderr
    return lines[0]


@pytest.mark.parametrize(("args", "env", "names"), [
    (["consume", "--queue", "q"], {"TRIGGERFLOW_CAPACITY": "abc"}, "TRIGGERFLOW_CAPACITY"),
    (["health"], {"TRIGGERFLOW_HEARTBEAT": "0"}, "TRIGGERFLOW_HEARTBEAT"),
    (["health", "--heartbeat", "0"], {}, "--heartbeat"),
    (["status"], {"TRIGGERFLOW_LOG_FORMAT": "xml"}, "TRIGGERFLOW_LOG_FORMAT"),
    (["status", "--log-level", "loud"], {}, "--log-level"),
    (["health"], {"TRIGGERFLOW_PGBOUNCER": "maybe"}, "TRIGGERFLOW_PGBOUNCER"),
    (["requeue", "1"], {"TRIGGERFLOW_REQUEUE_FORCE": "perhaps"}, "TRIGGERFLOW_REQUEUE_FORCE"),
    (["defer", "--queue", "q", "--trigger", "x.Y"], {"TRIGGERFLOW_DEFER_COUNT": "0"},
     "TRIGGERFLOW_DEFER_COUNT"),
    (["cancel", "1"], {"TRIGGERFLOW_DATABASE_URL": "mysql://u:hunter2@db/x"},
     "TRIGGERFLOW_DATABASE_URL"),
    (["writer"], {"TRIGGERFLOW_TEAM_USERS": "{not json"}, "TRIGGERFLOW_TEAM_USERS"),
    (["consume", "--queue", "q"], {"TRIGGERFLOW_KWARGS_KEY": "hunter2-not-a-fernet-key"},
     "TRIGGERFLOW_KWARGS_KEY"),
])
def test_a_bad_value_is_one_line_naming_its_variable_or_flag(
        args: list[str], env: dict[str, str], names: str) -> None:
    done = run(*args, **env)
    assert done.returncode == 2, done.stderr
    line = one_line_error(done)
    assert names in line
    assert "hunter2" not in line


@pytest.mark.parametrize("command", [["health"], ["status", "--json"], ["trigger", "show", "1"],
                                     ["requeue", "1"]])
def test_an_unrelated_bad_variable_does_not_stop_a_command(command: list[str]) -> None:
    """Each of these reaches its database (refused: exit 1) despite variables it does not
    use holding invalid values."""
    done = run(*command, TRIGGERFLOW_DATABASE_URL=CLOSED_DB, TRIGGERFLOW_CAPACITY="abc",
               TRIGGERFLOW_WRITER_BATCH="-1", TRIGGERFLOW_TEAM_USERS="{not json")
    assert done.returncode == 1, done.stderr
    assert "CAPACITY" not in done.stdout + done.stderr
    assert "Connect" in done.stdout + done.stderr or "connect" in done.stdout + done.stderr


@pytest.mark.parametrize(("given", "level", "fmt"), [
    ({"log_format": "JSON", "log_level": "debug"}, "DEBUG", "json"),
    ({"log_format": "Text", "log_level": "Warning"}, "WARNING", "text"),
])
def test_enumerated_settings_are_case_insensitive(given: dict[str, Any], level: str,
                                                  fmt: str) -> None:
    settings = Settings.without_environment(given)
    assert (settings.log_level, settings.log_format) == (level, fmt)


def test_log_format_json_in_any_case_gives_json_lines(capsys: pytest.CaptureFixture[str]) -> None:
    import logging

    logs.setup("info", "JSON")
    logging.getLogger("triggerflow.test").warning("hello")
    assert json.loads(capsys.readouterr().err.strip().splitlines()[-1])["msg"] == "hello"
    with pytest.raises(ValueError, match="log format 'xml'"):
        logs.setup("INFO", "xml")


def test_airflow_form_of_the_database_url_is_accepted() -> None:
    settings = Settings.without_environment(
        {"database_url": "postgresql+psycopg2://airflow:pw@db:5432/airflow"})
    assert settings.database_dsn() == "postgresql://airflow:pw@db:5432/airflow"


# -- what a service that gives up prints (its last error raised, wrapped or not)


def _raised(inner: BaseException, wrapped: bool) -> BaseException:
    try:
        try:
            raise inner
        except Exception as exc:
            if wrapped:
                raise RuntimeError("gave up after 5 attempts") from exc
            raise
    except Exception as exc:
        return exc


@pytest.mark.parametrize("wrapped", [False, True])
def test_a_refused_login_names_the_url_to_check_even_when_wrapped(wrapped: bool) -> None:
    import asyncpg
    from aiormq.exceptions import ProbableAuthenticationError

    from triggerflow.cli.failures import describe

    settings = Settings.without_environment({
        "amqp_url": "amqp://team:s3cretpw@broker:5672/",
        "database_url": "postgresql://team:s3cretpw@db:5432/triggerflow"})
    broker = describe(_raised(ProbableAuthenticationError(
        "ACCESS_REFUSED - Login was refused using authentication mechanism PLAIN"), wrapped),
        settings)
    assert broker.startswith("the broker at broker:5672 refused the login"), broker
    assert "TRIGGERFLOW_AMQP_URL" in broker
    database = describe(_raised(asyncpg.InvalidPasswordError(
        'password authentication failed for user "team"'), wrapped), settings)
    assert database.startswith("the database at db:5432 refused the login"), database
    assert "TRIGGERFLOW_DATABASE_URL" in database
    assert "s3cretpw" not in broker + database


def test_status_id_states_are_the_stores_statements() -> None:
    from triggerflow.cli.status import ID_STATES
    from triggerflow.store.postgres.admin import TRIGGER_IDS

    assert sorted(ID_STATES) == sorted(TRIGGER_IDS)


def test_a_command_checks_its_own_variables_and_reads_the_others_it_can() -> None:
    """A setting a command uses without declaring it still follows its variable; an invalid
    one it does not declare is left at its default instead of stopping the command."""
    from click.testing import CliRunner

    from triggerflow.cli.options import build_settings, settings_options

    @click.command()
    @settings_options("heartbeat")
    def probe(**values: Any) -> None:
        settings = build_settings(values)
        click.echo(f"{settings.heartbeat} {settings.lease_ttl.total_seconds()} "
                   f"{settings.capacity}")

    runner = CliRunner()
    env = {"TRIGGERFLOW_LEASE_TTL": "1.5", "TRIGGERFLOW_CAPACITY": "abc",
           "TRIGGERFLOW_HEARTBEAT": "7"}
    done = runner.invoke(probe, [], env=env)
    assert (done.exit_code, done.output) == (0, f"7 1.5 {Settings().capacity}\n")
    refused = runner.invoke(probe, [], env={**env, "TRIGGERFLOW_HEARTBEAT": "0"})
    assert refused.exit_code == 2
    assert "TRIGGERFLOW_HEARTBEAT" in refused.output
