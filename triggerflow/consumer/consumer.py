"""The triggerer consumer: claim -> run -> emit, with the lease and the reaper beside it.

The one place that decides ack/reject for wake-ups: a delivery is acked only after the
claim committed (the store holds the lease from then on); ids beyond our free capacity are
re-published for other consumers and the delivery acked -- never held or nacked. What is
let in and the room left are ``admission``'s; starting what was claimed is ``starting``'s.
The lifecycle is a set of named tasks (subscriptions, claims, renewals, reaper, cancel
sweep, probation, reconcile; ``lifecycle.Tasks``) stopped in a known order. Knows the store
and the transport only by interface. A trigger that blocks the loop past ``block_limit`` is
stopped and charged (``strikes``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Sequence

from triggerflow.balance import excess
from triggerflow.consumer.admission import Admission, Wakeup, ack_all, requeue_all
from triggerflow.consumer.cancel import CancelSweep
from triggerflow.consumer.context import ConsumerContext
from triggerflow.consumer.doubts import Doubts
from triggerflow.consumer.messages import decoded, republish
from triggerflow.consumer.observe import ConsumerObserver
from triggerflow.consumer.outcomes import EncodeFn, Outcomes
from triggerflow.consumer.presence import Presence
from triggerflow.consumer.probation import Probation
from triggerflow.consumer.reconcile import Reconciler
from triggerflow.consumer.starting import Starter
from triggerflow.consumer.strikes import Strikes
from triggerflow.emitter import EventSink
from triggerflow.lease import Lease, LeaseLost
from triggerflow.lifecycle import Background, Tasks, before_stop, report_stopped
from triggerflow.loader import Loader, TriggerLoader
from triggerflow.reaper import Reaper
from triggerflow.runner import Held, TriggerRunner
from triggerflow.settings import Settings
from triggerflow.store import Capabilities, ConsumerStore, ProcessKind, StoreError, TriggerRef
from triggerflow.telemetry import get_metrics
from triggerflow.transport import Delivery, Transport
from triggerflow.transport.subscriptions import Subscriptions
from triggerflow.wire import decode_control, decode_wakeup

log = logging.getLogger(__name__)
# Renewals a shed waits for before the next rebalancing decision: every peer has renewed
# (and so counted what it claimed) at least once, with one to spare.
SETTLE_RENEWALS = 3


class Consumer:
    """Runs the triggers of ``settings.queues``.

    Keyword settings that matter most: ``capacity`` (max triggers held), ``lease_ttl`` and
    ``renew_interval`` (failover time), ``claim_batch`` (ids per claim statement),
    ``prefetch`` (wake-up messages in flight), ``allowed_modules``, ``max_clock_skew``.
    ``clock`` is the wall clock timers and timeouts are read on (tests shift it).
    ``warm_up``: set once what triggers need beside the consumer answers (Airflow mode's
    runtime child takes seconds to start); until then, if a subscribed peer serves our
    queues at our first renewal, we take nothing and it runs them. None: nothing to wait for.
    ``capabilities``: what the mode says its store does beyond the roles (default: native's).
    Raises ValueError when ``settings.queues`` is empty.
    """

    def __init__(self, settings: Settings, store: ConsumerStore, transport: Transport, *,
                 loader: Loader | None = None, encode: EncodeFn | None = None,
                 clock: Callable[[], float] = time.time,
                 warm_up: asyncio.Event | None = None,
                 capabilities: Capabilities | None = None) -> None:
        if not settings.queues:
            raise ValueError("a consumer needs at least one queue")
        self.settings = settings
        self.store = store
        self.capabilities = capabilities or Capabilities()
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
        self.subscriptions = Subscriptions(
            transport, prefetch=settings.prefetch,
            check_interval=settings.subscription_check_interval.total_seconds(),
            renew_interval=settings.subscription_renew_interval.total_seconds())
        for queue in self.queues:
            self.subscriptions.add(queue, self._on_delivery)
        # Nothing is taken before the first renewal finds our clock within max_clock_skew.
        self.subscriptions.paused = True
        self.metrics = get_metrics()
        self.background = Background()
        self.tasks = Tasks()
        # What the parts share; each is built after what it needs.
        self.context = ctx = ConsumerContext(settings, store, self.lease, self.runner,
                                             self.background, functools.partial(republish, transport))
        self.admission = Admission.of(ctx, self.subscriptions)
        self.starter = Starter.of(ctx, self.loader, self.outcomes, self.admission)
        self.reaper = Reaper(store, transport, settings, local=self.admission,
                             times_out_orphans=self.capabilities.times_out_orphans)
        self._reap_now = asyncio.Event()
        self._settled_at = 0.0  # monotonic: no rebalancing shed before it
        # A peer gone: the wake-ups a shed handed it are ours to claim again at once, not
        # bounced between us and the queue until the shed settles (admission's ceiling).
        self.presence = Presence(store, transport, self.lease, self.queues, self._reap_now,
                                 peer_left=self.admission.peer_gone)
        self.warm_up = warm_up
        self.subscriptions.on_session = self.presence.connected
        self.probation = Probation.of(ctx, self.admission, self.starter.start)
        self.reconciler = Reconciler.of(ctx)
        self.doubts = Doubts.of(ctx, self.admission, self.reconciler.remembered)
        self.admission.connect(self.starter.start_all, self.doubts.doubt)
        self.strikes = Strikes.of(ctx, self.probation)
        self.observer = ConsumerObserver(
            ctx, broker=self.subscriptions.problem, on_overrun=self.strikes.overran,
            warming=None if warm_up is None else self.admission.is_warming)

    @property
    def me(self) -> int:
        return self.lease.me

    # -- lifecycle ---------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> int:
        """Serve until ``stop`` is set (0) or a lifecycle task crashed (1), then stop cleanly."""
        self.observer.start()  # readiness and the loop's watchdog, while registering too
        registered = await before_stop(self.lease.register(), stop)
        if registered is None or registered.exception():  # stopped, or refused
            self.observer.stop()
            await self.transport.close()
            return 1 if report_stopped([registered] if registered else []) else 0
        await self.subscriptions.set_control(self.me, self._on_control)
        if self.warm_up is not None:
            self.background.spawn(self.admission.warmed_up(self.warm_up))
        for name, coro in (
            ("broker", self.subscriptions.run(on_connected=self.sink.retry)),
            ("claims", self._claim_loop()),
            ("renewals", self._renew_loop()),
            ("reaper", self.reaper.run(self.subscriptions.connected, self._reap_now)),
            ("cancel-sweep", self._sweep_loop()),
            ("probation", self.probation.run()),
            ("reconcile", self.reconciler.run()),
            ("doubts", self.doubts.run()),
        ):
            self.tasks.start(name, coro)
        crashed = await self.tasks.until(stop)
        await self.shutdown()
        return 1 if crashed else 0

    async def shutdown(self) -> None:
        """Graceful stop: no new claims, cancel triggers (cleanup), flush, hand back, leave."""
        self.admission.stop()
        log.info("stopping: releasing %d triggers", len(self.runner))
        await self.subscriptions.stop()
        # A claim cancelled mid-flight may still commit after the release below and strand
        # its triggers on our dead row; let the one in flight finish instead.
        await self.admission.lock.acquire()
        # hand-overs and rebalancing in flight publish their wake-ups
        await self.background.wait(timeout=5)
        await self.tasks.cancel(keep={"broker"})
        self.runner.cancel()
        await self.runner.wait_cleanups()
        await self.sink.drain(timeout=10)
        with contextlib.suppress(Exception):
            refs = await self.store.release(self.me)
            await self.context.republish(refs)
            self.metrics.released.add(len(refs), {"cause": "shutdown"})
            log.info("handed back %d triggers", len(refs))
        with contextlib.suppress(Exception):
            await self.lease.leave()
        self.observer.stop()
        await self.tasks.cancel()
        await self.transport.close()

    # -- deliveries ----------------------------------------------------------------------

    async def _on_delivery(self, message: Delivery) -> None:
        ids = await decoded(self.transport, message, decode_wakeup)
        if ids is None:
            return
        self.admission.deliver(ids, message)

    async def _on_control(self, message: Delivery) -> None:
        ctl = await decoded(self.transport, message, decode_control)
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
        admission = self.admission
        while True:
            batch = await admission.next_batch()
            began = asyncio.get_running_loop().time()
            try:
                async with admission.lock:
                    if admission.stopping:
                        return  # unacked: returned to the queue when the channel closes
                    await self._claim(batch)
            except asyncio.CancelledError:
                raise
            except Exception:
                # Requeued after a pause: left unacked on an open channel they would wait for
                # the broker's consumer timeout; handed back at once, a lost database would
                # spend their delivery limit in a hot loop.
                # The claim may have committed all the same: ``doubts`` hands back what it
                # made ours once the store answers, so the redelivered wake-ups find it free.
                admission.unanswered(began)
                log.exception("claim failed; requeueing %d deliveries", len(batch))
                await asyncio.sleep(1)  # before the hand-back: each counts towards the limit
                await requeue_all(batch)
            finally:
                admission.claimed(batch)
            await asyncio.sleep(0)  # a 100k reclaim must not starve renewals

    async def _lease_back(self) -> bool:
        """Whether the lease is valid again within one lease period, the batch held unacked
        meanwhile: each hand-back counts towards the queue's delivery limit, so handing
        wake-ups back every moment of a short store outage would dead-letter healthy ones."""
        loop = asyncio.get_running_loop()
        until = loop.time() + self.lease.ttl
        while not self.lease.valid():
            if self.admission.stopping or loop.time() >= until:
                return False
            await asyncio.sleep(0.1)
        return True

    async def _claim(self, batch: list[Wakeup]) -> None:
        """One claim for the batch, then the acks: the lease is in the store now."""
        if not self.lease.valid() and not await self._lease_back():
            # Fenced, re-registering, or the store away: a claim now would be stranded.
            await requeue_all(batch)
            await asyncio.sleep(0.1)
            return
        me = self.me
        ids, overflow = self.admission.fit(batch)
        found = await self.store.claim(me, ids, self.queues)
        if not self.admission.keeps(me):
            # Fenced while the claim ran: nobody runs what it took under the old id.
            # (Or our clock went wrong meanwhile: peers run it.)
            await self.store.release(me, [s.id for s in found.claimed])
            await requeue_all(batch)
            return
        try:
            if overflow:  # hand the rest to other consumers through the queue, never nack
                await self.transport.publish_wakeups(overflow)
        except Exception:
            # What we claimed still starts below; the deliveries go back to the queue so the
            # overflow is not lost (their claimed ids then find a live owner and are skipped).
            log.warning("re-publishing %d overflow ids failed; requeueing their wake-ups",
                        sum(len(v) for v in overflow.values()), exc_info=True)
            await requeue_all(batch)
        else:
            await ack_all(batch)
        if found.suspects:
            self.probation.suspects.set()
        if found.refused:  # we cannot load these: back to the queue for a consumer that can
            self.background.spawn(self.starter.pass_on(found.refused))
        if found.elsewhere:  # another team's, whose consumer is next in the broker's turn
            self.background.spawn(self.starter.hand_on(found.elsewhere))
        await self.starter.start_all(found.claimed)

    def _on_fired(self, helds: Sequence[Held]) -> None:
        self.reconciler.fired([h.id for h in helds], [h.attempt for h in helds])
        if self.subscriptions.paused:
            self.admission.update_flow()

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
                subscribed=self.subscriptions.connected.is_set() and self.admission.serving(),
                warming=self.admission.warming)
        except LeaseLost as exc:
            await self._fence(str(exc))
            return
        except StoreError as exc:
            log.warning("lease renewal failed: %r", exc)
            return
        self.metrics.renewals.add(1)
        self.admission.decide_warm_up(self.warm_up, renewal.live_peers)
        self._check_clock()
        await self.presence.announce()
        if renewal.dead_peers:
            self._reap_now.set()
            self.admission.peer_gone("a peer of our queues died")  # maybe a shed's peer
        self._maybe_rebalance(renewal.live_peers, renewal.peers_running)

    def _check_clock(self) -> None:
        """Run triggers only while our clock is within ``max_clock_skew`` of the database's:
        timers and timeouts are read on it. Skewed, the consumer unsubscribes, takes nothing
        and hands back what it holds (stopped here, before a timer can fire), so peers with
        good clocks run it; it serves again once a renewal finds its clock back."""
        check = self.lease.clock_check
        if check.skew is None or not self.admission.clock_checked(check.ok):
            return
        if check.ok:
            log.info("clock %+.3fs off the database's, within max_clock_skew (%gs): "
                     "running triggers", check.skew, check.bound)
        else:
            stopped = self.runner.cancel()
            log.error("clock %+.1fs off the database's, past max_clock_skew (%gs): "
                      "not firing timers or timeouts on it; handing %d triggers to peers",
                      check.skew, check.bound, len(stopped), extra={"consumer_id": self.me})
            if stopped:
                self.background.spawn(self._hand_back(stopped, "clock_skew"))
        self.admission.update_flow()

    async def _fence(self, why: str) -> None:
        """Lost the lease: stop everything held, forget unsent events, register anew."""
        self.metrics.leases_lost.add(1)
        stopped = self.runner.cancel()
        dropped = self.sink.drop()
        log.error("lease lost (%s): stopped %d triggers, dropped %d events; re-registering",
                  why, len(stopped), dropped, extra={"consumer_id": self.me})
        self.probation.group = []
        old = self.me
        await self.lease.register_anew()  # no claim, no event meanwhile
        await self.subscriptions.set_control(self.me, self._on_control)  # named after our id
        await self.presence.announce()
        log.info("consumer %s replaced by %s", old, self.me)

    def _maybe_rebalance(self, live_peers: int, peers_running: int) -> None:
        """After a rolling restart, shed what is over our fair share so peers fill up.

        Not again until the peers have counted the last shed: what they claimed shows in
        ``peers_running`` only after their next renewal, and read before it the fair share
        looks smaller than it is and a second shed takes us below it (900 of 2,000 left on
        one of two consumers in a CI run)."""
        if (self.admission.stopping or self.background.running("shed")
                or time.monotonic() < self._settled_at):
            return
        n = excess(len(self.runner), live_peers, peers_running, self.settings.reclaim_rate)
        if n:
            self.background.spawn(self._shed(list(self.runner.running)[-n:]), name="shed")

    async def _shed(self, ids: list[int]) -> None:
        if self.admission.stopping:
            return
        settle = SETTLE_RENEWALS * self.settings.renew_interval.total_seconds()
        self._settled_at = time.monotonic() + settle
        self.admission.keep_at_most(len(self.runner) - len(ids), settle)
        refs = await self._hand_back(self.runner.cancel(ids), "rebalance")
        self._settled_at = time.monotonic() + settle
        log.info("rebalanced: handed %d triggers to peers", len(refs))

    async def _hand_back(self, stopped: list[Held], cause: str) -> list[TriggerRef]:
        """Release stopped triggers and wake their queues' other consumers."""
        refs = await self.store.release(self.me, [h.id for h in stopped])
        await self.context.republish(refs)
        self.metrics.released.add(len(refs), {"cause": cause})
        return refs

    # -- periodic sweeps ---------------------------------------------------------------------

    async def _sweep_loop(self) -> None:
        """Drop held triggers whose task is no longer deferred (prompt where the store
        signals it, else every ``cancel_sweep_interval``)."""
        await CancelSweep.of(self.context, functools.partial(self.cancel, cause="sweep"),
                             self.capabilities.cancel_signal).run()
