"""The DB writer: batch events by size or age -> one statement -> ack.

Batching is natural: while one batch is being applied the next accumulates, so an idle
writer applies an event at once and a loaded one applies thousands per statement. Acks go
out only after the statement committed. A batch the database refuses is split in halves
until the bad event is found; that one is dead-lettered with the reason and the rest applied.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import asyncpg
from aio_pika.abc import AbstractIncomingMessage

from triggerflow import __version__
from triggerflow.model import EventKind, FailureReason
from triggerflow.postgres import APPLY_EVENTS, DB_DISCONNECTED, Database
from triggerflow.rabbitmq import Broker
from triggerflow.reaper import Reaper
from triggerflow.runner import failure
from triggerflow.settings import Settings
from triggerflow.telemetry import context_from, get_metrics, tracer, tracing_enabled
from triggerflow.wire import Event, WireError, decode_events, encode_events, encode_json

log = logging.getLogger(__name__)


@dataclass
class Delivery:
    """One event message: its events, or why it is dead-lettered instead."""

    message: AbstractIncomingMessage
    events: list[Event]
    reject: str | None = None
    forged: list[Event] = field(default_factory=list)

RETRYABLE = (asyncpg.DeadlockDetectedError, asyncpg.SerializationError)


class Writer:
    """Consumes ``<namespace>.events`` and applies events to ``task_instance``.

    Settings: ``writer_batch`` (max events per statement), ``writer_prefetch`` (unacked
    messages), ``team_users`` (queue -> the only AMQP user allowed to publish its events).
    """

    def __init__(self, settings: Settings, db: Database, broker: Broker) -> None:
        self.settings = settings
        self.db = db
        self.broker = broker
        self.reaper = Reaper(db, broker, settings.model_copy(update={"queues": []}))
        self.metrics = get_metrics()
        self._inbox: asyncio.Queue[AbstractIncomingMessage] = asyncio.Queue()
        self.me = 0
        self.applied_total = 0

    async def run(self, stop: asyncio.Event) -> int:
        """Apply events until ``stop`` is set (0) or a lifecycle task crashed (1)."""
        while not self.me:
            try:
                await self._register()
            except (OSError, asyncpg.PostgresError) as exc:
                log.warning("cannot register (%r); retrying", exc)
                await asyncio.sleep(1)
        loop = asyncio.get_running_loop()
        tasks = [
            loop.create_task(self._broker_loop(), name="broker"),
            loop.create_task(self._apply_loop(), name="apply"),
            loop.create_task(self._heartbeat_loop(), name="heartbeat"),
        ]
        stopper = loop.create_task(stop.wait(), name="stop")
        done, _ = await asyncio.wait([stopper, *tasks], return_when=asyncio.FIRST_COMPLETED)
        crashed = [t for t in done if t is not stopper]
        for task in crashed:
            log.error("task %s stopped unexpectedly; shutting down", task.get_name(),
                      exc_info=task.exception())
        stopper.cancel()
        log.info("stopping writer")
        # Let the batch in hand commit; unacked deliveries return to the queue on close.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle(), timeout=10)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self.db.unregister(self.me)
        await self.broker.close()
        return 1 if crashed else 0

    async def _register(self) -> None:
        self.me = await self.db.register(
            "writer", socket.gethostname(), os.getpid(), [], 0, __version__,
            max(self.settings.lease_ttl, 10.0))

    async def _idle(self) -> None:
        while not self._inbox.empty() or self._busy:  # noqa: ASYNC110 - polled only at shutdown
            await asyncio.sleep(0.05)

    _busy = False

    async def _broker_loop(self) -> None:
        backoff = 0.5
        while True:
            try:
                await self.broker.connect()
                _, tag = await self.broker.subscribe(
                    self.broker.topology.events_queue, self._inbox.put,
                    prefetch=self.settings.writer_prefetch,
                )
                backoff = 0.5
                while self.broker.is_open:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.broker.closed.wait(),
                                               self.settings.subscription_check_interval)
                    if self.broker.is_open and not await self.broker.is_consuming(tag):
                        log.warning("events subscription cancelled by the broker; re-subscribing")
                        break
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("broker unavailable (%r); retrying in %.1fs", exc, backoff)
            # Deliveries not yet acked die with this channel and will be redelivered.
            self._drain_inbox()
            await self.broker.close()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 10)

    def _drain_inbox(self) -> None:
        while not self._inbox.empty():
            self._inbox.get_nowait()

    async def _heartbeat_loop(self) -> None:
        """Keep our row alive for ``status``/``health`` and run the all-queue reaper."""
        next_reap = 0.0
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(max(self.settings.renew_interval, 1.0))
            try:
                renewed = await self.db.renew(self.me, max(self.settings.lease_ttl, 10.0), 0, [])
                if renewed is None:
                    await self._register()
                if loop.time() >= next_reap and self.broker.is_open:
                    next_reap = loop.time() + self.settings.reaper_interval
                    # Dead consumers are reaped by their live peers, which claim the freed
                    # triggers themselves; a re-send from here could land in a stalled
                    # consumer's prefetch. The writer keeps the all-queue sweeps.
                    await self.reaper.time_out_orphans()
                    await self.reaper.report_unconsumed()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("writer heartbeat/reaper failed: %r", exc)

    # -- batching --------------------------------------------------------------------------

    async def _apply_loop(self) -> None:
        while True:
            first = await self._inbox.get()
            self._busy = True
            try:
                batch = [self._decode(first)]
                size = len(batch[0].events)
                while not self._inbox.empty() and size < self.settings.writer_batch:
                    batch.append(self._decode(self._inbox.get_nowait()))
                    size += len(batch[-1].events)
                await self._commit(batch)
            finally:
                self._busy = False

    def _decode(self, message: AbstractIncomingMessage) -> Delivery:
        try:
            events = decode_events(message.body)
        except WireError as exc:
            return Delivery(message, [], reject=str(exc))
        owners = self.settings.team_users
        if not owners:
            return Delivery(message, events)
        kept: list[Event] = []
        forged: list[Event] = []
        for ev in events:
            owner = owners.get(ev.queue)
            (forged if owner is not None and owner != message.user_id else kept).append(ev)
        return Delivery(message, kept, forged=forged)

    async def _commit(self, batch: list[Delivery]) -> None:
        """Apply, retrying while the database is down; ack only after the commit."""
        events = [ev for d in batch for ev in d.events]
        started = time.perf_counter()
        backoff = 0.2
        while True:
            try:
                applied = await self._apply(self._dedupe(events))
                break
            except DB_DISCONNECTED as exc:
                log.warning("database unavailable (%r); retrying batch of %d", exc, len(events))
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5)
        self.metrics.commit_time.record(time.perf_counter() - started)
        self.metrics.batch_size.record(len(events))
        for d in batch:
            if d.reject:
                await self._dead_letter(d.message.body, d.reject, d.message.routing_key or "")
            for ev in d.forged:
                await self._dead_letter(
                    encode_events([ev]),
                    f"forged: user {d.message.user_id!r} may not publish events of {ev.queue}",
                    ev.queue)
        # One ack for the whole batch: everything up to the last tag is durable.
        await batch[-1].message.ack(multiple=True)
        self.applied_total += applied

    @staticmethod
    def _dedupe(events: list[Event]) -> list[Event]:
        seen: dict[tuple[int, int], Event] = {}
        for ev in events:
            seen.setdefault((ev.trigger_id, ev.attempt), ev)
        return sorted(seen.values(), key=lambda e: e.trigger_id)

    async def _apply(self, events: list[Event]) -> int:
        """Apply a batch; split it to isolate events the database refuses."""
        if not events:
            return 0
        try:
            rows = await self._execute(events)
        except (asyncpg.DataError, asyncpg.IntegrityConstraintViolationError) as exc:
            if len(events) == 1:
                ev = events[0]
                await self._dead_letter(encode_events(events),
                                        f"database refused event: {exc}", ev.queue)
                if ev.kind == EventKind.FAIL:
                    return 0
                # Its trigger has fired and is forgotten: fail the task readably instead of
                # leaving it deferred forever.
                return await self._apply([Event(
                    ev.trigger_id, ev.attempt, ev.queue, EventKind.FAIL,
                    encode_json(failure(FailureReason.TRIGGER_FAILURE,
                                        f"event dead-lettered: database refused it ({exc})")),
                    ev.fired_at, ev.traceparent)])
            mid = len(events) // 2
            return await self._apply(events[:mid]) + await self._apply(events[mid:])
        self._record(rows, events)
        return len(rows)

    async def _execute(self, events: list[Event]) -> list[Any]:
        args = (
            [e.trigger_id for e in events], [e.attempt for e in events],
            [e.queue for e in events], [e.kind for e in events],
            [e.payload for e in events], [e.fired_at for e in events],
        )
        for attempt in range(5):
            try:
                return await self.db.fetch(APPLY_EVENTS, *args)
            except RETRYABLE:
                if attempt == 4:
                    raise
                await asyncio.sleep(0.05 * (attempt + 1))
        raise AssertionError("unreachable")

    def _record(self, rows: list[Any], events: list[Event]) -> None:
        m = self.metrics
        for row in rows:
            m.applied.add(1, {"kind": row["kind"], "queue": row["queue"]})
            m.latency.record(max(0.0, row["latency"]), {"queue": row["queue"]})
        if len(rows) < len(events):
            m.ignored.add(len(events) - len(rows))
        if tracing_enabled():
            # One short span per traced event, child of its fire span: defer -> fire -> write.
            for ev in events:
                if ev.traceparent:
                    with tracer.start_as_current_span(
                        "triggerflow.write", context=context_from(ev.traceparent),
                        attributes={"triggerflow.trigger_id": ev.trigger_id,
                                    "triggerflow.batch_size": len(events)},
                    ):
                        pass

    async def _dead_letter(self, body: bytes, reason: str, source: str) -> None:
        log.warning("dead-lettering event(s) from %s: %s", source, reason)
        self.metrics.dead_lettered.add(1, {"reason": reason.split(":")[0]})
        with contextlib.suppress(Exception):
            await self.broker.dead_letter(body, reason, source=source)

