"""The Airflow store's seeder: Airflow's own rows (a DAG run, trigger rows with a deferred
task instance each, kwargs encrypted with the test Fernet key) on a copy of the migrated
Airflow 3.3 template database, with triggerflow's schema set up on it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import asyncpg

from tests import airflow_support as af
from tests.contract.backends import (
    NEXT_KWARGS,
    Meanwhile,
    T,
    TaskView,
    _execute,
    _shift,
    _task_view,
    race_in_sql,
)
from triggerflow.airflow.store import AirflowStore
from triggerflow.store import ServingStore

DATETIME_TRIGGER = "airflow.providers.standard.triggers.temporal.DateTimeTrigger"


def _encrypted(plain: bytes, key: str) -> str:
    from cryptography.fernet import Fernet

    return Fernet(key.encode()).encrypt(plain).decode()


class AirflowBackend:
    name = "airflow"

    def __init__(self, dsn: str, store: AirflowStore) -> None:
        from airflow.models.crypto import get_fernet
        from cryptography.fernet import Fernet

        self.dsn = dsn
        self.store: ServingStore = store
        self.airflow = store
        # Under another Fernet key: a process with another key may hold the right one.
        self.unreadable_kwargs = _encrypted(b'{"x": 1}', Fernet.generate_key().decode())
        # Decrypted with the right key, but not JSON: nobody can build the trigger from them.
        # (Decrypted text that does not start with "{" is taken as still encrypted by
        # Airflow's Trigger._decrypt_kwargs, hence unreadable, not invalid.)
        self.invalid_kwargs = get_fernet().encrypt(b'{"moment": ').decode()
        self._tasks: dict[int, str] = {}

    @classmethod
    async def open(cls, database: str) -> AirflowBackend:
        dsn = af.dsn_of(database)
        await af.prepare(dsn)
        return cls(dsn, await AirflowStore.connect(dsn, max_size=2))

    async def defer(self, queue: str, *, timeout: float = 3600.0,
                    stored_kwargs: str | None = None) -> int:
        # timeout: Airflow's scheduler times deferred tasks out, not the store
        from triggerflow.airflow.kwargs import encrypt_kwargs

        name = f"task{len(self._tasks)}"
        kwargs = stored_kwargs or encrypt_kwargs({"moment": "2030-01-01T00:00:00+00:00"})
        conn = await asyncpg.connect(self.dsn)
        try:
            task = await af.add_deferred_task(conn, name, DATETIME_TRIGGER, kwargs, queue=queue,
                                              next_kwargs=NEXT_KWARGS)
        finally:
            await conn.close()
        self._tasks[task.trigger_id] = name
        return task.trigger_id

    async def task(self, trigger_id: int) -> TaskView:
        return await _task_view(self.dsn, "task_id = $1", self._tasks[trigger_id])

    async def travel(self, seconds: float) -> None:
        await _execute(
            self.dsn,
            _shift("triggerflow.consumer", "registered_at", "renewed_at", "expires_at"),
            _shift("triggerflow.trigger_state", "claimed_at", "published_at", "quarantined_at"),
            _shift('"trigger"', "created_date"),
            _shift("task_instance", "updated_at", "start_date"),
            args=(seconds,))

    async def end_task(self, trigger_id: int, state: str) -> None:
        await _execute(self.dsn, "UPDATE task_instance SET state = $1 WHERE trigger_id = $2",
                       args=(state, trigger_id))

    async def allow_retries(self, trigger_id: int, retries: int) -> None:
        """The task may be retried (``max_tries``), as a task with ``retries=`` set."""
        await _execute(self.dsn, "UPDATE task_instance SET max_tries = $1 WHERE trigger_id = $2",
                       args=(retries, trigger_id))

    async def race(self, meanwhile: Meanwhile, call: Callable[[], Awaitable[T]]) -> T:
        return await race_in_sql(self.dsn, lambda pool: AirflowStore(
            pool, self.dsn, release=self.airflow.airflow_release),
                                 meanwhile, call)

    @contextlib.asynccontextmanager
    async def process(self) -> AsyncIterator[ServingStore]:
        store = await AirflowStore.connect(self.dsn, max_size=1)
        try:
            yield store
        finally:
            await store.close()

    async def close(self) -> None:
        await self.store.close()
