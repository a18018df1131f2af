"""``SqlStore``: what both PostgreSQL stores share (native mode's and Airflow mode's).

A pool, the translation of driver errors into the store's own (``pool.store_errors``), and
the lease (:class:`~triggerflow.store.LeaseStore`, :class:`~triggerflow.store.PresenceStore`)
on the statements of ``statements.lease``, optionally on a connection of its own. Each store
adds the roles it serves on its own tables.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from typing import Any

import asyncpg

from triggerflow import balance
from triggerflow.store.interface import ProcessKind, Renewal
from triggerflow.store.postgres.pool import REFUSED_CONTENT, Record, session_settings, store_errors
from triggerflow.store.postgres.statements.lease import LeaseStatements

PEERS_EVERY = 5.0  # seconds between reads of the peers' counts (rebalancing) on renewal


def scope(queues: Sequence[str] | None) -> tuple[list[str], bool]:
    """(queues, every queue?) as the reaper statements take them."""
    return ([], True) if queues is None else (list(queues), False)


class SqlStore:
    """The lease and the plumbing on one pool. ``refused``: the driver errors that mean an
    event's content was refused. With ``lease_dsn``, renewals get a connection of their own:
    queued behind bulk work on a small pool (a flood of claims, sweeps, hand-overs) they
    would miss the lease and fence us."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        lease: LeaseStatements,
        *,
        refused: tuple[type[BaseException], ...] = REFUSED_CONTENT,
        lease_dsn: str | None = None,
        pgbouncer: bool = False,
    ) -> None:
        self.pool = pool
        self._lease = lease
        self._refused = refused
        self._peers_due = 0.0  # monotonic time of the next renewal that reads the peers
        self._uneven = False  # the last read of the peers found triggers for us to shed
        self._lease_dsn = lease_dsn
        self._pgbouncer = pgbouncer
        self._lease_conn: asyncpg.Connection | None = None
        self._lease_lock = asyncio.Lock()

    async def close(self) -> None:
        await self._drop_lease_connection()
        with contextlib.suppress(TimeoutError):
            await self.pool.close()

    async def _drop_lease_connection(self) -> None:
        conn, self._lease_conn = self._lease_conn, None
        if conn is not None:
            conn.terminate()  # never waits: it may be the connection that hangs

    async def _lease_fetchrow(self, query: str, *args: Any) -> Record | None:
        """Run a lease statement on the dedicated connection (the pool when there is none)."""
        if self._lease_dsn is None:
            return await self._fetchrow(query, *args)
        async with self._lease_lock, self._errors():
            try:
                if self._lease_conn is None or self._lease_conn.is_closed():
                    self._lease_conn = await asyncpg.connect(
                        self._lease_dsn,
                        statement_cache_size=0 if self._pgbouncer else 16,
                        server_settings=session_settings("triggerflow-lease", pgbouncer=self._pgbouncer),
                    )
                row: Record | None = await self._lease_conn.fetchrow(query, *args)
                return row
            except BaseException:  # timed out, cancelled or broken: start clean next time
                await self._drop_lease_connection()
                raise

    # -- plumbing ------------------------------------------------------------------------

    def _errors(self) -> contextlib.AbstractAsyncContextManager[None]:
        return store_errors(self._refused)

    async def _fetch(self, query: str, *args: Any) -> list[Record]:
        async with self._errors(), self.pool.acquire() as conn:
            rows: list[Record] = await conn.fetch(query, *args)
            return rows

    async def _fetchrow(self, query: str, *args: Any) -> Record | None:
        async with self._errors(), self.pool.acquire() as conn:
            row: Record | None = await conn.fetchrow(query, *args)
            return row

    async def _execute(self, query: str, *args: Any) -> None:
        async with self._errors(), self.pool.acquire() as conn:
            await conn.execute(query, *args)

    # -- a process's lease ----------------------------------------------------------------

    async def register(
        self,
        kind: ProcessKind,
        host: str,
        pid: int,
        queues: Sequence[str],
        capacity: int,
        version: str,
        ttl: float,
    ) -> int:
        row = await self._fetchrow(
            self._lease.register, str(kind), host, pid, list(queues), capacity, version, ttl
        )
        assert row is not None
        return int(row["id"])

    async def renew(
        self,
        me: int,
        ttl: float,
        running: int,
        queues: Sequence[str],
        *,
        subscribed: bool = True,
        clock_skew: float | None = None,
        warming: bool = False,
    ) -> Renewal | None:
        # The peers' counts only feed rebalancing, which can wait a few seconds: reading
        # them on every renewal made each renewal scan the consumer table.
        # While the last read found us overloaded (a shed under way), read them on
        # every renewal, so shedding converges as fast as before.
        now = time.monotonic()
        peers = bool(queues) and (now >= self._peers_due or self._uneven)
        row = await self._lease_fetchrow(
            self._lease.renew, me, ttl, running, list(queues), peers, subscribed, clock_skew,
            warming,
        )
        if row is None:
            return None
        if peers:
            self._peers_due = now + PEERS_EVERY
            self._uneven = balance.uneven(running, row["live_peers"], row["peers_running"])
        return Renewal(row["dead_peers"], row["live_peers"], row["peers_running"], row["db_time"])

    async def unregister(self, me: int) -> None:
        await self._execute(self._lease.unregister, me)

    async def announce_presence(self, me: int, presence: str) -> bool:
        return bool(await self._fetch(self._lease.announce_presence, me, presence))

    async def presence_gone(self, presence: str, queues: Sequence[str]) -> list[int]:
        return [r["id"] for r in await self._fetch(self._lease.presence_gone, presence, list(queues))]

    async def writer_gone(self, presence: str) -> list[int]:
        return [r["id"] for r in await self._fetch(self._lease.writer_gone, presence)]
