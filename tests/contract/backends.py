"""One small seeder per store: what the contract cases need and the store roles do not
offer (a trigger with a deferred task, the task read back, time moved on, a task ended by
hand). Memory and native stores defer through ``Store.defer``; Airflow's rows are written as
Airflow's API server writes them (``tests.airflow_support``).

Time moves the same way in every backend: the memory store's clock goes forward, the SQL
stores' timestamps go back by as much (their clock is the database's ``now()``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import asyncpg

from triggerflow.codec import ENCRYPTED_PREFIX, KwargsCodec
from triggerflow.model import TaskKey
from triggerflow.store import NewDeferral, ProcessKind, ServingStore, Store
from triggerflow.store.memory import ManualClock, MemoryStore
from triggerflow.store.postgres import PostgresStore

T = TypeVar("T")
# Another process's store calls, run in a transaction that commits only once the call under
# test waits on the rows they locked (a serial store runs them first).
Meanwhile = Callable[[Any], Awaitable[Any]]  # given the other process's store

CLASSPATH = "tests.triggers.WaitsForever"
NEXT_KWARGS = {"k": "v"}
# Plain JSON that is not an object: no process can decode it into keyword arguments.
INVALID_KWARGS = "[1, 2]"


@dataclass(frozen=True)
class TaskView:
    state: str | None
    next_method: str | None
    next_kwargs: Any


class Backend(Protocol):
    """A store under test and its seeder."""

    name: str
    store: ServingStore  # and DeferralStore for memory and postgres (Airflow defers itself)
    unreadable_kwargs: str  # stored kwargs this store's processes hold no key for
    invalid_kwargs: str  # stored kwargs no process can decode

    async def defer(self, queue: str, *, timeout: float = 3600.0,
                    stored_kwargs: str | None = None) -> int:
        """A trigger of ``queue`` with a task deferred on it; returns the trigger id."""
        ...

    async def task(self, trigger_id: int) -> TaskView:
        """The task that was deferred on ``trigger_id``, as it is now."""
        ...

    async def travel(self, seconds: float) -> None:
        """Let ``seconds`` pass for every lease, trigger and task."""
        ...

    async def end_task(self, trigger_id: int, state: str) -> None:
        """Move the task off ``deferred`` by hand (an operator, Airflow's UI)."""
        ...

    async def race(self, meanwhile: Meanwhile, call: Callable[[], Awaitable[T]]) -> T:
        """``call``, with ``meanwhile`` committed between its snapshot and its row locks."""
        ...

    def process(self) -> contextlib.AbstractAsyncContextManager[ServingStore]:
        """Another process's own store on the same data: a SQL store of its own pool, whose
        first renewal reads the peers' counts (a store reads them every few seconds)."""
        ...

    async def close(self) -> None: ...


async def register(backend: Backend, queues: list[str], ttl: float = 2.0,
                   kind: ProcessKind = ProcessKind.CONSUMER) -> int:
    me = await backend.store.register(kind, "contract", 1, queues, 100, "t", ttl)
    if kind == ProcessKind.CONSUMER:  # capacity once subscribed on the broker, as a consumer is
        await backend.store.renew(me, ttl, 0, queues, subscribed=True)
    return me


class MemoryBackend:
    name = "memory"
    unreadable_kwargs = ENCRYPTED_PREFIX + "gAAAAAB-no-key-here"
    invalid_kwargs = INVALID_KWARGS

    def __init__(self) -> None:
        self.clock = ManualClock()
        self.memory = MemoryStore(clock=self.clock, codec=KwargsCodec())
        self.store: Store = self.memory
        self._keys: dict[int, TaskKey] = {}
        self._queues: dict[int, str] = {}

    async def defer(self, queue: str, *, timeout: float = 3600.0,
                    stored_kwargs: str | None = None) -> int:
        key = TaskKey("dag", f"task{len(self._keys)}", "run", -1)
        [trigger_id] = await self.store.defer([_deferral(key, queue, timeout, stored_kwargs)])
        self._keys[trigger_id], self._queues[trigger_id] = key, queue
        return trigger_id

    async def task(self, trigger_id: int) -> TaskView:
        t = self.memory.task(self._keys[trigger_id])
        return TaskView(t.state, t.next_method, t.next_kwargs)

    async def travel(self, seconds: float) -> None:
        self.clock.advance(seconds)

    async def end_task(self, trigger_id: int, state: str) -> None:
        self.memory.task(self._keys[trigger_id]).state = state

    async def trigger_ids(self) -> list[int]:
        """Every trigger row there is, by id."""
        return sorted(self.memory.triggers)

    async def untime(self, trigger_id: int) -> None:
        """The task waits with no timeout (as a row an older SDK stored)."""
        self.memory.task(self._keys[trigger_id]).trigger_timeout = None

    async def race(self, meanwhile: Meanwhile, call: Callable[[], Awaitable[T]]) -> T:
        await meanwhile(self.store)  # one call at a time: the other commit comes first
        return await call()

    @contextlib.asynccontextmanager
    async def process(self) -> AsyncIterator[ServingStore]:
        yield self.store  # one store for every process: it reads the peers on each renewal

    async def defer_again(self, trigger_id: int, store: Store) -> int:
        """The task of ``trigger_id`` deferred again, through ``store``, on a new trigger."""
        key, queue = self._keys[trigger_id], self._queues[trigger_id]
        [again] = await store.defer([_deferral(key, queue, 3600.0, None)])
        self._keys[again], self._queues[again] = key, queue
        return again

    async def close(self) -> None:
        await self.store.close()


def _deferral(key: TaskKey, queue: str, timeout: float, stored_kwargs: str | None) -> NewDeferral:
    return NewDeferral(key.dag_id, key.task_id, key.run_id, key.map_index, CLASSPATH,
                       stored_kwargs or '{"x": 1}', queue, "execute_complete",
                       json.dumps(NEXT_KWARGS), timeout)


async def _execute(dsn: str, *statements: str, args: tuple[Any, ...] = ()) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        for statement in statements:
            await conn.execute(statement, *args)
    finally:
        await conn.close()


def _shift(table: str, *columns: str) -> str:
    moved = ", ".join(f"{c} = {c} - make_interval(secs => $1)" for c in columns)
    return f"UPDATE {table} SET {moved}"


async def _task_view(dsn: str, where: str, *args: Any) -> TaskView:
    conn = await asyncpg.connect(dsn)
    try:
        row = await conn.fetchrow(
            f"SELECT state, next_method, next_kwargs::text AS nk FROM task_instance WHERE {where}",
            *args)
    finally:
        await conn.close()
    assert row is not None
    return TaskView(row["state"], row["next_method"],
                    None if row["nk"] is None else json.loads(row["nk"]))


class NativeBackend(MemoryBackend):
    """The native PostgreSQL store on a database of its own (``dsn``)."""

    name = "postgres"

    def __init__(self, dsn: str, store: PostgresStore) -> None:
        super().__init__()
        self.dsn = dsn
        self.store = store

    @classmethod
    async def open(cls, dsn: str) -> NativeBackend:
        return cls(dsn, await PostgresStore.connect(dsn, max_size=2, codec=KwargsCodec()))

    async def task(self, trigger_id: int) -> TaskView:
        key = self._keys[trigger_id]
        return await _task_view(self.dsn, "dag_id = $1 AND task_id = $2 AND run_id = $3",
                                key.dag_id, key.task_id, key.run_id)

    async def travel(self, seconds: float) -> None:
        await _execute(
            self.dsn,
            _shift("consumer", "started_at", "renewed_at", "expires_at"),
            _shift("trigger", "created_at", "dispatched_at", "claimed_at", "quarantined_at",
                   "timeout_at"),
            _shift("task_instance", "updated_at", "trigger_timeout", "start_date"),
            args=(seconds,))

    async def trigger_ids(self) -> list[int]:
        conn = await asyncpg.connect(self.dsn)
        try:
            return [r["id"] for r in await conn.fetch("SELECT id FROM trigger ORDER BY id")]
        finally:
            await conn.close()

    async def end_task(self, trigger_id: int, state: str) -> None:
        await _execute(self.dsn, "UPDATE task_instance SET state = $1 WHERE trigger_id = $2",
                       args=(state, trigger_id))

    async def untime(self, trigger_id: int) -> None:
        await _execute(self.dsn, "UPDATE task_instance SET trigger_timeout = NULL "
                                 "WHERE trigger_id = $1", args=(trigger_id,))

    async def race(self, meanwhile: Meanwhile, call: Callable[[], Awaitable[T]]) -> T:
        return await race_in_sql(self.dsn, lambda pool: PostgresStore(pool, KwargsCodec()),
                                 meanwhile, call)

    @contextlib.asynccontextmanager
    async def process(self) -> AsyncIterator[ServingStore]:
        store = await PostgresStore.connect(self.dsn, max_size=1, codec=KwargsCodec())
        try:
            yield store
        finally:
            await store.close()


class _HeldPool:
    """A pool of one connection, inside a transaction its owner commits."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn

    @contextlib.asynccontextmanager
    async def acquire(self) -> AsyncIterator[asyncpg.Connection]:
        yield self.conn


# Sessions that wait on a lock the given backend holds.
_BLOCKED_BY = "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid)))"


async def race_in_sql(dsn: str, store_on: Callable[[Any], Store], meanwhile: Meanwhile,
                      call: Callable[[], Awaitable[T]]) -> T:
    """Run ``meanwhile`` on a store of its own in an open transaction, start ``call``, and
    commit once ``call`` waits on a row lock that transaction holds: ``call``'s snapshot
    predates the commit, its row locks come after it (READ COMMITTED re-checks the rows)."""
    held, watcher = await asyncpg.connect(dsn), await asyncpg.connect(dsn)
    try:
        async with asyncio.timeout(30):
            tx = held.transaction()
            await tx.start()
            await meanwhile(store_on(_HeldPool(held)))
            running = asyncio.ensure_future(call())
            # until it waits on our lock (or finished without: it read nothing we changed)
            while not await watcher.fetchval(_BLOCKED_BY, held.get_server_pid()):
                if (await asyncio.wait([running], timeout=0.01))[0]:
                    break
            await tx.commit()
            return await running
    finally:
        await held.close()
        await watcher.close()
