"""Task keys are per queue: a team cannot squat on a key another team will defer later.

Attack 12a of issue 19: team A, on its own SDK role, created a task row under a key team B
would use later; B's ``defer`` of that key then met a row its row security hides, and
PostgreSQL refused it ("new row violates row-level security policy"). The key now includes
the queue (migration 0008), so A's rows live in A's namespace of keys only.
"""

from __future__ import annotations

import asyncpg

from tests.conftest import Processes, wait_until
from tests.test_isolation import team_role
from tests.triggers import EventAfter, WaitsForever
from triggerflow.model import TaskKey
from triggerflow.sdk import Deferral, TriggerflowClient
from triggerflow.settings import Settings
from triggerflow.store.postgres import Database
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
