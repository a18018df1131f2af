"""The per-task trigger log files of ``consume --airflow`` (``triggerflow/airflow/trigger_logs.py``),
in process on a real Airflow 3.3.2 database: a trigger's lines, through its structlog
logger and through ``logging``, land in the file Airflow's API server reads for its task
(``<task log file>.trigger.<suffix>.log`` under ``base_log_folder``), secrets masked; lines of
no trigger and of triggerflow's own loggers do not; a full buffer drops and counts."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import asyncpg
import pytest

from tests.airflow_support import add_deferred_task, airflow_db, airflow_template, dsn_of, prepare
from triggerflow.airflow import trigger_logs
from triggerflow.airflow.runtime import CURRENT_TRIGGER

__all__ = ["airflow_db", "airflow_template"]

pytestmark = pytest.mark.usefixtures("airflow_template")

SECRET = "s3cr3t-in-trigger-log"


def lines_of(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_a_triggers_lines_land_in_its_tasks_trigger_log_masked(airflow_db: str, tmp_path: Path) -> None:
    import structlog
    from airflow.sdk._shared.secrets_masker import mask_secret

    dsn = dsn_of(airflow_db)
    await prepare(dsn)
    conn = await asyncpg.connect(dsn)
    try:
        task = await add_deferred_task(conn, "logs_here", "x.Trigger", "{}", map_index=3)
        other = await add_deferred_task(conn, "logs_not", "x.Trigger", "{}")
    finally:
        await conn.close()
    mask_secret(SECRET)
    with trigger_logs.writing(dsn, str(tmp_path)) as sink:
        token = CURRENT_TRIGGER.set(task.trigger_id)
        try:
            structlog.get_logger("my_company.triggers").info(
                "polled %s, password %s", "api", SECRET, attempt=2
            )
            logging.getLogger("my_company.hooks").warning("hook says %s", SECRET)
            logging.getLogger("triggerflow.consumer").warning("not the trigger's own line")
        finally:
            CURRENT_TRIGGER.reset(token)
        structlog.get_logger("my_company.triggers").info("logged by no trigger")
    assert sink.written == 2 and sink.dropped == 0
    expected = (
        tmp_path / "dag_id=tf_golden/run_id=manual__golden/task_id=logs_here/"
        f"map_index=3/attempt=1.log.trigger.{trigger_logs.log_suffix()}.log"
    )
    assert [p.relative_to(tmp_path) for p in tmp_path.rglob("*.log")] == [expected.relative_to(tmp_path)]
    first, second = lines_of(expected)
    assert (first["event"], first["level"], first["logger"], first["attempt"]) == (
        "polled api, password ***",
        "info",
        "my_company.triggers",
        2,
    )
    assert str(first["timestamp"]).endswith("Z")
    assert (second["event"], second["level"], second["logger"]) == (
        "hook says ***",
        "warning",
        "my_company.hooks",
    )
    assert SECRET not in expected.read_text()
    assert other.trigger_id not in [t for t, path in sink.paths.items() if path is not None]


def test_a_full_buffer_drops_and_counts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trigger_logs, "MAX_BUFFERED", 3)
    sink = trigger_logs.TriggerLogs("postgresql://unused", tmp_path)
    for n in range(5):
        sink.add(1, {"event": str(n)})
    assert [e["event"] for _, e in sink.buffer] == ["0", "1", "2"] and sink.dropped == 2
