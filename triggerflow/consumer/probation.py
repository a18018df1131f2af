"""Probation: suspects (triggers whose consumer died twice or more) run in halving groups.

The store records each group on our row; if we die while it runs, only that group is blamed
and climbs a level, and a killer among N suspects is alone (then quarantined) after about
log2(N) deaths. A group that survives ``seconds`` is cleared.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from triggerflow.consumer.admission import Admission
from triggerflow.lease import Lease
from triggerflow.store import ProbationStore, StoreError, TriggerSpec

if TYPE_CHECKING:
    from triggerflow.consumer.context import ConsumerContext

log = logging.getLogger(__name__)


class Probation:
    """Runs suspect groups one at a time, after ``suspects`` is set by a claim."""

    def __init__(self, store: ProbationStore, lease: Lease, queues: Sequence[str], admission: Admission,
                 start: Callable[[TriggerSpec], None], seconds: float) -> None:
        self.store = store
        self.lease = lease
        self.queues = list(queues)
        self.admission = admission  # its room: a probation group never takes more
        self.start = start
        self.seconds = seconds
        self.suspects = asyncio.Event()
        self.group: list[int] = []

    @classmethod
    def of(cls, context: ConsumerContext, admission: Admission,
           start: Callable[[TriggerSpec], None]) -> Probation:
        return cls(context.store, context.lease, context.queues, admission, start,
                   context.settings.probation_seconds.total_seconds())

    async def run(self) -> None:
        while True:
            await self.suspects.wait()
            room = self.admission.room()
            if room <= 0:  # full: suspects wait until we have room (or another consumer does)
                await asyncio.sleep(1)
                continue
            began = asyncio.get_running_loop().time()
            try:
                async with self.admission.lock:  # held at shutdown: no group starts then
                    specs = await self.store.claim_probation(self.lease.me, self.queues, room)
            except StoreError:
                self.admission.unanswered(began)
                await asyncio.sleep(1)
                continue
            if not specs:
                self.suspects.clear()
                continue
            self.group = [s.id for s in specs]
            log.warning("running %d suspect trigger(s) on probation", len(specs))
            for spec in specs:
                self.start(spec)
            await asyncio.sleep(self.seconds)
            await self._clear(self.group)
            self.group = []

    async def _clear(self, group: list[int]) -> None:
        """Clear the group, retrying a transient store error rather than stopping."""
        while True:
            try:
                await self.store.clear_probation(self.lease.me, group)
                return
            except StoreError as exc:
                log.warning("clearing probation failed (%r); retrying", exc)
                await asyncio.sleep(1)
