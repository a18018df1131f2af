"""Per-queue gauges every ``consume``/``writer`` process exports: depth, consumers by lease,
subscribers on the broker, leased consumers not subscribed, backlog age, overdue tasks."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from triggerflow.modes import Mode, mode_for
from triggerflow.redact import Redactor
from triggerflow.settings import Settings
from triggerflow.store.gauges import GaugeSource
from triggerflow.transport import QueueInfo
from triggerflow.transport.rabbitmq import RabbitTransport, Topology
from triggerflow.wiring import rabbit_transport

log = logging.getLogger(__name__)

# The broker's queue list (management API, two HTTP calls) is read every this many polls:
# it only adds queues nothing else names, which change rarely.
LISTING_EVERY = 6


@dataclass(frozen=True)
class QueueSample:
    """One poll's numbers for one queue; None where they do not apply or could not be read."""

    depth: int | None  # ready messages
    subscribers: int | None  # consumers the broker delivers to
    consumers: int | None  # live by lease (live writers for the events queue)
    unsubscribed: int | None = None  # leased, well below capacity, yet not subscribed
    backlog_seconds: float | None = None  # how long ready messages have waited unbroken
    overdue: int | None = None  # deferred tasks > 10 s past their timeout


class QueueGauges:
    """Exports the ``triggerflow.queue.*`` gauges (telemetry.py names them) per queue.

    A daemon thread with its own event loop, one database connection and one AMQP connection
    polls every ``interval`` seconds, so the numbers keep coming while the process's own loop
    is blocked. A consumer reports its queues; a writer reports every team queue it has ever
    seen while the broker still has it (those consumers declare, those with triggers waiting,
    and those bound to the deferrals exchange per the management API), so a queue whose
    triggers all timed out is still reported with 0 consumers. Both report the events queue
    (``consumers`` there = live writers) and the dead-letter queue, so a vanished writer shows
    as 0 writers rather than as no series. Aggregate with ``max by (queue)``.

    ``backlog_seconds`` is how long the poll has seen ready messages in the queue without
    once finding it empty: for a queue nobody drains (dead letters, events with no writer)
    the age of its oldest message, within one interval, as long as this process has run.

    The lease numbers come from ``mode`` (by default the one ``settings`` ask for), which
    knows where its consumers and writers keep their rows. A writer whose mode scopes it to
    some queues (Airflow mode's ``--queue`` during a migration) reports those, as a consumer.
    """

    def __init__(self, settings: Settings, *, all_queues: bool = False,
                 interval: float | None = None, mode: Mode[Any] | None = None) -> None:
        from triggerflow import telemetry

        self.settings = settings
        self.mode = mode or mode_for(settings)
        self.all_queues = all_queues and not self.mode.writer_queues
        self.interval = interval or min(5.0, settings.reaper_interval.total_seconds())
        self.topology = Topology(settings.namespace)
        self.redact = Redactor(settings)
        self.snapshot: dict[str, QueueSample] = {}
        self.updated = 0.0  # monotonic time of the last good poll
        self._known: set[str] = set()  # team queues seen, kept while the broker has them
        self._waiting_since: dict[str, float] = {}
        self._listing_failed = False
        self._polls = 0
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None  # set from stop(), on the thread's own loop
        self._thread = threading.Thread(target=self._run, name="queue-gauges", daemon=True)
        m = telemetry.get_metrics()
        for name, description, field in (
            (telemetry.QUEUE_DEPTH, "Wake-up (or event) messages ready in the broker queue",
             "depth"),
            (telemetry.QUEUE_CONSUMERS,
             "Live consumers (by lease) serving the queue; live writers for the events queue",
             "consumers"),
            (telemetry.QUEUE_SUBSCRIBERS,
             "Consumers the broker delivers the queue to (0 while paused at capacity)",
             "subscribers"),
            (telemetry.QUEUE_UNSUBSCRIBED,
             "Live consumers below 90% of capacity the broker does not deliver the queue to",
             "unsubscribed"),
            (telemetry.QUEUE_BACKLOG,
             "Seconds the queue has had ready messages without being seen empty",
             "backlog_seconds"),
            (telemetry.QUEUE_OVERDUE, "Deferred tasks more than 10 s past their timeout",
             "overdue"),
        ):
            m.gauge(name, description, self._observer(field))

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

    def _observer(self, field: str) -> Callable[[], list[tuple[float, dict[str, Any]]]]:
        def observe() -> list[tuple[float, dict[str, Any]]]:
            if time.monotonic() - self.updated > 3 * self.interval + 5:
                return []  # stale: report nothing rather than old numbers
            out: list[tuple[float, dict[str, Any]]] = []
            for queue, sample in sorted(self.snapshot.items()):
                value = getattr(sample, field)
                if value is not None:
                    out.append((float(value), {"queue": queue}))
            return out

        return observe

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        source: GaugeSource | None = None
        broker: RabbitTransport | None = None
        failing = False
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        while not self._stop.is_set():
            try:
                if source is None:
                    source = await self.mode.connect_gauges()
                if broker is None or not broker.is_open:
                    if broker is not None:
                        await broker.close()
                    broker = rabbit_transport(self.settings, name="triggerflow-queue-gauges")
                    await broker.connect()
                self.snapshot = await self.poll(source, broker)
                self.updated = time.monotonic()
                failing = False
            except Exception as exc:
                if not failing:
                    log.warning("queue gauges: poll failed (%s); retrying",
                                self.redact(repr(exc)))
                failing = True
                if source is not None:
                    with contextlib.suppress(Exception):
                        await source.close()
                    source = None
            # Not to_thread(self._stop.wait): at exit the default executor is shut down
            # before atexit runs stop(), and the submit raised in this thread.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval):
                    await self._wake.wait()
        for closer in (broker.close() if broker else None, source.close() if source else None):
            if closer is not None:
                with contextlib.suppress(Exception):
                    await closer

    async def poll(self, source: GaugeSource, broker: RabbitTransport) -> dict[str, QueueSample]:
        """{queue: sample} for the team queues this process reports and the shared queues."""
        queues = await self._team_queues(source)
        gauges = await source.leases(queues, self.settings.lease_ttl.total_seconds())
        now = time.monotonic()
        snapshot: dict[str, QueueSample] = {}
        for queue in queues:
            info = await broker.queue_info(queue)
            if info is None:
                self._known.discard(queue)  # deleted from the broker: stop reporting it
            leases = gauges.queues.get(queue)
            expected = leases.expected if leases else 0
            snapshot[queue] = QueueSample(
                depth=info.ready if info else None,
                subscribers=info.consumers if info else None,
                consumers=leases.consumers if leases else 0,
                unsubscribed=max(0, expected - info.consumers) if info else None,
                backlog_seconds=self._backlog(queue, info, now),
                overdue=leases.overdue if leases else 0)
        for queue, consumers in ((self.topology.events_queue, gauges.writers),
                                 (self.topology.dead_queue, None)):
            info = await self._shared_queue_info(broker, queue)
            snapshot[queue] = QueueSample(
                depth=info.ready if info else None,
                subscribers=info.consumers if info else None, consumers=consumers,
                backlog_seconds=self._backlog(queue, info, now))
        return snapshot

    async def _team_queues(self, source: GaugeSource) -> list[str]:
        if not self.all_queues:
            return list(self.settings.queues)
        found = await source.team_queues()
        if self._polls % LISTING_EVERY == 0:
            found |= await self._listed_by_broker()
        self._polls += 1
        self._known |= found
        return sorted(self._known)

    async def _listed_by_broker(self) -> set[str]:
        """Team queues bound to the deferrals exchange; empty (logged once) without the
        management API: the database's queues and those seen before are still reported."""
        from triggerflow.transport.management import (
            ManagementClient,
            ManagementUnavailable,
            vhost_of,
        )

        try:
            async with ManagementClient(self.settings.management_dsn()) as api:
                listed = await api.team_queues(vhost_of(self.settings.amqp_dsn()),
                                               self.topology.deferrals)
        except ManagementUnavailable as exc:
            if not self._listing_failed:
                log.warning("queue gauges: cannot list the broker's team queues (%s); "
                            "reporting those the database knows", self.redact(str(exc)))
            self._listing_failed = True
            return set()
        self._listing_failed = False
        return set(listed)

    async def _shared_queue_info(self, broker: RabbitTransport, queue: str) -> QueueInfo | None:
        # A team's broker user may not be allowed to look at the shared queues: that costs
        # only those series, never the team queue's.
        if self.all_queues:
            return await broker.queue_info(queue)
        try:
            return await broker.queue_info(queue)
        except Exception as exc:
            log.debug("queue gauges: cannot read %s (%s)", queue, self.redact(repr(exc)))
            return None

    def _backlog(self, queue: str, info: QueueInfo | None, now: float) -> float | None:
        if info is None:
            self._waiting_since.pop(queue, None)
            return None
        if not info.ready:
            self._waiting_since.pop(queue, None)
            return 0.0
        return now - self._waiting_since.setdefault(queue, now)


_queue_gauges: QueueGauges | None = None


def start_queue_gauges(settings: Settings, *, all_queues: bool = False) -> QueueGauges:
    """Start the per-queue gauges of this process (once; later calls return the first).

    A consumer reports ``settings.queues``; a writer (``all_queues``) reports every queue.
    """
    global _queue_gauges
    if _queue_gauges is None:
        _queue_gauges = QueueGauges(settings, all_queues=all_queues).start()
    return _queue_gauges
