"""The reaper: re-sends, times out and reports. Runs inside consumers and writers.

Safe to run in many processes at once: the store hands each row to one sweep only (the
PostgreSQL store locks with ``SKIP LOCKED``). Each is scoped to its process's queues (a writer's
reaper, which has none, covers all).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter, defaultdict
from contextlib import AbstractAsyncContextManager
from typing import Protocol

from triggerflow.settings import Settings
from triggerflow.store import Reaped, ReaperStore, Taker, TriggerRef, TriggerSpec
from triggerflow.telemetry import get_metrics
from triggerflow.transport import Transport, TransportUnavailable, Unroutable

log = logging.getLogger(__name__)


class Local(Protocol):
    """The admission of the consumer a reaper runs in (``consumer.admission``). It takes
    freed triggers first: a stalled peer still subscribed to the queue (SIGSTOP, a blocked
    loop) would otherwise receive its share of the re-sent wake-ups and sit on them until
    the broker's heartbeat gives up on it."""

    def taking(self) -> AbstractAsyncContextManager[Taker | None]:
        """Holds claims and shutdown off while a take-over runs; None: take nothing now."""
        ...

    async def adopt(self, taker: Taker, specs: list[TriggerSpec]) -> None:
        """Start what a take-over made ours (or hand it back if we were fenced meanwhile)."""
        ...

    def take_locally(self, queue: str, ids: list[int]) -> list[int]:
        """Queue freed triggers for our claim loop; return the ids with no room here."""
        ...

    def unanswered(self, began: float) -> None:
        """A take-over begun at ``began`` (loop time) failed: it may have committed."""
        ...


class Reaper:
    """Sweeps for one process; ``local`` is the consumer it runs in (a writer's has none).
    ``times_out_orphans``: the mode's store times deferrals out (``Capabilities``)."""

    def __init__(self, store: ReaperStore, transport: Transport, settings: Settings,
                 local: Local | None = None, times_out_orphans: bool = True) -> None:
        self.store = store
        self.transport = transport
        self.settings = settings
        self.local = local
        self.times_out_orphans = times_out_orphans
        # The reaper's scope: its process's queues; None (a writer's) covers every queue.
        self.queues: list[str] | None = list(settings.queues) or None
        self.unconsumed: list[str] = []

    async def _resend(self, refs: list[TriggerRef], cause: str) -> None:
        by_queue: dict[str, list[int]] = defaultdict(list)
        for ref in refs:
            by_queue[ref.queue].append(ref.id)
        if self.local is not None:
            by_queue = {q: rest for q, ids in by_queue.items()
                        if (rest := self.local.take_locally(q, ids))}
        try:
            await self.transport.publish_wakeups(by_queue, rate=self.settings.reclaim_rate)
        except Unroutable as exc:
            log.error("cannot re-send triggers: %s", exc)
        except TransportUnavailable:
            log.warning("broker down; %d triggers will be re-sent later", len(refs))
            return
        for queue, ids in by_queue.items():
            get_metrics().resent.add(len(ids), {"cause": cause, "queue": queue})

    async def run(self, connected: asyncio.Event, now: asyncio.Event) -> None:
        """A consumer's sweeps: dead owners every ``reaper_interval`` or at once when ``now``
        is set (a renewal saw a dead peer), the full sweep every interval; only while
        ``connected`` (freed triggers are re-sent through the broker)."""
        interval = self.settings.reaper_interval.total_seconds()
        next_full = 0.0
        loop = asyncio.get_running_loop()
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await now.wait()
            now.clear()
            try:
                await connected.wait()
                await self.reap_dead()
                if loop.time() >= next_full:
                    next_full = loop.time() + interval
                    await self.resend_unclaimed()
                    await self.time_out_orphans()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("reaper sweep failed")

    async def reap_dead(self) -> int:
        """Take over (a consumer) or free the triggers of consumers whose lease expired;
        quarantine proven killers.

        In batches of ``reap_batch``, each started or re-sent before the next is rewritten:
        a million reclaimed triggers start running while the rest are still being taken.
        """
        batch, total = self.settings.reap_batch, 0
        while True:
            reaped = await self._reap_batch(batch)
            await self._reaped(reaped)
            n = len(reaped.freed) + len(reaped.taken)
            total += n
            if n < batch:
                return total

    async def _reap_batch(self, batch: int) -> Reaped:
        max_failures = self.settings.max_failures
        if self.local is None:
            return await self.store.reap_dead(self.queues, max_failures, batch, None,
                                              self.settings.max_blocks)
        async with self.local.taking() as taker:
            began = asyncio.get_running_loop().time()
            try:
                reaped = await self.store.reap_dead(self.queues, max_failures, batch, taker,
                                                    self.settings.max_blocks)
            except Exception:
                if taker is not None:
                    self.local.unanswered(began)
                raise
            if reaped.taken:
                assert taker is not None
                get_metrics().taken_over.add(len(reaped.taken))
                await self.local.adopt(taker, reaped.taken)
            return reaped

    async def _reaped(self, reaped: Reaped) -> None:
        if not reaped.freed and not reaped.taken:
            return
        m = get_metrics()
        for t in reaped.freed:
            if t.quarantined:
                m.quarantined.add(1, {"queue": t.queue})
                log.warning(
                    "quarantined trigger %s (%s) after %s ungraceful losses; its task failed",
                    t.id, t.classpath, t.failures,
                    extra={"trigger_id": t.id, "queue": t.queue, "trigger_class": t.classpath},
                )
        n, taken = len(reaped.freed) + len(reaped.taken), len(reaped.taken)
        if reaped.dead_owners:
            log.info("reclaimed %d triggers (%d taken over here) from %d dead consumer(s)",
                     n, taken, reaped.dead_owners)
        else:  # the dead row stays until its last batch
            log.info("reclaimed %d triggers (%d taken over here) of dead consumers (a batch; "
                     "more follow)", n, taken)
        await self._resend([TriggerRef(t.id, t.queue) for t in reaped.freed if not t.quarantined],
                           "dead_owner")

    async def resend_unclaimed(self) -> int:
        refs = await self.store.resend_unclaimed(
            self.queues, self.settings.unclaimed_grace.total_seconds(), self.settings.reclaim_rate)
        if refs:
            log.info("re-sending %d triggers nobody claimed", len(refs))
            await self._resend(refs, "unclaimed")
        return len(refs)

    async def time_out_orphans(self) -> int:
        if not self.times_out_orphans:
            return 0  # another component times deferrals out (Airflow's scheduler)
        refs = await self.store.time_out_orphans(
            self.queues, self.settings.max_deferral.total_seconds())
        for queue, n in Counter(r.queue for r in refs).items():
            get_metrics().timed_out.add(n, {"queue": queue})
        if refs:
            log.warning("timed out %d deferred tasks whose trigger ran nowhere", len(refs))
        return len(refs)

    async def report_unconsumed(self) -> list[str]:
        """Queues in scope with no live consumer: the "nobody consumes default" trap."""
        queues = self.queues
        if queues is None:
            queues = await self.store.waiting_queues(self.settings.unclaimed_grace.total_seconds())
            if not queues:
                self.unconsumed = []
                return []
        counts = await self.store.queue_consumers(queues)
        self.unconsumed = [q for q, n in counts.items() if n == 0]
        for queue in self.unconsumed:
            get_metrics().unconsumed.add(1, {"queue": queue})
            log.warning("queue %s has no live consumer: its triggers wait (start "
                        "`triggerflow consume --queue %s`)", queue, queue, extra={"queue": queue})
        return self.unconsumed
