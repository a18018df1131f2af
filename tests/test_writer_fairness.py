"""One team cannot delay another team's events in the writer (issue 19, attacks 4 and 8), on
the suite's real services, from the attacking team's own credentials: its SDK role holding
row locks on its own deferred tasks, its routing key flooded with oversized junk. The other
team's events are applied while the attack lasts; the attacker's own are applied once it
stops (locks) or dead-lettered with a reason (junk); nothing is lost or applied twice."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from tests.conftest import START_WAIT, Processes, wait_until
from tests.test_bad_input import dead_letters
from tests.test_documented_roles import as_role, roles
from tests.test_isolation import publish_raw, team_role
from tests.test_writer_faults import dead_count, make_deferred, publish_burst, writer_waits_on_lock
from triggerflow.model import TaskKey
from triggerflow.sdk import Deferral, TriggerflowClient
from triggerflow.settings import Settings
from triggerflow.store.postgres import Database
from triggerflow.triggers.temporal import DateTimeTrigger
from triggerflow.wire import Event, encode_events

__all__ = ["roles"]  # a fixture

TIMERS = 40  # per team


async def states(db: Database, queue: str) -> dict[str, int]:
    rows = await db.fetch("SELECT state, count(*) AS n FROM task_instance WHERE queue = $1 "
                          "GROUP BY state", queue)
    return {r["state"]: r["n"] for r in rows}


async def all_scheduled(db: Database, queue: str, n: int) -> bool:
    return await states(db, queue) == {"scheduled": n}


@contextlib.asynccontextmanager
async def sdk_locks_own_tasks(dsn_a: str) -> AsyncIterator[int]:
    """Team A's SDK role, in an open transaction, locks every deferred task it can see (row
    security shows it only its own queue's) as ``SELECT ... FOR UPDATE``; yields how many."""
    conn = await asyncpg.connect(dsn_a)
    tx = conn.transaction()
    await tx.start()
    try:
        rows = await conn.fetch("SELECT id FROM task_instance WHERE state = 'deferred' FOR UPDATE")
        yield len(rows)
    finally:
        await tx.rollback()
        await conn.close()


@pytest.mark.serial  # timing bound (under 5 s late): runs alone, after the parallel part
async def test_a_teams_row_locks_do_not_delay_another_teams_events(
    client: TriggerflowClient, db: Database, dsn: str, procs: Processes, teams: list[str],
    settings: Settings, roles: dict[str, str],
) -> None:
    a, b = teams
    # The writer and consumers on the documented roles: HELD_ELSEWHERE's row locks need
    # nothing the docs do not grant.
    writer = procs.writer(database_url=as_role(dsn, roles["tf_writer"]))
    consuming = as_role(dsn, roles["tf_consumer"])
    # A's consumer publishes small messages: A's batches want every slot of the writer.
    procs.consume(a, event_batch=4, database_url=consuming)
    procs.consume(b, database_url=consuming)

    def timers(queue: str, after: float) -> list[Deferral]:
        moment = datetime.now(UTC) + timedelta(seconds=after)
        return [Deferral(TaskKey("locks", f"{queue}-{i}", "r"), DateTimeTrigger(moment), queue)
                for i in range(TIMERS)]

    await client.defer_many(timers(a, 3))
    async with team_role(db, dsn, a) as dsn_a, sdk_locks_own_tasks(dsn_a) as locked:
        assert locked == TIMERS  # A's own rows only: row security hides B's

        async def a_reached_the_writer() -> bool:
            held = f"queue {a}: rows held by another transaction" in procs.log(writer)
            return held or await writer_waits_on_lock(db)

        # A's events are in the writer, stopped by A's own locks, before B's timers fire.
        await wait_until(a_reached_the_writer, 30, message="A's events met A's locks")
        await client.defer_many(timers(b, 2))
        await wait_until(lambda: all_scheduled(db, b, TIMERS), 30,
                         message="B's timers applied while A holds its locks")
        late = await db.fetchval(
            "SELECT max(extract(epoch FROM event_applied_at - event_fired_at)) "
            "FROM task_instance WHERE queue = $1", b)
        assert late < 5, f"B's events waited {late:.1f} s behind A's locks"
        assert await states(db, a) == {"deferred": TIMERS}
        assert f"queue {a}: rows held by another transaction" in procs.log(writer)
    await wait_until(lambda: all_scheduled(db, a, TIMERS), 20,
                     message="A's events applied once its locks are gone")
    assert await db.fetchval("SELECT count(*) FROM trigger") == 0
    assert await dead_count(settings) == 0


