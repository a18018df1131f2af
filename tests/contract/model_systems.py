"""The stores the model-based test (``test_model.py``) drives side by side: the in-memory
store (the model) and a SQL store (the system), each behind the same few seeding calls.

One database serves every example of a run: ``reset`` empties it between examples (a copy
of the template per example would cost more than the example). Rows are read back as plain
values, keyed by task name and trigger id, for the machine to compare.

Time: the memory store's clock stands still between steps, while the database's ``now()``
goes on with the wall clock. ``travel`` shifts the rows back by the step less the wall time
spent since the last step, so a row written early in a step stands as far from ``now()`` as
the model says, give or take the wall time of one stretch between travels; the machine keeps
every duration it compares five seconds away from a tie (see ``test_model.py``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import asyncpg

from tests.contract.backends import _deferral, _shift
from triggerflow.codec import KwargsCodec
from triggerflow.model import TaskKey
from triggerflow.store import Store
from triggerflow.store.memory import ManualClock, MemoryStore
from triggerflow.store.postgres import PostgresStore


@dataclass(frozen=True)
class TriggerRow:
    """What the contract decides about a trigger row (ids as the store gave them)."""

    owner: int | None
    attempt: int
    failures: int
    quarantined: bool
    blocked_attempts: tuple[int, ...]
    rejected_by: frozenset[int]


@dataclass(frozen=True)
class TaskRow:
    state: str | None
    next_method: str | None
    next_kwargs: Any


@dataclass(frozen=True)
class Rows:
    triggers: dict[int, TriggerRow]
    tasks: dict[str, TaskRow]  # by task name
    processes: list[int]  # registered, not yet reaped or gone


class System(Protocol):
    """A store with its seeder, emptied for each example.

    ``differences``: the machine's rules this store does not run, each with the reason the
    store roles let it differ there (``model_airflow``); empty for the model and native."""

    name: str
    store: Store
    differences: Mapping[str, str]

    async def reset(self) -> None: ...

    async def defer(self, name: str, queue: str, timeout: float) -> int:
        """Task ``name`` deferred on a new trigger of ``queue``; returns the trigger id."""
        ...

    async def travel(self, seconds: float) -> None: ...

    async def end_task(self, name: str, state: str) -> None:
        """Move the task off ``deferred`` by hand (an operator)."""
        ...

    async def rows(self) -> Rows:
        """Every trigger, task and process row, read at once."""
        ...

    async def settle(self) -> None:
        """After an apply: what the store leaves to a moment later, done now."""
        ...

    def content(self, classpath: str, kwargs: Any, task: str | None) -> tuple[Any, Any, Any]:
        """A claimed trigger's class, kwargs and task in the model's terms."""
        ...

    def canonical_task(self, state: str | None, next_method: str | None,
                       next_kwargs: Any) -> tuple[Any, Any, Any]:
        """A task row as compared with this store (applied to the model's rows too)."""
        ...

    async def close(self) -> None: ...


def _key(name: str) -> TaskKey:
    return TaskKey("dag", name, "run", -1)


class SameAsModel:
    """A store that stores what the model stores, as the model does."""

    differences: Mapping[str, str] = {}

    async def settle(self) -> None:
        pass

    def content(self, classpath: str, kwargs: Any, task: str | None) -> tuple[Any, Any, Any]:
        return classpath, kwargs, task

    def canonical_task(self, state: str | None, next_method: str | None,
                       next_kwargs: Any) -> tuple[Any, Any, Any]:
        return state, next_method, next_kwargs


class MemorySystem(SameAsModel):
    """The model: the in-memory store on a manual clock."""

    name = "memory"

    def __init__(self) -> None:
        self.clock = ManualClock()
        self.memory = MemoryStore(clock=self.clock, codec=KwargsCodec())
        self.store: Store = self.memory

    async def reset(self) -> None:
        self.clock = ManualClock()
        self.memory = MemoryStore(clock=self.clock, codec=KwargsCodec())
        self.store = self.memory

    async def defer(self, name: str, queue: str, timeout: float) -> int:
        [trigger_id] = await self.store.defer([_deferral(_key(name), queue, timeout, None)])
        return trigger_id

    async def travel(self, seconds: float) -> None:
        self.clock.advance(seconds)

    async def end_task(self, name: str, state: str) -> None:
        self.memory.task(_key(name)).state = state

    async def rows(self) -> Rows:
        return Rows(
            {t.id: TriggerRow(t.owner, t.attempt, t.failures, t.quarantined,
                              tuple(t.blocked_attempts), frozenset(t.rejected_by))
             for t in self.memory.triggers.values()},
            {key.task_id: TaskRow(t.state, t.next_method, t.next_kwargs)
             for (key, _), t in self.memory.tasks.items()},
            list(self.memory.processes))

    async def close(self) -> None:
        await self.store.close()


_NATIVE_SHIFTS = (
    _shift("consumer", "started_at", "renewed_at", "expires_at"),
    _shift("trigger", "created_at", "dispatched_at", "claimed_at", "quarantined_at",
           "timeout_at"),
    _shift("task_instance", "updated_at", "trigger_timeout", "start_date"),
)


# One round trip a step: the machine reads them after every step, shrinking replays included.
_ROWS = """
SELECT
  (SELECT coalesce(json_agg(json_build_object(
       'id', id, 'owner_id', owner_id, 'attempt', attempt, 'failures', failures,
       'q', quarantined_at IS NOT NULL, 'blocked_attempts', blocked_attempts,
       'rejected_by', rejected_by)), '[]') FROM trigger)::text AS triggers,
  (SELECT coalesce(json_agg(json_build_object(
       'task_id', task_id, 'state', state, 'next_method', next_method,
       'next_kwargs', next_kwargs)), '[]') FROM task_instance)::text AS tasks,
  (SELECT coalesce(json_agg(id), '[]') FROM consumer)::text AS processes
"""


class PostgresSystem(SameAsModel):
    """The native PostgreSQL store on a database of its own, with an admin connection for
    seeding, moving time and reading rows back."""

    name = "postgres"

    def __init__(self, store: PostgresStore, admin: asyncpg.Connection, tables: Sequence[str]) -> None:
        self.store: Store = store
        self.admin = admin
        self._tables = tables
        self._synced = time.time()

    @classmethod
    async def open(cls, dsn: str) -> PostgresSystem:
        admin = await asyncpg.connect(dsn)
        tables = [r["tablename"] for r in await admin.fetch(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public' "
            "AND tablename <> 'alembic_version'")]
        return cls(await PostgresStore.connect(dsn, max_size=2, codec=KwargsCodec()), admin, tables)

    async def reset(self) -> None:
        # ids restart too, as the memory store's counters do (the machine maps them anyway)
        await self.admin.execute(
            f"TRUNCATE {', '.join(self._tables)} RESTART IDENTITY CASCADE")
        self._synced = time.time()

    async def defer(self, name: str, queue: str, timeout: float) -> int:
        [trigger_id] = await self.store.defer([_deferral(_key(name), queue, timeout, None)])
        return trigger_id

    async def travel(self, seconds: float) -> None:
        now = time.time()
        spent, self._synced = now - self._synced, now
        # one round trip: the shift as a literal in each statement
        await self.admin.execute(";".join(
            statement.replace("$1", repr(float(seconds - spent))) for statement in _NATIVE_SHIFTS))

    async def end_task(self, name: str, state: str) -> None:
        await self.admin.execute("UPDATE task_instance SET state = $1 WHERE task_id = $2",
                                 state, name)

    async def rows(self) -> Rows:
        return await sql_rows(self.admin, _ROWS)

    async def close(self) -> None:
        await self.store.close()
        await self.admin.close()


async def sql_rows(admin: Any, query: str) -> Rows:
    """A SQL system's rows, read by ``query`` as three JSON arrays (triggers, tasks, processes)."""
    found = await admin.fetchrow(query)
    assert found is not None
    return Rows(
        {t["id"]: TriggerRow(t["owner_id"], t["attempt"], t["failures"], t["q"],
                             tuple(t["blocked_attempts"]), frozenset(t["rejected_by"]))
         for t in json.loads(found["triggers"])},
        {t["task_id"]: TaskRow(t["state"], t["next_method"], t["next_kwargs"])
         for t in json.loads(found["tasks"])},
        json.loads(found["processes"]))
