"""A team cannot plant a trigger id ahead of the shared sequence.

Issue 19: trigger ids are one namespace. Team A's SDK role inserted a ``trigger`` row of its
own queue under an explicit id the sequence would hand out later, and team B's ``defer`` that
drew it failed (``duplicate key value violates unique constraint "trigger_pkey"``). Since
migration 0011 a listed role may insert only an id its own session drew.
"""

from __future__ import annotations

import asyncpg
import pytest
from yarl import URL

from tests.test_isolation import team_role
from tests.test_task_keys import on_role
from tests.triggers import WaitsForever
from triggerflow.model import TaskKey
from triggerflow.settings import Settings
from triggerflow.store.postgres import Database
from triggerflow.transport.rabbitmq import Topology

PLANT = ("INSERT INTO trigger (id, classpath, kwargs, queue) "
         "VALUES ($1, 'tests.triggers.EventAfter', '{}', $2)")


async def next_trigger_id(db: Database) -> int:
    """The id the sequence hands out next (read as the owner, without drawing it)."""
    value: int = await db.fetchval(
        "SELECT CASE WHEN is_called THEN last_value + 1 ELSE last_value END FROM trigger_id_seq"
    )
    return value


async def test_a_team_cannot_plant_a_trigger_id_another_teams_defer_draws_later(
    db: Database,
    dsn: str,
    teams: list[str],
    settings: Settings,
    topology: Topology,
) -> None:
    mine, theirs = teams
    async with team_role(db, dsn, mine) as dsn_a, team_role(db, dsn, theirs) as dsn_b:
        # The attack, with team A's own credentials and in its own queue.
        conn = await asyncpg.connect(dsn_a)
        try:
            ahead = await next_trigger_id(db) + 1
            with pytest.raises(asyncpg.ObjectNotInPrerequisiteStateError, match="currval"):
                await conn.execute(PLANT, ahead, mine)  # a session that drew no id
            drawn = await conn.fetchval("SELECT nextval(pg_get_serial_sequence('trigger', 'id'))")
            assert ahead == drawn + 1
            with pytest.raises(asyncpg.InsufficientPrivilegeError, match="trigger_id_drawn_by_this_session"):
                await conn.execute(PLANT, ahead, mine)
            await conn.execute(PLANT, drawn, mine)  # an id A drew itself is A's to use
        finally:
            await conn.close()
        assert await db.fetchval("SELECT array_agg(id) FROM trigger") == [drawn]

        # B's defer draws the very id A tried to take, and succeeds.
        async with on_role(settings, dsn_b) as b:
            taken = await b.defer(
                TaskKey("etl", "load", "2030-01-01"), WaitsForever(marker_dir="/"), queue=theirs
            )
        assert taken == ahead
        assert await db.fetchval("SELECT queue FROM trigger WHERE id = $1", ahead) == theirs


async def test_no_role_can_move_a_trigger_to_another_id(
    db: Database,
    dsn: str,
    teams: list[str],
) -> None:
    """A team's consumer role holds UPDATE on ``trigger``: moving its row ahead of the
    sequence would squat on an id just as an insert would."""
    mine = teams[0]
    async with team_role(db, dsn, mine) as dsn_a:
        await db.execute(f'GRANT UPDATE ON trigger TO "{URL(dsn_a).user}"')
        conn = await asyncpg.connect(dsn_a)
        try:
            own = await conn.fetchval(
                "INSERT INTO trigger (classpath, kwargs, queue) "
                "VALUES ('tests.triggers.EventAfter', '{}', $1) RETURNING id",
                mine,
            )
            with pytest.raises(asyncpg.InsufficientPrivilegeError, match="never changes"):
                await conn.execute("UPDATE trigger SET id = id + 100 WHERE id = $1", own)
        finally:
            await conn.close()
    assert await db.fetchval("SELECT array_agg(id) FROM trigger") == [own]
