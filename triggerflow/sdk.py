"""The embedded publisher SDK: what operators call to defer.

``defer`` records the trigger and moves the task instance to ``deferred`` in one store
transaction, then publishes a confirmed wake-up to the task's team queue. The store is the
record: a publish lost after the commit is re-sent by the reaper, so only a failed *write*
(or an unroutable queue) raises. Connections are reused, capped, and dropped in forked
children. Knows the store and the transport only by interface; the real ones come from
``triggerflow.wiring`` unless a ``connect`` function is given (tests pass in-memory ones).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import weakref
from collections import defaultdict
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential_jitter

from triggerflow import telemetry
from triggerflow.codec import KwargsCodec
from triggerflow.errors import TriggerflowError
from triggerflow.model import TaskKey, is_allowed
from triggerflow.settings import Settings
from triggerflow.store import NewDeferral, SdkStore, StoreUnavailable
from triggerflow.telemetry import current_traceparent, tracer
from triggerflow.transport import PublishRefused, Transport, TransportUnavailable, Unroutable
from triggerflow.triggers.base import BaseTrigger, TimerTrigger, usable_deadline
from triggerflow.wire import encode_json

log = logging.getLogger(__name__)
T = TypeVar("T")


class DeferralError(TriggerflowError, ValueError):
    """A deferral refused before anything was written (bad queue, kwargs, class...)."""


# (settings, max store connections) -> a connected store and an unconnected transport.
Connect = Callable[[Settings, int], Awaitable[tuple[SdkStore, Transport]]]


async def _connect_real(settings: Settings, max_connections: int) -> tuple[SdkStore, Transport]:
    from triggerflow.wiring import connect_deferral_store, make_transport

    store = await connect_deferral_store(settings, max_size=max_connections)
    return store, make_transport(settings, name="triggerflow-sdk")


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
    """Async SDK client. Create one per process and reuse it (``async with`` closes it).

    ``max_connections`` caps the store's pool; one broker connection is shared. Safe across
    ``fork()``: a child never reuses the parent's sockets, it reconnects on first use.
    ``connect`` replaces the real store and transport (``triggerflow.wiring``), e.g. by the
    in-memory ones of ``triggerflow.testing``.

    Raises, from ``defer``/``defer_many``: :class:`DeferralError` (nothing written: bad queue
    name, class outside ``allowed_modules``, kwargs not JSON or too big, a task twice in one
    batch); :class:`~triggerflow.transport.Unroutable` (the queue does not exist, or the
    broker returned the wake-up; the deferral is undone and its task failed);
    :class:`~triggerflow.transport.PublishRefused` (this user may not publish to the queue;
    undone likewise); :class:`~triggerflow.store.StoreError` (the write failed, after
    riding out a store restart for about two seconds). A wake-up lost to a broker outage
    after the write does not raise: the reaper re-sends it.
    """

    def __init__(self, settings: Settings | None = None, *, max_connections: int = 2,
                 connect: Connect | None = None) -> None:
        self.settings = settings or Settings()
        self.max_connections = max_connections
        self.codec = KwargsCodec.from_secrets(self.settings.kwargs_key, self.settings.kwargs_keys)
        self._connect_fn = connect or _connect_real
        self._store: SdkStore | None = None
        self._transport: Transport | None = None
        self._lock: asyncio.Lock | None = None
        self._routable: set[str] = set()
        _clients.add(self)

    def _forget_connections(self) -> None:
        self._store = None
        self._transport = None
        self._lock = None
        self._routable.clear()

    async def _connect(self) -> tuple[SdkStore, Transport]:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._store is None or self._transport is None:
                self._store, self._transport = await self._connect_fn(
                    self.settings, self.max_connections)
            if not self._transport.is_open:
                await self._transport.connect()
            return self._store, self._transport

    async def close(self) -> None:
        """Close the connections; the client reconnects if used again."""
        if self._transport is not None:
            await self._transport.close()
        if self._store is not None:
            await self._store.close()
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
        """Defer one task; returns the trigger id once the deferral is durable.

        ``timeout`` (a timedelta or seconds; capped at ``max_deferral``) fails the task with
        ``__fail__`` if the trigger has not fired by then. Raises as the class says.
        """
        ids = await self.defer_many(
            [Deferral(task, trigger, queue, method_name, kwargs or {}, timeout)]
        )
        return ids[0]

    async def defer_many(self, deferrals: Sequence[Deferral]) -> list[int]:
        """Defer many tasks in one store transaction and one wake-up message per queue.

        All or nothing: a :class:`DeferralError` for any item writes none of them. If the
        broker refuses a queue's wake-up (``Unroutable``, ``PublishRefused``), the deferrals
        not yet published are undone (their tasks fail) and those on queues already published
        stay deferred; the exception's note lists them.
        Returns the trigger ids in the order of ``deferrals``.
        """
        if not deferrals:
            return []
        with tracer.start_as_current_span(
            telemetry.SPAN_DEFER, attributes={telemetry.ATTR_COUNT: len(deferrals)}
        ):
            traceparent = current_traceparent()
            rows = self._validate(deferrals, traceparent)
            store, transport = await self._connect()
            await self._check_routable(transport, {d.queue for d in deferrals})
            ids = await self._record(store, rows)
            by_queue: dict[str, list[int]] = defaultdict(list)
            for d, trigger_id in zip(deferrals, ids, strict=True):
                by_queue[d.queue].append(trigger_id)
            published: set[int] = set()
            try:
                # Queue by queue, so a refusal knows which wake-ups already went out.
                for queue, queue_ids in by_queue.items():
                    await transport.publish_wakeups({queue: queue_ids}, traceparent=traceparent)
                    published.update(queue_ids)
            except (Unroutable, PublishRefused) as exc:
                # Not a lost publish but a refused one: undo what was not sent, so the error
                # is the whole truth. Deferrals whose wake-up went out stay deferred: a
                # consumer may already run them, and they are valid.
                await store.undo_defer([i for i in ids if i not in published],
                                       f"deferral not published: {exc}")
                if published:
                    exc.add_note(f"{len(published)} deferral(s) on other queues were published "
                                 f"and stay deferred: trigger ids {sorted(published)}")
                self._routable.clear()
                if isinstance(exc, PublishRefused):
                    await transport.close()  # the broker closed the channel
                raise
            except TransportUnavailable as exc:
                # Durable already: the reaper re-sends unclaimed triggers after its grace.
                log.warning("wake-up publish failed (%r); the reaper will re-send %d triggers",
                            exc, len(ids))
                await transport.close()
        return ids

    @staticmethod
    async def _record(store: SdkStore, rows: list[NewDeferral]) -> list[int]:
        """Write the deferral; ride out a store restart (a pool's dead connection).

        A retry after a commit whose answer was lost leaves one spare trigger row, which the
        task no longer points at: it fires into nothing and the writer deletes it.
        """
        ids: list[int] = []
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(StoreUnavailable), stop=stop_after_attempt(4),
            wait=wait_exponential_jitter(multiplier=0.25, max=2, jitter=0.1), reraise=True,
        ):
            with attempt:
                ids = await store.defer(rows)
        return ids

    async def _check_routable(self, transport: Transport, queues: set[str]) -> None:
        for queue in queues - self._routable:
            if await transport.queue_info(queue) is None:
                raise Unroutable(
                    f"queue {queue!r} does not exist: run `triggerflow topology apply "
                    f"--queue {queue}` (or defer to an existing team queue)"
                )
            self._routable.add(queue)

    def _validate(self, deferrals: Sequence[Deferral],
                  traceparent: str | None) -> list[NewDeferral]:
        s = self.settings
        rows: list[NewDeferral] = []
        seen: set[TaskKey] = set()
        for d in deferrals:
            if d.task in seen:
                raise DeferralError(f"task {d.task} appears twice in one batch")
            seen.add(d.task)
            if not d.queue or len(d.queue) > 200:
                raise DeferralError(f"bad queue name {d.queue!r}")
            classpath, kwargs = d.trigger.serialize()
            if isinstance(d.trigger, TimerTrigger):
                try:
                    usable_deadline(d.trigger)
                except ValueError as exc:
                    raise DeferralError(str(exc)) from None
            if not is_allowed(classpath, s.allowed_modules):
                raise DeferralError(
                    f"trigger class {classpath!r} is outside the allowed modules {s.allowed_modules}"
                )
            try:
                stored = self.codec.encode(kwargs, d.queue)
                next_kwargs = encode_json(d.kwargs)
            except Exception as exc:
                raise DeferralError(f"kwargs of {classpath} are not JSON-serializable: {exc}") from None
            if len(stored) > s.max_kwargs_bytes or len(next_kwargs) > s.max_kwargs_bytes:
                raise DeferralError(
                    f"kwargs of {classpath} exceed {s.max_kwargs_bytes} bytes; store big data elsewhere"
                )
            if "\\u0000" in next_kwargs:
                raise DeferralError("next kwargs contain a NUL character")
            longest = s.max_deferral.total_seconds()
            timeout = d.timeout.total_seconds() if isinstance(d.timeout, timedelta) else d.timeout
            timeout = longest if timeout is None else min(float(timeout), longest)
            rows.append(NewDeferral(
                d.task.dag_id, d.task.task_id, d.task.run_id, d.task.map_index, classpath,
                stored, d.queue, d.method_name, next_kwargs, timeout, traceparent))
        return rows

    # -- cancel --------------------------------------------------------------------------

    async def cancel(self, trigger_ids: list[int], *, state: str = "removed") -> int:
        """Move the tasks out of ``deferred`` (to ``state``) and stop their triggers on
        whoever runs them; returns how many tasks moved. A control message that cannot be
        sent does not raise: the owner's periodic sweep cancels the trigger instead.
        Raises :class:`~triggerflow.store.StoreError` when the store write fails."""
        store, transport = await self._connect()
        cancelled = await store.cancel(trigger_ids, state)
        by_owner: dict[tuple[int, str], list[int]] = defaultdict(list)
        for c in cancelled:
            if c.owner is not None:
                by_owner[c.owner, c.queue].append(c.id)
        for (owner, queue), ids in by_owner.items():
            try:
                await transport.publish_control(owner, "cancel", ids, queue=queue)
            except (TransportUnavailable, Unroutable, PublishRefused) as exc:
                # Unroutable: no control exchange for the queue (topology not applied since
                # the upgrade); the broker closed the channel, the next call reconnects.
                log.warning("control message to consumer %s failed (%r); its sweep will cancel",
                            owner, exc)
        return sum(1 for c in cancelled if c.moved)


class SyncClient:
    """Blocking facade for non-async code (prefork workers): a private loop in a thread.

    Same methods and errors as :class:`TriggerflowClient`, each blocking until done; the
    errors are raised in the calling thread. Safe across ``fork()`` (the child starts its
    own loop thread). Call ``close()`` when done.
    """

    def __init__(self, settings: Settings | None = None, *, max_connections: int = 2,
                 connect: Connect | None = None) -> None:
        self._settings = settings
        self._max = max_connections
        self._connect_fn = connect
        self._start()
        _sync_clients.add(self)

    def _start(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="triggerflow-sdk")
        self._thread.start()
        self._client = TriggerflowClient(self._settings, max_connections=self._max,
                                         connect=self._connect_fn)

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
