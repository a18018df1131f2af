"""PostgresStore: the :class:`~triggerflow.store.Store` of native mode, on triggerflow's tables.

Runs the statements of ``statements`` (a module per role) on a pool, decodes claimed kwargs
with the native codec; ``base.SqlStore`` keeps the lease and turns driver errors into the
store's own (``StoreUnavailable`` for a lost connection, ``EventRefused`` for content the
database rejects, ``StoreError`` otherwise).
Imports nothing from the broker side.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import asyncpg
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_random_exponential

from triggerflow.codec import KwargsCodec, MissingKey
from triggerflow.store.interface import (
    MAX_BLOCKS,
    Applied,
    Cancelled,
    ClaimResult,
    FreedTrigger,
    KwargsError,
    KwargsProblem,
    NewDeferral,
    Reaped,
    Struck,
    Taker,
    TriggerRef,
    TriggerSpec,
)
from triggerflow.store.postgres.base import SqlStore, scope
from triggerflow.store.postgres.pool import Record, create_pool, store_errors
from triggerflow.store.postgres.statements import claims, deferral, lease, reaper, writer
from triggerflow.wire import Event, first_per_attempt

# Two writers' batches can still meet on a row; such a statement is simply run again.
_CONFLICTS = (asyncpg.DeadlockDetectedError, asyncpg.SerializationError)


class PostgresStore(SqlStore):
    """The native store on one pool. ``codec`` decodes the kwargs of claimed triggers."""

    def __init__(self, pool: asyncpg.Pool, codec: KwargsCodec | None = None, *,
                 lease_dsn: str | None = None, pgbouncer: bool = False) -> None:
        super().__init__(pool, lease.NATIVE, lease_dsn=lease_dsn, pgbouncer=pgbouncer)
        self.codec = codec or KwargsCodec()

    @classmethod
    async def connect(cls, dsn: str, *, max_size: int = 4, pgbouncer: bool = False,
                      codec: KwargsCodec | None = None,
                      lock_timeout: float | None = None) -> PostgresStore:
        async with store_errors():
            pool = await create_pool(dsn, max_size=max_size, pgbouncer=pgbouncer,
                                     lock_timeout=lock_timeout)
        return cls(pool, codec, lease_dsn=dsn, pgbouncer=pgbouncer)

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

    # -- consumer ------------------------------------------------------------------------

    async def claim(self, me: int, ids: Sequence[int], queues: Sequence[str]) -> ClaimResult:
        result = ClaimResult()
        if not ids:
            return result
        for row in await self._fetch(claims.CLAIM, me, list(ids), list(queues)):
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
        rows = await self._fetch(claims.CLAIM_PROBATION, me, list(queues), limit or 2**31 - 1)
        return [self._spec(r) for r in rows]

    async def clear_probation(self, me: int, ids: Sequence[int]) -> None:
        await self._execute(claims.CLEAR_PROBATION, me, list(ids))

    async def release(self, me: int, ids: Sequence[int] | None = None, *,
                      cannot_load: bool = False, reason: str | None = None) -> list[TriggerRef]:
        rows = await self._fetch(claims.RELEASE, me, None if ids is None else list(ids),
                                 cannot_load, reason)
        return [TriggerRef(r["id"], r["queue"]) for r in rows]

    async def release_lost(self, me: int, ids: Sequence[int],
                           attempts: Sequence[int]) -> list[TriggerRef]:
        rows = await self._fetch(claims.RELEASE_LOST, me, list(ids), list(attempts))
        return [TriggerRef(r["id"], r["queue"]) for r in rows]

    async def taken_since(self, me: int, seconds: float) -> list[tuple[int, int]]:
        return [(r["id"], r["attempt"]) for r in await self._fetch(claims.TAKEN_SINCE, me, seconds)]

    async def fail_unloadable(self, me: int, ids: Sequence[int]) -> list[int]:
        return [r["id"] for r in await self._fetch(claims.FAIL_UNLOADABLE, list(ids), me)]

    async def other_loaders(self, trigger_id: int, me: int) -> int:
        row = await self._fetchrow(claims.OTHER_LOADERS, trigger_id, me)
        return int(row["count"]) if row else 0

    async def forget(self, me: int, ids: Sequence[int]) -> None:
        await self._execute(claims.FORGET_HELD, list(ids), me)

    async def sweep_cancelled(self, me: int) -> list[int]:
        return [r["id"] for r in await self._fetch(claims.SWEEP_CANCELLED, me)]

    async def strike(self, me: int, trigger_id: int, attempt: int, blocked: float,
                     max_blocks: int, queues: Sequence[str]) -> Struck | None:
        row = await self._fetchrow(claims.STRIKE, me, trigger_id, attempt, blocked, max_blocks,
                                   list(queues))
        if row is not None and row["quarantined"]:
            await self._execute(reaper.DROP_UNWAITED, [row["id"]])
        return None if row is None else Struck(row["id"], row["queue"], row["classpath"],
                                               row["blocks"], row["quarantined"], row["freed"])

    # -- writer --------------------------------------------------------------------------

    @staticmethod
    def _columns(events: Sequence[Event]) -> tuple[list[Any], ...]:
        return (
            [e.trigger_id for e in events], [e.attempt for e in events],
            [e.queue for e in events], [e.kind for e in events],
            [e.payload for e in events], [e.fired_at for e in events],
        )

    async def apply_events(self, events: Sequence[Event]) -> list[Applied]:
        args = self._columns(first_per_attempt(events))
        rows: list[Record] = []
        async with self._errors():
            async for attempt in AsyncRetrying(
                retry=retry_if_exception_type(_CONFLICTS), stop=stop_after_attempt(5),
                wait=wait_random_exponential(multiplier=0.05, max=1), reraise=True,
            ):
                with attempt:
                    async with self.pool.acquire() as conn:
                        rows = await conn.fetch(writer.APPLY_EVENTS, *args)
        return [Applied(r["kind"], r["queue"], r["latency"]) for r in rows]

    async def apply_unlocked(self, events: Sequence[Event]) -> tuple[list[Applied], list[Event]]:
        # Never waits: the rows it applies are locked first with SKIP LOCKED, so no deadlock
        # retry is needed either.
        columns = self._columns(events)
        async with self._errors(), self.pool.acquire() as conn, conn.transaction():
            held = {r["id"] for r in await conn.fetch(writer.HELD_ELSEWHERE, *columns[:3])}
            free = first_per_attempt(e for e in events if e.trigger_id not in held)
            rows = await conn.fetch(writer.APPLY_EVENTS, *self._columns(free)) if free else []
        return ([Applied(r["kind"], r["queue"], r["latency"]) for r in rows],
                [e for e in events if e.trigger_id in held])

    # -- reaper ----------------------------------------------------------------------------

    async def reap_dead(self, queues: Sequence[str] | None, max_failures: int,
                        limit: int | None = None, taker: Taker | None = None,
                        max_blocks: int = MAX_BLOCKS) -> Reaped:
        if taker is not None and queues is None:
            raise ValueError("a taker reaps only its own queues")
        rows = await self._fetch(reaper.REAP_DEAD, *scope(queues), max_failures,
                                 limit or 2**31 - 1, taker and taker.me,
                                 taker.room if taker else 0, max_blocks)
        if quarantined := [r["id"] for r in rows if r["quarantined"]]:
            await self._execute(reaper.DROP_UNWAITED, quarantined)
        freed = [FreedTrigger(r["id"], r["queue"], r["classpath"], r["failures"],
                              r["quarantined"]) for r in rows if not r["taken"]]
        taken = [self._spec(r) for r in rows if r["taken"]]
        return Reaped(freed, rows[0]["dead"] if rows else 0, taken)

    async def resend_unclaimed(self, queues: Sequence[str] | None, grace: float,
                               limit: int) -> list[TriggerRef]:
        rows = await self._fetch(reaper.RESEND_UNCLAIMED, *scope(queues), grace, limit)
        return [TriggerRef(r["id"], r["queue"]) for r in rows]

    async def time_out_orphans(self, queues: Sequence[str] | None,
                               max_deferral: float) -> list[TriggerRef]:
        return [TriggerRef(r["id"], r["queue"])
                for r in await self._fetch(reaper.TIMEOUT_ORPHANS, *scope(queues), max_deferral)]

    async def waiting_queues(self, grace: float) -> list[str]:
        return [r["queue"] for r in await self._fetch(reaper.WAITING_QUEUES, grace)]

    async def queue_consumers(self, queues: Sequence[str]) -> dict[str, int]:
        rows = await self._fetch(reaper.QUEUE_CONSUMERS, list(queues))
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
        return [r["id"] for r in await self._fetch(deferral.DEFER, *columns)]

    async def undo_defer(self, ids: Sequence[int], error: str) -> None:
        await self._execute(deferral.UNDO_DEFER, list(ids), error)

    async def cancel(self, ids: Sequence[int], state: str) -> list[Cancelled]:
        rows = await self._fetch(deferral.CANCEL, list(ids), state)
        return [Cancelled(r["id"], r["owner_id"], r["moved"], r["queue"]) for r in rows]
