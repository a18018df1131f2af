"""Golden test: triggerflow's set-based writer against Airflow's own functions.

Two identical copies of the same rows (a database and its ``TEMPLATE`` copy); on one, every
event is applied by Airflow 3.3.2's ``Trigger.submit_event`` / ``submit_failure`` (one ORM
session per event, as the triggerer does) followed by ``Trigger.clean_unused``; on the other,
by ``triggerflow.airflow.events.apply_events`` in one batch. Every row of ``task_instance``,
``xcom`` and ``trigger`` must then be equal, save the instants each side took from its clock.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import subprocess
import sys
import time
from typing import Any

import asyncpg
import pendulum

from tests.airflow_oracle import events_by_task
from tests.airflow_support import (
    DAG_ID,
    add_dag_run,
    add_deferred_task,
    airflow_db,
    airflow_env,
    airflow_minor,
    airflow_template,
    copy_database,
    drop_database,
    dsn_of,
)
from triggerflow.airflow import setup as airflow_setup
from triggerflow.airflow.codec import encode_event, failure_body
from triggerflow.airflow.events import AirflowEvent, apply_events, needs_airflow
from triggerflow.airflow.kwargs import encrypt_kwargs

__all__ = ["airflow_db", "airflow_template"]

DATETIME_TRIGGER = "airflow.providers.standard.triggers.temporal.DateTimeTrigger"
# Instants each side reads from its own clock: equal nullness, both recent.
CALLBACKS = """
SELECT type, fetch_method, bundle_name, state, output, priority_weight, created_at, trigger_id,
       data #>> '{__var,req_class}' AS req_class, data ->> '__type' AS type_tag,
       (data #>> '{__var,req_data}')::jsonb AS request,
       substring(id::text FROM 15 FOR 1) AS uuid_version
FROM callback
ORDER BY (data #>> '{__var,req_data}')::jsonb #>> '{ti,task_id}'
"""
CLOCK_COLUMNS = {"scheduled_dttm", "updated_at", "end_date", "start_date", "timestamp",
                 "created_at"}


async def _rows(dsn: str, sql: str) -> list[dict[str, Any]]:
    conn = await asyncpg.connect(dsn)
    try:
        return [dict(r) for r in await conn.fetch(sql)]
    finally:
        await conn.close()


def _comparable(row: dict[str, Any], since: datetime.datetime,
                original_ids: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in row.items():
        if key in ("id", "task_instance_id") and row.get("task_id") == "failed_retry" and (
                value != original_ids["failed_retry"]):
            value = "<the next try's new id>"  # prepare_db_for_next_try: a fresh uuid7 each side
        if key in CLOCK_COLUMNS and isinstance(value, datetime.datetime) and value >= since:
            value = "<recent>"
        elif key == "duration" and value is not None:
            # each side's own end_date - start_date (set_state's formula)
            spent = (row["end_date"] - row["start_date"]).total_seconds()
            value = "<end - start>" if abs(value - spent) < 0.001 else value
        out[key] = value
    return out


def _apply_with_airflow(database: str, tasks: dict[str, int]) -> None:
    """Airflow's functions run in a process of their own configured for ``database``: some
    (``xcom_push``) open their own session on Airflow's configured engine."""
    subprocess.run([sys.executable, "-m", "tests.airflow_oracle", json.dumps(tasks)],
                   check=True, env={**os.environ, **airflow_env(database)}, timeout=120)


async def test_writer_writes_the_rows_airflow_writes(airflow_db: str) -> None:
    events = events_by_task()
    conn = await asyncpg.connect(dsn_of(airflow_db))
    tasks: dict[str, int] = {}
    try:
        await add_dag_run(conn)
        kwargs = encrypt_kwargs({"moment": pendulum.datetime(2026, 11, 30, tz="UTC"),
                                 "end_from_trigger": False})
        for name in events:
            previous = {"carried": 7} if name == "resume_kwargs" else None
            task = await add_deferred_task(conn, name, DATETIME_TRIGGER, kwargs,
                                           queue="team-a", next_kwargs=previous,
                                           max_tries=1 if name == "failed_retry" else 0)
            tasks[name] = task.trigger_id
        # A task no longer deferred (cleared by hand): its trigger's event must change nothing.
        bystander = await add_deferred_task(conn, "cleared", DATETIME_TRIGGER, kwargs)
        await conn.execute("UPDATE task_instance SET state = 'up_for_retry' WHERE task_id = 'cleared'")
        since = await conn.fetchval("SELECT now()")
        original_ids = {r["task_id"]: r["id"] for r in await conn.fetch(
            "SELECT task_id, id FROM task_instance")}
    finally:
        await conn.close()
    # The DAG as Airflow's handler loads it: 'failed_retry' has a retry left.
    subprocess.run([sys.executable, "-m", "tests.airflow_oracle", "--serialize-dag", DAG_ID,
                    "failed_retry"], check=True, capture_output=True,
                   env={**os.environ, **airflow_env(airflow_db)}, timeout=120)

    ours = await copy_database(airflow_db)
    try:
        _apply_with_airflow(airflow_db, tasks)

        await airflow_setup.setup(dsn_of(ours))
        batch = []
        conn = await asyncpg.connect(dsn_of(ours))
        try:
            await conn.execute(
                "INSERT INTO triggerflow.trigger_state (trigger_id, attempt) SELECT id, 1 FROM trigger")
            for name, event in events.items():
                if isinstance(event, BaseException):
                    kind, body = "fail", failure_body(event)
                else:
                    kind, body = encode_event(event)
                batch.append(AirflowEvent(tasks[name], 1, "team-a", kind, body, time.time()))
            batch.append(AirflowEvent(bystander.trigger_id, 1, "default", "resume", '"late"',
                                      time.time()))
            release = await airflow_setup.check_airflow_schema(conn)  # 3.2 or 3.3
            moved = [r["trigger_id"] for r in await apply_events(conn, batch, "default",
                                                                 release=release)]
        finally:
            await conn.close()
        rest = needs_airflow(batch, set(moved))
        assert [e.trigger_id for e in rest] == [tasks["failed_retry"]]
        done = subprocess.run(
            [sys.executable, "-m", "tests.airflow_oracle", "--triggerflow-orm", dsn_of(ours),
             json.dumps([dataclasses.asdict(e) for e in rest])],
            check=True, capture_output=True, text=True, env={**os.environ, **airflow_env(ours)},
            timeout=120)
        moved += json.loads(done.stdout.strip().splitlines()[-1])
        assert sorted(moved) == sorted(tasks.values())

        for table, order in (("task_instance", "task_id"), ("xcom", "task_id, key"),
                             ("trigger", "id"), ("callback", "data"),
                             ("task_instance_history", "task_id, try_number")):
            sql = f'SELECT * FROM "{table}" ORDER BY {order}'
            if table == "callback":  # random ids; the request compared as the JSON it is
                sql = CALLBACKS
            theirs = [_comparable(r, since, original_ids)
                      for r in await _rows(dsn_of(airflow_db), sql)]
            mine = [_comparable(r, since, original_ids) for r in await _rows(dsn_of(ours), sql)]
            assert len(mine) == len(theirs), table
            if table == "callback":  # success_xcom, success, failed, failed_retry
                assert [json.loads(r["request"])["ti"]["task_id"] for r in mine] == [
                    "failed", "failed_retry", "success", "success_xcom"]
                assert {r["uuid_version"] for r in mine} == {"7"}
            for m, t in zip(mine, theirs, strict=True):
                differ = {k: (m[k], t.get(k)) for k in m if m[k] != t.get(k)}
                assert not differ, (table, m.get("task_id", m.get("id")), differ)
        states = {r["task_id"]: r["state"] for r in await _rows(
            dsn_of(ours), "SELECT task_id, state FROM task_instance")}
        assert states == {"resume": "scheduled", "resume_dict": "scheduled",
                          "resume_kwargs": "scheduled", "fail": "scheduled",
                          "success_xcom": "success", "success": "success", "failed": "failed",
                          # 3.2's handle_event_submit fails it; 3.3 retries (its DAG says so)
                          "failed_retry": "up_for_retry" if airflow_minor() == "3.3" else "failed",
                          "skipped": "skipped", "cleared": "up_for_retry"}
    finally:
        await drop_database(ours)
