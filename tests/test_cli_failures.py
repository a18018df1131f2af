"""The ordinary failures at a command's start, against the suite's real services: the database
or broker unreachable or refusing the login end in one line naming the setting to check,
exit 1, no traceback (unless the log level is DEBUG); a service logs its bounded retries
before it."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from yarl import URL

from tests.conftest import ROOT, Processes, settings_env, wait_until
from triggerflow.settings import Settings
from triggerflow.transport.rabbitmq import Topology

# The suite's PostgreSQL trusts every local login, so a refused login is an unknown role.
SECRET = "hunter2secret"


def run(settings: Settings, *args: str, **overrides: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "triggerflow", *args],
                          env=settings_env(settings, **overrides), cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    # A service retries a bounded number of times, one log line each, then ends with one
    # line: the CLI's error, or the service's own exit line after repeated refusals.
    assert lines and (lines[-1].startswith("error: ") or " exiting: " in lines[-1]), done.stderr
    assert all("retrying in" in line for line in lines[:-1]), done.stderr
    assert SECRET not in done.stdout + done.stderr
    return lines[-1]


def test_database_and_broker_failures_are_one_line_naming_the_setting(
        settings: Settings, topology: Topology) -> None:
    db = URL(settings.database_dsn())
    closed_db = str(db.with_port(1).with_password(SECRET))
    unknown_role = str(db.with_user("nosuchrole").with_password(SECRET))
    missing_db = str(db.with_path("/nosuchdb"))
    amqp = URL(settings.amqp_url.get_secret_value())
    refused_broker = str(amqp.with_password(SECRET))
    closed_broker = str(amqp.with_port(1).with_password(SECRET))
    queue = ["--queue", settings.queues[0]] if settings.queues else ["--queue", "q"]
    cases: list[tuple[list[str], dict[str, str], tuple[str, ...]]] = [
        (["consume", *queue], {"database_url": closed_db},
         ("cannot reach the database at 127.0.0.1:1", "TRIGGERFLOW_DATABASE_URL")),
        (["consume", *queue], {"database_url": unknown_role},
         ("refused our credentials", 'role "nosuchrole" does not exist',
          "TRIGGERFLOW_DATABASE_URL")),
        (["consume", *queue], {"database_url": missing_db},
         ('database "nosuchdb" does not exist', "triggerflow db upgrade")),
        (["writer"], {"database_url": closed_db},
         ("cannot reach the database at 127.0.0.1:1", "TRIGGERFLOW_DATABASE_URL")),
        (["writer"], {"database_url": unknown_role},
         ("refused our credentials", "TRIGGERFLOW_DATABASE_URL")),
        (["topology", "apply", *queue], {"amqp_url": refused_broker},
         (f"the broker at {amqp.host}:{amqp.port} refused the login", "TRIGGERFLOW_AMQP_URL")),
        (["topology", "apply", *queue], {"amqp_url": closed_broker},
         ("cannot reach the broker at 127.0.0.1:1", "TRIGGERFLOW_AMQP_URL")),
        (["defer", *queue, "--trigger", "triggerflow.triggers.temporal.TimeDeltaTrigger",
          "--kwargs", '{"delta": 5}'], {"database_url": unknown_role},
         ("refused the login", "TRIGGERFLOW_DATABASE_URL")),
        (["requeue", "1"], {"database_url": closed_db},
         ("cannot reach the database", "TRIGGERFLOW_DATABASE_URL")),
    ]
    # Each case is a process of its own that spends most of its time in its retries' back-off:
    # run side by side, they take the time of the slowest instead of the sum.
    with ThreadPoolExecutor(len(cases)) as pool:
        done = list(pool.map(lambda case: run(settings, *case[0], **case[1]), cases))
    for (args, _, wanted), result in zip(cases, done, strict=True):
        line = one_line(result)
        for text in wanted:
            assert text in line, (args, line)


def test_status_with_the_database_down_is_one_line(settings: Settings) -> None:
    closed_db = str(URL(settings.database_dsn()).with_port(1).with_password(SECRET))
    one_line(run(settings, "status", database_url=closed_db))


def test_debug_log_level_adds_the_traceback(settings: Settings) -> None:
    closed_db = str(URL(settings.database_dsn()).with_port(1))
    done = run(settings, "consume", "--queue", "q", "--log-level", "debug",
               database_url=closed_db)
    assert done.returncode == 1
    assert "Traceback" in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("error: cannot reach the database")


def test_airflow_form_of_the_database_url_works(settings: Settings, topology: Topology,
                                                teams: list[str]) -> None:
    psycopg2_form = settings.database_dsn().replace("postgresql://", "postgresql+psycopg2://")
    done = run(settings, "defer", "--queue", teams[0], "--trigger",
               "triggerflow.triggers.temporal.TimeDeltaTrigger", "--kwargs", '{"delta": 60}',
               database_url=psycopg2_form)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"deferred 1 task(s) on triggerflow.triggers.temporal."
                                  f"TimeDeltaTrigger to {teams[0]}")


async def test_log_format_in_capitals_gives_json_lines(procs: Processes, teams: list[str]) -> None:
    consumer = procs.consume(teams[0], log_format="JSON")

    async def check() -> dict[str, Any] | None:
        for line in procs.log(consumer).splitlines():
            if "registered as consumer" in line:
                parsed: dict[str, Any] = json.loads(line)  # not JSON: the test fails here
                return parsed
        return None

    record = await wait_until(check, 30, message="the consumer's registration logged")
    assert record["level"] == "INFO" and record["logger"] == "triggerflow.lease"
