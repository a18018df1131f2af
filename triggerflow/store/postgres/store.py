"""PostgresStore: the :class:`~triggerflow.store.Store` of native mode, on triggerflow's tables.

Runs the statements of ``statements`` on a pool, decodes claimed kwargs with the native
codec, and turns driver errors into the store's own (``StoreUnavailable`` for a lost
connection, ``EventRefused`` for content the database rejects, ``StoreError`` otherwise).
Imports nothing from the broker side.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Sequence
from typing import Any

import asyncpg
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_random_exponential

from triggerflow.codec import KwargsCodec, MissingKey
from triggerflow.store.interface import (
    Applied,
    Cancelled,
    ClaimResult,
    FreedTrigger,
    KwargsError,
    KwargsProblem,
    NewDeferral,
    ProcessKind,
    Reaped,
    Renewal,
    Taker,
    TriggerRef,
    TriggerSpec,
)
from triggerflow.store.postgres import statements as sql
from triggerflow.store.postgres.pool import (
    Record,
    create_pool,
    session_settings,
    store_errors,
)
from triggerflow.wire import Event

# Two writers' batches can still meet on a row; such a statement is simply run again.
_CONFLICTS = (asyncpg.DeadlockDetectedError, asyncpg.SerializationError)
PEERS_EVERY = 5.0  # seconds between reads of the peers' counts (rebalancing) on renewal


def _scope(queues: Sequence[str] | None) -> tuple[list[str], bool]:
    """(queues, every queue?) as the reaper statements take them."""
    return ([], True) if queues is None else (list(queues), False)


class PostgresStore:
    """The native store on one pool. ``codec`` decodes the kwargs of claimed triggers."""

    def __init__(self, pool: asyncpg.Pool, codec: KwargsCodec | None = None, *,
                 lease_dsn: str | None = None, pgbouncer: bool = False) -> None:
        self.pool = pool
        self.codec = codec or KwargsCodec()
        self._peers_due = 0.0  # monotonic time of the next renewal that reads the peers
        self._uneven = False  # the last read of the peers found a rebalance to do
        # Renewals get a connection of their own: queued behind bulk work on a small pool
        # (a flood of claims, sweeps, hand-overs) they would miss the lease and fence us.
        self._lease_dsn = lease_dsn
        self._pgbouncer = pgbouncer
        self._lease_conn: asyncpg.Connection | None = None
        self._lease_lock = asyncio.Lock()

    @classmethod
    async def connect(cls, dsn: str, *, max_size: int = 4, pgbouncer: bool = False,
                      codec: KwargsCodec | None = None,
                      lock_timeout: float | None = None) -> PostgresStore:
        async with store_errors():
            pool = await create_pool(dsn, max_size=max_size, pgbouncer=pgbouncer,
                                     lock_timeout=lock_timeout)
        return cls(pool, codec, lease_dsn=dsn, pgbouncer=pgbouncer)

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
                        self._lease_dsn, statement_cache_size=0 if self._pgbouncer else 16,
                        server_settings=session_settings("triggerflow-lease", pgbouncer=self._pgbouncer))
                row: Record | None = await self._lease_conn.fetchrow(query, *args)
                return row
            except BaseException:  # timed out, cancelled or broken: start clean next time
                await self._drop_lease_connection()
                raise

    # -- plumbing ------------------------------------------------------------------------

    def _errors(self) -> contextlib.AbstractAsyncContextManager[None]:
        return store_errors()

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

    def _spec(self, row: Record) -> TriggerSpec:
        kwargs: dict[str, Any] | None = None
        problem: KwargsError | None = None
        try:
            kwargs = self.codec.decode(row["kwargs"], row["queue"])
        except MissingKey as exc:
            problem = KwargsError(KwargsProblem.UNREADABLE_HERE, str(exc))
        except Exception as exc:
            problem = KwargsError(KwargsProblem.INVALID, repr(exc))
        # Interned: 100k held triggers share one string per class and queue, not 100k copies.
        return TriggerSpec(row["id"], row["attempt"], sys.intern(row["queue"]),
                           sys.intern(row["classpath"]), kwargs, problem, row["task"],
                           row["timeout_at"], row["traceparent"])

    # -- a process's lease ----------------------------------------------------------------

    async def register(self, kind: ProcessKind, host: str, pid: int, queues: Sequence[str],
                       capacity: int, version: str, ttl: float) -> int:
        row = await self._fetchrow(sql.REGISTER, str(kind), host, pid, list(queues), capacity,
                                   version, ttl)
        assert row is not None
        return int(row["id"])

    async def renew(self, me: int, ttl: float, running: int, queues: Sequence[str], *,
                    subscribed: bool = True, clock_skew: float | None = None) -> Renewal | None:
        # The peers' counts only feed rebalancing, which can wait a few seconds: reading
        # them on every renewal made each renewal scan the consumer table.
        # While the last read found the load uneven (a rebalance under way), read them on
        # every renewal, so shedding converges as fast as before.
        now = time.monotonic()
        peers = bool(queues) and (now >= self._peers_due or self._uneven)
        row = await self._lease_fetchrow(sql.RENEW, me, ttl, running, list(queues), peers,
                                         subscribed, clock_skew)
        if row is None:
            return None
        if peers:
            self._peers_due = now + PEERS_EVERY
            live, held = row["live_peers"], row["peers_running"]
            fair = held / live if live else 0.0
            self._uneven = live >= 2 and abs(running - fair) > 0.25 * fair + 20
        return Renewal(row["dead_peers"], row["live_peers"], row["peers_running"],
                       row["db_time"])

    async def unregister(self, me: int) -> None:
        await self._execute(sql.UNREGISTER, me)

    async def announce_presence(self, me: int, presence: str) -> bool:
        return bool(await self._fetch(sql.ANNOUNCE_PRESENCE, me, presence))

    async def presence_gone(self, presence: str, queues: Sequence[str]) -> list[int]:
        return [r["id"] for r in await self._fetch(sql.PRESENCE_GONE, presence, list(queues))]

    # -- consumer ------------------------------------------------------------------------

    async def claim(self, me: int, ids: Sequence[int], queues: Sequence[str]) -> ClaimResult:
        result = ClaimResult()
        if not ids:
            return result
        for row in await self._fetch(sql.CLAIM, me, list(ids), list(queues)):
            outcome = row["outcome"]
            if outcome == "claimed":
                result.claimed.append(self._spec(row))
            elif outcome == "suspect":
                result.suspects.append(row["id"])
            else:
                result.refused.append(TriggerRef(row["id"], row["queue"]))
        return result

    async def claim_probation(self, me: int, queues: Sequence[str],
                              limit: int | None = None) -> list[TriggerSpec]:
        rows = await self._fetch(sql.CLAIM_PROBATION, me, list(queues), limit or 2**31 - 1)
        return [self._spec(r) for r in rows]

    async def clear_probation(self, me: int, ids: Sequence[int]) -> None:
        await self._execute(sql.CLEAR_PROBATION, me, list(ids))

    async def release(self, me: int, ids: Sequence[int] | None = None, *,
                      cannot_load: bool = False, reason: str | None = None) -> list[TriggerRef]:
        rows = await self._fetch(sql.RELEASE, me, None if ids is None else list(ids),
                                 cannot_load, reason)
        return [TriggerRef(r["id"], r["queue"]) for r in rows]

    async def release_lost(self, me: int, ids: Sequence[int],
                           attempts: Sequence[int]) -> list[TriggerRef]:
        rows = await self._fetch(sql.RELEASE_LOST, me, list(ids), list(attempts))
        return [TriggerRef(r["id"], r["queue"]) for r in rows]

    async def fail_unloadable(self, me: int, ids: Sequence[int]) -> list[int]:
        return [r["id"] for r in await self._fetch(sql.FAIL_UNLOADABLE, list(ids), me)]

    async def other_loaders(self, trigger_id: int, me: int) -> int:
        row = await self._fetchrow(sql.OTHER_LOADERS, trigger_id, me)
        return int(row["count"]) if row else 0

    async def forget(self, me: int, ids: Sequence[int]) -> None:
        await self._execute(sql.FORGET_HELD, list(ids), me)

    async def sweep_cancelled(self, me: int) -> list[int]:
        return [r["id"] for r in await self._fetch(sql.SWEEP_CANCELLED, me)]

    async def strike(self, me: int, trigger_id: int, attempt: int, blocked: float,
                     max_failures: int) -> FreedTrigger | None:
        row = await self._fetchrow(sql.STRIKE, me, trigger_id, attempt, blocked, max_failures)
        return None if row is None else FreedTrigger(
            row["id"], row["queue"], row["classpath"], row["failures"], row["quarantined"])

    # -- writer --------------------------------------------------------------------------

    @staticmethod
    def _columns(events: Sequence[Event]) -> tuple[list[Any], ...]:
        return (
            [e.trigger_id for e in events], [e.attempt for e in events],
            [e.queue for e in events], [e.kind for e in events],
            [e.payload for e in events], [e.fired_at for e in events],
        )

    async def apply_events(self, events: Sequence[Event]) -> list[Applied]:
        args = self._columns(events)
        rows: list[Record] = []
        async with self._errors():
            async for attempt in AsyncRetrying(
                retry=retry_if_exception_type(_CONFLICTS), stop=stop_after_attempt(5),
                wait=wait_random_exponential(multiplier=0.05, max=1), reraise=True,
            ):
                with attempt:
                    async with self.pool.acquire() as conn:
                        rows = await conn.fetch(sql.APPLY_EVENTS, *args)
        return [Applied(r["kind"], r["queue"], r["latency"]) for r in rows]

    async def apply_unlocked(self, events: Sequence[Event]) -> tuple[list[Applied], list[Event]]:
        # Never waits: the rows it applies are locked first with SKIP LOCKED, so no deadlock
        # retry is needed either.
        columns = self._columns(events)
        async with self._errors(), self.pool.acquire() as conn, conn.transaction():
            held = {r["id"] for r in await conn.fetch(sql.HELD_ELSEWHERE, *columns[:3])}
            free = [e for e in events if e.trigger_id not in held]
            rows = await conn.fetch(sql.APPLY_EVENTS, *self._columns(free)) if free else []
        return ([Applied(r["kind"], r["queue"], r["latency"]) for r in rows],
                [e for e in events if e.trigger_id in held])

    # -- reaper ----------------------------------------------------------------------------

    async def reap_dead(self, queues: Sequence[str] | None, max_failures: int,
                        limit: int | None = None, taker: Taker | None = None) -> Reaped:
        if taker is not None and queues is None:
            raise ValueError("a taker reaps only its own queues")
        rows = await self._fetch(sql.REAP_DEAD, *_scope(queues), max_failures,
                                 limit or 2**31 - 1, taker and taker.me,
                                 taker.room if taker else 0)
        freed = [FreedTrigger(r["id"], r["queue"], r["classpath"], r["failures"],
                              r["quarantined"]) for r in rows if not r["taken"]]
        taken = [self._spec(r) for r in rows if r["taken"]]
        return Reaped(freed, rows[0]["dead"] if rows else 0, taken)

    async def resend_unclaimed(self, queues: Sequence[str] | None, grace: float,
                               limit: int) -> list[TriggerRef]:
        rows = await self._fetch(sql.RESEND_UNCLAIMED, *_scope(queues), grace, limit)
        return [TriggerRef(r["id"], r["queue"]) for r in rows]

    async def time_out_orphans(self, queues: Sequence[str] | None,
                               max_deferral: float) -> list[TriggerRef]:
        return [TriggerRef(r["id"], r["queue"])
                for r in await self._fetch(sql.TIMEOUT_ORPHANS, *_scope(queues), max_deferral)]

    async def waiting_queues(self, grace: float) -> list[str]:
        return [r["queue"] for r in await self._fetch(sql.WAITING_QUEUES, grace)]

    async def queue_consumers(self, queues: Sequence[str]) -> dict[str, int]:
        rows = await self._fetch(sql.QUEUE_CONSUMERS, list(queues))
        return {r["q"]: int(r["consumers"]) for r in rows}

    # -- SDK -----------------------------------------------------------------------------

    async def defer(self, deferrals: Sequence[NewDeferral]) -> list[int]:
        columns = (
            [d.dag_id for d in deferrals], [d.task_id for d in deferrals],
            [d.run_id for d in deferrals], [d.map_index for d in deferrals],
            [d.classpath for d in deferrals], [d.stored_kwargs for d in deferrals],
            [d.queue for d in deferrals], [d.next_method for d in deferrals],
            [d.next_kwargs for d in deferrals], [d.timeout for d in deferrals],
            [d.traceparent for d in deferrals],
        )
        return [r["id"] for r in await self._fetch(sql.DEFER, *columns)]

    async def undo_defer(self, ids: Sequence[int], error: str) -> None:
        await self._execute(sql.UNDO_DEFER, list(ids), error)

    async def cancel(self, ids: Sequence[int], state: str) -> list[Cancelled]:
        rows = await self._fetch(sql.CANCEL, list(ids), state)
        return [Cancelled(r["id"], r["owner_id"], r["moved"], r["queue"]) for r in rows]
