"""The gauges' reads as two SQL statements on one connection: native mode's on triggerflow's
tables, or (given its statements) Airflow mode's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from triggerflow.store.gauges import LeaseGauges, lease_gauges
from triggerflow.store.postgres.admin import ALL_QUEUES, QUEUE_GAUGES
from triggerflow.store.postgres.pool import Database


class SqlGauges:
    """A :class:`~triggerflow.store.gauges.GaugeSource` on ``db``.

    ``leases_sql`` takes ($1 queues, $2 settle seconds, *``args``) and returns the rows
    :func:`~triggerflow.store.gauges.lease_gauges` reads; ``queues_sql`` takes (*``args``)
    and returns a ``queue`` column. The defaults are native mode's.
    """

    def __init__(self, db: Database, *, leases_sql: str = QUEUE_GAUGES,
                 queues_sql: str = ALL_QUEUES, args: Sequence[Any] = ()) -> None:
        self.db = db
        self.leases_sql = leases_sql
        self.queues_sql = queues_sql
        self.args = tuple(args)

    @classmethod
    async def connect(cls, dsn: str, *, pgbouncer: bool = False, leases_sql: str = QUEUE_GAUGES,
                      queues_sql: str = ALL_QUEUES, args: Sequence[Any] = ()) -> SqlGauges:
        db = await Database.connect(dsn, max_size=1, pgbouncer=pgbouncer)
        return cls(db, leases_sql=leases_sql, queues_sql=queues_sql, args=args)

    async def leases(self, queues: Sequence[str], settle: float) -> LeaseGauges:
        return lease_gauges(await self.db.fetch(self.leases_sql, list(queues), settle, *self.args))

    async def team_queues(self) -> set[str]:
        return {r["queue"] for r in await self.db.fetch(self.queues_sql, *self.args)}

    async def close(self) -> None:
        await self.db.close()
