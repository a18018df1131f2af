"""The writer survives what happens between its commit and its ack, and database errors that
are not a lost connection, on the suite's own services. A 5,000-event burst is held by a row
lock so the fault lands while the batch is in the statement; a spy queue bound to the events
exchange shows what was published. Every task is applied exactly once and nothing reaches
the dead-letter queue (a writer death would spend the deliveries' limit)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator

import aio_pika
import asyncpg
import pytest

from tests.conftest import START_WAIT, Processes, SuiteServices, wait_until
from tests.test_faults import close_connections
from triggerflow.settings import Settings
from triggerflow.store.postgres import Database
from triggerflow.transport.rabbitmq import RabbitTransport, Topology
from triggerflow.wire import Event

BURST = 5000
PER_MESSAGE = 500
# The test's row lock is how a fault lands mid-statement: the writer must wait for it, not
# give up after its lock_timeout and apply around it (tests/test_writer_fairness.py does that).
WAITS_FOR_THE_LOCK = {"writer_lock_timeout": 120}

MAKE_DEFERRED = """
WITH t AS (
    INSERT INTO trigger (classpath, kwargs, queue)
    SELECT 'tests.triggers.EventAfter', '{}', $1 FROM generate_series(1, $2)
    RETURNING id
)
INSERT INTO task_instance (dag_id, task_id, run_id, state, queue, next_method, trigger_id)
SELECT 'burst', 't' || id, 'r', 'deferred', $1, 'execute_complete', id FROM t
RETURNING trigger_id
"""


async def make_deferred(db: Database, queue: str, n: int) -> list[int]:
    rows = await db.fetch(MAKE_DEFERRED, queue, n)
    return sorted(r["trigger_id"] for r in rows)


async def publish_burst(settings: Settings, queue: str, ids: list[int]) -> None:
    """What consumers would publish: each trigger's event, under its queue's routing key."""
    broker = RabbitTransport(settings.amqp_dsn(), Topology(settings.namespace))
    await broker.connect()
    try:
        for i in range(0, len(ids), PER_MESSAGE):
            events = [Event(t, 0, queue, "resume", f'{{"n": {t}}}', time.time())
                      for t in ids[i:i + PER_MESSAGE]]
            await broker.publish_events(queue, events)
    finally:
        await broker.close()


@contextlib.asynccontextmanager
async def spy(settings: Settings) -> AsyncIterator[aio_pika.abc.AbstractQueue]:
    """A queue bound to the events exchange: a copy of every event message published."""
    conn = await aio_pika.connect(settings.amqp_dsn())
    try:
        ch = await conn.channel()
        q = await ch.declare_queue(exclusive=True)
        await q.bind(Topology(settings.namespace).events, "#")
        yield q
    finally:
        await conn.close()


async def spied_events(q: aio_pika.abc.AbstractQueue) -> int:
    from triggerflow.wire import decode_events

    n = 0
    while (msg := await q.get(fail=False)) is not None:
        n += len(decode_events(msg.body))
        await msg.ack()
    return n


@contextlib.asynccontextmanager
async def row_lock(dsn: str, trigger_id: int) -> AsyncIterator[None]:
    """Hold ``trigger_id``'s row: the writer's batch naming it waits in its statement."""
    conn = await asyncpg.connect(dsn, server_settings={"default_transaction_read_only": "off"})
    tx = conn.transaction()
    await tx.start()
    await conn.execute("SELECT 1 FROM trigger WHERE id = $1 FOR UPDATE", trigger_id)
    try:
        yield
    finally:
        await tx.rollback()
        await conn.close()


async def writer_waits_on_lock(db: Database) -> bool:
    return bool(await db.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND wait_event_type = 'Lock' AND query LIKE '%WITH ev AS%'"))


async def dead_count(settings: Settings) -> int:
    conn = await aio_pika.connect(settings.amqp_dsn())
    try:
        ch = await conn.channel()
        q = await ch.declare_queue(Topology(settings.namespace).dead_queue, passive=True)
        return int(q.declaration_result.message_count or 0)
    finally:
        await conn.close()


async def all_applied_once(db: Database, n: int) -> bool:
    row = await db.fetchrow(
        "SELECT count(*) FILTER (WHERE state = 'scheduled' "
        "  AND (next_kwargs->'event'->>'n')::bigint = substr(task_id, 2)::bigint) AS ok, "
        "(SELECT count(*) FROM trigger) AS left FROM task_instance")
    assert row is not None
    return bool(row["ok"] == n and row["left"] == 0)


@pytest.mark.parametrize("fault", ["close-connection", "sigkill"])
async def test_writer_fault_between_commit_and_ack_applies_each_event_once(
    fault: str, db: Database, dsn: str, procs: Processes, teams: list[str],
    settings: Settings, services: SuiteServices,
) -> None:
    services.owned("amqp")
    writer = procs.writer(**WAITS_FOR_THE_LOCK)
    await wait_until(lambda: db.fetchval("SELECT count(*) FROM consumer WHERE kind = 'writer'"),
                     START_WAIT, message="writer registered")
    ids = await make_deferred(db, teams[0], BURST)
    async with spy(settings) as spy_q:
        async with row_lock(dsn, ids[0]):
            await publish_burst(settings, teams[0], ids)
            await wait_until(lambda: writer_waits_on_lock(db), 15,
                             message="batch held by the lock")
            if fault == "sigkill":
                writer.send_signal(signal.SIGKILL)
                writer.wait(10)
            else:
                assert close_connections(services, "triggerflow-writer", "test: close") == 1
            await asyncio.sleep(0.5)
        # The lock is gone: the held statement commits; its ack cannot reach the broker.
        if fault == "sigkill":
            writer = procs.writer(**WAITS_FOR_THE_LOCK)
        await wait_until(lambda: all_applied_once(db, BURST), 30,
                         message="every task applied once")
        assert writer.poll() is None, "the writer died"
        assert await spied_events(spy_q) == BURST
    assert await dead_count(settings) == 0


@pytest.mark.parametrize("setting, value", [
    ("default_transaction_read_only", "on"),  # a primary turned read-only during failover
    ("statement_timeout", "300ms"),  # the batch held past the timeout by a row lock
])
async def test_writer_rides_out_database_errors_that_are_not_a_lost_connection(
    setting: str, value: str, db: Database, dsn: str, pg_server: str, procs: Processes,
    teams: list[str], settings: Settings, services: SuiteServices,
) -> None:
    services.owned("pg")
    writer = procs.writer(**WAITS_FOR_THE_LOCK)
    await wait_until(lambda: db.fetchval("SELECT count(*) FROM consumer WHERE kind = 'writer'"),
                     START_WAIT, message="writer registered")
    ids = await make_deferred(db, teams[0], 200)
    admin = await asyncpg.connect(f"{pg_server}/postgres",
                                  server_settings={"default_transaction_read_only": "off"})
    try:
        async with row_lock(dsn, ids[0]):
            # ALTER SYSTEM + reload reaches the writer's open sessions, as a failover would.
            await admin.execute(f"ALTER SYSTEM SET {setting} = '{value}'")
            await admin.execute("SELECT pg_reload_conf()")
            await asyncio.sleep(0.5)
            await publish_burst(settings, teams[0], ids)
            await asyncio.sleep(3)  # the writer meets the error several times
            assert writer.poll() is None, "the writer died"
            assert await db.fetchval("SELECT count(*) FROM trigger") == 200
    finally:
        await admin.execute(f"ALTER SYSTEM RESET {setting}")
        await admin.execute("SELECT pg_reload_conf()")
        await admin.close()
    await wait_until(lambda: all_applied_once(db, 200), 15, message="every task applied once")
    assert writer.poll() is None
    assert "retrying" in procs.log(writer)
    assert await dead_count(settings) == 0


async def test_writer_rides_out_its_backend_killed_mid_statement(
    db: Database, dsn: str, procs: Processes, teams: list[str], settings: Settings,
) -> None:
    """The batch's connection dies inside its transaction (what a server restart does to a
    statement in flight): the batch goes again on a new connection."""
    writer = procs.writer(**WAITS_FOR_THE_LOCK)
    await wait_until(lambda: db.fetchval("SELECT count(*) FROM consumer WHERE kind = 'writer'"),
                     START_WAIT, message="writer registered")
    ids = await make_deferred(db, teams[0], 500)
    async with row_lock(dsn, ids[0]):
        await publish_burst(settings, teams[0], ids)
        await wait_until(lambda: writer_waits_on_lock(db), 15, message="batch held by the lock")
        killed = await db.fetchval(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND wait_event_type = 'Lock' "
            "AND query LIKE '%WITH ev AS%'")
        assert killed == 1
        await asyncio.sleep(0.5)
    await wait_until(lambda: all_applied_once(db, 500), 30, message="every task applied once")
    assert writer.poll() is None, "the writer died"
    assert "retrying" in procs.log(writer)
    assert await dead_count(settings) == 0
