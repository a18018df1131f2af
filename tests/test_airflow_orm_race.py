"""``consume --airflow`` configures Airflow's ORM before any trigger runs
(``task_context.prepare_orm``): left lazy, a trigger class imported on the loop and the first
``workload`` in a thread wait for each other for good (CI saw it: the loop blocked from the
first claim on, every DAG timed out)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator

import pytest

from tests.airflow_support import BASE_ENV
from tests.conftest import ROOT

pytest.importorskip("airflow", reason="needs triggerflow[airflow]")

# Never connected to: configuring the mappers needs no database.
ENV = {**BASE_ENV, "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN":
       "postgresql+psycopg2://nobody@127.0.0.1:9/none", "PYTHONPATH": str(ROOT),
       "PATH": "/usr/bin:/bin"}


def race(mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tests.airflow_orm_race", mode], env=ENV,
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_lazy_orm_deadlocks_and_prepared_does_not() -> None:
    lazy = race("lazy")  # the control: the forced order deadlocks without the defence
    # The verdict is stdout's last line (Airflow 3.2's alembic logs its plugins there first).
    assert (lazy.returncode, lazy.stdout.split()[-1:]) == (3, ["deadlocked"]), lazy.stderr[-2000:]
    prepared = race("prepared")
    assert (prepared.returncode, prepared.stdout.split()[-1:]) == (0, ["finished"]), \
        prepared.stderr[-2000:]


async def test_consumer_prepares_the_orm_before_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    from triggerflow.airflow import runtime, task_context, trigger_logs
    from triggerflow.airflow.mode import AirflowMode
    from triggerflow.settings import Settings

    calls: list[str] = []

    class Runtime:
        ready = asyncio.Event()

    @contextlib.asynccontextmanager
    async def serving() -> AsyncIterator[Runtime]:
        calls.append("runtime")
        yield Runtime()

    @contextlib.contextmanager
    def writing(dsn: str) -> Iterator[None]:
        calls.append("trigger logs")
        yield

    monkeypatch.setattr(task_context, "prepare_orm", lambda: calls.append("prepare_orm"))
    monkeypatch.setattr(runtime, "serving", serving)
    monkeypatch.setattr(trigger_logs, "writing", writing)
    async with AirflowMode(Settings(airflow=True)).serving_consumer() as ready:
        calls.append("serving")
    assert calls == ["prepare_orm", "runtime", "trigger logs", "serving"]
    assert ready is Runtime.ready  # the consumer's warm-up: set once the runtime answers
