"""What a consumer shows of itself: gauges of held triggers, the blocked-loop watchdog, and
the checks its readiness probe answers from.

It reads the consumer through its context (settings, lease, runner) and the few callables
it is given, never the consumer itself."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from triggerflow import telemetry
from triggerflow.health import Check, get_health
from triggerflow.telemetry import get_metrics
from triggerflow.triggers.base import BaseTrigger
from triggerflow.watchdog import LoopWatchdog, OverrunFn

if TYPE_CHECKING:
    from triggerflow.consumer.context import ConsumerContext

log = logging.getLogger(__name__)


class ConsumerObserver:
    """Registers the consumer's gauges and names the trigger that blocks the loop.

    ``broker`` is the subscriptions' readiness check; ``on_overrun`` gets a trigger that
    blocked the loop past ``block_limit`` (strikes); ``warming``, for a mode with a runtime
    to start, says whether we still wait for it beside a peer.
    """

    def __init__(self, context: ConsumerContext, *, broker: Check,
                 on_overrun: OverrunFn,
                 warming: Callable[[], bool] | None) -> None:
        self.context = context
        self.broker = broker
        self.warming = warming
        self.metrics = get_metrics()
        settings = context.settings
        self.watchdog = LoopWatchdog(settings.blocked_threshold.total_seconds(),
                                     self._on_blocked,
                                     on_lag=lambda lag: self.metrics.loop_lag.record(lag),
                                     limit=settings.block_limit.total_seconds(),
                                     on_overrun=on_overrun)
        self._register_gauges()

    def start(self) -> None:
        """Watch the loop, and answer readiness from the lease and the subscriptions."""
        self.watchdog.start()
        lease, warming = self.context.lease, self.warming
        health = get_health()
        health.watch_loop()
        health.check("lease", lease.problem)
        health.check("database", lease.database_problem)
        health.check("broker", self.broker)
        health.check("clock", lease.clock_check.problem)
        # Not ready while it waits beside a peer for its trigger runtime: a rolling update
        # keeps the old pod until the new one can run what the old one hands back.
        if warming is not None:  # a mode with a runtime to start (Airflow mode)
            health.check("warm-up", lambda: ("taking nothing until the trigger runtime answers "
                                             "(a peer serves the queues meanwhile)")
                         if warming() else None)

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
        c = self.context
        queues, runner, capacity = c.queues, c.runner, c.settings.capacity

        def running() -> list[tuple[float, dict[str, Any]]]:
            if len(queues) == 1:  # no walk over a million held per scrape
                return [(float(len(runner)), {"queue": queues[0]})]
            counts = Counter(map(attrgetter("queue"), list(runner.running.values())))
            return [(float(counts.get(q, 0)), {"queue": q}) for q in queues]

        self.metrics.gauge(telemetry.RUNNING, "Triggers running, per queue", running)
        self.metrics.gauge(telemetry.CAPACITY_LEFT, "Triggers this consumer can still take",
                           lambda: [(float(capacity - len(runner)), {})])
        skew = c.lease.clock_check
        self.metrics.gauge(
            telemetry.CLOCK_SKEW, "This consumer's clock minus the database's, in seconds "
            "(past max_clock_skew it runs no trigger)",
            lambda: [] if skew.skew is None else [(skew.skew, {})])
