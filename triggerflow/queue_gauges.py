"""Per-queue gauges (depth, consumers, subscribers) every ``consume``/``writer`` process exports."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import threading
import time
from typing import Any

from triggerflow.redact import Redactor
from triggerflow.settings import Settings
from triggerflow.store.postgres import Database
from triggerflow.store.postgres.admin import ALL_QUEUES, LIVE_WRITERS
from triggerflow.store.postgres.statements import QUEUE_CONSUMERS
from triggerflow.transport.rabbitmq import RabbitTransport, Topology
from triggerflow.wiring import admin_database, rabbit_transport

log = logging.getLogger(__name__)


class QueueGauges:
    """Exports ``triggerflow.queue.depth`` / ``.consumers`` / ``.subscribers`` per queue.

    A daemon thread with its own event loop, one database connection and one AMQP connection
    polls every ``interval`` seconds (two statements and a passive declare per queue), so the
    numbers keep coming while the process's own loop is blocked. A consumer reports its
    queues; a writer reports every queue (those consumers declare and those with triggers
    waiting) plus the events queue (``consumers`` there = live writers) and the dead-letter
    queue. Each process reports the same queues, so aggregate with ``max by (queue)``.
    """

    def __init__(self, settings: Settings, interval: float | None = None) -> None:
        from triggerflow import telemetry

        self.settings = settings
        self.interval = interval or min(5.0, settings.reaper_interval.total_seconds())
        self.topology = Topology(settings.namespace)
        self.redact = Redactor(settings)
        self.snapshot: dict[str, tuple[int | None, int | None, int | None]] = {}
        self.updated = 0.0  # monotonic time of the last good poll
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None  # set from stop(), on the thread's own loop
        self._thread = threading.Thread(target=self._run, name="queue-gauges", daemon=True)
        m = telemetry.get_metrics()
        m.gauge(telemetry.QUEUE_DEPTH, "Wake-up (or event) messages ready in the broker queue",
                lambda: self._observe(0))
        m.gauge(telemetry.QUEUE_CONSUMERS,
                "Live consumers (by lease) serving the queue; live writers for the events queue",
                lambda: self._observe(2))
        m.gauge(telemetry.QUEUE_SUBSCRIBERS,
                "Consumers the broker delivers the queue to (0 while paused at capacity)",
                lambda: self._observe(1))

    def start(self) -> QueueGauges:
        self._thread.start()
        atexit.register(self.stop)
        return self

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # that loop has already closed
                loop.call_soon_threadsafe(wake.set)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _observe(self, index: int) -> list[tuple[float, dict[str, Any]]]:
        if time.monotonic() - self.updated > 3 * self.interval + 5:
            return []  # stale: report nothing rather than old numbers
        out: list[tuple[float, dict[str, Any]]] = []
        for queue, values in sorted(self.snapshot.items()):
            value = values[index]
            if value is not None:
                out.append((float(value), {"queue": queue}))
        return out

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        db: Database | None = None
        broker: RabbitTransport | None = None
        failing = False
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        while not self._stop.is_set():
            try:
                if db is None:
                    db = await admin_database(self.settings)
                if broker is None or not broker.is_open:
                    if broker is not None:
                        await broker.close()
                    broker = rabbit_transport(self.settings, name="triggerflow-queue-gauges")
                    await broker.connect()
                self.snapshot = await self.poll(db, broker)
                self.updated = time.monotonic()
                failing = False
            except Exception as exc:
                if not failing:
                    log.warning("queue gauges: poll failed (%s); retrying",
                                self.redact(repr(exc)))
                failing = True
                if db is not None:
                    with contextlib.suppress(Exception):
                        await db.close()
                    db = None
            # Not to_thread(self._stop.wait): at exit the default executor is shut down
            # before atexit runs stop(), and the submit raised in this thread.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval):
                    await self._wake.wait()
        for closer in (broker.close() if broker else None, db.close() if db else None):
            if closer is not None:
                with contextlib.suppress(Exception):
                    await closer

    async def poll(
        self, db: Database, broker: RabbitTransport
    ) -> dict[str, tuple[int | None, int | None, int | None]]:
        """{queue: (depth, subscribers, live consumers)}; None where the broker has no queue."""
        queues = list(self.settings.queues)
        serves_all = not queues
        if serves_all:
            scope: list[Any] = await db.fetch(ALL_QUEUES)
            queues = [r["queue"] for r in scope]
        counts: list[Any] = await db.fetch(QUEUE_CONSUMERS, queues)
        live = {r["q"]: int(r["consumers"]) for r in counts}
        snapshot: dict[str, tuple[int | None, int | None, int | None]] = {}
        for queue in queues:
            info = await broker.queue_info(queue)
            snapshot[queue] = (info[0] if info else None, info[1] if info else None,
                               live.get(queue, 0))
        if serves_all:
            writers = int(await db.fetchval(LIVE_WRITERS))
            for queue, consumers in ((self.topology.events_queue, writers),
                                     (self.topology.dead_queue, None)):
                found = await broker.queue_info(queue)
                snapshot[queue] = (found[0] if found else None, found[1] if found else None,
                                   consumers)
        return snapshot


_queue_gauges: QueueGauges | None = None


def start_queue_gauges(settings: Settings, *, all_queues: bool = False) -> QueueGauges:
    """Start the per-queue gauges of this process (once; later calls return the first).

    A consumer reports ``settings.queues``; a writer (``all_queues``) reports every queue.
    """
    global _queue_gauges
    if _queue_gauges is None:
        if all_queues:
            settings = settings.model_copy(update={"queues": []})
        _queue_gauges = QueueGauges(settings).start()
    return _queue_gauges
