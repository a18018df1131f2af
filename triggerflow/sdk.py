"""The embedded publisher SDK: what operators call to defer.

``defer`` writes the trigger row and moves the task instance to ``deferred`` in one
statement (one transaction), then publishes a persistent, mandatory wake-up with publisher
confirms to ``<namespace>.deferrals`` (routing key = team queue). Postgres is the record: a
publish lost after the commit is re-sent by the reaper, so only a failed *write* (or an
unroutable queue) raises. Connections are reused, capped, and dropped in forked children.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import weakref
from collections import defaultdict
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

from triggerflow.loader import KwargsCodec
from triggerflow.model import TaskKey, is_allowed
from triggerflow.postgres import CANCEL, DB_DISCONNECTED, DEFER, UNDO_DEFER, Database
from triggerflow.rabbitmq import (
    CONNECTION_ERRORS,
    Broker,
    RefusedError,
    Topology,
    UnroutableError,
)
from triggerflow.settings import Settings
from triggerflow.telemetry import current_traceparent, tracer
from triggerflow.triggers.base import BaseTrigger
from triggerflow.wire import encode_control, encode_json

log = logging.getLogger(__name__)
T = TypeVar("T")


class DeferralError(ValueError):
    """A deferral refused before anything was written (bad queue, kwargs, class...)."""


@dataclass
class Deferral:
    """One task to defer: mirrors Airflow's ``self.defer(trigger=, method_name=, kwargs=, timeout=)``."""

    task: TaskKey
    trigger: BaseTrigger
    queue: str = "default"
    method_name: str = "execute_complete"
    kwargs: dict[str, Any] = field(default_factory=dict)
    timeout: timedelta | float | None = None


_clients: weakref.WeakSet[TriggerflowClient] = weakref.WeakSet()


_sync_clients: weakref.WeakSet[SyncClient] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for client in list(_clients):
        client._forget_connections()
    for sync in list(_sync_clients):
        sync._start()  # the parent's loop thread does not exist in the child


os.register_at_fork(after_in_child=_after_fork_in_child)


