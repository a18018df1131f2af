"""Airflow mode's processes: the native loops on ``AirflowStore``, plus what Airflow's
triggerer did that nothing else in the deployment does.

``serve_consumer``: the native consumer with Airflow's classes (``loader.AirflowLoader``:
heap timers for ``DateTimeTrigger`` forms, Airflow's coroutine otherwise), Airflow's
serialisers for every event (``codec.wire_outcome``) and the runtime trigger code calls
(``runtime.serving``: connections, variables, XComs, DAG-run and task states ...).

``serve_writer``: the native writer (its backstop scoped to ``queues`` when given: during a
migration the other queues are Airflow's own triggerer's), and alongside it
- the ``TriggererJob`` heartbeat (``heartbeat.triggerer_job``), so Airflow's health checks see
  a triggerer while a writer runs;
- LISTEN on the NOTIFY trigger ``setup`` installed: each new Airflow trigger row becomes a
  wake-up on its team queue within milliseconds (``wakeups.listen``);
- the backstop: every ``reaper_interval``, rows nobody claimed within ``unclaimed_grace`` (a
  notification lost while no listener was connected, a wake-up the broker refused) are sent
  again, and ``Trigger.clean_unused`` runs (Airflow's triggerer runs it every loop).

Importing this module imports nothing from Airflow; ``serve_consumer`` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

from triggerflow.airflow.store import AirflowStore
from triggerflow.reaper import Reaper
from triggerflow.settings import Settings
from triggerflow.store import Store
from triggerflow.transport import Transport, TransportError

log = logging.getLogger(__name__)


async def connect_store(settings: Settings, *, max_size: int | None = None,
                        lock_timeout: float | None = None) -> AirflowStore:
    return await AirflowStore.connect(settings.database_dsn(),
                                      default_queue=settings.default_queue,
                                      max_size=max_size or settings.db_pool_size,
                                      lock_timeout=lock_timeout,
                                      resume_delay=settings.airflow_resume_delay.total_seconds())


def _airflow(store: Store) -> AirflowStore:
    if not isinstance(store, AirflowStore):
        raise TypeError(f"Airflow mode needs an AirflowStore, not {type(store).__name__}")
    return store


async def serve_consumer(settings: Settings, store: Store, transport: Transport,
                         stop: asyncio.Event) -> int:
    from triggerflow.airflow import runtime
    from triggerflow.airflow.codec import wire_outcome
    from triggerflow.airflow.loader import AirflowLoader
    from triggerflow.consumer import Consumer

    consumer = Consumer(settings, _airflow(store), transport,
                        loader=AirflowLoader(settings.allowed_modules), encode=wire_outcome)
    async with runtime.serving():
        return await consumer.run(stop)


class WakeUps:
    """New Airflow trigger rows -> wake-ups on their queues, then marked published (so the
    backstop leaves them alone for ``unclaimed_grace``). ``queues``, when given, are the only
    queues triggerflow serves: rows of any other are Airflow's own triggerer's."""

    def __init__(self, store: AirflowStore, transport: Transport,
                 queues: Sequence[str] = ()) -> None:
        self.store = store
        self.transport = transport
        self.queues = frozenset(queues)

    async def deliver(self, queue: str | None, ids: list[int]) -> None:
        queue = queue or self.store.default_queue
        if queue is None or not ids or (self.queues and queue not in self.queues):
            return  # not triggerflow's queue: Airflow's own triggerer serves these rows
        try:
            await self.transport.publish_wakeups({queue: ids})
        except TransportError as exc:
            # The backstop re-sends them once the broker (or the queue) is back.
            log.warning("wake-up for %d trigger(s) of %s not sent: %r", len(ids), queue, exc)
            return
        with contextlib.suppress(Exception):
            await self.store.mark_published(ids)


async def backstop(store: AirflowStore, reaper: Reaper, transport: Transport,
                   interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        if not transport.is_open:
            continue
        try:
            await reaper.resend_unclaimed()
            await store.clean_unused()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("Airflow backstop scan failed: %r", exc)


async def serve_writer(settings: Settings, any_store: Store, transport: Transport,
                       stop: asyncio.Event) -> int:
    from triggerflow.airflow import heartbeat, wakeups
    from triggerflow.writer import Writer

    store = _airflow(any_store)
    writer = Writer(settings, store, transport)
    wake = WakeUps(store, transport, settings.queues)
    interval = settings.reaper_interval.total_seconds()
    async with heartbeat.triggerer_job(store.pool):
        side = [
            asyncio.create_task(wakeups.listen(settings.database_dsn(), wake.deliver, stop),
                                name="airflow-listen"),
            asyncio.create_task(backstop(store, writer.reaper, transport, interval),
                                name="airflow-backstop"),
        ]
        try:
            return await writer.run(stop)
        finally:
            for task in side:
                task.cancel()
            await asyncio.gather(*side, return_exceptions=True)
