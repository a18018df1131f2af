"""Airflow's own forms of its database URL (``[database] sql_alchemy_conn``) through the CLI,
against a real Airflow 3.3.2 database: the PostgreSQL forms are taken as ``postgresql://``
(``airflow setup`` succeeds with each); a URL of another database (Airflow's default SQLite,
MySQL) is refused in one line naming the setting, no traceback, exit code 2 (a usage error),
whether given as ``--database-url`` or ``TRIGGERFLOW_DATABASE_URL``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.airflow_support import airflow_db, airflow_template, dsn_of
from tests.conftest import ROOT

__all__ = ["airflow_db", "airflow_template"]

AIRFLOW_FORMS = ("postgresql+psycopg2://", "postgresql+asyncpg://", "postgres://", "postgresql+psycopg://")


def triggerflow(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run(
        [sys.executable, "-m", "triggerflow", *args],
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_airflows_postgresql_url_forms_are_accepted_by_airflow_setup(airflow_db: str) -> None:
    plain = dsn_of(airflow_db)
    assert plain.startswith("postgresql://")
    for form in AIRFLOW_FORMS:
        done = triggerflow("airflow", "setup", "--database-url", plain.replace("postgresql://", form, 1))
        assert done.returncode == 0, (form, done.stderr)
        assert done.stdout.startswith("triggerflow Airflow mode installed"), (form, done.stdout)


@pytest.mark.parametrize(
    ("url", "scheme"),
    [
        ("sqlite:////opt/airflow/airflow.db", "sqlite"),
        ("mysql+mysqldb://airflow:pw@db/airflow", "mysql+mysqldb"),
    ],
)
def test_other_databases_urls_are_refused_in_one_line(url: str, scheme: str) -> None:
    wanted = f"not a PostgreSQL URL ({scheme}); give postgresql://user:pass@host/db"
    for args, env in (
        (["airflow", "setup", "--database-url", url], {}),
        (["consume", "--airflow", "--queue", "q"], {"TRIGGERFLOW_DATABASE_URL": url}),
        (["writer", "--airflow"], {"TRIGGERFLOW_DATABASE_URL": url}),
    ):
        done = triggerflow(*args, env=env)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2, (args, done.returncode, done.stderr)
        assert len(lines) == 1 and "Traceback" not in done.stderr, (args, done.stderr)
        assert lines[0].startswith("error: ") and wanted in lines[0], (args, lines)
        assert "DATABASE_URL" in lines[0] or "--database-url" in lines[0], lines
        assert "pw" not in lines[0] and "Value error" not in lines[0]