class TriggerflowClient:
    """Async SDK client. Create one per process and reuse it.

    ``max_connections`` caps the PostgreSQL pool; one AMQP connection is shared. Safe across
    ``fork()``: a child never reuses the parent's sockets, it reconnects on first use.
    """

    def __init__(self, settings: Settings | None = None, *, max_connections: int = 2) -> None:
        self.settings = settings or Settings()
        self.max_connections = max_connections
        self.topology = Topology(self.settings.namespace)
        self.codec = KwargsCodec(
            self.settings.kwargs_key.get_secret_value() if self.settings.kwargs_key else None
        )
        self._db: Database | None = None
        self._broker: Broker | None = None
        self._lock: asyncio.Lock | None = None
        self._routable: set[str] = set()
        _clients.add(self)

    def _forget_connections(self) -> None:
        self._db = None
        self._broker = None
        self._lock = None
        self._routable.clear()

    async def _connect(self) -> tuple[Database, Broker]:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._db is None:
                self._db = await Database.connect(
                    self.settings.database_dsn(), max_size=self.max_connections,
                    pgbouncer=self.settings.pgbouncer,
                )
            if self._broker is None or not self._broker.is_open:
                broker = Broker(self.settings.amqp_dsn(), self.topology, name="triggerflow-sdk")
                await broker.connect()
                self._broker = broker
            return self._db, self._broker

    async def close(self) -> None:
        if self._broker is not None:
            await self._broker.close()
        if self._db is not None:
            await self._db.close()
        self._forget_connections()

    async def __aenter__(self) -> TriggerflowClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- defer ---------------------------------------------------------------------------

    async def defer(
        self,
        task: TaskKey,
        trigger: BaseTrigger,
        *,
        queue: str = "default",
        method_name: str = "execute_complete",
        kwargs: dict[str, Any] | None = None,
        timeout: timedelta | float | None = None,
    ) -> int:
        """Defer one task; returns the trigger id once the deferral is durable."""
        ids = await self.defer_many(
            [Deferral(task, trigger, queue, method_name, kwargs or {}, timeout)]
        )
        return ids[0]

    async def defer_many(self, deferrals: Sequence[Deferral]) -> list[int]:
        """Defer many tasks in one statement and one wake-up message per queue."""
        if not deferrals:
            return []
        columns = self._validate(deferrals)
        with tracer.start_as_current_span(
            "triggerflow.defer", attributes={"triggerflow.count": len(deferrals)}
        ):
            traceparent = current_traceparent()
            columns.append([traceparent] * len(deferrals))
            db, broker = await self._connect()
            await self._check_routable(broker, {d.queue for d in deferrals})
            ids = await self._record(db, columns)
            by_queue: dict[str, list[int]] = defaultdict(list)
            for d, trigger_id in zip(deferrals, ids, strict=True):
                by_queue[d.queue].append(trigger_id)
            try:
                await broker.publish_wakeups(by_queue, traceparent=traceparent)
            except (UnroutableError, RefusedError) as exc:
                # Not a lost publish but a refused one: undo, so the error is the whole truth.
                await db.execute(UNDO_DEFER, ids, f"deferral not published: {exc}")
                self._routable.clear()
                if isinstance(exc, RefusedError):
                    self._broker = None  # the broker closed the channel
                raise
            except CONNECTION_ERRORS as exc:
                # Durable already: the reaper re-sends unclaimed triggers after its grace.
                log.warning("wake-up publish failed (%r); the reaper will re-send %d triggers",
                            exc, len(ids))
                self._broker = None
        return ids

    @staticmethod
    async def _record(db: Database, columns: list[list[Any]]) -> list[int]:
        """Write the deferral; ride out a database restart (a pool's dead connection).

        A retry after a commit whose answer was lost leaves one spare trigger row, which the
        task no longer points at: it fires into nothing and the writer deletes it.
        """
        for attempt in range(4):
            try:
                return [r["id"] for r in await db.fetch(DEFER, *columns)]
            except DB_DISCONNECTED:
                if attempt == 3:
                    raise
                await asyncio.sleep(0.25 * 2**attempt)
        raise AssertionError("unreachable")

    async def _check_routable(self, broker: Broker, queues: set[str]) -> None:
        for queue in queues - self._routable:
            if await broker.queue_info(queue) is None:
                raise UnroutableError(
                    f"queue {queue!r} does not exist: run `triggerflow topology apply "
                    f"--queue {queue}` (or defer to an existing team queue)"
                )
            self._routable.add(queue)

    def _validate(self, deferrals: Sequence[Deferral]) -> list[list[Any]]:
        s = self.settings
        cols: list[list[Any]] = [[] for _ in range(10)]
        seen: set[TaskKey] = set()
        for d in deferrals:
            if d.task in seen:
                raise DeferralError(f"task {d.task} appears twice in one batch")
            seen.add(d.task)
            if not d.queue or len(d.queue) > 200:
                raise DeferralError(f"bad queue name {d.queue!r}")
            classpath, kwargs = d.trigger.serialize()
            if not is_allowed(classpath, s.allowed_modules):
                raise DeferralError(
                    f"trigger class {classpath!r} is outside the allowed modules {s.allowed_modules}"
                )
            try:
                stored = self.codec.encode(kwargs)
                next_kwargs = encode_json(d.kwargs)
            except Exception as exc:
                raise DeferralError(f"kwargs of {classpath} are not JSON-serializable: {exc}") from None
            if len(stored) > s.max_kwargs_bytes or len(next_kwargs) > s.max_kwargs_bytes:
                raise DeferralError(
                    f"kwargs of {classpath} exceed {s.max_kwargs_bytes} bytes; store big data elsewhere"
                )
            if "\\u0000" in next_kwargs:
                raise DeferralError("next kwargs contain a NUL character")
            timeout = d.timeout.total_seconds() if isinstance(d.timeout, timedelta) else d.timeout
            timeout = s.max_deferral if timeout is None else min(float(timeout), s.max_deferral)
            for col, value in zip(cols, (
                d.task.dag_id, d.task.task_id, d.task.run_id, d.task.map_index, classpath,
                stored, d.queue, d.method_name, next_kwargs, timeout,
            ), strict=True):
                col.append(value)
        return cols

    # -- cancel --------------------------------------------------------------------------

    async def cancel(self, trigger_ids: list[int], *, state: str = "removed") -> int:
        """Move the tasks out of ``deferred`` and stop their triggers on whoever runs them."""
        db, broker = await self._connect()
        rows = await db.fetch(CANCEL, trigger_ids, state)
        by_owner: dict[int, list[int]] = defaultdict(list)
        for r in rows:
            if r["owner_id"] is not None:
                by_owner[r["owner_id"]].append(r["id"])
        for owner, ids in by_owner.items():
            try:
                await broker.publish(self.topology.control, str(owner),
                                     encode_control("cancel", ids), mandatory=False)
            except CONNECTION_ERRORS:
                log.warning("control message to consumer %s failed; its sweep will cancel", owner)
        return sum(1 for r in rows if r["moved"])


class SyncClient:
    """Blocking facade for non-async code (prefork workers): a private loop in a thread."""

    def __init__(self, settings: Settings | None = None, *, max_connections: int = 2) -> None:
        self._settings = settings
        self._max = max_connections
        self._start()
        _sync_clients.add(self)

    def _start(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="triggerflow-sdk")
        self._thread.start()
        self._client = TriggerflowClient(self._settings, max_connections=self._max)

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def defer(self, task: TaskKey, trigger: BaseTrigger, **options: Any) -> int:
        return self._call(self._client.defer(task, trigger, **options))

    def defer_many(self, deferrals: Sequence[Deferral]) -> list[int]:
        return self._call(self._client.defer_many(deferrals))

    def cancel(self, trigger_ids: list[int], *, state: str = "removed") -> int:
        return self._call(self._client.cancel(trigger_ids, state=state))

    def close(self) -> None:
        self._call(self._client.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
