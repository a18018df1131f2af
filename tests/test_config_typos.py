"""Configuration that refuses typos: a ``TRIGGERFLOW_*`` variable that names nothing, an AMQP
URL of another scheme and a broker that is not there at start end a command in one line
instead of running on a default or retrying for ever; every variable the deployment files and
docs set or name is one triggerflow knows."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import click
import pytest
from yarl import URL

from tests.conftest import ROOT
from tests.test_cli_failures import SECRET, one_line, run
from triggerflow.cli.commands import main
from triggerflow.errors import ConfigurationError
from triggerflow.settings import Settings
from triggerflow.transport.rabbitmq import Topology
from triggerflow.variables import COMMAND_OPTIONS, READ_ELSEWHERE

# Where a deployment or a reader sets or names variables; docs/configuration.md among them.
DEPLOYMENT = ["compose.yaml", "Dockerfile", "README.md", "deploy/helm", "deploy/kubernetes",
              "docs"]
# Misspellings the docs show being refused.
DOCUMENTED_TYPOS = {"TRIGGERFLOW_CAPCITY"}
NAME = re.compile(r"TRIGGERFLOW_[A-Z0-9_]*[A-Z0-9]")


def cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """The CLI without services, with only ``env`` of the TRIGGERFLOW_* variables."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TRIGGERFLOW_")}
    environ["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "triggerflow", *args], env={**environ, **env},
                          cwd=ROOT, capture_output=True, text=True, timeout=60)


def refused(done: subprocess.CompletedProcess[str]) -> str:
    """The one line of a configuration error (exit 2)."""
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: ")
    return line


@pytest.mark.parametrize("args", [["consume", "--queue", "q"], ["writer"], ["status"],
                                  ["health"], ["db", "upgrade"], ["docs", "config"],
                                  ["airflow", "setup", "--database-url", "postgresql://x/y"]])
def test_a_misspelt_setting_variable_stops_every_command(args: list[str]) -> None:
    line = refused(cli(*args, TRIGGERFLOW_CAPCITY="5"))
    assert line == ("error: TRIGGERFLOW_CAPCITY is not a triggerflow setting; "
                    "did you mean TRIGGERFLOW_CAPACITY?")


@pytest.mark.parametrize(("typo", "meant"), [
    ("TRIGGERFLOW_DATABSE_URL", "TRIGGERFLOW_DATABASE_URL"),
    ("TRIGGERFLOW_AMQP_ULR", "TRIGGERFLOW_AMQP_URL"),
    ("TRIGGERFLOW_MANAGMENT_URL", "TRIGGERFLOW_MANAGEMENT_URL"),
    ("TRIGGERFLOW_REQUEUE_FORCED", "TRIGGERFLOW_REQUEUE_FORCE"),  # a command's own option
])
def test_a_misspelt_url_or_option_variable_names_the_closest(typo: str, meant: str) -> None:
    line = refused(cli("status", **{typo: f"postgresql://u:{SECRET}@h/db"}))
    assert line == f"error: {typo} is not a triggerflow setting; did you mean {meant}?"
    assert SECRET not in line


def test_each_unknown_variable_is_named_on_the_one_line() -> None:
    line = refused(cli("health", TRIGGERFLOW_CAPCITY="5", TRIGGERFLOW_NO_SUCH_THING="1"))
    assert "TRIGGERFLOW_CAPCITY is not a triggerflow setting" in line
    assert "TRIGGERFLOW_NO_SUCH_THING is not a triggerflow setting; see docs/configuration.md" \
        in line


