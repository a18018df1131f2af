"""What a consumer shows of itself: gauges of held triggers, the blocked-loop watchdog, and
the checks its readiness probe answers from."""

from __future__ import annotations

import logging
from collections import Counter
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from triggerflow import telemetry
from triggerflow.health import get_health
from triggerflow.telemetry import get_metrics
from triggerflow.triggers.base import BaseTrigger
from triggerflow.watchdog import LoopWatchdog

if TYPE_CHECKING:
    from triggerflow.consumer.consumer import Consumer

log = logging.getLogger(__name__)


class ConsumerObserver:
    """Registers the consumer's gauges and names the trigger that blocks the loop."""

    def __init__(self, consumer: Consumer) -> None:
        self.consumer = consumer
        self.metrics = get_metrics()
        settings = consumer.settings
        self.watchdog = LoopWatchdog(settings.blocked_threshold.total_seconds(),
                                     self._on_blocked,
                                     on_lag=lambda lag: self.metrics.loop_lag.record(lag),
                                     limit=settings.block_limit.total_seconds(),
                                     on_overrun=consumer.strikes.overran)
        self._register_gauges()

    def start(self) -> None:
        """Watch the loop, and answer readiness from the lease and the subscriptions."""
        self.watchdog.start()
        c = self.consumer
        health = get_health()
        health.watch_loop()
        health.check("lease", c.lease.problem)
        health.check("database", c.lease.database_problem)
        health.check("broker", c.subscriptions.problem)
        health.check("clock", c.lease.clock_check.problem)
        # Not ready while it waits beside a peer for its trigger runtime: a rolling update
        # keeps the old pod until the new one can run what the old one hands back.
        if c.warm_up is not None:  # a mode with a runtime to start (Airflow mode)
            health.check("warm-up", lambda: ("taking nothing until the trigger runtime answers "
                                             "(a peer serves the queues meanwhile)")
                         if c.admission.warming else None)

    def stop(self) -> None:
        self.watchdog.stop()

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
        c = self.consumer

        def running() -> list[tuple[float, dict[str, Any]]]:
            if len(c.queues) == 1:  # no walk over a million held per scrape
                return [(float(len(c.runner)), {"queue": c.queues[0]})]
            counts = Counter(map(attrgetter("queue"), list(c.runner.running.values())))
            return [(float(counts.get(q, 0)), {"queue": q}) for q in c.queues]

        self.metrics.gauge(telemetry.RUNNING, "Triggers running, per queue", running)
        self.metrics.gauge(telemetry.CAPACITY_LEFT, "Triggers this consumer can still take",
                           lambda: [(float(c.settings.capacity - len(c.runner)), {})])
        skew = c.lease.clock_check
        self.metrics.gauge(
            telemetry.CLOCK_SKEW, "This consumer's clock minus the database's, in seconds "
            "(past max_clock_skew it runs no trigger)",
            lambda: [] if skew.skew is None else [(skew.skew, {})])
