"""Task keys are per queue: a team cannot squat on a key another team will defer later.

Attack 12a of issue 19: team A, on its own SDK role, created a task row under a key team B
would use later; B's ``defer`` of that key then met a row its row security hides, and
PostgreSQL refused it ("new row violates row-level security policy"). The key now includes
the queue (migration 0010), so A's rows live in A's namespace of keys only.
"""

from __future__ import annotations

import asyncio
import uuid

import asyncpg
import pytest

from tests.conftest import Processes, admin_sql, drop_database_sql, wait_until
from tests.test_isolation import team_role
from tests.triggers import EventAfter, WaitsForever
from triggerflow.model import TaskKey
from triggerflow.sdk import Deferral, TriggerflowClient
from triggerflow.settings import Settings
from triggerflow.store.postgres import Database, upgrade_schema
from triggerflow.transport.rabbitmq import Topology

DEFERRED = TaskKey("etl", "load", "2030-01-01", 3)  # A defers it first, through the SDK
PLANTED = TaskKey("etl", "report", "2030-01-01")  # A inserts a bare row under it


def on_role(settings: Settings, dsn: str) -> TriggerflowClient:
    return TriggerflowClient(Settings(**{**settings.model_dump(), "database_url": dsn}))


async def rows_of(db: Database) -> set[tuple[str, str, str | None, bool]]:
    return {tuple(r) for r in await db.fetch(
        "SELECT task_id, queue, state, trigger_id IS NOT NULL FROM task_instance")}


async def test_a_team_cannot_squat_on_a_task_key_another_team_defers_later(
    db: Database, dsn: str, procs: Processes, teams: list[str], settings: Settings,
    topology: Topology,
) -> None:
    mine, theirs = teams
    async with team_role(db, dsn, mine) as dsn_a, team_role(db, dsn, theirs) as dsn_b:
        # The attack, with team A's own credentials: both keys are taken before B uses them.
        async with on_role(settings, dsn_a) as a:
            await a.defer(DEFERRED, WaitsForever(marker_dir="/"), queue=mine)
        conn = await asyncpg.connect(dsn_a)
        try:
            await conn.execute(
                "INSERT INTO task_instance (dag_id, task_id, run_id, queue) VALUES ($1, $2, $3, $4)",
                PLANTED.dag_id, PLANTED.task_id, PLANTED.run_id, mine)
        finally:
            await conn.close()
        squatted = await rows_of(db)
        assert squatted == {("load", mine, "deferred", True), ("report", mine, None, False)}

        procs.writer()
        procs.consume(theirs)
        async with on_role(settings, dsn_b) as b:
            await b.defer_many([Deferral(key, EventAfter(kind="success"), theirs)
                                for key in (DEFERRED, PLANTED)])
        await wait_until(lambda: db.fetchval(
            "SELECT count(*) = 2 FROM task_instance WHERE queue = $1 AND state = 'success'",
            theirs), 20, message="team B's tasks completed")
    # A's rows are as A left them; B's are its own.
    assert await rows_of(db) == squatted | {("load", theirs, "success", False),
                                            ("report", theirs, "success", False)}


async def test_the_upgrade_keeps_existing_task_rows_and_keys_them_per_queue(pg_server: str) -> None:
    name = f"tf_keys_{uuid.uuid4().hex[:12]}"
    await admin_sql(pg_server, f'CREATE DATABASE "{name}"')
    insert = ("INSERT INTO task_instance (dag_id, task_id, run_id, state, queue) "
              "VALUES ('etl', $1, 'r', 'success', $2)")
    try:
        dsn = f"{pg_server}/{name}"
        await asyncio.to_thread(upgrade_schema, dsn, "0009")
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(insert, "load", "team-ml")
            await conn.execute(insert, "report", None)  # rows the SDK did not write
            await asyncio.to_thread(upgrade_schema, dsn)
            assert {tuple(r) for r in await conn.fetch(
                "SELECT task_id, queue FROM task_instance")} == {("load", "team-ml"),
                                                                 ("report", None)}
            await conn.execute(insert, "load", "team-data-eng")  # the key, in another queue
            with pytest.raises(asyncpg.UniqueViolationError, match="task_instance_queue_key"):
                await conn.execute(insert, "load", "team-ml")
        finally:
            await conn.close()
    finally:
        await admin_sql(pg_server, drop_database_sql(name))
