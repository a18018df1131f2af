"""The writer: events in -> batches -> one store transaction each -> one ack per batch.

A batch is whatever arrived while the previous one was applied, up to ``writer_batch``
events and shared among the free connections (``writer_concurrency``): an idle writer
applies an event at once, a loaded one thousands per statement.
Acks go out only after the commit. A batch the store refuses is split in halves until the
bad event is found; that one is dead-lettered with the reason and the rest applied.
Knows the store and the transport only by interface.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential_jitter

from triggerflow import telemetry
from triggerflow.health import get_health
from triggerflow.lease import Lease
from triggerflow.lifecycle import report_refused, report_stopped
from triggerflow.model import EventKind, FailureReason
from triggerflow.reaper import Reaper
from triggerflow.runner import failure
from triggerflow.settings import Settings
from triggerflow.store import (
    Applied,
    EventRefused,
    ProcessKind,
    Store,
    StoreAccessRefused,
    StoreError,
)
from triggerflow.telemetry import context_from, get_metrics, tracer, tracing_enabled
from triggerflow.transport import Delivery, Transport, TransportUnavailable
from triggerflow.transport.subscriptions import Subscriptions
from triggerflow.wire import Event, WireError, decode_events, encode_events, encode_json

log = logging.getLogger(__name__)


@dataclass
class Received:
    """One event message: its events, or why it is dead-lettered instead."""

    message: Delivery
    events: list[Event]
    reject: str | None = None
    forged: list[tuple[Event, str]] = field(default_factory=list)  # (event, why refused)


def _log_retry(state: RetryCallState) -> None:
    exc = state.outcome.exception() if state.outcome else None
    log.warning("batch not applied (%r); retrying it", exc)


class Writer:
    """Consumes the events queue and applies events through the store.

    Settings: ``writer_batch`` (max events per statement), ``writer_prefetch`` (unacked
    messages), ``team_users`` (queue -> the only AMQP user allowed to publish its events).
    """

    def __init__(self, settings: Settings, store: Store, transport: Transport) -> None:
        self.settings = settings
        self.store = store
        self.transport = transport
        # A native writer's backstop covers every queue; in Airflow mode ``queues`` may name the
        # ones triggerflow serves, the rest being Airflow's own triggerer's (a migration).
        scope = list(settings.queues) if settings.airflow else []
        self.reaper = Reaper(store, transport, settings.model_copy(update={"queues": scope}))
        self.lease = Lease(store, ProcessKind.WRITER, ttl=max(settings.lease_ttl.total_seconds(), 10.0),
                           renew_interval=max(settings.renew_interval.total_seconds(), 1.0))
        self.subscriptions = Subscriptions(
            transport, prefetch=settings.writer_prefetch,
            check_interval=settings.subscription_check_interval.total_seconds(), renew=False)
        self.metrics = get_metrics()
        self._inbox: asyncio.Queue[Delivery] = asyncio.Queue()
        self._busy = 0  # batches being applied
        self._slots = asyncio.Semaphore(settings.writer_concurrency)
        self._applying: set[asyncio.Task[None]] = set()
        self._failures: asyncio.Queue[BaseException] = asyncio.Queue()
        self.applied_total = 0

    async def _receive(self, message: Delivery) -> None:
        self._inbox.put_nowait(message)

    async def run(self, stop: asyncio.Event) -> int:
        """Apply events until ``stop`` is set (0) or a lifecycle task crashed (1)."""
        health = get_health()
        health.watch_loop()
        health.check("lease", self.lease.problem)
        health.check("database", self.lease.database_problem)
        health.check("broker", self.subscriptions.problem)
        try:
            await self.lease.register()
        except StoreAccessRefused as exc:
            report_refused(exc)  # one line, no traceback
            await self.transport.close()
            return 1
        loop = asyncio.get_running_loop()
        self.subscriptions.add_events(self._receive)
        tasks = [
            loop.create_task(self.subscriptions.run(on_lost=self._drain_inbox), name="broker"),
            loop.create_task(self._apply_loop(), name="apply"),
            loop.create_task(self._raise_failures(), name="apply-batch"),
            loop.create_task(self._heartbeat_loop(), name="heartbeat"),
        ]
        stopper = loop.create_task(stop.wait(), name="stop")
        done, _ = await asyncio.wait([stopper, *tasks], return_when=asyncio.FIRST_COMPLETED)
        crashed = report_stopped(t for t in done if t is not stopper)
        stopper.cancel()
        log.info("stopping writer")
        # Let the batch in hand commit; unacked deliveries return to the queue on close.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle(), timeout=10)
        for task in [*tasks, *self._applying]:
            task.cancel()
        await asyncio.gather(*tasks, *self._applying, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self.lease.leave()
        await self.transport.close()
        return 1 if crashed else 0

    async def _idle(self) -> None:
        while not self._inbox.empty() or self._busy:  # noqa: ASYNC110 - polled only at shutdown
            await asyncio.sleep(0.05)

    def _drain_inbox(self) -> None:
        """Deliveries not yet acked died with the channel and will be redelivered."""
        while not self._inbox.empty():
            self._inbox.get_nowait()

    async def _heartbeat_loop(self) -> None:
        """Keep our row alive for ``status``/``health`` and run the all-queue reaper."""
        next_reap = 0.0
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.lease.renew_interval)
            try:
                await self.lease.keep(subscribed=self.subscriptions.connected.is_set())
                if loop.time() >= next_reap and self.transport.is_open:
                    next_reap = loop.time() + self.settings.reaper_interval.total_seconds()
                    # Dead consumers are reaped by their live peers, which claim the freed
                    # triggers themselves; a re-send from here could land in a stalled
                    # consumer's prefetch. The writer keeps the all-queue sweeps.
                    await self.reaper.time_out_orphans()
                    await self.reaper.report_unconsumed()
            except (asyncio.CancelledError, StoreAccessRefused):
                raise  # refused: report_stopped exits with one line
            except Exception as exc:
                log.warning("writer heartbeat/reaper failed: %r", exc)

    # -- batching --------------------------------------------------------------------------

    async def _apply_loop(self) -> None:
        # Up to writer_concurrency batches at once: while one commits (an fsync) the next is
        # already applying, as a profile of a 10,000-event burst showed the single loop idle
        # between statements. Each statement deletes its triggers in id order (a batch is
        # sorted), so concurrent batches do not deadlock; a trigger in both is applied once.
        while True:
            first = await self._inbox.get()
            await self._slots.acquire()
            batch = [self._decode(first)]
            size = len(batch[0].events)
            # What is queued is shared among the free slots: one batch of all of it would
            # finish last while another connection idles (a 10,000 burst's trace: 5,000 on
            # one connection for 135 ms, 3,000 then 500 on the other).
            free = max(1, self.settings.writer_concurrency - self._busy)
            share = -(-(self._inbox.qsize() + 1) // free)  # messages, rounded up
            while (not self._inbox.empty() and size < self.settings.writer_batch
                   and len(batch) < share):
                batch.append(self._decode(self._inbox.get_nowait()))
                size += len(batch[-1].events)
            self._busy += 1
            task = asyncio.get_running_loop().create_task(self._commit_in_slot(batch))
            self._applying.add(task)
            task.add_done_callback(self._applying.discard)

    async def _raise_failures(self) -> None:
        raise await self._failures.get()

    async def _commit_in_slot(self, batch: list[Received]) -> None:
        try:
            await self._commit(batch)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a crash of the writer, as when batches were applied inline
            self._failures.put_nowait(exc)
        finally:
            self._busy -= 1
            self._slots.release()

    def _decode(self, message: Delivery) -> Received:
        try:
            events = decode_events(message.body)
        except WireError as exc:
            return Received(message, [], reject=str(exc))
        kept: list[Event] = []
        forged: list[tuple[Event, str]] = []
        for ev in events:
            why = self._forged(ev, message)
            if why is None:
                kept.append(ev)
            else:
                forged.append((ev, why))
        return Received(message, kept, forged=forged)

    def _forged(self, ev: Event, message: Delivery) -> str | None:
        """Why ``ev`` may not be applied from this message, or None when it may.

        Topic permissions pin a team's user to its own routing keys, so the routing key
        names the publishing team's queue: an event for another queue's trigger is forged,
        whatever ``team_users`` says. Where ``team_users`` names the queue's user, RabbitMQ's
        validated ``user_id`` must match it as well.
        """
        if ev.queue != message.routing_key:
            return (f"forged: routing key {message.routing_key!r} may not carry events of "
                    f"{ev.queue!r}")
        owner = self.settings.team_users.get(ev.queue)
        if owner is not None and owner != message.user_id:
            return f"forged: user {message.user_id!r} may not publish events of {ev.queue}"
        return None

    async def _commit(self, batch: list[Received]) -> None:
        """Apply, retrying with backoff on any store error; ack only after the commit.

        Not only a lost connection is transient: a read-only database during failover or a
        statement timeout under a row lock pass too. Giving up would return the deliveries
        and spend their delivery limit, so the batch is retried until it goes through (a
        content error never gets here: ``_apply`` splits it out).
        """
        events = self._dedupe([ev for d in batch for ev in d.events])
        started = time.perf_counter()
        applied = 0
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(StoreError),
            wait=wait_exponential_jitter(multiplier=0.2, max=5, jitter=0.2),
            before_sleep=_log_retry,
        ):
            with attempt:
                applied = await self._apply(events)
        self.metrics.commit_time.record(time.perf_counter() - started)
        self.metrics.batch_size.record(len(events))
        for d in batch:
            if d.reject:
                await self._dead_letter(d.message.body, d.reject, d.message.routing_key)
            for ev, why in d.forged:
                await self._dead_letter(encode_events([ev]), why, d.message.routing_key)
        self.applied_total += applied
        try:
            if self.settings.writer_concurrency == 1:
                # One ack for the whole batch: everything up to the last tag is durable.
                await batch[-1].message.ack(multiple=True)
            else:  # an earlier batch may still be applying: ack exactly these
                for d in batch:
                    await d.message.ack()
        except TransportUnavailable as exc:
            # The connection dropped after the commit: the deliveries return to the queue and
            # come back once the subscriptions reconnect; applied already, they match nothing.
            log.warning("ack of a committed batch failed (%r); its redelivery will be ignored",
                        exc)

    @staticmethod
    def _dedupe(events: list[Event]) -> list[Event]:
        seen: dict[tuple[int, int], Event] = {}
        for ev in events:
            seen.setdefault((ev.trigger_id, ev.attempt), ev)
        return sorted(seen.values(), key=lambda e: e.trigger_id)

    async def _apply(self, events: list[Event]) -> int:
        """Apply a batch; split it to isolate events the store refuses."""
        if not events:
            return 0
        try:
            applied = await self.store.apply_events(events)
        except EventRefused as exc:
            if len(events) == 1:
                return await self._refused(events[0], exc)
            mid = len(events) // 2
            return await self._apply(events[:mid]) + await self._apply(events[mid:])
        self._record(applied, events)
        return len(applied)

    async def _refused(self, ev: Event, exc: StoreError) -> int:
        await self._dead_letter(encode_events([ev]), f"database refused event: {exc}", ev.queue)
        if ev.kind == EventKind.FAIL:
            return 0
        # Its trigger has fired and is forgotten: fail the task readably instead of leaving
        # it deferred forever.
        return await self._apply([Event(
            ev.trigger_id, ev.attempt, ev.queue, EventKind.FAIL,
            encode_json(failure(FailureReason.TRIGGER_FAILURE,
                                f"event dead-lettered: database refused it ({exc})")),
            ev.fired_at, ev.traceparent)])

    def _record(self, applied: list[Applied], events: list[Event]) -> None:
        m = self.metrics
        counts: dict[tuple[str, str], int] = {}
        for a in applied:  # one counter add per (kind, queue), not per event
            counts[a.kind, a.queue] = counts.get((a.kind, a.queue), 0) + 1
            m.latency.record(max(0.0, a.latency), {"queue": a.queue})
        for (kind, queue), n in counts.items():
            m.applied.add(n, {"kind": kind, "queue": queue})
        if len(applied) < len(events):
            m.ignored.add(len(events) - len(applied))
        if tracing_enabled():
            # One short span per traced event, child of its fire span: defer -> fire -> write.
            for ev in events:
                if ev.traceparent:
                    with tracer.start_as_current_span(
                        telemetry.SPAN_WRITE, context=context_from(ev.traceparent),
                        attributes={telemetry.ATTR_TRIGGER_ID: ev.trigger_id,
                                    telemetry.ATTR_BATCH_SIZE: len(events)},
                    ):
                        pass

    async def _dead_letter(self, body: bytes, reason: str, source: str) -> None:
        log.warning("dead-lettering event(s) from %s: %s", source, reason)
        self.metrics.dead_lettered.add(1, {"reason": reason.split(":")[0]})
        with contextlib.suppress(Exception):
            await self.transport.dead_letter(body, reason, source=source)
