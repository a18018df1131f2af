"""Airflow mode's half of the writer's row-lock defence (tests/test_writer_fairness.py has the
native half end to end): on a real Airflow 3.3.2 schema, a batch that meets a task row another
transaction holds fails after the writer's ``lock_timeout`` instead of waiting, and
``apply_unlocked`` applies the free events and names the held one, which applies once the lock
is gone."""

from __future__ import annotations

import asyncpg
import pytest

from tests import airflow_support as af
from tests.airflow_support import airflow_db, airflow_template
from tests.test_airflow_store import defer, resume
from triggerflow.airflow.store import AirflowStore
from triggerflow.store import EventsLocked, ProcessKind

__all__ = ["airflow_db", "airflow_template"]


async def test_a_held_task_row_is_skipped_not_waited_for_and_applied_once_free(
    airflow_db: str,
) -> None:
    dsn = af.dsn_of(airflow_db)
    await af.prepare(dsn)
    held_id = await defer(dsn, "held", "team-a")
    free_id = await defer(dsn, "free", "team-a")
    store = await AirflowStore.connect(dsn, lock_timeout=0.3)
    locker = await asyncpg.connect(dsn)
    try:
        me = await store.register(ProcessKind.CONSUMER, "h", 1, ["team-a"], 10, "t", 30)
        await store.claim(me, [held_id, free_id], ["team-a"])
        events = [resume(held_id, 1, "team-a"), resume(free_id, 1, "team-a")]
        tx = locker.transaction()
        await tx.start()
        await locker.execute("SELECT 1 FROM task_instance WHERE task_id = 'held' FOR UPDATE")
        with pytest.raises(EventsLocked):
            await store.apply_events(events)
        assert await af.scalar(dsn, "SELECT count(*) FROM task_instance "
                                    "WHERE state = 'deferred'") == 2  # all or nothing
        applied, held = await store.apply_unlocked(events)
        assert [a.kind for a in applied] == ["resume"]
        assert [e.trigger_id for e in held] == [held_id]
        assert await af.scalar(dsn, "SELECT state FROM task_instance WHERE task_id = 'free'") \
            == "scheduled"
        await tx.rollback()
        applied, held = await store.apply_unlocked(held)
        assert ([a.kind for a in applied], held) == (["resume"], [])
        assert await af.scalar(dsn, "SELECT state FROM task_instance WHERE task_id = 'held'") \
            == "scheduled"
    finally:
        await locker.close()
        await store.close()


async def test_housekeeping_waits_for_row_locks_the_batches_do_not(airflow_db: str) -> None:
    """The writer's ``lock_timeout`` binds its batches only: its whole-table clean-up (and the
    backstop's re-send) run on a session of their own without one, so a row another
    transaction holds for longer delays them and fails nothing."""
    import asyncio
    import time

    dsn = af.dsn_of(airflow_db)
    await af.prepare(dsn)
    unused = await af.scalar(dsn, """INSERT INTO "trigger" (classpath, kwargs, created_date)
                                     VALUES ('x.Y', '{}', now()) RETURNING id""")
    store = await AirflowStore.connect(dsn, lock_timeout=0.2)
    locker = await asyncpg.connect(dsn)
    try:
        tx = locker.transaction()
        await tx.start()
        await locker.execute('SELECT 1 FROM "trigger" WHERE id = $1 FOR UPDATE', unused)
        release = asyncio.get_running_loop().call_later(1.0, lambda: asyncio.ensure_future(
            tx.rollback()))
        started = time.monotonic()
        assert await store.clean_unused() == 1  # waited for the lock, then deleted the row
        assert time.monotonic() - started >= 0.9
        release.cancel()
        assert await af.scalar(dsn, 'SELECT count(*) FROM "trigger" WHERE id = $1', unused) == 0
    finally:
        await locker.close()
        await store.close()
