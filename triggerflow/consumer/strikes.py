"""Strikes: a trigger that blocked the event loop past ``block_limit`` is stopped and charged.

The watchdog queues :meth:`Strikes.overran` on the loop while the block lasts, so it runs as
the loop resumes, before the trigger's next step or done-callback: the trigger is cancelled
here (any event it yielded is dropped) and cannot block again on this consumer. The strike
then counts the blocked run in the store, apart from ungraceful losses and with its own,
lower threshold (``max_blocks``): at it the trigger is quarantined and its task fails naming
the class and the block.

Fleets: a block longer than the lease expires our row, and while our loop is blocked a
peer's reaper takes our triggers over -- the blocker too, which then blocks that peer in
turn. So the strike cannot be fenced by the attempt we ran: it lands after the trigger has
moved on, every time. It counts the run by (trigger id, attempt) whoever holds the trigger
now, once per run, and only for a trigger of our queues (a team strikes only its own rows).
Where the row is still ours or nobody's at that attempt it is also freed and re-sent. A
reaper that finds a trigger with a counted block on a dead consumer blames that blocker
alone (as a block of the run it held), so the innocents that shared the stalled consumer
are taken over uncharged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any

from triggerflow.consumer.probation import Probation
from triggerflow.lease import Lease
from triggerflow.runner import Held, TriggerRunner
from triggerflow.settings import Settings
from triggerflow.store import ProbationStore, StoreError
from triggerflow.store.interface import Struck, TriggerRef
from triggerflow.telemetry import get_metrics
from triggerflow.transport import TransportError
from triggerflow.triggers.base import BaseTrigger

if TYPE_CHECKING:
    from triggerflow.consumer.context import ConsumerContext

log = logging.getLogger(__name__)


class Strikes:
    """Stops triggers that overran ``block_limit`` and charges each a strike in the store.

    ``spawn`` runs a coroutine in the consumer's background (at once: a task created now
    starts before the loops a block held up); ``republish`` sends wake-ups.
    """

    def __init__(self, settings: Settings, store: ProbationStore, lease: Lease, runner: TriggerRunner,
                 probation: Probation, spawn: Callable[[Coroutine[Any, Any, Any]], object],
                 republish: Callable[[Sequence[TriggerRef]], Awaitable[None]]) -> None:
        self.store = store
        self.lease = lease
        self.runner = runner
        self.probation = probation
        self.claim_lock = probation.admission.lock  # held by every claim and take-over
        self.spawn = spawn
        self.republish = republish
        self.limit = settings.block_limit.total_seconds()
        self.max_blocks = settings.max_blocks
        self.queues = list(settings.queues)

    @classmethod
    def of(cls, context: ConsumerContext, probation: Probation) -> Strikes:
        return cls(context.settings, context.store, context.lease, context.runner, probation,
                   context.background.spawn, context.republish)

    def overran(self, trigger: BaseTrigger, since: float) -> None:
        """On the loop, as it resumes from a block by ``trigger`` that began at ``since``."""
        held = self.runner.holding(trigger)
        if held is None:  # it ended meanwhile, or blocked outside run() (cleanup, __init__)
            return
        blocked = round(time.monotonic() - since, 1)
        self.runner.cancel([held.id])
        # Not a survivor of its probation group: clearing would reset the failures we count.
        self.probation.group = [i for i in self.probation.group if i != held.id]
        log.warning("stopped trigger %s (id %s): it blocked the event loop for %.1f s "
                    "(block_limit %g s); charging a strike", held.classpath, held.id, blocked,
                    self.limit, extra=held.log_context())
        # The id it ran under: a fence about to follow registers us anew.
        self.spawn(self._strike(self.lease.me, held, blocked))

    async def _strike(self, me: int, held: Held, blocked: float) -> None:
        """Record the strike, retrying a lost store: until then the row stays ours, unrun.

        The first try holds the claim lock, taken before any other loop of ours resumes (this
        task was created first): past the lease our own reaper frees our expired row as soon
        as the loop runs, and probation or a claim would then run the trigger again at a new
        attempt before the strike landed, with no failure counted (a lone consumer has no
        witness). Retries go without it: shutdown waits for that lock.
        """
        lock: asyncio.Lock | None = self.claim_lock
        while True:
            try:
                async with lock or contextlib.nullcontext():
                    struck = await self.store.strike(me, held.id, held.attempt, blocked,
                                                     self.max_blocks, self.queues)
                break
            except StoreError as exc:
                log.warning("recording a strike failed (%r); retrying", exc,
                            extra=held.log_context())
                lock = None
                await asyncio.sleep(1)
        if struck is None:  # a reaper counted this run already, or it is quarantined or gone
            log.info("strike not recorded: run %s of trigger %s was counted already, or the "
                     "trigger is gone", held.attempt, held.id, extra=held.log_context())
        elif struck.quarantined:
            self._quarantined(struck, blocked)
        elif struck.freed:
            await self._resend(struck)
        else:
            log.info("strike recorded against trigger %s (%s runs blocked); a peer runs it now",
                     held.id, struck.blocks, extra=held.log_context())

    def _quarantined(self, struck: Struck, blocked: float) -> None:
        get_metrics().quarantined.add(1, {"queue": struck.queue})
        log.warning("quarantined trigger %s (%s) after it blocked the event loop for %.1f s "
                    "(%s runs blocked); its task failed", struck.id, struck.classpath, blocked,
                    struck.blocks, extra={"trigger_id": struck.id, "queue": struck.queue,
                                          "trigger_class": struck.classpath})

    async def _resend(self, struck: Struck) -> None:
        get_metrics().released.add(1, {"cause": "blocked"})
        try:
            await self.republish([TriggerRef(struck.id, struck.queue)])
        except TransportError as exc:  # unclaimed: the reaper re-sends it after the grace
            log.warning("re-sending struck trigger %s failed (%r)", struck.id, exc)
