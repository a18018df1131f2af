"""The triggerer consumer: claim -> run -> emit, with the lease and the reaper beside it.

The one place that decides ack/reject for wake-ups: a delivery is acked only after the
claim committed (the store holds the lease from then on); ids beyond our free capacity are
re-published for other consumers and the delivery acked -- never held or nacked. The
lifecycle is a set of named tasks (subscriptions, claims, renewals, reaper, cancel sweep,
probation) stopped in a known order. Knows the store and the transport only by interface.
A trigger that blocks the loop past ``block_limit`` is stopped and charged (``strikes``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any, TypeVar

from triggerflow.consumer.freezer import Freezer
from triggerflow.consumer.observe import ConsumerObserver
from triggerflow.consumer.outcomes import EncodeFn, Outcomes
from triggerflow.consumer.presence import Presence
from triggerflow.consumer.probation import Probation
from triggerflow.consumer.rebalance import excess
from triggerflow.consumer.reconcile import Reconciler
from triggerflow.consumer.strikes import Strikes
from triggerflow.emitter import EventSink
from triggerflow.lease import Lease, LeaseLost
from triggerflow.lifecycle import report_stopped
from triggerflow.loader import BadKwargs, Disallowed, Loader, TriggerLoader, Unloadable
from triggerflow.model import EventKind, FailureReason
from triggerflow.reaper import Reaper
from triggerflow.runner import Held, TriggerRunner, failure
from triggerflow.settings import Settings
from triggerflow.store import (
    ProcessKind,
    Store,
    StoreError,
    Taker,
    TriggerRef,
    TriggerSpec,
)
from triggerflow.telemetry import get_metrics
from triggerflow.transport import Delivery, Transport, TransportError
from triggerflow.transport.subscriptions import Subscriptions
from triggerflow.wire import WireError, decode_control, decode_wakeup

log = logging.getLogger(__name__)
T = TypeVar("T")

# Trigger ids to claim, and the wake-up that carried them (None: freed by our own reaper).
Wakeup = tuple[list[int], Delivery | None]


class Consumer:
    """Runs the triggers of ``settings.queues``.

    Keyword settings that matter most: ``capacity`` (max triggers held), ``lease_ttl`` and
    ``renew_interval`` (failover time), ``claim_batch`` (ids per claim statement),
    ``prefetch`` (wake-up messages in flight), ``allowed_modules``, ``max_clock_skew``.
    ``clock`` is the wall clock timers and timeouts are read on (tests shift it).
    Raises ValueError when ``settings.queues`` is empty.
    """

    def __init__(self, settings: Settings, store: Store, transport: Transport, *,
                 loader: Loader | None = None, encode: EncodeFn | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        if not settings.queues:
            raise ValueError("a consumer needs at least one queue")
        self.settings = settings
        self.store = store
        self.transport = transport
        self.queues = list(settings.queues)
        # Airflow mode passes its own (Airflow's classes, timers and serialisers).
        self.loader: Loader = loader or TriggerLoader(settings.allowed_modules)
        self.lease = Lease(store, ProcessKind.CONSUMER, queues=self.queues,
                           capacity=settings.capacity, ttl=settings.lease_ttl.total_seconds(),
                           renew_interval=settings.renew_interval.total_seconds(),
                           max_clock_skew=settings.max_clock_skew.total_seconds(), clock=clock)
        self.sink = EventSink(transport, settings)
        self.outcomes = Outcomes(self.sink, self.lease, settings, on_fired=self._on_fired,
                                encode=encode)
        self.runner = TriggerRunner(self.outcomes.emit, self.outcomes.emit_many, clock)
        self.reaper = Reaper(store, transport, settings, local=self)
        self.subscriptions = Subscriptions(
            transport, prefetch=settings.prefetch,
            check_interval=settings.subscription_check_interval.total_seconds())
        for queue in self.queues:
            self.subscriptions.add(queue, self._on_delivery)
        # Nothing is taken before the first renewal finds our clock within max_clock_skew.
        self.subscriptions.paused = True
        self.clock_ok: bool | None = None  # None: not compared yet
        self.metrics = get_metrics()
        self._wakeups: asyncio.Queue[Wakeup] = asyncio.Queue()
        self._pending_ids = 0
        self._reap_now = asyncio.Event()
        self.presence = Presence(store, transport, self.lease, self.queues, self._reap_now)
        self.subscriptions.on_session = self.presence.connected
        self._claim_lock = asyncio.Lock()
        self._background: set[asyncio.Task[Any]] = set()  # strong refs until done
        self._tasks: list[asyncio.Task[Any]] = []
        self._stopping = False
        self.probation = Probation(self.store, self.lease, self.queues, self._claim_lock,
                                   self._start, settings.probation_seconds.total_seconds(),
                                   room=self._room)
        self.reconciler = Reconciler(
            store, lambda: self.me, self.runner.running.__contains__, self._republish,
            settings.reconcile_after.total_seconds())
        self.strikes = Strikes(settings, store, self.lease, self.runner, self.probation,
                               self._spawn, self._republish)
        self.observer = ConsumerObserver(self)
        self.freezer = Freezer()  # a million held must not slow every full GC pass

    @property
    def me(self) -> int:
        return self.lease.me

    # -- lifecycle ---------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> int:
        """Serve until ``stop`` is set (0) or a lifecycle task crashed (1), then stop cleanly."""
        self.observer.start()  # readiness and the loop's watchdog, while registering too
        registering = asyncio.ensure_future(self.lease.register())
        await asyncio.wait([registering, asyncio.ensure_future(stop.wait())],
                           return_when=asyncio.FIRST_COMPLETED)
        if not registering.done() or registering.exception():  # stopped, or refused
            registering.cancel()
            self.observer.stop()
            await self.transport.close()
            return 1 if report_stopped([registering] if registering.done() else []) else 0
        await self.subscriptions.set_control(self.me, self._on_control)
        loop = asyncio.get_running_loop()
        for name, coro in (
            ("broker", self.subscriptions.run(on_connected=self.sink.retry)),
            ("claims", self._claim_loop()),
            ("renewals", self._renew_loop()),
            ("reaper", self.reaper.run(self.subscriptions.connected, self._reap_now)),
            ("cancel-sweep", self._sweep_loop()),
            ("probation", self.probation.run()),
            ("reconcile", self.reconciler.run()),
        ):
            self._tasks.append(loop.create_task(coro, name=name))
        stopper = loop.create_task(stop.wait(), name="stop")
        done, _ = await asyncio.wait([stopper, *self._tasks], return_when=asyncio.FIRST_COMPLETED)
        crashed = report_stopped(t for t in done if t is not stopper)
        stopper.cancel()
        await self.shutdown()
        return 1 if crashed else 0

    async def shutdown(self) -> None:
        """Graceful stop: no new claims, cancel triggers (cleanup), flush, hand back, leave."""
        self._stopping = True
        log.info("stopping: releasing %d triggers", len(self.runner))
        await self.subscriptions.stop()
        # A claim cancelled mid-flight may still commit after the release below and strand
        # its triggers on our dead row; let the one in flight finish instead.
        await self._claim_lock.acquire()
        if self._background:  # hand-overs and rebalancing in flight publish their wake-ups
            await asyncio.wait(list(self._background), timeout=5)
        others = [t for t in self._tasks if t.get_name() != "broker"]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        self.runner.cancel()
        await self.runner.wait_cleanups()
        await self.sink.drain(timeout=10)
        with contextlib.suppress(Exception):
            refs = await self.store.release(self.me)
            await self._republish(refs)
            self.metrics.released.add(len(refs), {"cause": "shutdown"})
            log.info("handed back %d triggers", len(refs))
        with contextlib.suppress(Exception):
            await self.lease.leave()
        self.observer.stop()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.transport.close()

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed", exc_info=task.exception())

    # -- deliveries ----------------------------------------------------------------------

    def _update_flow(self) -> None:
        """At capacity (or with a skewed clock) cancel the subscriptions; resume with room
        (10% hysteresis) and a good clock."""
        held = len(self.runner) + self._pending_ids
        paused = self.subscriptions.paused
        if not paused and (held >= self.settings.capacity or not self.clock_ok):
            if self.clock_ok:
                log.info("at capacity (%d); pausing subscriptions", held)
            self.subscriptions.paused = True  # at once: no resume may slip in before the task
            self._spawn(self.subscriptions.pause())
        elif paused and self.clock_ok and held < self.settings.capacity * 0.9:
            log.info("room again (%d held); resuming subscriptions", held)
            self.subscriptions.paused = False
            self._spawn(self.subscriptions.resume())

    async def _on_delivery(self, message: Delivery) -> None:
        ids = await self._decode(message, decode_wakeup)
        if ids is None:
            return
        self._pending_ids += len(ids)
        self._wakeups.put_nowait((ids, message))

    def _room(self) -> int:
        if not self.clock_ok:  # no take-over, probation or local claim on a skewed clock
            return 0
        return max(0, self.settings.capacity - len(self.runner) - self._pending_ids)

    # -- the reaper's side (reaper.Local) ---------------------------------------------------

    @contextlib.asynccontextmanager
    async def taking(self) -> AsyncIterator[Taker | None]:
        """While the reaper takes dead peers' triggers over: no claim, no shutdown's release
        in between (a take-over committed after it would strand them on our dead row)."""
        async with self._claim_lock:
            room = self._room()
            yield (Taker(self.me, room) if room and not self._stopping and self.lease.valid()
                   else None)

    async def adopt(self, taker: Taker, specs: list[TriggerSpec]) -> None:
        if taker.me != self.me or not self.lease.valid() or not self.clock_ok:
            # Fenced while the take-over ran: nobody runs what it took under the old id.
            # (Or our clock went wrong meanwhile: peers run it.)
            with contextlib.suppress(StoreError, TransportError):  # else the reaper's later
                await self._republish(await self.store.release(taker.me, [s.id for s in specs]))
            return
        # Started while the reaper's next batch is rewritten (the database works meanwhile);
        # pending until then, so the next batch leaves room for them.
        self._pending_ids += len(specs)
        self._spawn(self._start_adopted(specs))

    async def _start_adopted(self, specs: list[TriggerSpec]) -> None:
        try:
            await self._start_all(specs)
        finally:
            self._pending_ids -= len(specs)

    def take_locally(self, queue: str, ids: list[int]) -> list[int]:
        """Queue freed triggers for our own claim loop; return what does not fit."""
        if queue not in self.queues or self._stopping:
            return ids
        room = self._room()
        take, rest = ids[:room], ids[room:]
        for i in range(0, len(take), self.settings.claim_batch):
            chunk = take[i : i + self.settings.claim_batch]
            self._pending_ids += len(chunk)
            self._wakeups.put_nowait((chunk, None))
        return rest

    async def _decode(self, message: Delivery, decode: Callable[[bytes], T]) -> T | None:
        """The decoded message, or None when it was unreadable and is now dead-lettered."""
        try:
            return decode(message.body)
        except WireError as exc:
            await self._dead_letter(message, str(exc))
            return None

    async def _dead_letter(self, message: Delivery, reason: str) -> None:
        log.warning("dead-lettering a message from %s: %s", message.routing_key, reason)
        self.metrics.dead_lettered.add(1, {"reason": reason.split(":")[0]})
        try:
            await self.transport.dead_letter(message.body, reason, source=message.routing_key)
            await message.ack()
        except Exception:
            await message.reject(requeue=False)  # the queue's DLX still keeps it

    async def _on_control(self, message: Delivery) -> None:
        ctl = await self._decode(message, decode_control)
        if ctl is None:
            return
        if ctl.op == "cancel" and any(i in self.runner.running for i in ctl.ids):
            # Anyone who may cancel can publish to the control exchange, so the message is a
            # hint, not an order: cancel only held triggers whose task the store confirms is
            # no longer deferred (the sweep's statement, run now).
            try:
                confirmed = await self.store.sweep_cancelled(self.me)
            except StoreError as exc:
                log.warning("cancel check failed (%r); the sweep will retry", exc)
                confirmed = []
            if confirmed:
                await self.cancel(confirmed, cause="control")
        await message.ack()

    # -- claiming ----------------------------------------------------------------------------

    async def _claim_loop(self) -> None:
        while True:
            batch = [await self._wakeups.get()]
            n = len(batch[0][0])
            while n < self.settings.claim_batch and not self._wakeups.empty():
                item = self._wakeups.get_nowait()
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
                # Requeued at once: left unacked on an open channel they would wait for the
                # broker's consumer timeout. The pause keeps a lost database from a hot loop.
                log.exception("claim failed; requeueing %d deliveries", len(batch))
                await self._requeue_all(batch)
                await asyncio.sleep(1)
            finally:
                self._pending_ids -= n
            await asyncio.sleep(0)  # a 100k reclaim must not starve renewals

    async def _claim(self, batch: list[Wakeup]) -> None:
        """One claim for the batch, then the acks: the lease is in the store now."""
        me = self.me
        if not self.lease.valid():  # fenced, re-registering: a claim now would be stranded
            await self._requeue_all(batch)
            await asyncio.sleep(0.1)
            return
        ids, overflow = self._fit_to_room(batch)
        found = await self.store.claim(me, ids, self.queues)
        if me != self.me or not self.lease.valid() or not self.clock_ok:
            # Fenced while the claim ran: nobody runs what it took under the old id.
            # (Or our clock went wrong meanwhile: peers run it.)
            await self.store.release(me, [s.id for s in found.claimed])
            await self._requeue_all(batch)
            return
        try:
            if overflow:  # hand the rest to other consumers through the queue, never nack
                await self.transport.publish_wakeups(overflow)
        except Exception:
            # What we claimed still starts below; the deliveries go back to the queue so the
            # overflow is not lost (their claimed ids then find a live owner and are skipped).
            log.warning("re-publishing %d overflow ids failed; requeueing their wake-ups",
                        sum(len(v) for v in overflow.values()), exc_info=True)
            await self._requeue_all(batch)
        else:
            await self._ack_all(batch)
        if found.suspects:
            self.probation.suspects.set()
        if found.refused:  # we cannot load these: back to the queue for a consumer that can
            self._spawn(self._pass_on(found.refused))
        await self._start_all(found.claimed)

    async def _start_all(self, specs: list[TriggerSpec]) -> None:
        self.metrics.claimed.add(len(specs))
        for i, spec in enumerate(specs):
            self._start(spec)  # never raises: one bad trigger must not strand the rest
            if i % 500 == 499:
                await asyncio.sleep(0)
                if self._stopping:  # the rest stay ours in the store: shutdown hands them back
                    break
        self.freezer.started(len(specs))
        self._update_flow()

    def _fit_to_room(self, batch: list[Wakeup]) -> tuple[list[int], dict[str, list[int]]]:
        """Split delivered ids into what fits our free capacity and the overflow per queue."""
        # skewed: all of it goes on to peers (deliveries in flight as we unsubscribed)
        room = max(0, self.settings.capacity - len(self.runner)) if self.clock_ok else 0
        ids: list[int] = []
        overflow: dict[str, list[int]] = defaultdict(list)
        for msg_ids, message in batch:
            for trigger_id in msg_ids:
                if len(ids) < room:
                    ids.append(trigger_id)
                elif message is not None and message.routing_key:
                    overflow[message.routing_key].append(trigger_id)
        return ids, overflow

    async def _requeue_all(self, batch: list[Wakeup]) -> None:
        for _, message in batch:
            if message is None:
                continue  # freed by our reaper: its next pass re-sends what stays unclaimed
            try:
                await message.reject(requeue=True)
            except TransportError:
                log.debug("reject lost with the channel; the broker requeues it anyway")

    async def _ack_all(self, batch: list[Wakeup]) -> None:
        for _, message in batch:
            if message is None:
                continue  # taken locally from the reaper, not delivered
            try:
                await message.ack()
            except TransportError:
                # Redelivered after the reconnect; the claim then finds us the owner and
                # changes nothing.
                log.debug("ack lost with the channel")

    def _start(self, spec: TriggerSpec) -> None:
        held = Held(spec.id, spec.attempt, spec.queue, spec.classpath, spec.task,
                    spec.timeout_at, spec.traceparent)
        try:
            self._build_and_run(held, spec)
        except Exception as exc:  # whatever the trigger did, only its own task fails
            log.exception("starting %s failed", spec.classpath, extra=held.log_context())
            self.runner.cancel([held.id])
            self.outcomes.emit(held, EventKind.FAIL, failure(
                FailureReason.TRIGGER_FAILURE, f"trigger {spec.classpath} failed to start: {exc!r}"))

    def _build_and_run(self, held: Held, spec: TriggerSpec) -> None:
        try:
            trigger = self.loader.build(spec)
        except Unloadable as exc:
            self._spawn(self._hand_over_unloadable(held, str(exc)))
            return
        except (Disallowed, BadKwargs) as exc:
            reason = (FailureReason.TRIGGER_DISALLOWED if isinstance(exc, Disallowed)
                      else FailureReason.TRIGGER_UNLOADABLE)
            msg = f"{exc} (consumer {self.me} on {self.lease.host})"
            log.warning("%s", msg, extra=held.log_context())
            self.outcomes.emit(held, EventKind.FAIL, failure(reason, msg))
            return
        if log.isEnabledFor(logging.DEBUG):
            log.debug("starting %s", spec.classpath, extra=held.log_context())
        self.runner.start(held, trigger)
        self.metrics.started.add(1)

    async def _hand_over_unloadable(self, held: Held, reason: str) -> None:
        """Mixed code versions: let a consumer that can import the class take it."""
        if await self.store.other_loaders(held.id, self.me):
            log.warning("%s; handing it to another consumer", reason, extra=held.log_context())
            refs = await self.store.release(self.me, [held.id], cannot_load=True, reason=reason)
            await self._republish(refs)
            self.metrics.released.add(len(refs), {"cause": "unloadable"})
        else:
            msg = f"{reason}; no consumer of queue {held.queue} can load it (last: {self.me})"
            log.warning("%s", msg, extra=held.log_context())
            self.outcomes.emit(held, EventKind.FAIL,
                               failure(FailureReason.TRIGGER_UNLOADABLE, msg))

    async def _pass_on(self, refs: list[TriggerRef]) -> None:
        """Refused here before: fail what no live consumer may load, pass the rest on."""
        try:
            failed = set(await self.store.fail_unloadable(self.me, [r.id for r in refs]))
        except StoreError as exc:  # passed on as before; the next refusal asks again
            log.warning("checking refused triggers failed: %r", exc)
            failed = set()
        if failed:
            log.warning("failed %d trigger(s) no live consumer of their queue can load",
                        len(failed))
            for ref in refs:
                if ref.id in failed:
                    self.metrics.failed.add(1, {"queue": ref.queue,
                                                "reason": str(FailureReason.TRIGGER_UNLOADABLE)})
        rest = [r for r in refs if r.id not in failed]
        await asyncio.sleep(1.0)  # no hot loop if the queue's only other consumer just left
        if rest and not self._stopping:
            await self._republish(rest)

    async def _republish(self, refs: Sequence[TriggerRef]) -> None:
        by_queue: dict[str, list[int]] = defaultdict(list)
        for ref in refs:
            by_queue[ref.queue].append(ref.id)
        if by_queue:
            await self.transport.publish_wakeups(by_queue)

    def _on_fired(self, helds: Sequence[Held]) -> None:
        self.reconciler.fired([h.id for h in helds], [h.attempt for h in helds])
        if self.subscriptions.paused:
            self._update_flow()

    async def cancel(self, ids: list[int], *, cause: str) -> int:
        """Stop the held triggers among ``ids`` and drop their rows; returns how many."""
        stopped = self.runner.cancel(ids)
        if stopped:
            await self.store.forget(self.me, [h.id for h in stopped])
            self.metrics.cancelled.add(len(stopped), {"cause": cause})
            for held in stopped:
                log.info("cancelled (%s)", cause, extra=held.log_context())
        return len(stopped)

    # -- lease -------------------------------------------------------------------------------

    async def _renew_loop(self) -> None:
        while True:  # the first at once: it checks our clock before anything is taken
            await self._renew()
            await asyncio.sleep(self.settings.renew_interval.total_seconds())

    async def _renew(self) -> None:
        try:
            renewal = await self.lease.renew(
                len(self.runner),
                subscribed=self.subscriptions.connected.is_set() and self.clock_ok is True)
        except LeaseLost as exc:
            await self._fence(str(exc))
            return
        except StoreError as exc:
            log.warning("lease renewal failed: %r", exc)
            return
        self.metrics.renewals.add(1)
        self._check_clock()
        await self.presence.announce()
        if renewal.dead_peers:
            self._reap_now.set()
        self._maybe_rebalance(renewal.live_peers, renewal.peers_running)

    def _check_clock(self) -> None:
        """Run triggers only while our clock is within ``max_clock_skew`` of the database's:
        timers and timeouts are read on it. Skewed, the consumer unsubscribes, takes nothing
        and hands back what it holds (stopped here, before a timer can fire), so peers with
        good clocks run it; it serves again once a renewal finds its clock back."""
        check = self.lease.clock_check
        if check.skew is None or check.ok is self.clock_ok:
            return
        self.clock_ok = check.ok
        if check.ok:
            log.info("clock %+.3fs off the database's, within max_clock_skew (%gs): "
                     "running triggers", check.skew, check.bound)
        else:
            stopped = self.runner.cancel()
            log.error("clock %+.1fs off the database's, past max_clock_skew (%gs): "
                      "not firing timers or timeouts on it; handing %d triggers to peers",
                      check.skew, check.bound, len(stopped), extra={"consumer_id": self.me})
            if stopped:
                self._spawn(self._hand_back(stopped, "clock_skew"))
        self._update_flow()

    async def _fence(self, why: str) -> None:
        """Lost the lease: stop everything held, forget unsent events, register anew."""
        self.metrics.leases_lost.add(1)
        stopped = self.runner.cancel()
        dropped = self.sink.drop()
        log.error("lease lost (%s): stopped %d triggers, dropped %d events; re-registering",
                  why, len(stopped), dropped, extra={"consumer_id": self.me})
        self.probation.group = []
        self.lease.deadline = 0.0  # invalid until re-registered: no claim, no event meanwhile
        old = self.me
        await self.lease.register()
        await self.subscriptions.set_control(self.me, self._on_control)  # named after our id
        await self.presence.announce()
        log.info("consumer %s replaced by %s", old, self.me)

    def _maybe_rebalance(self, live_peers: int, peers_running: int) -> None:
        """After a rolling restart, shed what is over our fair share so peers fill up."""
        if self._stopping or any(
                getattr(t.get_coro(), "__name__", "") == "_shed" for t in self._background):
            return
        n = excess(len(self.runner), live_peers, peers_running, self.settings.reclaim_rate)
        if n:
            self._spawn(self._shed(list(self.runner.running)[-n:]))

    async def _shed(self, ids: list[int]) -> None:
        if self._stopping:
            return
        refs = await self._hand_back(self.runner.cancel(ids), "rebalance")
        log.info("rebalanced: handed %d triggers to peers", len(refs))

    async def _hand_back(self, stopped: list[Held], cause: str) -> list[TriggerRef]:
        """Release stopped triggers and wake their queues' other consumers."""
        refs = await self.store.release(self.me, [h.id for h in stopped])
        await self._republish(refs)
        self.metrics.released.add(len(refs), {"cause": cause})
        return refs

    # -- periodic sweeps ---------------------------------------------------------------------

    async def _sweep_loop(self) -> None:
        """Backstop for cancellation: drop held triggers whose task is no longer deferred."""
        while True:
            await asyncio.sleep(self.settings.cancel_sweep_interval.total_seconds())
            if not self.runner.running:
                continue
            try:
                ids = await self.store.sweep_cancelled(self.me)
                if ids:
                    await self.cancel(ids, cause="sweep")
            except StoreError as exc:  # transient: the next sweep tries again
                log.warning("cancel sweep failed: %r", exc)