def test_variables_read_elsewhere_and_command_options_are_not_refused() -> None:
    env = {name: "1" for name in READ_ELSEWHERE} | {"TRIGGERFLOW_DEFER_COUNT": "3"}
    done = cli("docs", "config", **env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("# Configuration reference")


@pytest.mark.parametrize("url", ["http://guest:hunter2secret@127.0.0.1:15672/",
                                 "127.0.0.1:5672"])
def test_an_amqp_url_of_another_scheme_is_configuration(url: str) -> None:
    scheme = "http" if "://" in url else "no scheme"
    line = refused(cli("consume", "--queue", "q", TRIGGERFLOW_AMQP_URL=url))
    assert line.startswith(f"error: TRIGGERFLOW_AMQP_URL: not an AMQP URL ({scheme}); "), line
    assert SECRET not in line
    line = refused(cli("writer", "--amqp-url", url))
    assert line.startswith(f"error: --amqp-url: not an AMQP URL ({scheme}); "), line


def test_amqps_is_an_amqp_url() -> None:
    assert Settings(amqp_url="AMQPS://u:p@broker:5671/vh").amqp_url.get_secret_value() \
        == "AMQPS://u:p@broker:5671/vh"


def test_the_sdk_refuses_a_misspelt_variable_or_keyword(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigurationError, match="capcity is not a triggerflow setting; "
                                                 "did you mean capacity"):
        Settings(capcity=5)
    monkeypatch.setenv("TRIGGERFLOW_DATABSE_URL", "postgresql://elsewhere/db")
    with pytest.raises(ConfigurationError, match="did you mean TRIGGERFLOW_DATABASE_URL"):
        Settings()


def _cli_option_variables() -> set[str]:
    found: set[str] = set()

    def walk(command: click.Command) -> None:
        found.update(p.envvar for p in command.params if isinstance(p, click.Option)
                     and not p.is_eager and isinstance(p.envvar, str))
        if isinstance(command, click.Group):
            for sub in command.commands.values():
                walk(sub)

    walk(main.load_all())
    return found - {Settings.env_name(name) for name in Settings.model_fields}


def test_the_command_option_list_is_the_clis() -> None:
    assert _cli_option_variables() == set(COMMAND_OPTIONS), \
        "update COMMAND_OPTIONS in triggerflow/variables.py"


def known(name: str) -> bool:
    try:
        Settings.check_environment({name: ""})
    except ConfigurationError:
        return False
    return True


def _named_in(path: str) -> dict[str, set[str]]:
    """TRIGGERFLOW_* names in a file, or in every file under a folder: name -> files."""
    root = ROOT / path
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    found: dict[str, set[str]] = {}
    for file in files:
        for name in NAME.findall(file.read_text(errors="replace")):
            found.setdefault(name, set()).add(str(file.relative_to(ROOT)))
    return found


def test_every_variable_the_chart_manifests_compose_and_docs_name_is_known() -> None:
    named: dict[str, set[str]] = {}
    for path in DEPLOYMENT:
        for name, files in _named_in(path).items():
            named.setdefault(name, set()).update(files)
    assert "TRIGGERFLOW_TEAM_USERS" in named and "TRIGGERFLOW_CAPACITY" in named  # scanned
    unknown = {name: files for name, files in named.items()
               if name not in DOCUMENTED_TYPOS and not known(name)}
    assert unknown == {}, "a setting, a command option or READ_ELSEWHERE in triggerflow/variables.py"


def test_documented_typos_are_refused() -> None:
    assert not any(known(name) for name in DOCUMENTED_TYPOS)


# -- the broker at start, against the suite's real services


def test_a_broker_not_there_at_start_ends_the_services_in_one_line(
        settings: Settings, topology: Topology, teams: list[str]) -> None:
    """As the database: bounded retries, each logged, then one line (exit 1). A broker lost
    after start is still retried (tests/test_reconnect_units.py, tests/test_faults.py); one
    refusing our credentials at start: tests/test_health.py."""
    amqp = URL(settings.amqp_url.get_secret_value())
    closed = str(amqp.with_port(1).with_password(SECRET))
    queue = teams[0]
    cases: list[tuple[list[str], dict[str, str], tuple[str, ...]]] = [
        (["consume", "--queue", queue], {"amqp_url": closed},
         ("error: cannot reach the broker at 127.0.0.1:1", "TRIGGERFLOW_AMQP_URL")),
        (["writer"], {"amqp_url": closed},
         ("error: cannot reach the broker at 127.0.0.1:1", "TRIGGERFLOW_AMQP_URL")),
    ]
    with ThreadPoolExecutor(len(cases)) as pool:
        done = list(pool.map(lambda case: run(settings, *case[0], **case[1]), cases))
    for (args, _, wanted), result in zip(cases, done, strict=True):
        line = one_line(result)
        assert result.stderr.count("retrying in") == 5, (args, result.stderr)  # then gave up
        for text in wanted:
            assert text in line, (args, line)