JUNK_MESSAGES = 10
# The broker refuses messages over 4 MiB (tests/test_broker_isolation.py); under that, the
# writer's own cap, set lower here, refuses a message before parsing it.
JUNK_BYTES = 3 * 1024 * 1024 + 512 * 1024
WRITER_CAP = 1024 * 1024


def junk_ids(queue: str) -> bytes:
    """A message of junk events for trigger ids that exist nowhere, ``JUNK_BYTES`` long."""
    one = encode_events([Event(2**40, 0, queue, "resume", "1", 0.0)])
    per_event = len(one) - len(encode_events([]))
    n = JUNK_BYTES // per_event
    return encode_events([Event(2**40 + i, 0, queue, "resume", "1", 0.0) for i in range(n)])


@pytest.mark.serial  # timing bound (under 5 s late): runs alone, after the parallel part
async def test_a_teams_flood_of_junk_does_not_delay_another_teams_events(
    db: Database, procs: Processes, teams: list[str], settings: Settings,
) -> None:
    a, b = teams
    procs.writer(max_event_message_bytes=WRITER_CAP)
    await wait_until(lambda: db.fetchval("SELECT count(*) FROM consumer WHERE kind = 'writer'"),
                     START_WAIT, message="writer registered")
    ids_b = await make_deferred(db, b, TIMERS)
    junk = junk_ids(a)
    flood = asyncio.gather(*(publish_raw(settings, a, junk) for _ in range(JUNK_MESSAGES)))
    await asyncio.sleep(0.5)  # B's events arrive behind the first of A's junk
    await publish_burst(settings, b, ids_b)
    await flood
    await wait_until(lambda: all_scheduled(db, b, TIMERS), 60, message="B's events applied")
    late = await db.fetchval(
        "SELECT max(extract(epoch FROM event_applied_at - event_fired_at)) "
        "FROM task_instance WHERE queue = $1", b)
    assert late < 5, f"B's events waited {late:.1f} s behind A's junk"
    letters = await dead_letters(settings, JUNK_MESSAGES, timeout=30)
    assert len(letters) == JUNK_MESSAGES
    for body, reason in letters:
        assert f"event message of {len(junk)} bytes, over the" in reason, reason
        assert len(body) <= 65_536  # the dead letter keeps a prefix, not 3.5 MB of junk
    assert await dead_count(settings) == 0


POISON = 300  # per message, every one refused by the database


@pytest.mark.serial  # timing bound (under 5 s late): runs alone, after the parallel part
async def test_a_teams_poison_does_not_make_another_team_wait_behind_its_splitting(
    db: Database, procs: Processes, teams: list[str], settings: Settings,
) -> None:
    """Team A's own events, every one with a payload PostgreSQL refuses: the writer splits
    A's batches down to each bad event (hundreds of statements and dead letters), one
    statement per turn, while B's events are applied between two of A's turns."""
    a, b = teams
    procs.writer()
    await wait_until(lambda: db.fetchval("SELECT count(*) FROM consumer WHERE kind = 'writer'"),
                     START_WAIT, message="writer registered")
    ids_a = await make_deferred(db, a, 2 * POISON)
    ids_b = await make_deferred(db, b, TIMERS)
    for part in (ids_a[:POISON], ids_a[POISON:]):
        await publish_raw(settings, a, [Event(t, 0, a, "resume", "not json", time.time())
                                        for t in part])
    await publish_burst(settings, b, ids_b)
    await wait_until(lambda: all_scheduled(db, b, TIMERS), 60, message="B's events applied")
    late = await db.fetchval(
        "SELECT max(extract(epoch FROM event_applied_at - event_fired_at)) "
        "FROM task_instance WHERE queue = $1", b)
    # B overtook A's splitting: most of A's tasks still wait for their refusal.
    still = (await states(db, a)).get("deferred", 0)
    assert late < 5 and still > POISON, (late, still)
    await wait_until(lambda: db.fetchval(
        "SELECT count(*) = $2 FROM task_instance WHERE queue = $1 AND next_method = '__fail__'",
        a, 2 * POISON), 180, message="each of A's bad events refused and its task failed")
    assert await dead_count(settings) == 2 * POISON
