"""The in-memory :class:`~triggerflow.store.LeaseStore` and :class:`~triggerflow.store.PresenceStore`."""

from __future__ import annotations

from collections.abc import Sequence

from triggerflow.store.interface import (
    ProcessKind,
    Renewal,
)
from triggerflow.store.memory.state import MemoryState, Process


class MemoryLeases(MemoryState):
    async def register(
        self,
        kind: ProcessKind,
        host: str,
        pid: int,
        queues: Sequence[str],
        capacity: int,
        version: str,
        ttl: float,
    ) -> int:
        me = next(self._process_ids)
        now = self.clock()
        self.processes[me] = Process(ProcessKind(kind), list(queues), now + ttl, started_at=now, ttl=ttl)
        return me

    async def renew(
        self,
        me: int,
        ttl: float,
        running: int,
        queues: Sequence[str],
        *,
        subscribed: bool = True,
        clock_skew: float | None = None,
        warming: bool = False,
    ) -> Renewal | None:
        if not self._alive(me):
            return None
        now = self.clock()
        mine = self.processes[me]
        mine.expires_at, mine.running, mine.ttl = now + ttl, running, ttl
        mine.subscribed, mine.clock_skew, mine.warming = subscribed, clock_skew, warming
        same_set = [p for p in self.processes.values() if set(p.queues) == set(queues)]
        dead = [
            p
            for p in self.processes.values()
            if p.expires_at <= now and (not queues or set(p.queues) & set(queues))
        ]
        live = [p for p in same_set if p.kind is ProcessKind.CONSUMER and p.expires_at > now and p.subscribed]
        return Renewal(len(dead), len(live), sum(p.running for p in live), now)

    async def unregister(self, me: int) -> None:
        for t in self.triggers.values():
            if t.owner == me:  # dated back: the next reaper sweep re-sends it at once
                t.owner, t.dispatched_at = None, self.clock() - 86400
        self.processes.pop(me, None)

    async def announce_presence(self, me: int, presence: str) -> bool:
        p = self.processes.get(me)
        if p is None:
            return False
        p.presence = presence
        return True

    async def presence_gone(self, presence: str, queues: Sequence[str]) -> list[int]:
        now = self.clock()
        gone = [
            pid
            for pid, p in self.processes.items()
            if p.presence == presence and p.expires_at > now and set(p.queues) & set(queues)
            and p.kind is ProcessKind.CONSUMER
        ]
        for pid in gone:
            self.processes[pid].expires_at = now
        return gone

    async def writer_gone(self, presence: str) -> list[int]:
        now = self.clock()
        gone = [pid for pid, p in self.processes.items()
                if p.presence == presence and p.expires_at > now and p.kind is ProcessKind.WRITER]
        for pid in gone:
            self.processes[pid].expires_at = now
        return gone
