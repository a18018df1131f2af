"""Starting claimed triggers: built from what the row says, run, or handed on.

A trigger that cannot start fails only its own task (``__fail__`` naming the class); one
whose class this consumer cannot import goes to a consumer that can (mixed code versions
during a rolling upgrade), or fails once no live consumer of its queue can load it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from triggerflow.consumer.admission import Admission
from triggerflow.consumer.freezer import Freezer
from triggerflow.consumer.outcomes import Outcomes
from triggerflow.lease import Lease
from triggerflow.lifecycle import Background
from triggerflow.loader import BadKwargs, Disallowed, Loader, Unloadable
from triggerflow.model import EventKind, FailureReason
from triggerflow.runner import Held, TriggerRunner, failure
from triggerflow.store import ClaimStore, StoreError, TriggerRef, TriggerSpec
from triggerflow.telemetry import get_metrics

if TYPE_CHECKING:
    from triggerflow.consumer.context import ConsumerContext

log = logging.getLogger(__name__)

# Seconds before another team's rows are handed on (``Starter.hand_on``).
HAND_ON_PAUSE = 0.05


class Starter:
    """Starts what a claim, a take-over or probation made ours."""

    def __init__(
        self,
        store: ClaimStore,
        lease: Lease,
        loader: Loader,
        runner: TriggerRunner,
        outcomes: Outcomes,
        admission: Admission,
        background: Background,
        republish: Callable[[Sequence[TriggerRef]], Awaitable[None]],
    ) -> None:
        self.store = store
        self.lease = lease
        self.loader = loader
        self.runner = runner
        self.outcomes = outcomes
        self.admission = admission
        self.background = background
        self.republish = republish
        self.metrics = get_metrics()
        self.freezer = Freezer()  # a million held must not slow every full GC pass

    @classmethod
    def of(cls, context: ConsumerContext, loader: Loader, outcomes: Outcomes,
           admission: Admission) -> Starter:
        return cls(context.store, context.lease, loader, context.runner, outcomes, admission,
                   context.background, context.republish)

    async def start_all(self, specs: list[TriggerSpec]) -> None:
        self.metrics.claimed.add(len(specs))
        for i, spec in enumerate(specs):
            self.start(spec)  # never raises: one bad trigger must not strand the rest
            if i % 500 == 499:
                await asyncio.sleep(0)
                if self.admission.stopping:  # the rest stay ours in the store: shutdown hands them back
                    break
        self.freezer.started(len(specs))
        self.admission.update_flow()

    def start(self, spec: TriggerSpec) -> None:
        held = Held(
            spec.id, spec.attempt, spec.queue, spec.classpath, spec.task, spec.timeout_at, spec.traceparent
        )
        try:
            self._build_and_run(held, spec)
        except Exception as exc:  # whatever the trigger did, only its own task fails
            log.exception("starting %s failed", spec.classpath, extra=held.log_context())
            self.runner.cancel([held.id])
            self.outcomes.emit(
                held,
                EventKind.FAIL,
                failure(FailureReason.TRIGGER_FAILURE, f"trigger {spec.classpath} failed to start: {exc!r}"),
            )

    def _build_and_run(self, held: Held, spec: TriggerSpec) -> None:
        try:
            trigger = self.loader.build(spec)
        except Unloadable as exc:
            self.background.spawn(self._hand_over_unloadable(held, str(exc)))
            return
        except (Disallowed, BadKwargs) as exc:
            reason = (
                FailureReason.TRIGGER_DISALLOWED
                if isinstance(exc, Disallowed)
                else FailureReason.TRIGGER_UNLOADABLE
            )
            msg = f"{exc} (consumer {self.lease.me} on {self.lease.host})"
            log.warning("%s", msg, extra=held.log_context())
            self.outcomes.emit(held, EventKind.FAIL, failure(reason, msg))
            return
        if log.isEnabledFor(logging.DEBUG):
            log.debug("starting %s", spec.classpath, extra=held.log_context())
        self.runner.start(held, trigger)
        self.metrics.started.add(1)

    async def _hand_over_unloadable(self, held: Held, reason: str) -> None:
        """Mixed code versions: let a consumer that can import the class take it."""
        if await self.store.other_loaders(held.id, self.lease.me):
            log.warning("%s; handing it to another consumer", reason, extra=held.log_context())
            refs = await self.store.release(self.lease.me, [held.id], cannot_load=True, reason=reason)
            await self.republish(refs)
            self.metrics.released.add(len(refs), {"cause": "unloadable"})
        else:
            msg = f"{reason}; no consumer of queue {held.queue} can load it (last: {self.lease.me})"
            log.warning("%s", msg, extra=held.log_context())
            self.outcomes.emit(held, EventKind.FAIL, failure(FailureReason.TRIGGER_UNLOADABLE, msg))

    async def hand_on(self, refs: list[TriggerRef]) -> None:
        """Wake the queue again for rows of another Airflow team, whose live consumer shares
        it: the broker gives each wake-up to the next consumer in turn, whatever its team.
        A short pause bounds the round trips while the lease table still shows a consumer
        that has just gone."""
        await asyncio.sleep(HAND_ON_PAUSE)
        if not self.admission.stopping:
            self.metrics.released.add(len(refs), {"cause": "other_team"})
            await self.republish(refs)

    async def pass_on(self, refs: list[TriggerRef]) -> None:
        """Refused here before: fail what no live consumer may load, pass the rest on."""
        try:
            failed = set(await self.store.fail_unloadable(self.lease.me, [r.id for r in refs]))
        except StoreError as exc:  # passed on as before; the next refusal asks again
            log.warning("checking refused triggers failed: %r", exc)
            failed = set()
        if failed:
            log.warning("failed %d trigger(s) no live consumer of their queue can load", len(failed))
            for ref in refs:
                if ref.id in failed:
                    self.metrics.failed.add(
                        1, {"queue": ref.queue, "reason": str(FailureReason.TRIGGER_UNLOADABLE)}
                    )
        rest = [r for r in refs if r.id not in failed]
        await asyncio.sleep(1.0)  # no hot loop if the queue's only other consumer just left
        if rest and not self.admission.stopping:
            await self.republish(rest)
