"""The cancel log's row triggers on Airflow's ``task_instance`` (``airflow/cancels.py``), on a
real Airflow 3.3.2 database, one case per condition of their ``WHEN``: a task leaving
``deferred``, or moving to another trigger, or deleted while deferred, is logged (with its
``trigger_timeout``) by whichever session does it, Airflow's API server's or the
scheduler's; a row that stays deferred on its trigger, a task that was not deferred, and
every move triggerflow's own sessions make (``cancels.ORIGIN``: the writer's hot path) are
not. Deleting any one condition from the ``WHEN`` fails a case here (``make mutate``). The
notification, once per transaction, and the store's reading of the log are in
``tests/test_airflow_store.py``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import asyncpg
import pytest

from tests import airflow_support as af
from tests.airflow_support import airflow_db, airflow_template
from triggerflow.airflow import cancels
from triggerflow.airflow.kwargs import encrypt_kwargs
from triggerflow.airflow.schema import SCHEMA

__all__ = ["airflow_db", "airflow_template"]

LOGGED = f"SELECT trigger_id, timeout_at IS NOT NULL FROM {SCHEMA}.cancel_log ORDER BY 1"


@dataclass
class Sessions:
    dsn: str
    theirs: asyncpg.Connection
    ours: asyncpg.Connection


@pytest.fixture
async def conns(airflow_db: str) -> AsyncIterator[Sessions]:
    """Airflow's kind of session, and triggerflow's (``ORIGIN`` set at connect)."""
    dsn = af.dsn_of(airflow_db)
    await af.prepare(dsn)
    theirs = await asyncpg.connect(dsn)
    ours = await asyncpg.connect(dsn, server_settings=cancels.ORIGIN)
    try:
        yield Sessions(dsn, theirs, ours)
    finally:
        await theirs.close()
        await ours.close()


async def deferred(conn: asyncpg.Connection, name: str) -> af.DeferredTask:
    task = await af.add_deferred_task(conn, name, "m.T", encrypt_kwargs({}))
    await conn.execute("UPDATE task_instance SET trigger_timeout = now() + interval '1 hour' "
                       "WHERE task_id = $1", name)
    return task


async def test_a_task_leaving_its_trigger_is_logged_whichever_way(conns: Sessions) -> None:
    theirs = conns.theirs
    cleared, marked, moved, deleted = [await deferred(theirs, n)
                                      for n in ("cleared", "marked", "moved", "deleted")]
    other = await theirs.fetchval("""INSERT INTO "trigger" (classpath, kwargs, created_date)
                                     VALUES ('m.T', $1, now()) RETURNING id""", encrypt_kwargs({}))
    await theirs.execute("UPDATE task_instance SET state = NULL WHERE task_id = $1",
                         cleared.task_id)  # cleared: state NULL
    await theirs.execute("UPDATE task_instance SET state = 'success' WHERE task_id = $1",
                         marked.task_id)
    await theirs.execute("UPDATE task_instance SET trigger_id = $2 WHERE task_id = $1",
                         moved.task_id, other)  # deferred again, on another trigger
    await theirs.execute("DELETE FROM task_instance WHERE task_id = $1", deleted.task_id)
    assert await theirs.fetch(LOGGED) == [
        (t.trigger_id, True) for t in (cleared, marked, moved, deleted)]


async def test_rows_that_stay_deferred_or_were_not_deferred_are_not_logged(
        conns: Sessions) -> None:
    theirs = conns.theirs
    staying = await deferred(theirs, "staying")
    await theirs.execute("UPDATE task_instance SET updated_at = now(), next_kwargs = '{}' "
                         "WHERE task_id = $1", staying.task_id)  # still deferred, same trigger
    running = await deferred(theirs, "running")
    await theirs.execute("UPDATE task_instance SET state = 'running' WHERE task_id = $1",
                         running.task_id)  # left deferred: logged, the case's control
    await theirs.execute("UPDATE task_instance SET state = 'success' WHERE task_id = $1",
                         running.task_id)  # was not deferred: nothing more
    await theirs.execute("DELETE FROM task_instance WHERE task_id = $1", running.task_id)
    # a row that never had a trigger, leaving deferred (Airflow never writes one; the WHEN
    # needs its trigger id)
    bare = await deferred(theirs, "bare")
    await theirs.execute("UPDATE task_instance SET trigger_id = NULL WHERE task_id = $1",
                         bare.task_id)  # logged: it let go of its trigger
    await theirs.execute("UPDATE task_instance SET state = 'success' WHERE task_id = $1",
                         bare.task_id)  # no trigger any more: nothing more
    gone = await deferred(theirs, "gone")
    await theirs.execute("UPDATE task_instance SET trigger_id = NULL WHERE task_id = $1",
                         gone.task_id)  # logged
    await theirs.execute("DELETE FROM task_instance WHERE task_id = $1", gone.task_id)  # not
    assert await theirs.fetch(LOGGED) == [
        (running.trigger_id, True), (bare.trigger_id, True), (gone.trigger_id, True)]


async def test_triggerflows_own_moves_are_not_logged(
        conns: Sessions) -> None:
    theirs, ours = conns.theirs, conns.ours
    applied, gone = await deferred(theirs, "applied"), await deferred(theirs, "gone")
    await ours.execute("UPDATE task_instance SET state = 'scheduled', trigger_id = NULL "
                       "WHERE task_id = $1", applied.task_id)  # the writer applying an event
    await ours.execute("DELETE FROM task_instance WHERE task_id = $1", gone.task_id)
    assert await theirs.fetch(LOGGED) == []
