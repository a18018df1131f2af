"""Takes whose reply never came: rows a claim or take-over may have made ours unseen.

A claim, a probation claim or a take-over is one statement that commits ownership. If the
connection drops after the server committed but before the reply arrived (a restarting
server, a cut socket, a timeout), the consumer sees an error while the store says the rows
are its own. Nothing runs them, no claim takes them again (their owner is alive: us), and
no reaper looks at a live owner's rows: they would wait until the task's timeout.

So every such failure is a doubt: once the store answers again, the rows given to us since
the doubtful statement began that we neither run nor have fired are handed back (by id and
attempt) and their queues woken. Settled under the claim lock, with no take-over still
starting, so nothing we are about to run is mistaken for lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from triggerflow.consumer.admission import Admission
from triggerflow.lease import Lease
from triggerflow.store import ClaimStore, TriggerRef
from triggerflow.telemetry import get_metrics

if TYPE_CHECKING:
    from triggerflow.consumer.context import ConsumerContext

log = logging.getLogger(__name__)

MARGIN = 2.0  # seconds added to the window: the store's clock started the statement later
RETRY_FIRST, RETRY_MAX = 0.5, 5.0  # seconds between tries while the store does not answer


class Doubts:
    """Records doubtful takes (``doubt``) and settles them (``run``)."""

    def __init__(self, store: ClaimStore, lease: Lease, admission: Admission,
                 fired: Callable[[], set[int]],
                 republish: Callable[[Sequence[TriggerRef]], Awaitable[None]]) -> None:
        self.store = store
        self.lease = lease
        self.admission = admission
        self.fired = fired  # ids fired lately whose event may still be on its way
        self.republish = republish
        self._since: float | None = None  # loop time the oldest unsettled doubt began
        self._owner = 0  # the id the doubtful statements ran under
        self._doubted = asyncio.Event()
        self.freed = 0  # rows handed back so far (read by tests and logs)

    @classmethod
    def of(cls, context: ConsumerContext, admission: Admission,
           fired: Callable[[], set[int]]) -> Doubts:
        return cls(context.store, context.lease, admission, fired, context.republish)

    def doubt(self, began: float) -> None:
        """A take that began at ``began`` (loop time) failed: it may have committed."""
        if self._since is None or self._owner != self.lease.me:
            self._since, self._owner = began, self.lease.me
        else:
            self._since = min(self._since, began)
        self._doubted.set()

    async def run(self) -> None:
        delay = RETRY_FIRST
        while True:
            await self._doubted.wait()
            try:
                await self.settle()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the store is still away: try again
                log.debug("settling doubtful claims failed (%r); retrying", exc)
                await asyncio.sleep(delay)
                delay = backoff(delay)
            else:
                delay = RETRY_FIRST

    async def settle(self) -> int:
        """Hand back what the doubtful takes made ours that nothing runs; returns how many."""
        admission = self.admission
        async with admission.lock:
            since, owner = self._since, self._owner
            self._doubted.clear()
            self._since = None
            if since is None or admission.stopping or owner != self.lease.me:
                return 0  # shutdown hands back all; a lost id's rows are the reaper's
            try:
                # a take-over still starting is running, not lost (it ends without the lock)
                while admission.adopting:  # noqa: ASYNC110 - a counter, no event to wait on
                    await asyncio.sleep(0.01)
                window = asyncio.get_running_loop().time() - since + MARGIN
                fired = self.fired()
                lost = [(i, a) for i, a in await self.store.taken_since(owner, window)
                        if i not in admission.runner.running and i not in fired]
                refs = await self.store.release_lost(owner, [i for i, _ in lost],
                                                     [a for _, a in lost]) if lost else []
            except BaseException:
                self.doubt(since)  # not settled: the next try covers it again
                raise
        if refs:
            log.warning("%d trigger(s) became ours in a claim whose reply was lost; "
                        "handing them back", len(refs))
            self.freed += len(refs)
            get_metrics().released.add(len(refs), {"cause": "reply_lost"})
            await self.republish(refs)
        return len(refs)


def backoff(delay: float) -> float:
    """The wait after ``delay`` while the store still does not answer."""
    return min(delay * 2, RETRY_MAX)
