"""``adopt``: task trigger rows with no queue (what Airflow 3.3.2's scheduler writes for a
``start_from_trigger`` task) get their task instance's queue, in a real Airflow 3.3.2
database; rows an Airflow triggerer holds, rows of other queues and rows with no task stay
as they are."""

from __future__ import annotations

import asyncpg
import pytest

import tests.airflow_support as af
from tests.airflow_support import airflow_db, airflow_template

__all__ = ["airflow_db", "airflow_template"]

DATETIME_TRIGGER = "airflow.providers.standard.triggers.temporal.DateTimeTrigger"


@pytest.fixture
async def dsn(airflow_db: str) -> str:
    dsn = af.dsn_of(airflow_db)
    await af.prepare(dsn, set_up=False)
    return dsn


async def no_queue_row(conn: asyncpg.Connection, task_id: str, task_queue: str) -> int:
    """A deferred task on queue ``task_queue`` whose trigger row has no queue, as the
    scheduler's ``TaskInstance.defer_task`` writes it."""
    from triggerflow.airflow.kwargs import encrypt_kwargs

    task = await af.add_deferred_task(
        conn,
        task_id,
        DATETIME_TRIGGER,
        encrypt_kwargs({"target_time": "2026-01-01T00:00:00"}),
        queue=task_queue,
    )
    await conn.execute('UPDATE "trigger" SET queue = NULL WHERE id = $1', task.trigger_id)
    return task.trigger_id


async def queue_of(conn: asyncpg.Connection, trigger_id: int) -> str | None:
    queue: str | None = await conn.fetchval('SELECT queue FROM "trigger" WHERE id = $1', trigger_id)
    return queue


async def test_rows_with_no_queue_get_their_tasks_queue_unless_airflow_holds_them(dsn: str) -> None:
    conn = await asyncpg.connect(dsn)
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=1)
    try:
        await check_adoption(conn, pool)
    finally:
        await pool.close()
        await conn.close()


async def check_adoption(conn: asyncpg.Connection, pool: asyncpg.Pool) -> None:
    from triggerflow.airflow.adopt import adopt

    ml = await no_queue_row(conn, "ml", "team-ml")
    other = await no_queue_row(conn, "other", "team-other")
    held = await no_queue_row(conn, "held", "team-ml")
    stale = await no_queue_row(conn, "stale", "team-ml")
    # An asset watcher's row: no task instance, so no task queue to take.
    watcher = await conn.fetchval(
        """INSERT INTO "trigger" (classpath, kwargs, created_date) VALUES ($1, '{}', now())
           RETURNING id""",
        DATETIME_TRIGGER,
    )
    # Airflow triggerers (no --queues) that assigned themselves a row: one heart-beating,
    # one whose heartbeat is a minute old (Airflow would hand its rows to another).
    live, dead = [
        await conn.fetchval(
            """INSERT INTO job (job_type, state, start_date, latest_heartbeat, hostname, unixname)
           VALUES ('TriggererJob', 'running', now(), now() - make_interval(secs => $1), 'h', 'u')
           RETURNING id""",
            age,
        )
        for age in (0.0, 60.0)
    ]
    await conn.execute('UPDATE "trigger" SET triggerer_id = $1 WHERE id = $2', live, held)
    await conn.execute('UPDATE "trigger" SET triggerer_id = $1 WHERE id = $2', dead, stale)

    # A writer given --queue team-ml: only that queue's rows, by id (a notification).
    assert await adopt(pool, [ml, other, held, watcher], ["team-ml"]) == {"team-ml": [ml]}
    # The backstop (every row with no queue), a writer of every queue.
    assert await adopt(pool, None, []) == {"team-other": [other], "team-ml": [stale]}
    assert await adopt(pool, None, []) == {}  # nothing left to adopt
    assert [await queue_of(conn, i) for i in (ml, other, held, stale, watcher)] == [
        "team-ml",
        "team-other",
        None,
        "team-ml",
        None,
    ]
