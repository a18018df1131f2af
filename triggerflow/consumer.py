"""The triggerer consumer: claim -> run -> emit, with the lease and the reaper beside it.

The one place that decides ack/reject for wake-ups: a delivery is acked only after the
claim statement committed (Postgres holds the lease from then on); ids beyond our free
capacity are re-published for other consumers and the delivery acked — never held or
nacked. Lifecycle is a set of named tasks (deliveries, claims, renewals, reaper, sweeps,
probation, subscription watch) stopped in a known order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
import time
from collections import defaultdict
from collections.abc import Coroutine
from typing import Any

from aio_pika.abc import AbstractIncomingMessage

from triggerflow import __version__
from triggerflow.emitter import EventSink
from triggerflow.loader import BadKwargs, Disallowed, KwargsCodec, TriggerLoader, Unloadable
from triggerflow.model import EventKind, FailureReason
from triggerflow.postgres import (
    CLAIM,
    CLAIM_PROBATION,
    CLEAR_PROBATION,
    DB_ERRORS,
    OTHER_LOADERS,
    RELEASE,
    SWEEP_CANCELLED,
    Database,
)
from triggerflow.rabbitmq import CONNECTION_ERRORS, Broker, Topology
from triggerflow.reaper import Reaper
from triggerflow.runner import Held, TriggerRunner, failure
from triggerflow.settings import Settings
from triggerflow.telemetry import (
    context_from,
    current_traceparent,
    get_metrics,
    tracer,
    tracing_enabled,
)
from triggerflow.triggers.base import BaseTrigger
from triggerflow.watchdog import LoopWatchdog
from triggerflow.wire import (
    Event,
    PayloadError,
    WireError,
    decode_control,
    decode_wakeup,
    validate_payload,
)

log = logging.getLogger(__name__)

DELETE_HELD = "DELETE FROM trigger WHERE id = ANY($1::bigint[]) AND owner_id = $2"


# Trigger ids to claim, and the wake-up that carried them (None: freed by our own reaper).
Delivery = tuple[list[int], AbstractIncomingMessage | None]


class LeaseLost(Exception):
    """Our consumer row expired: every trigger we hold may already run elsewhere."""


class Consumer:
    """Runs the triggers of ``settings.queues``.

    Keyword settings that matter most: ``capacity`` (max triggers held), ``lease_ttl`` and
    ``renew_interval`` (failover time), ``claim_batch`` (ids per claim statement),
    ``prefetch`` (wake-up messages in flight), ``allowed_modules``.
    """

    def __init__(self, settings: Settings, db: Database, broker: Broker) -> None:
        if not settings.queues:
            raise ValueError("a consumer needs at least one queue")
        self.settings = settings
        self.db = db
        self.broker = broker
        self.topology: Topology = broker.topology
        self.queues = list(settings.queues)
        self.loader = TriggerLoader(
            settings.allowed_modules,
            KwargsCodec(settings.kwargs_key.get_secret_value() if settings.kwargs_key else None),
        )
        self.sink = EventSink(broker, settings)
        self.runner = TriggerRunner(self._on_outcome)
        self.reaper = Reaper(db, broker, settings, take_locally=self._take_locally)
        self.me = 0
        self.host = socket.gethostname()
        self.metrics = get_metrics()
        self._deliveries: asyncio.Queue[Delivery] = asyncio.Queue()
        self._pending_ids = 0
        self._subscriptions: dict[str, str] = {}  # queue -> consumer tag
        self._unacked = 0  # wake-up deliveries received and not yet acked
        self._control_tag: str | None = None
        self._paused = False
        self._lease_deadline = 0.0  # loop time by which the next renewal must succeed
        self._suspects = asyncio.Event()
        self._probation: list[int] = []
        self._reap_now = asyncio.Event()
        self._claim_lock = asyncio.Lock()
        self._background: set[asyncio.Task[Any]] = set()  # strong refs until done
        self._connected = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []
        self._stopping = False
        self.watchdog = LoopWatchdog(settings.blocked_threshold, self._on_blocked,
                                     on_lag=lambda lag: self.metrics.loop_lag.record(lag))
        self._register_gauges()

    # -- lifecycle ---------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> int:
        """Serve until ``stop`` is set (0) or a lifecycle task crashed (1), then stop cleanly."""
        registering = asyncio.ensure_future(self._register())
        await asyncio.wait([registering, asyncio.ensure_future(stop.wait())],
                           return_when=asyncio.FIRST_COMPLETED)
        if not registering.done():  # stopped before the database ever answered
            registering.cancel()
            await self.broker.close()
            return 0
        self.watchdog.start()
        loop = asyncio.get_running_loop()
        for name, coro in (
            ("broker", self._broker_loop()),
            ("claims", self._claim_loop()),
            ("renewals", self._renew_loop()),
            ("reaper", self._reaper_loop()),
            ("cancel-sweep", self._sweep_loop()),
            ("probation", self._probation_loop()),
        ):
            self._tasks.append(loop.create_task(coro, name=name))
        stopper = loop.create_task(stop.wait(), name="stop")
        done, _ = await asyncio.wait([stopper, *self._tasks], return_when=asyncio.FIRST_COMPLETED)
        crashed = [t for t in done if t is not stopper]
        for task in crashed:
            log.error("task %s stopped unexpectedly; shutting down", task.get_name(),
                      exc_info=task.exception())
        stopper.cancel()
        await self.shutdown()
        return 1 if crashed else 0

    async def shutdown(self) -> None:
        """Graceful stop: no new claims, cancel triggers (cleanup), flush, hand back, leave."""
        self._stopping = True
        log.info("stopping: releasing %d triggers", len(self.runner))
        await self._unsubscribe_all()
        # A claim statement cancelled mid-flight may still commit after the release below and
        # strand its triggers on our dead row; let the one in flight finish instead.
        await self._claim_lock.acquire()
        if self._background:  # hand-overs and rebalancing in flight publish their wake-ups
            await asyncio.wait(list(self._background), timeout=5)
        for task in self._tasks:
            if task.get_name() not in ("broker",):
                task.cancel()
        await asyncio.gather(*[t for t in self._tasks if t.get_name() != "broker"],
                             return_exceptions=True)
        self.runner.cancel()
        await self.runner.wait_cleanups()
        await self.sink.drain(timeout=10)
        with contextlib.suppress(Exception):
            rows = await self.db.fetch(RELEASE, self.me, None, False, None)
            await self._republish(rows)
            self.metrics.released.add(len(rows), {"cause": "shutdown"})
            log.info("handed back %d triggers", len(rows))
        with contextlib.suppress(Exception):
            await self.db.unregister(self.me)
        self.watchdog.stop()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.broker.close()

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed", exc_info=task.exception())

    async def _register(self) -> None:
        while True:
            try:
                self.me = await self.db.register(
                    "consumer", self.host, os.getpid(), self.queues, self.settings.capacity,
                    __version__, self.settings.lease_ttl,
                )
                break
            except DB_ERRORS as exc:
                log.warning("cannot register (%r); retrying", exc)
                await asyncio.sleep(1)
        self._lease_deadline = asyncio.get_running_loop().time() + self._lease_budget()
        log.info("registered as consumer %s for %s", self.me, ",".join(self.queues),
                 extra={"consumer_id": self.me})

    def _lease_budget(self) -> float:
        return self.settings.lease_ttl - min(0.5, self.settings.renew_interval / 2)

    # -- broker ------------------------------------------------------------------------------

    async def _broker_loop(self) -> None:
        """Connect, subscribe, watch the subscriptions; reconnect with backoff on any loss."""
        backoff = 0.5
        while True:
            try:
                await self.broker.connect()
                await self._subscribe_all()
                await self._subscribe_control()
                self._connected.set()
                self.sink.retry()
                backoff = 0.5
                while self.broker.is_open:
                    await self._check_subscriptions()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(
                            self.broker.closed.wait(), self.settings.subscription_check_interval
                        )
                log.warning("broker connection lost; reconnecting")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("broker unavailable (%r); retrying in %.1fs", exc, backoff)
            self._connected.clear()
            self._subscriptions.clear()
            self._unacked = 0
            self._control_tag = None
            await self.broker.close()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 10)

    async def _subscribe_all(self) -> None:
        if self._paused or self._stopping:
            return
        for queue in self.queues:
            if queue not in self._subscriptions:
                _, tag = await self.broker.subscribe(
                    queue, self._on_delivery, prefetch=self.settings.prefetch
                )
                self._subscriptions[queue] = tag

    async def _unsubscribe_all(self) -> None:
        for queue, tag in list(self._subscriptions.items()):
            with contextlib.suppress(Exception):
                ch = await self.broker._channel().get_underlay_channel()
                await ch.basic_cancel(tag)
            self._subscriptions.pop(queue, None)

    async def _subscribe_control(self) -> None:
        name = self.topology.control_queue(self.me)
        q, tag = await self.broker.subscribe(
            name, self._on_control, prefetch=self.settings.prefetch,
            declare={"exclusive": True, "auto_delete": True},
        )
        await q.bind(self.topology.control, str(self.me))
        self._control_tag = tag

    async def _check_subscriptions(self) -> None:
        """Keep the subscriptions real while the connection looks fine.

        The broker's ``basic.cancel`` (queue deleted) is handled, but not every loss sends
        one: a quorum queue deleted and declared again at once keeps a ghost consumer on
        RabbitMQ 3.10 that swallows deliveries without ever sending them. Only a fresh
        ``basic.consume`` heals that, so each check also renews the subscription (two frames).
        """
        for queue, tag in list(self._subscriptions.items()):
            if not await self.broker.is_consuming(tag):
                log.warning("subscription to %s was cancelled by the broker; re-subscribing",
                            queue, extra={"queue": queue})
            elif await self.broker.queue_info(queue) is None:
                log.error("queue %s no longer exists on the broker", queue, extra={"queue": queue})
            else:
                with contextlib.suppress(Exception):
                    ch = await self.broker._channel().get_underlay_channel()
                    await ch.basic_cancel(tag)
            del self._subscriptions[queue]
        if self._control_tag and not await self.broker.is_consuming(self._control_tag):
            await self._subscribe_control()
        await self._subscribe_all()

    def _update_flow(self) -> None:
        """At capacity cancel the subscriptions; resume with room (10% hysteresis)."""
        held = len(self.runner) + self._pending_ids
        if not self._paused and held >= self.settings.capacity:
            self._paused = True
            log.info("at capacity (%d); pausing subscriptions", held)
            self._spawn(self._unsubscribe_all())
        elif self._paused and held < self.settings.capacity * 0.9:
            self._paused = False
            log.info("room again (%d held); resuming subscriptions", held)
            if self.broker.is_open:
                self._spawn(self._subscribe_all())

    async def _on_delivery(self, message: AbstractIncomingMessage) -> None:
        try:
            ids = decode_wakeup(message.body)
        except WireError as exc:
            await self._dead_letter(message, str(exc))
            return
        self._pending_ids += len(ids)
        self._unacked += 1
        self._deliveries.put_nowait((ids, message))

    def _take_locally(self, queue: str, ids: list[int]) -> list[int]:
        """Queue freed triggers for our own claim loop; return what does not fit."""
        if queue not in self.queues or self._stopping:
            return ids
        room = max(0, self.settings.capacity - len(self.runner) - self._pending_ids)
        take, rest = ids[:room], ids[room:]
        for i in range(0, len(take), self.settings.claim_batch):
            chunk = take[i : i + self.settings.claim_batch]
            self._pending_ids += len(chunk)
            self._deliveries.put_nowait((chunk, None))
        return rest

    async def _dead_letter(self, message: AbstractIncomingMessage, reason: str) -> None:
        log.warning("dead-lettering a message from %s: %s", message.routing_key, reason)
        self.metrics.dead_lettered.add(1, {"reason": reason.split(":")[0]})
        try:
            await self.broker.dead_letter(message.body, reason, source=message.routing_key or "")
            await message.ack()
        except Exception:
            await message.reject(requeue=False)  # the queue's DLX still keeps it

    async def _on_control(self, message: AbstractIncomingMessage) -> None:
        try:
            ctl = decode_control(message.body)
        except WireError as exc:
            await self._dead_letter(message, str(exc))
            return
        if ctl.op == "cancel":
            await self.cancel(ctl.ids, cause="control")
        await message.ack()

    # -- claiming ----------------------------------------------------------------------------

    async def _claim_loop(self) -> None:
        while True:
            batch = [await self._deliveries.get()]
            n = len(batch[0][0])
            while n < self.settings.claim_batch and not self._deliveries.empty():
                item = self._deliveries.get_nowait()
                batch.append(item)
                n += len(item[0])
            try:
                async with self._claim_lock:
                    if self._stopping:
                        return  # unacked: returned to the queue when the channel closes
                    await self._claim(batch)
            except asyncio.CancelledError:
                raise
            except Exception:
                # Not acked: the deliveries return to the queue when the channel closes, and
                # the reaper re-sends whatever stays unclaimed. Nothing is lost.
                log.exception("claim failed; %d deliveries left unacked", len(batch))
                await asyncio.sleep(1)
            finally:
                self._pending_ids -= n
            await asyncio.sleep(0)  # a 100k reclaim must not starve renewals

    async def _claim(self, batch: list[Delivery]) -> None:
        """One claim statement for the batch, then the acks: the lease is in Postgres now."""
        ids, overflow = self._fit_to_room(batch)
        rows = await self.db.fetch(CLAIM, self.me, ids, self.queues) if ids else []
        if overflow:  # hand the rest to other consumers through the queue, never nack
            await self.broker.publish_wakeups(overflow)
        await self._ack_all(batch)
        claimed = [r for r in rows if r["outcome"] == "claimed"]
        if any(r["outcome"] == "suspect" for r in rows):
            self._suspects.set()
        refused = [r for r in rows if r["outcome"] == "refused"]
        if refused:  # we cannot load these: back to the queue for a consumer that can
            self._spawn(self._pass_on(refused))
        self.metrics.claimed.add(len(claimed))
        for i, row in enumerate(claimed):
            self._start(row)
            if i % 500 == 499:
                await asyncio.sleep(0)
        self._update_flow()

    def _fit_to_room(self, batch: list[Delivery]) -> tuple[list[int], dict[str, list[int]]]:
        """Split delivered ids into what fits our free capacity and the overflow per queue."""
        room = max(0, self.settings.capacity - len(self.runner))
        ids: list[int] = []
        overflow: dict[str, list[int]] = defaultdict(list)
        for msg_ids, message in batch:
            for trigger_id in msg_ids:
                if len(ids) < room:
                    ids.append(trigger_id)
                elif message is not None and message.routing_key:
                    overflow[message.routing_key].append(trigger_id)
        return ids, overflow

    async def _ack_all(self, batch: list[Delivery]) -> None:
        for _, message in batch:
            if message is None:
                continue  # taken locally from the reaper, not delivered
            self._unacked -= 1
            try:
                await message.ack()
            except CONNECTION_ERRORS:
                # Redelivered after the reconnect; the claim then finds us the owner and
                # changes nothing.
                log.debug("ack lost with the channel")

    def _start(self, row: Any) -> None:
        # Interned: 100k held triggers share one string per class and queue, not 100k copies.
        held = Held(row["id"], row["attempt"], sys.intern(row["queue"]),
                    sys.intern(row["classpath"]), row["task"], row["timeout_at"],
                    row["traceparent"])
        try:
            trigger = self.loader.build(row["classpath"], row["kwargs"])
        except Unloadable as exc:
            self._spawn(self._hand_over_unloadable(held, str(exc)))
            return
        except (Disallowed, BadKwargs) as exc:
            reason = (FailureReason.TRIGGER_DISALLOWED if isinstance(exc, Disallowed)
                      else FailureReason.TRIGGER_UNLOADABLE)
            msg = f"{exc} (consumer {self.me} on {self.host})"
            log.warning("%s", msg, extra=held.log_context())
            self._on_outcome(held, EventKind.FAIL, failure(reason, msg))
            return
        if log.isEnabledFor(logging.DEBUG):
            log.debug("starting %s", row["classpath"], extra=held.log_context())
        self.runner.start(held, trigger)
        self.metrics.started.add(1)

    async def _hand_over_unloadable(self, held: Held, reason: str) -> None:
        """Mixed code versions: let a consumer that can import the class take it."""
        others = await self.db.fetchval(OTHER_LOADERS, held.id, self.me)
        if others:
            log.warning("%s; handing it to another consumer", reason, extra=held.log_context())
            rows = await self.db.fetch(RELEASE, self.me, [held.id], True, reason)
            await self._republish(rows)
            self.metrics.released.add(len(rows), {"cause": "unloadable"})
        else:
            msg = f"{reason}; no consumer of queue {held.queue} can load it (last: {self.me})"
            log.warning("%s", msg, extra=held.log_context())
            self._on_outcome(held, EventKind.FAIL, failure(FailureReason.TRIGGER_UNLOADABLE, msg))

    async def _pass_on(self, rows: list[Any]) -> None:
        await asyncio.sleep(1.0)  # no hot loop if the queue's only other consumer just left
        if not self._stopping:
            await self._republish(rows)

    async def _republish(self, rows: list[Any]) -> None:
        by_queue: dict[str, list[int]] = defaultdict(list)
        for r in rows:
            by_queue[r["queue"]].append(r["id"])
        if by_queue:
            await self.broker.publish_wakeups(by_queue)

    # -- outcomes ----------------------------------------------------------------------------

    def _on_outcome(self, held: Held, kind: EventKind, payload: Any) -> None:
        """Validate, stamp with (trigger id, attempt) and queue the event for publishing."""
        if asyncio.get_running_loop().time() > self._lease_deadline:
            return  # fenced: a peer may run this trigger now; our event would be stale
        reason: str | None = None
        try:
            text = validate_payload(payload, self.settings.max_event_bytes)
        except PayloadError as exc:
            reason = FailureReason.TRIGGER_FAILURE
            kind, text = EventKind.FAIL, validate_payload(
                failure(FailureReason.TRIGGER_FAILURE, f"{held.classpath}: {exc}"), 1 << 20)
        fired = time.time()
        traceparent = None
        if held.traceparent and tracing_enabled():
            traceparent = self._fire_span(held, kind)
        self.sink.add(Event(held.id, held.attempt, held.queue, str(kind), text, fired,
                            traceparent))
        if kind == EventKind.FAIL:
            if reason is None and isinstance(payload, dict):
                reason = payload.get("error")
            self.metrics.failed.add(
                1, {"queue": held.queue, "reason": str(reason or FailureReason.TRIGGER_FAILURE)})
        else:
            self.metrics.succeeded.add(1, {"queue": held.queue})
        if log.isEnabledFor(logging.DEBUG):
            log.debug("fired %s", kind, extra=held.log_context())
        if self._paused:
            self._update_flow()

    @staticmethod
    def _fire_span(held: Held, kind: EventKind) -> str | None:
        """A span for the run, parented on the defer span; only its id outlives this call."""
        with tracer.start_as_current_span(
            "triggerflow.fire", context=context_from(held.traceparent),
            attributes={"triggerflow.trigger_id": held.id, "triggerflow.queue": held.queue,
                        "triggerflow.event": str(kind), "triggerflow.attempt": held.attempt},
        ):
            return current_traceparent()

    async def cancel(self, ids: list[int], *, cause: str) -> int:
        stopped = self.runner.cancel(ids)
        if stopped:
            await self.db.execute(DELETE_HELD, [h.id for h in stopped], self.me)
            self.metrics.cancelled.add(len(stopped), {"cause": cause})
            for held in stopped:
                log.info("cancelled (%s)", cause, extra=held.log_context())
        return len(stopped)

    # -- lease -------------------------------------------------------------------------------

    async def _renew_loop(self) -> None:
        loop = asyncio.get_running_loop()
        interval = self.settings.renew_interval
        while True:
            await asyncio.sleep(interval)
            remaining = self._lease_deadline - loop.time()
            try:
                if remaining <= 0:
                    raise LeaseLost("renewal overdue (loop stalled or database unreachable)")
                result = await asyncio.wait_for(
                    self.db.renew(self.me, self.settings.lease_ttl, len(self.runner),
                                  self.queues),
                    timeout=remaining,
                )
                if result is None:
                    raise LeaseLost("lease had expired in the database")
            except (LeaseLost, TimeoutError) as exc:
                await self._fence(str(exc) or "renewal timed out")
                continue
            except DB_ERRORS as exc:
                log.warning("lease renewal failed: %r", exc)
                continue
            self._lease_deadline = loop.time() + self._lease_budget()
            self.metrics.renewals.add(1)
            if result.dead_peers:
                self._reap_now.set()
            self._maybe_rebalance(result.live_peers, result.peers_running)

    async def _fence(self, why: str) -> None:
        """Lost the lease: stop everything held, forget unsent events, register anew."""
        self.metrics.leases_lost.add(1)
        stopped = self.runner.cancel()
        dropped = self.sink.drop()
        log.error("lease lost (%s): stopped %d triggers, dropped %d events; re-registering",
                  why, len(stopped), dropped, extra={"consumer_id": self.me})
        self._probation = []
        old = self.me
        await self._register()
        if self.broker.is_open:  # control queue is named after our id
            with contextlib.suppress(Exception):
                await self._subscribe_control()
        log.info("consumer %s replaced by %s", old, self.me)

    def _maybe_rebalance(self, live_peers: int, peers_running: int) -> None:
        """After a rolling restart, shed what is over our fair share so peers fill up."""
        if live_peers < 2 or self._stopping or any(
                getattr(t.get_coro(), "__name__", "") == "_shed" for t in self._background):
            return
        mine = len(self.runner)
        fair = peers_running / live_peers
        excess = int(mine - fair * 1.1)
        if mine > fair * 1.25 and excess >= 20:
            excess = min(excess, self.settings.reclaim_rate)
            ids = list(self.runner.running)[-excess:]
            self._spawn(self._shed(ids))

    async def _shed(self, ids: list[int]) -> None:
        if self._stopping:
            return
        stopped = self.runner.cancel(ids)
        rows = await self.db.fetch(RELEASE, self.me, [h.id for h in stopped], False, None)
        await self._republish(rows)
        self.metrics.released.add(len(rows), {"cause": "rebalance"})
        log.info("rebalanced: handed %d triggers to peers", len(rows))

    # -- periodic sweeps ---------------------------------------------------------------------

    async def _reaper_loop(self) -> None:
        interval = self.settings.reaper_interval
        next_full = 0.0
        loop = asyncio.get_running_loop()
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._reap_now.wait(), timeout=interval)
            self._reap_now.clear()
            try:
                await self._connected.wait()
                await self.reaper.reap_dead()
                if loop.time() >= next_full:
                    next_full = loop.time() + interval
                    await self.reaper.resend_unclaimed()
                    await self.reaper.time_out_orphans()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("reaper sweep failed")

    async def _sweep_loop(self) -> None:
        """Backstop for cancellation: drop held triggers whose task is no longer deferred."""
        while True:
            await asyncio.sleep(self.settings.cancel_sweep_interval)
            if not self.runner.running:
                continue
            try:
                rows = await self.db.fetch(SWEEP_CANCELLED, self.me)
            except DB_ERRORS:
                continue
            if rows:
                await self.cancel([r["id"] for r in rows], cause="sweep")

    async def _probation_loop(self) -> None:
        """Run suspects (triggers whose consumer died) in halving groups, one group at a time."""
        while True:
            await self._suspects.wait()
            try:
                async with self._claim_lock:
                    if self._stopping:
                        return
                    rows = await self.db.fetch(CLAIM_PROBATION, self.me, self.queues)
            except DB_ERRORS:
                await asyncio.sleep(1)
                continue
            if not rows:
                self._suspects.clear()
                continue
            self._probation = [r["id"] for r in rows]
            log.warning("running %d suspect trigger(s) on probation", len(rows))
            for row in rows:
                self._start(row)
            await asyncio.sleep(self.settings.probation_seconds)
            await self.db.execute(CLEAR_PROBATION, self.me, self._probation)
            self._probation = []

    # -- observability -----------------------------------------------------------------------

    def _on_blocked(self, trigger: BaseTrigger | None, seconds: float) -> None:
        # Called from the watchdog thread while the loop is still blocked.
        name = f"{type(trigger).__module__}.{type(trigger).__qualname__}" if trigger else "unknown"
        self.metrics.blocked.add(1, {"trigger_class": name})
        log.warning(
            "event loop blocked for %.2fs by trigger %s (id %s); move blocking calls off the loop",
            seconds, name, trigger.trigger_id if trigger else None,
            extra={"trigger_id": trigger.trigger_id if trigger else None,
                   "task": trigger.task_key if trigger else None, "trigger_class": name},
        )

    def _register_gauges(self) -> None:
        m = self.metrics

        def running() -> list[tuple[float, dict[str, Any]]]:
            counts: dict[str, int] = defaultdict(int)
            for held in list(self.runner.running.values()):
                counts[held.queue] += 1
            return [(float(counts.get(q, 0)), {"queue": q}) for q in self.queues]

        m.gauge("triggerflow.triggers.running", "Triggers running, per queue", running)
        m.gauge("triggerflow.capacity_left", "Triggers this consumer can still take",
                lambda: [(float(self.settings.capacity - len(self.runner)), {})])

