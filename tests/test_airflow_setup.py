"""Airflow mode against a real Airflow 3.3.2 metadata database: set-up, tear-down, version
check, the NOTIFY on new trigger rows, and the triggerer heartbeat as `airflow jobs check`
sees it."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import asyncpg
import pytest

from tests import airflow_support as af
from tests.airflow_support import airflow_db, airflow_template
from triggerflow.airflow import heartbeat, schema
from triggerflow.airflow import setup as airflow_setup
from triggerflow.airflow.kwargs import encrypt_kwargs
from triggerflow.airflow.store import AirflowStore

__all__ = ["airflow_db", "airflow_template"]

AIRFLOW_TABLES = """
SELECT c.relname, string_agg(a.attname || ':' || format_type(a.atttypid, a.atttypmod), ','
                             ORDER BY a.attnum) AS columns
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
WHERE n.nspname = 'public' GROUP BY c.relname ORDER BY c.relname
"""
PUBLIC_TRIGGERS = """
SELECT tgname FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'public' AND NOT t.tgisinternal
"""


def triggerflow_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(af.BIN / "triggerflow"), *args], capture_output=True, text=True,
                          timeout=60)


async def fetch(dsn: str, sql: str) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(dsn)
    try:
        return list(await conn.fetch(sql))
    finally:
        await conn.close()


def test_known_revisions_are_the_heads_of_airflow_3_2_and_3_3() -> None:
    from airflow.utils.db import _REVISION_HEADS_MAP

    assert set(schema.KNOWN_AIRFLOW_REVISIONS) == {"3.2", "3.3"}
    for release, revision in schema.KNOWN_AIRFLOW_REVISIONS.items():
        if f"{release}.0" in _REVISION_HEADS_MAP:  # 3.2's map has no 3.3
            assert revision == _REVISION_HEADS_MAP[f"{release}.0"], release


async def test_setup_is_idempotent_and_teardown_leaves_airflow_as_it_was(airflow_db: str) -> None:
    dsn = af.dsn_of(airflow_db)
    before = await fetch(dsn, AIRFLOW_TABLES)
    for _ in range(2):
        done = triggerflow_cli("airflow", "setup", "--database-url", dsn)
        assert done.returncode == 0, done.stderr
        assert f"Airflow {af.airflow_minor()} schema" in done.stdout
    assert await airflow_setup.installed(dsn) == (True, True)
    assert sorted(r["tgname"] for r in await fetch(dsn, PUBLIC_TRIGGERS)) == [
        "triggerflow_deferred_task_deleted", "triggerflow_notify_insert",
        "triggerflow_task_left_deferred"]  # the last two: the cancel log (airflow/cancels.py)
    # Airflow's tables: not one column added, removed or changed.
    assert await fetch(dsn, AIRFLOW_TABLES) == before
    tables = {r["tablename"] for r in await fetch(
        dsn, "SELECT tablename FROM pg_tables WHERE schemaname = 'triggerflow'")}
    assert tables == {"meta", "consumer", "trigger_state", "cancel_log"}

    done = triggerflow_cli("airflow", "teardown", "--database-url", dsn)
    assert done.returncode == 0, done.stderr
    assert await airflow_setup.installed(dsn) == (False, False)
    assert await fetch(dsn, PUBLIC_TRIGGERS) == []
    assert await fetch(dsn, AIRFLOW_TABLES) == before


async def test_setup_refuses_an_unknown_airflow_schema(airflow_db: str) -> None:
    dsn = af.dsn_of(airflow_db)
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("UPDATE alembic_version SET version_num = 'ffffffffffff'")
    finally:
        await conn.close()
    done = triggerflow_cli("airflow", "setup", "--database-url", dsn)
    assert done.returncode == 1
    assert "Airflow schema revision ffffffffffff is not one triggerflow knows" in done.stderr
    assert await airflow_setup.installed(dsn) == (False, False)
    # A writer or consumer refuses it too, before serving anything (its statements are per
    # release: events.APPLY_FOR).
    with pytest.raises(airflow_setup.UnknownAirflowSchema, match="ffffffffffff"):
        await AirflowStore.connect(dsn)


async def test_setup_refuses_a_database_without_airflow(dsn: str) -> None:
    with pytest.raises(airflow_setup.UnknownAirflowSchema, match="airflow db migrate"):
        await airflow_setup.setup(dsn)


async def test_new_trigger_rows_notify_with_their_ids_and_queue(airflow_db: str) -> None:
    dsn = af.dsn_of(airflow_db)
    await airflow_setup.setup(dsn)
    received: asyncio.Queue[str] = asyncio.Queue()
    listener = await asyncpg.connect(dsn)
    await listener.add_listener(schema.NOTIFY_CHANNEL, lambda *args: received.put_nowait(args[3]))
    writer = await asyncpg.connect(dsn)
    try:
        await af.add_dag_run(writer)
        kwargs = encrypt_kwargs({"x": 1})
        one = await af.add_deferred_task(writer, "one", "m.T", kwargs, queue="team-a")
        message = json.loads(await asyncio.wait_for(received.get(), 5))
        assert message == {"queue": "team-a", "ids": [one.trigger_id]}
        # A bulk insert: one notification per queue and 500 ids, not one per row.
        ids = await writer.fetch(
            """INSERT INTO "trigger" (classpath, kwargs, created_date, queue)
               SELECT 'm.T', $1, now(), CASE WHEN g % 2 = 0 THEN 'team-a' END
               FROM generate_series(1, 1200) g RETURNING id, queue""", kwargs)
        got: dict[str | None, list[int]] = {}
        for _ in range(4):  # team-a: 600 ids -> 2 messages; no queue: 600 -> 2
            message = json.loads(await asyncio.wait_for(received.get(), 5))
            assert len(message["ids"]) <= schema.NOTIFY_CHUNK
            got.setdefault(message["queue"], []).extend(message["ids"])
        assert received.empty()
        assert sorted(got["team-a"]) == sorted(r["id"] for r in ids if r["queue"] == "team-a")
        assert sorted(got[None]) == sorted(r["id"] for r in ids if r["queue"] is None)
    finally:
        await listener.close()
        await writer.close()


def jobs_check(database: str, threshold: float = 30.0) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **af.airflow_env(database),
           "AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD": str(threshold)}
    return subprocess.run([str(af.BIN / "airflow"), "jobs", "check", "--job-type", "TriggererJob"],
                          capture_output=True, text=True, env=env, timeout=120)


async def test_airflow_jobs_check_sees_the_heartbeat(airflow_template: str) -> None:
    """Real ``airflow jobs check`` (each CLI start costs seconds of CPU here, so two, at once,
    on two copies of the database): healthy while a writer beats; unhealthy when the only
    rows are a writer that stopped and one killed outright (its row still 'running', its
    heartbeat stale)."""
    beating, gone = [await af.copy_database(airflow_template) for _ in range(2)]
    pools = {n: await asyncpg.create_pool(af.dsn_of(n), min_size=1, max_size=2)
             for n in (beating, gone)}
    try:
        async with heartbeat.triggerer_job(pools[gone], interval=0.5):
            pass  # started and stopped (state 'success', end_date set)
        async with pools[gone].acquire() as conn:
            killed = await heartbeat.start_job(conn)
            assert await heartbeat.beat(conn, killed)  # then killed: no stop_job
        await asyncio.sleep(3.5)  # stale for a threshold of 3 s
        async with heartbeat.triggerer_job(pools[beating], interval=0.5):
            await asyncio.sleep(1.5)  # beats several times; a threshold of 2 s still holds
            alive, dead = await asyncio.gather(asyncio.to_thread(jobs_check, beating, 2.0),
                                               asyncio.to_thread(jobs_check, gone, 3.0))
        assert alive.returncode == 0, alive.stderr
        assert "Found one alive job." in alive.stdout
        async with pools[gone].acquire() as conn:
            states = dict(await conn.fetch("SELECT id, state FROM job"))
        assert states[killed] == "running" and sorted(states.values()) == ["running", "success"]
        assert dead.returncode != 0
        assert "No alive jobs found." in dead.stderr + dead.stdout
    finally:
        for pool in pools.values():
            await pool.close()
        for name in (beating, gone):
            await af.drop_database(name)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
