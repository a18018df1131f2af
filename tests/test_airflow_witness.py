"""The scheduler race's witness (triggerflow/airflow/witness.py) on a real Airflow 3.3.2
schema, with no scheduler: the tests write what a scheduler writes (a dag run's
``last_scheduling_decision``, a scheduler job's heartbeat) and read the witness themselves
(``Witness.poll``; the poller's own reads are an hour apart here)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from typing import Any

import asyncpg
import pytest

from tests import airflow_support as af
from tests.airflow_support import airflow_db, airflow_template
from tests.conftest import wait_until
from triggerflow.airflow.witness import Witness

__all__ = ["airflow_db", "airflow_template"]

GRACE = 1.0  # the worker's exit, after the deferral
LATER = 600.0  # a ceiling no test reaches


@pytest.fixture
async def dsn(airflow_db: str) -> str:
    dsn = af.dsn_of(airflow_db)
    await af.prepare(dsn)
    return dsn


@pytest.fixture
async def db(dsn: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(dsn)
    try:
        yield conn
    finally:
        await conn.close()


@contextlib.asynccontextmanager
async def witness(dsn: str) -> AsyncIterator[Witness]:
    w = Witness()
    async with w.serving(dsn, GRACE, poll=3600):
        yield w


async def deferred(conn: asyncpg.Connection, name: str, ago: float = 10.0) -> tuple[int, datetime]:
    """A task deferred ``ago`` seconds ago: its trigger id and deferral time."""
    from triggerflow.airflow.kwargs import encrypt_kwargs

    task = await af.add_deferred_task(conn, name, "airflow.providers.standard.triggers."
                                      "temporal.DateTimeTrigger", encrypt_kwargs({}))
    created = await conn.fetchval(
        """UPDATE "trigger" SET created_date = now() - make_interval(secs => $2)
           WHERE id = $1 RETURNING created_date""", task.trigger_id, ago)
    return task.trigger_id, created


async def stamp(conn: asyncpg.Connection, at: datetime) -> None:
    """What each scheduler loop writes on the running dag runs it examines."""
    await conn.execute("UPDATE dag_run SET last_scheduling_decision = $1", at)


async def held(w: Witness, trigger_id: int, ceiling: float = LATER) -> asyncio.Task[str]:
    """``trigger_id``'s event, held from now on."""
    hold = asyncio.create_task(w.hold(trigger_id, time.time() + ceiling))
    await asyncio.sleep(0)  # the hold registers before its first wait
    return hold


async def settled() -> None:
    await asyncio.sleep(0.05)  # let released holds return


async def test_released_after_two_stamps_past_the_exit(db: asyncpg.Connection, dsn: str) -> None:
    """One stamp past the exit: that loop may queue the task before it reads the exit.
    A second: that loop ended, the exit handled while the task was still deferred."""
    trigger_id, created = await deferred(db, "a")
    exit_ = created + timedelta(seconds=GRACE)
    async with witness(dsn) as w:
        hold = await held(w, trigger_id)
        await stamp(db, exit_ - timedelta(seconds=0.5))  # a loop before the exit
        await w.poll()
        await stamp(db, exit_ + timedelta(seconds=1))  # the loop that reads the exit
        await w.poll()
        await w.poll()
        await settled()
        assert not hold.done()
        await stamp(db, exit_ + timedelta(seconds=2))  # the next loop: the exit was handled
        await w.poll()
        assert await asyncio.wait_for(hold, 10) == "witness"


async def test_released_at_the_ceiling_when_the_scheduler_never_stamps(
        db: asyncpg.Connection, dsn: str) -> None:
    trigger_id, created = await deferred(db, "a")
    await stamp(db, created + timedelta(seconds=GRACE + 1))
    async with witness(dsn) as w:
        hold = await held(w, trigger_id, ceiling=1.0)
        await w.poll()
        await w.poll()
        assert await asyncio.wait_for(hold, 30) == "ceiling"


async def test_an_event_fired_after_its_witness_goes_at_once(
        db: asyncpg.Connection, dsn: str) -> None:
    """Stamps already seen for the dag run (another held event watched them) count for an
    event that fires later: released by the next read, with no new stamp."""
    waiting, _ = await deferred(db, "waiting", ago=-3600.0)  # its exit is an hour away
    late, created = await deferred(db, "late", ago=60.0)
    async with witness(dsn) as w:
        keeper = await held(w, waiting)
        for after in (10, 20):
            await stamp(db, created + timedelta(seconds=after))
            await w.poll()
        hold = await held(w, late)
        await w.poll()
        assert await asyncio.wait_for(hold, 10) == "witness"
        await settled()
        assert not keeper.done()
        keeper.cancel()


