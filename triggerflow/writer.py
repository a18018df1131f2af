"""The writer: events in -> per-queue batches -> one store transaction each -> acks.

A batch is whatever of one queue arrived while the previous one was applied, up to
``writer_batch`` events and shared among the free connections (``writer_concurrency``): an
idle writer applies an event at once, a loaded one thousands per statement. Queues take
turns (``writer_lanes``), so one team's flood, poison or row locks cannot delay another's.
Acks go out only after the commit. A batch the store refuses is split in halves until the
bad event is found; that one is dead-lettered with the reason and the rest applied. Events
whose rows another transaction holds wait in their lane, retried without waiting for locks.
Knows the store and the transport only by interface.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, wait_exponential_jitter

from triggerflow import telemetry
from triggerflow.health import get_health
from triggerflow.lease import Lease
from triggerflow.lifecycle import Background, Tasks, report_refused
from triggerflow.model import EventKind, FailureReason
from triggerflow.presence import Presence
from triggerflow.reaper import Reaper
from triggerflow.runner import failure
from triggerflow.settings import Settings
from triggerflow.store import (
    Applied,
    Capabilities,
    EventRefused,
    EventsLocked,
    ProcessKind,
    StoreAccessRefused,
    StoreError,
    WriterStore,
)
from triggerflow.telemetry import context_from, get_metrics, tracer, tracing_enabled
from triggerflow.transport import Delivery, Transport, TransportUnavailable
from triggerflow.transport.subscriptions import Subscriptions
from triggerflow.wire import Event, encode_events, encode_json
from triggerflow.writer_lanes import Lanes, Letter, Received, Work, decode, new_work, resolve

log = logging.getLogger(__name__)


DEAD_LETTER_KEEP = 65_536  # bytes of a refused message's body kept in its dead letter


def _transient(exc: BaseException) -> bool:
    """A store error worth retrying as it is: not one about the events themselves."""
    return isinstance(exc, StoreError) and not isinstance(exc, EventRefused | EventsLocked)


def _log_retry(state: RetryCallState) -> None:
    exc = state.outcome.exception() if state.outcome else None
    log.warning("batch not applied (%r); retrying it", exc)


class Writer:
    """Consumes the events queue and applies events through the store.

    Settings: ``writer_batch`` (max events per statement), ``writer_prefetch`` (unacked
    messages), ``team_users`` (queue -> the only AMQP user allowed to publish its events).
    ``reaper_queues``: the queues its reaper's sweeps cover, empty for every queue (the mode
    decides: Airflow mode's ``--queue`` names those triggerflow serves during a migration).
    ``capabilities``: what the mode says its store does beyond the roles (default: native's).
    """

    def __init__(self, settings: Settings, store: WriterStore, transport: Transport, *,
                 reaper_queues: Sequence[str] = (),
                 capabilities: Capabilities | None = None) -> None:
        self.settings = settings
        self.store = store
        self.transport = transport
        scope = settings.model_copy(update={"queues": list(reaper_queues)})
        self.reaper = Reaper(store, transport, scope, times_out_orphans=(
            capabilities or Capabilities()).times_out_orphans)
        # A writer's lease fences nothing (it holds no triggers), so a short one buys nothing,
        # while a writer busy with a burst, or with the reaper sweeps its renewal loop runs,
        # on a loaded host would miss a short one: shown dead by status, health and the
        # gauges, and registered anew. Hence the floor; a killed writer is seen through its
        # presence queue at once instead (``presence``).
        self.lease = Lease(store, ProcessKind.WRITER, ttl=max(settings.lease_ttl.total_seconds(), 10.0),
                           renew_interval=max(settings.renew_interval.total_seconds(), 1.0))
        self.subscriptions = Subscriptions(
            transport, prefetch=settings.writer_prefetch,
            check_interval=settings.subscription_check_interval.total_seconds(), renew=False)
        self.presence = Presence(store, transport, self.lease)
        self.subscriptions.on_session = self.presence.connected
        self.metrics = get_metrics()
        self._inbox: asyncio.Queue[Delivery | None] = asyncio.Queue()  # None: look again
        # A lane may keep a quarter of the prefetch unacked while its rows are locked: the
        # rest stays free for the other queues' messages.
        self.lanes = Lanes(max_held=max(1, settings.writer_prefetch // 4),
                           max_events=settings.writer_batch)
        self._busy = 0  # batches being applied
        self._slots = asyncio.Semaphore(settings.writer_concurrency)
        self._applying = Background()  # batches in their slots, and finishing messages
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
        self.subscriptions.add_events(self._receive)
        tasks = Tasks()
        tasks.start("broker", self.subscriptions.run(on_lost=self._drain_inbox))
        tasks.start("apply", self._apply_loop())
        tasks.start("apply-batch", self._raise_failures())
        tasks.start("heartbeat", self._heartbeat_loop())
        crashed = await tasks.until(stop)
        log.info("stopping writer")
        # Let the batch in hand commit; unacked deliveries return to the queue on close.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle(), timeout=10)
        await tasks.cancel(also=list(self._applying.tasks))
        with contextlib.suppress(Exception):
            await self.lease.leave()
        await self.transport.close()
        return 1 if crashed else 0

    async def _idle(self) -> None:
        # Held events are not waited for: their deliveries return to the queue on close.
        while not self._inbox.empty() or self._busy or self.lanes.has_pending():  # noqa: ASYNC110 - polled only at shutdown
            await asyncio.sleep(0.05)

    def _drain_inbox(self) -> None:
        """Deliveries not yet acked died with the channel and will be redelivered."""
        while not self._inbox.empty():
            self._inbox.get_nowait()
        self.lanes.clear()

    async def _heartbeat_loop(self) -> None:
        """Keep our row alive for ``status``/``health`` and run the all-queue reaper."""
        next_reap = 0.0
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.lease.renew_interval)
            try:
                await self.lease.keep(subscribed=self.subscriptions.connected.is_set())
                await self.presence.announce()  # on a new row, if keep registered anew
                if loop.time() >= next_reap and self.transport.is_open:
                    next_reap = loop.time() + self.settings.reaper_interval.total_seconds()
                    # Dead consumers are reaped by their live peers, which claim the freed
                    # triggers themselves; a re-send from here could land in a stalled
                    # consumer's prefetch. The writer keeps the all-queue sweeps.
                    await self.reaper.time_out_orphans()
                    await self.reaper.report_unconsumed()
            except (asyncio.CancelledError, StoreAccessRefused):
                raise  # refused: Tasks.until exits with one line
            except Exception as exc:
                log.warning("writer heartbeat/reaper failed: %r", exc)

    # -- batching ----------------------------------------------------------------------------

    async def _apply_loop(self) -> None:
        # Up to writer_concurrency batches at once: while one commits (an fsync) the next is
        # already applying, as a profile of a 10,000-event burst showed the single loop idle
        # between statements. Each statement deletes its triggers in id order (a batch is
        # sorted), so concurrent batches do not deadlock; a trigger in both is applied once.
        while True:
            await self._slots.acquire()
            work = await self._next_work()
            self._busy += 1
            self._applying.spawn(self._run_in_slot(work))

    async def _next_work(self) -> Work:
        """The next queue's turn; every waiting delivery is decoded first, so a queue whose
        message arrived behind another team's thousand gets the very next turn."""
        loop = asyncio.get_running_loop()
        while True:
            while not self._inbox.empty():
                self._accept(self._inbox.get_nowait())
            # What is queued is shared among the free slots: one batch of all of it would
            # finish last while another connection idles (a 10,000 burst's trace: 5,000 on
            # one connection for 135 ms, 3,000 then 500 on the other).
            free = max(1, self.settings.writer_concurrency - self._busy)
            work = self.lanes.take(loop.time(), self.settings.writer_batch, free)
            if work is not None:
                return work
            due = self.lanes.next_due()
            with contextlib.suppress(TimeoutError):  # a held work is due
                self._accept(await asyncio.wait_for(
                    self._inbox.get(), None if due is None else max(0.0, due - loop.time())))

    def _accept(self, message: Delivery | None) -> None:
        if message is None:  # a nudge: work went back into a lane
            return
        received = decode(message, self.settings.max_event_message_bytes,
                          self.settings.team_users)
        if received.events:
            self.lanes.add(received)
        else:  # nothing to apply: dead-letter what it carried and ack it
            self._applying.spawn(self._finish(received))

    def _nudge(self) -> None:
        self._inbox.put_nowait(None)

    async def _raise_failures(self) -> None:
        raise await self._failures.get()

    async def _run_in_slot(self, work: Work) -> None:
        try:
            await self._run(work)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a crash of the writer, as when batches were applied inline
            self._failures.put_nowait(exc)
        finally:
            self._busy -= 1
            self._slots.release()
            self._nudge()

    async def _run(self, work: Work) -> None:
        """One turn of one queue: one statement (retried with backoff on any store error that
        is not about the events themselves), then the acks of the messages it completed.

        Not only a lost connection is transient: a read-only database during failover or a
        statement timeout pass too. Giving up would return the deliveries and spend their
        delivery limit, so the batch is retried until it goes through. Content the store
        refuses splits the work (``_refuse``); rows another transaction holds park the events
        they name in the lane (``_hold``) while the rest is applied.
        """
        started = time.perf_counter()
        try:
            async for attempt in AsyncRetrying(
                retry=retry_if_exception(_transient),
                # At most ~1 s apart: once a standby is promoted the next try finds it (the
                # URL's next host), so the cap is how long applying stays stopped after the
                # promotion; a try while nothing answers is one refused connect.
                wait=wait_exponential_jitter(multiplier=0.2, max=1, jitter=0.2),
                before_sleep=_log_retry,
            ):
                with attempt:
                    applied, held = await self._apply(work)
        except EventRefused as exc:
            await self._refuse(work, exc)
            return
        self.metrics.commit_time.record(time.perf_counter() - started)
        self.metrics.batch_size.record(len(work.events))
        waiting = {(ev.trigger_id, ev.attempt) for ev in held}
        self._record(applied, [ev for ev in work.events
                               if (ev.trigger_id, ev.attempt) not in waiting] if held else work.events)
        self.applied_total += len(applied)
        if held:
            await self._hold(work, held)
            return
        if work.queue in self.lanes.contended and not self.lanes.held_events(work.queue):
            self.lanes.contended.discard(work.queue)  # the locks are gone: wait for rows again
        await self._resolve(work)

    async def _apply(self, work: Work) -> tuple[list[Applied], list[Event]]:
        if not (work.held or work.queue in self.lanes.contended):
            try:
                return await self.store.apply_events(work.events), []
            except EventsLocked as exc:
                log.warning("queue %s: rows held by another transaction (%s); its events are "
                            "applied without waiting for them from now on, the held ones "
                            "retried", work.queue, exc)
                self.lanes.contended.add(work.queue)
        try:
            return await self.store.apply_unlocked(work.events)
        except EventsLocked:  # a row beyond the ones locked first: retry them all later
            return [], work.events

    async def _hold(self, work: Work, held: list[Event]) -> None:
        work.events = held
        for gone in self.lanes.hold(work, asyncio.get_running_loop().time()):
            waited = asyncio.get_running_loop().time() - gone.held_since
            reason = (f"held: rows of queue {gone.queue} locked by another transaction for "
                      f"{waited:.0f} s; over {self.lanes.max_held} messages of it waiting")
            await self._letter(gone, encode_events(gone.events), reason)
            await self._resolve(gone)

    async def _refuse(self, work: Work, exc: EventRefused) -> None:
        """Split ``work`` in halves, each its own turn, until the bad event is alone."""
        events = work.events
        if len(events) > 1:
            mid = len(events) // 2
            for half in (events[mid:], events[:mid]):
                self.lanes.push_front(new_work(work.queue, half, work.messages))
        else:
            ev = events[0]
            await self._letter(work, encode_events([ev]), f"database refused event: {exc}")
            if ev.kind != EventKind.FAIL:
                # Its trigger has fired and is forgotten: fail the task readably instead of
                # leaving it deferred forever.
                self.lanes.push_front(new_work(work.queue, [Event(
                    ev.trigger_id, ev.attempt, ev.queue, EventKind.FAIL,
                    encode_json(failure(FailureReason.TRIGGER_FAILURE,
                                        f"event dead-lettered: database refused it ({exc})")),
                    ev.fired_at, ev.traceparent)], work.messages))
        await self._resolve(work)

    async def _resolve(self, work: Work) -> None:
        for received in resolve(work):
            await self._finish(received)

    async def _letter(self, work: Work, body: bytes, reason: str) -> None:
        """Dead-letter ``body`` now; if it cannot be filed, before any message of ``work`` is
        acked (filed once)."""
        letter = Letter(body, reason, work.queue)
        await self._file([letter])
        for received in work.messages:
            received.letters.append(letter)

    async def _finish(self, received: Received, wait: float = 0.5) -> None:
        """Every event of ``received`` is settled: dead-letter what it carried that could not
        be applied, then ack it (each message on its own: lanes finish out of order)."""
        routing_key = received.message.routing_key
        if received.reject:
            received.letters.append(Letter(received.message.body[:DEAD_LETTER_KEEP],
                                           received.reject, routing_key))
            received.reject = None
        received.letters += [Letter(encode_events([ev]), why, routing_key)
                             for ev, why in received.forged]
        received.forged = []
        if not await self._file(received.letters):
            # Neither acked (what it carried would be gone with its reason) nor requeued
            # (redelivered at once, it would spend its delivery limit in moments): held
            # unacked and filed again later; if this writer stops, the broker hands it on.
            self._applying.spawn(self._finish_later(received, wait))
            return
        try:
            await received.message.ack()
        except TransportUnavailable as exc:
            # The connection dropped after the commit: the deliveries return to the queue and
            # come back once the subscriptions reconnect; applied already, they match nothing.
            log.warning("ack of a committed batch failed (%r); its redelivery will be ignored",
                        exc)

    async def _finish_later(self, received: Received, wait: float) -> None:
        await asyncio.sleep(wait)
        await self._finish(received, min(wait * 2, 30.0))

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

    async def _file(self, letters: list[Letter]) -> bool:
        """File the dead letters not yet filed; False when one could not be (logged)."""
        for letter in letters:
            if letter.filed:
                continue
            try:
                await self.transport.dead_letter(letter.body, letter.reason, source=letter.source)
            except Exception as exc:  # its exchange gone, the broker away, a full queue
                log.warning("a dead letter from %s could not be filed (%r); its message is "
                            "held unacked and filed again: %s", letter.source, exc,
                            letter.reason)
                return False
            letter.filed = True
            log.warning("dead-lettered event(s) from %s: %s", letter.source, letter.reason)
            self.metrics.dead_lettered.add(1, {"reason": letter.reason.split(":")[0]})
        return True
