"""The per-queue gauges of ``consume --airflow`` / ``writer --airflow``: read through Airflow
mode (triggerflow's schema beside Airflow's rows), never native mode's tables, which an
Airflow database does not have."""

from __future__ import annotations

import asyncpg
import pytest
from pydantic import SecretStr

from tests import airflow_support as af
from tests.airflow_support import airflow_db, airflow_template
from triggerflow.airflow.store import AirflowStore
from triggerflow.modes import NativeMode
from triggerflow.queue_gauges import QueueGauges, QueueSample
from triggerflow.settings import Settings
from triggerflow.store import ProcessKind
from triggerflow.transport.rabbitmq import Topology
from triggerflow.wiring import rabbit_transport

__all__ = ["airflow_db", "airflow_template"]

DATETIME_TRIGGER = "airflow.providers.standard.triggers.temporal.DateTimeTrigger"


async def test_gauges_read_airflow_mode_rows(airflow_db: str, settings: Settings,
                                             topology: Topology, teams: list[str]) -> None:
    from triggerflow.airflow.kwargs import encrypt_kwargs

    dsn = af.dsn_of(airflow_db)
    await af.prepare(dsn)
    team = teams[0]
    conn = await asyncpg.connect(dsn)
    store = await AirflowStore.connect(dsn)
    try:
        kwargs = encrypt_kwargs({"moment": "2026-11-30T12:00:00+00:00"})
        for name in ("waiting", "overdue"):
            await af.add_deferred_task(conn, name, DATETIME_TRIGGER, kwargs, queue=team)
        # Past its timeout by more than the scheduler's check interval allows for.
        await conn.execute("UPDATE task_instance SET trigger_timeout = now() - interval '2 min'"
                           " WHERE task_id = 'overdue'")
        consumer = await store.register(ProcessKind.CONSUMER, "h", 1, [team], 100, "t", 30)
        await store.renew(consumer, 30, 0, [team], subscribed=True)
        await store.register(ProcessKind.WRITER, "h", 2, [], 0, "t", 30)
        # Registered long enough ago to be subscribed, yet the broker delivers to nobody.
        await conn.execute("UPDATE triggerflow.consumer SET registered_at = now() - "
                           "interval '1 min' WHERE id = $1", consumer)

        airflow = settings.model_copy(update={"airflow": True, "database_url": SecretStr(dsn)})
        gauges = QueueGauges(airflow, all_queues=True)  # not started: polled here
        broker = rabbit_transport(airflow, name="test-airflow-gauges")
        await broker.connect()
        source = await gauges.mode.connect_gauges()
        try:
            assert await source.team_queues() == {team}
            snapshot = await gauges.poll(source, broker)
            # What native mode's statements meet in this database: the bug the mode removes.
            native = await NativeMode(airflow).connect_gauges()
            try:
                with pytest.raises(asyncpg.UndefinedTableError):
                    await native.leases([team], 1.0)
            finally:
                await native.close()
        finally:
            await source.close()
            await broker.close()
    finally:
        await store.close()
        await conn.close()

    assert snapshot[team] == QueueSample(depth=0, subscribers=0, consumers=1, unsubscribed=1,
                                         backlog_seconds=0.0, overdue=1)
    assert snapshot[topology.events_queue].consumers == 1  # the writer, by its lease


def test_a_scoped_airflow_writer_reports_its_queues_only() -> None:
    """During a migration the other queues are Airflow's own triggerer's: a writer scoped to
    some must not report the rest as queues without consumers."""
    scoped = QueueGauges(Settings(airflow=True, queues=["team-a"]), all_queues=True)
    assert not scoped.all_queues and scoped.settings.queues == ["team-a"]
    assert QueueGauges(Settings(airflow=True), all_queues=True).all_queues
    assert QueueGauges(Settings(queues=["team-a"]), all_queues=True).all_queues  # native