async def test_held_events_are_released_together_by_one_read(
        db: asyncpg.Connection, dsn: str) -> None:
    tasks = [await deferred(db, f"t{i}") for i in range(5)]
    latest = max(created for _, created in tasks) + timedelta(seconds=GRACE)
    async with witness(dsn) as w:
        holds = [await held(w, trigger_id) for trigger_id, _ in tasks]
        await stamp(db, latest + timedelta(seconds=1))
        await w.poll()
        await settled()
        assert not any(h.done() for h in holds)
        await stamp(db, latest + timedelta(seconds=2))
        reads = w.polls
        await w.poll()
        done, _ = await asyncio.wait(holds, timeout=10)
        assert w.polls == reads + 1 and len(done) == 5
        assert {h.result() for h in holds} == {"witness"}


async def test_a_trigger_whose_task_moved_on_is_released(db: asyncpg.Connection, dsn: str) -> None:
    trigger_id, _ = await deferred(db, "a")
    async with witness(dsn) as w:
        hold = await held(w, trigger_id)
        await w.poll()
        await db.execute("UPDATE task_instance SET state = 'scheduled', trigger_id = NULL "
                         "WHERE trigger_id = $1", trigger_id)
        await db.execute('DELETE FROM "trigger" WHERE id = $1', trigger_id)
        await w.poll()
        assert await asyncio.wait_for(hold, 10) == "gone"


async def test_with_two_schedulers_the_witness_is_the_queueing_schedulers_heartbeat(
        db: asyncpg.Connection, dsn: str) -> None:
    """Another scheduler's loops stamp the dag run too, but the exit waits in the memory of
    the scheduler that ran the task: only its heartbeats (end of a loop) count."""
    trigger_id, created = await deferred(db, "a")
    exit_ = created + timedelta(seconds=GRACE)
    jobs = [await db.fetchval(
        """INSERT INTO job (state, job_type, start_date, latest_heartbeat, hostname)
           VALUES ('running', 'SchedulerJob', now(), now(), $1) RETURNING id""", host)
        for host in ("s1", "s2")]
    await db.execute("UPDATE task_instance SET queued_by_job_id = $1 WHERE trigger_id = $2",
                     jobs[0], trigger_id)

    async def beat(at: datetime) -> None:
        await db.execute("UPDATE job SET latest_heartbeat = $1 WHERE id = $2", at, jobs[0])

    async with witness(dsn) as w:
        hold = await held(w, trigger_id)
        for after in (1, 2, 3):
            await stamp(db, exit_ + timedelta(seconds=after))
            await w.poll()
        await settled()
        assert not hold.done()
        now = await db.fetchval("SELECT now()")
        for after in (0, 1):
            await beat(now + timedelta(seconds=after))
            await w.poll()
        assert await asyncio.wait_for(hold, 10) == "witness"


async def test_the_consumers_held_resume_goes_with_the_witness(
        db: asyncpg.Connection, dsn: str) -> None:
    """``AirflowCoroutine`` (a timer already due, its deferral younger than the ceiling)
    holds its resume on the consumer's witness: released by the stamps, long before the
    ceiling."""
    import pendulum
    from airflow.providers.standard.triggers.temporal import DateTimeTrigger

    from triggerflow.airflow.loader import AirflowCoroutine
    from triggerflow.airflow.witness import WITNESS
    from triggerflow.model import EventKind

    trigger_id, created = await deferred(db, "a")
    exit_ = created + timedelta(seconds=GRACE)
    coroutine = AirflowCoroutine(DateTimeTrigger(moment=pendulum.now("UTC")),
                                 time.time() + LATER)
    coroutine.trigger_id = trigger_id
    events = coroutine.run()

    async def first_event() -> Any:
        return await anext(events)

    async with WITNESS.serving(dsn, GRACE, poll=0.05):
        first = asyncio.create_task(first_event())
        for after in (1, 2):
            reads = WITNESS.polls
            await stamp(db, exit_ + timedelta(seconds=after))

            async def read_since(reads: int = reads) -> bool:
                return WITNESS.polls > reads or first.done()

            await wait_until(read_since, 30)
        event = await asyncio.wait_for(first, 30)
        await events.aclose()  # type: ignore[attr-defined]
    assert event.kind is EventKind.RESUME
