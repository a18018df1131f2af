"""Reconciliation: rows this consumer still owns but no longer runs go back to the queue.

A trigger leaves the runner when it fires (or fails to start); its row leaves the store when
the writer applies the event. Anything lost in between (an event dead-lettered after its
delivery limit, a publish that never made it) would leave the row owned by a live consumer
that runs nothing for it, and no reaper looks at rows of a live owner. So the consumer keeps
(id, attempt) of what it fired and, ``after`` seconds later, frees those rows that are still
its own at that attempt. Only the rows that changed are read, never everything held.
"""

from __future__ import annotations

import asyncio
import logging
from array import array
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from triggerflow.store import ClaimStore, TriggerRef

if TYPE_CHECKING:
    from triggerflow.consumer.context import ConsumerContext

log = logging.getLogger(__name__)

CHUNK = 5000  # ids per statement


class _Bucket:
    """Triggers fired in one short span of time: two flat int arrays, 16 bytes a trigger."""

    __slots__ = ("attempts", "ids", "owner", "started")

    def __init__(self, started: float, owner: int) -> None:
        self.started = started
        self.owner = owner
        self.ids = array("q")
        self.attempts = array("q")


class Reconciler:
    """Remembers fired triggers; ``after`` seconds later frees the ones whose row stayed."""

    def __init__(self, store: ClaimStore, me: Callable[[], int], running: Callable[[int], bool],
                 republish: Callable[[Sequence[TriggerRef]], Awaitable[None]],
                 after: float) -> None:
        self.store = store
        self.me = me
        self.running = running
        self.republish = republish
        self.after = after
        self._buckets: deque[_Bucket] = deque()
        self.lost = 0  # rows freed so far (read by tests and logs)

    @classmethod
    def of(cls, context: ConsumerContext) -> Reconciler:
        lease = context.lease  # ``me`` changes when we are fenced and register anew
        return cls(context.store, lambda: lease.me, context.runner.running.__contains__,
                   context.republish, context.settings.reconcile_after.total_seconds())

    def fired(self, ids: Sequence[int], attempts: Sequence[int]) -> None:
        now = asyncio.get_running_loop().time()
        me = self.me()
        last = self._buckets[-1] if self._buckets else None
        if last is None or last.owner != me or now - last.started > self.after / 4:
            last = _Bucket(now, me)
            self._buckets.append(last)
        last.ids.extend(ids)
        last.attempts.extend(attempts)

    def tracked(self) -> int:
        return sum(len(b.ids) for b in self._buckets)

    def remembered(self) -> set[int]:
        """Ids fired lately, whose event may still be on its way to the writer."""
        return {i for b in self._buckets for i in b.ids}

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.after / 4)
            try:
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # transient: the next check tries again
                log.warning("reconciliation failed: %r", exc)

    async def check(self) -> int:
        """Free the rows of triggers fired over ``after`` seconds ago that are still ours."""
        cutoff = asyncio.get_running_loop().time() - self.after
        freed = 0
        while self._buckets and self._buckets[0].started + self.after / 4 <= cutoff:
            bucket = self._buckets[0]
            if bucket.owner == self.me():  # rows of an id we lost are the reaper's now
                due = [(i, a) for i, a in zip(bucket.ids, bucket.attempts, strict=True)
                       if not self.running(i)]
                for n in range(0, len(due), CHUNK):
                    part = due[n : n + CHUNK]
                    refs = await self.store.release_lost(
                        bucket.owner, [d[0] for d in part], [d[1] for d in part])
                    if refs:
                        log.warning("reconciled %d trigger(s) held but not run (event lost); "
                                    "re-sending", len(refs))
                        self.lost += len(refs)
                        freed += len(refs)
                        await self.republish(refs)
            self._buckets.popleft()  # only once its rows were checked: an error retries it
        return freed
