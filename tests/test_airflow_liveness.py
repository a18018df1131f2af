"""The writer's ``TriggererJob`` heartbeat vouches for the consumers
(``triggerflow/airflow/liveness.py``), on a real Airflow 3.3.2 database with the real
``airflow jobs check``: while a queue has a deferred task and no live consumer, the heartbeat is
withheld and Airflow reports no alive triggerer; once a consumer of that queue holds a lease,
the heartbeat resumes and Airflow reports it alive."""

from __future__ import annotations

import asyncio
import logging

import asyncpg
import pytest

from tests import airflow_support as af
from tests.airflow_support import airflow_db, airflow_template
from tests.test_airflow_setup import jobs_check
from triggerflow.airflow import heartbeat, liveness
from triggerflow.airflow.kwargs import encrypt_kwargs
from triggerflow.airflow.schema import SCHEMA

__all__ = ["airflow_db", "airflow_template"]

ADD_CONSUMER = f"""
INSERT INTO {SCHEMA}.consumer (kind, host, pid, queues, capacity, expires_at, subscribed)
VALUES ($1, 'test', 1, $2, 100, now() + make_interval(secs => $3), $4) RETURNING id
"""


async def test_unserved_queues_are_those_with_deferred_work_and_no_live_subscribed_consumer(
    airflow_db: str,
) -> None:
    dsn = af.dsn_of(airflow_db)
    await af.prepare(dsn)
    conn = await asyncpg.connect(dsn)
    try:
        kwargs = encrypt_kwargs({"x": 1})
        for name, queue in (("a", "team-a"), ("b", "team-b"), ("c", "team-c"), ("none", None)):
            await af.add_deferred_task(conn, name, "m.T", kwargs, queue=queue)
        # a trigger row whose task is no longer deferred is no work
        done = await af.add_deferred_task(conn, "done", "m.T", kwargs, queue="team-d")
        await conn.execute("UPDATE task_instance SET state = 'success' WHERE task_id = $1", done.task_id)
        # a row with no queue and no default queue: nothing serves it (statements/unserved.py)
        assert await liveness.unserved_queues(conn, None) == [
            "(no queue)", "team-a", "team-b", "team-c"]
        assert await liveness.unserved_queues(conn, "dflt") == ["dflt", "team-a", "team-b", "team-c"]
        assert await liveness.unserved_queues(conn, "dflt", ["team-b", "team-x"]) == ["team-b"]
        await conn.execute(ADD_CONSUMER, "consumer", ["team-a"], 60.0, True)  # live
        await conn.execute(ADD_CONSUMER, "consumer", ["team-b"], -1.0, True)  # lease expired
        await conn.execute(ADD_CONSUMER, "consumer", ["team-c"], 60.0, False)  # not subscribed
        await conn.execute(ADD_CONSUMER, "writer", ["dflt"], 60.0, True)  # a writer runs nothing
        assert await liveness.unserved_queues(conn, "dflt") == ["dflt", "team-b", "team-c"]
        async with conn.transaction():  # now() is the transaction's: a lease ending now is over
            await conn.execute(ADD_CONSUMER, "consumer", ["team-b"], 0.0, True)
            assert await liveness.unserved_queues(conn, "dflt") == ["dflt", "team-b", "team-c"]
    finally:
        await conn.close()


async def test_airflow_jobs_check_is_unhealthy_while_deferred_work_has_no_consumer(
    airflow_db: str, caplog: pytest.LogCaptureFixture
) -> None:
    dsn = af.dsn_of(airflow_db)
    await af.prepare(dsn)
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2)
    caplog.set_level(logging.INFO, logger=liveness.__name__)
    try:
        async with pool.acquire() as conn:
            await af.add_deferred_task(conn, "waits", "m.T", encrypt_kwargs({"x": 1}), queue="team-a")
        beat = liveness.served_beat(None)
        async with heartbeat.triggerer_job(pool, interval=0.5, stamp=beat) as job_id:
            await asyncio.sleep(4.0)  # the start's stamp is older than the 3 s threshold
            unhealthy = await asyncio.to_thread(jobs_check, airflow_db, 3.0)
            async with pool.acquire() as conn:
                first_beat = await conn.fetchval("SELECT latest_heartbeat FROM job WHERE id = $1", job_id)
                await conn.execute(ADD_CONSUMER, "consumer", ["team-a"], 600.0, True)
            await asyncio.sleep(1.5)  # a few intervals: stamped again
            healthy = await asyncio.to_thread(jobs_check, airflow_db, 30.0)
            async with pool.acquire() as conn:
                resumed = await conn.fetchval("SELECT latest_heartbeat FROM job WHERE id = $1", job_id)
        assert unhealthy.returncode != 0, unhealthy.stdout
        assert "No alive jobs found." in unhealthy.stderr + unhealthy.stdout
        assert healthy.returncode == 0, healthy.stderr
        assert "Found one alive job." in healthy.stdout
        assert resumed > first_beat
        messages = [r.getMessage() for r in caplog.records if r.name == liveness.__name__]
        assert messages == [
            "triggerer heartbeat withheld: deferred work and no live consumer on team-a",
            "triggerer heartbeat resumed: every queue with deferred work has a consumer",
        ]
    finally:
        await pool.close()
