"""The reaper: re-sends, times out and reports. Runs inside consumers and writers.

Safe to run in many processes at once: every sweep locks with ``SKIP LOCKED``, so two
reapers never handle the same row. Each is scoped to its process's queues (a writer's
reaper, which has none, covers all).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable

from triggerflow.postgres import (
    QUEUE_CONSUMERS,
    REAP_DEAD,
    RESEND_UNCLAIMED,
    TIMEOUT_ORPHANS,
    WAITING_QUEUES,
    Database,
)
from triggerflow.rabbitmq import CONNECTION_ERRORS, Broker, UnroutableError
from triggerflow.settings import Settings
from triggerflow.telemetry import get_metrics

log = logging.getLogger(__name__)


TakeLocally = Callable[[str, list[int]], list[int]]


class Reaper:
    """Sweeps for one process. ``take_locally(queue, ids)`` (consumers only) claims freed
    triggers in this process first and returns the ids it had no room for; only those are
    published. A stalled peer still subscribed to the queue (SIGSTOP, a blocked loop) would
    otherwise receive its share of the re-sent wake-ups and sit on them until the broker's
    heartbeat gives up on it."""

    def __init__(self, db: Database, broker: Broker, settings: Settings,
                 take_locally: TakeLocally | None = None) -> None:
        self.db = db
        self.broker = broker
        self.settings = settings
        self.take_locally = take_locally
        self.queues = list(settings.queues)
        self.all_queues = not self.queues
        self.unconsumed: list[str] = []

    async def _resend(self, rows: list[tuple[int, str]], cause: str) -> None:
        by_queue: dict[str, list[int]] = defaultdict(list)
        for trigger_id, queue in rows:
            by_queue[queue].append(trigger_id)
        if self.take_locally is not None:
            by_queue = {q: rest for q, ids in by_queue.items()
                        if (rest := self.take_locally(q, ids))}
        try:
            await self.broker.publish_wakeups(by_queue, rate=self.settings.reclaim_rate)
        except UnroutableError as exc:
            log.error("cannot re-send triggers: %s", exc)
        except CONNECTION_ERRORS:
            log.warning("broker down; %d triggers will be re-sent later", len(rows))
            return
        for queue, ids in by_queue.items():
            get_metrics().resent.add(len(ids), {"cause": cause, "queue": queue})

    async def reap_dead(self) -> int:
        """Free the triggers of consumers whose lease expired; quarantine proven killers."""
        rows = await self.db.fetch(
            REAP_DEAD, self.queues, self.all_queues, self.settings.max_failures
        )
        if not rows:
            return 0
        m = get_metrics()
        resend = [(r["id"], r["queue"]) for r in rows if not r["quarantined"]]
        for r in rows:
            if r["quarantined"]:
                m.quarantined.add(1, {"queue": r["queue"]})
                log.warning(
                    "quarantined trigger %s (%s) after %s ungraceful losses; its task failed",
                    r["id"], r["classpath"], r["failures"],
                    extra={"trigger_id": r["id"], "queue": r["queue"],
                           "trigger_class": r["classpath"]},
                )
        log.info("reclaimed %d triggers from %d dead consumer(s)", len(rows), rows[0]["dead"])
        await self._resend(resend, "dead_owner")
        return len(rows)

    async def resend_unclaimed(self) -> int:
        rows = await self.db.fetch(
            RESEND_UNCLAIMED, self.queues, self.all_queues, self.settings.unclaimed_grace,
            self.settings.reclaim_rate,
        )
        if rows:
            log.info("re-sending %d triggers nobody claimed", len(rows))
            await self._resend([(r["id"], r["queue"]) for r in rows], "unclaimed")
        return len(rows)

    async def time_out_orphans(self) -> int:
        rows = await self.db.fetch(
            TIMEOUT_ORPHANS, self.queues, self.all_queues, self.settings.max_deferral
        )
        if rows:
            get_metrics().timed_out.add(len(rows))
            log.warning("timed out %d deferred tasks whose trigger ran nowhere", len(rows))
        return len(rows)

    async def report_unconsumed(self) -> list[str]:
        """Queues in scope with no live consumer: the "nobody consumes default" trap."""
        queues = self.queues
        if self.all_queues:
            waiting = await self.db.fetch(WAITING_QUEUES, self.settings.unclaimed_grace)
            queues = [r["queue"] for r in waiting]
            if not queues:
                self.unconsumed = []
                return []
        rows = await self.db.fetch(QUEUE_CONSUMERS, queues)
        self.unconsumed = [r["q"] for r in rows if r["consumers"] == 0]
        for queue in self.unconsumed:
            get_metrics().unconsumed.add(1, {"queue": queue})
            log.warning("queue %s has no live consumer: its triggers wait (start "
                        "`triggerflow consume --queue %s`)", queue, queue, extra={"queue": queue})
        return self.unconsumed

    async def sweep(self) -> None:
        await self.reap_dead()
        await self.resend_unclaimed()
        await self.time_out_orphans()
