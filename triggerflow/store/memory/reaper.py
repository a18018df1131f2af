"""The in-memory :class:`~triggerflow.store.ReaperStore`."""

from __future__ import annotations

from collections.abc import Sequence

from triggerflow.model import FAIL_METHOD, FailureReason, TaskState
from triggerflow.store.interface import (
    MAX_BLOCKS,
    ORPHAN_SLACK,
    SUSPECT_FAILURES,
    FreedTrigger,
    ProcessKind,
    Reaped,
    Taker,
    TriggerRef,
    TriggerSpec,
)
from triggerflow.store.memory.state import MemoryState


class MemoryReaper(MemoryState):
    async def reap_dead(
        self,
        queues: Sequence[str] | None,
        max_failures: int,
        limit: int | None = None,
        taker: Taker | None = None,
        max_blocks: int = MAX_BLOCKS,
    ) -> Reaped:
        # all at once: no batches here
        now = self.clock()
        dead = {
            pid: p
            for pid, p in self.processes.items()
            if p.expires_at < now and (queues is None or set(p.queues) & set(queues))
        }
        # Witnessed: someone stayed alive across the expiry; else it was an outage for all.
        witnessed = {
            pid: any(
                other != pid and p.expires_at > now and p.started_at < d.expires_at and p.ttl <= d.ttl
                for other, p in self.processes.items()
            )
            for pid, d in dead.items()
        }
        # Stalled: it held a known loop-blocker, which alone is blamed (its run counted as a block).
        stalled = {t.owner for t in self.triggers.values() if t.owner in dead and t.blocked_attempts}
        freed: list[FreedTrigger] = []
        taken: list[TriggerSpec] = []
        room = taker.room if taker else 0
        for t in sorted(self.triggers.values(), key=lambda t: t.id):
            owner = dead.get(t.owner) if t.owner is not None else None
            if owner is None or t.owner is None:
                continue
            if t.owner in stalled:
                blame = witnessed[t.owner] and bool(t.blocked_attempts)
                block = blame
            else:
                blame = witnessed[t.owner] and (not owner.probation or t.id in owner.probation)
                block = False
            alone = owner.probation == [t.id]
            if block:
                if t.attempt not in t.blocked_attempts:
                    t.blocked_attempts.append(t.attempt)
                t.quarantined = len(t.blocked_attempts) >= max_blocks
                t.last_error = (f"it blocked the event loop of consumer {t.owner} past its lease "
                                f"({len(t.blocked_attempts)} runs blocked)")
            elif blame:
                t.quarantined = alone or t.failures + 1 >= max_failures
                t.failures += 1
                t.last_error = f"consumer {t.owner} died while running it ({t.failures} ungraceful losses)"
            t.owner, t.dispatched_at = None, now
            if t.quarantined:
                self._fail_quarantined(
                    t,
                    f"trigger {t.id} ({t.classpath}) was quarantined after it blocked the event "
                    f"loop ({len(t.blocked_attempts)} runs blocked)" if block else
                    f"trigger {t.id} ({t.classpath}) was quarantined after "
                    f"its consumers died {t.failures} time(s) while "
                    "running it",
                )
            elif (
                taker is not None
                and queues is not None
                and t.queue in queues
                and t.failures < SUSPECT_FAILURES
                and taker.me not in t.rejected_by
                and len(taken) < room
            ):
                taken.append(self._take(t, taker.me))
                continue
            freed.append(FreedTrigger(t.id, t.queue, t.classpath, t.failures, t.quarantined))
        for pid in dead:
            del self.processes[pid]
        return Reaped(freed, len(dead), taken)

    async def resend_unclaimed(
        self, queues: Sequence[str] | None, grace: float, limit: int
    ) -> list[TriggerRef]:
        now = self.clock()
        due = sorted(
            (
                t
                for t in self.triggers.values()
                if t.owner is None
                and not t.quarantined
                and t.dispatched_at < now - grace
                and self._in_scope(t.queue, queues)
            ),
            key=lambda t: t.dispatched_at,
        )[:limit]
        for t in due:
            t.dispatched_at = now
        return [TriggerRef(t.id, t.queue) for t in due]

    async def time_out_orphans(self, queues: Sequence[str] | None, max_deferral: float) -> list[TriggerRef]:
        now = self.clock()
        gone = []
        for task in self.tasks.values():
            if task.state != TaskState.DEFERRED or not self._in_scope(task.queue, queues):
                continue
            late = (
                task.trigger_timeout < now - ORPHAN_SLACK
                if task.trigger_timeout is not None
                else task.updated_at < now - max_deferral
            )
            t = self.triggers.get(task.trigger_id) if task.trigger_id is not None else None
            held = t is not None and self._alive(t.owner)
            if not late or (task.trigger_timeout is None and held):
                continue
            task.state, task.next_method = TaskState.SCHEDULED, FAIL_METHOD
            task.next_kwargs = {
                "error": FailureReason.TRIGGER_TIMEOUT,
                "message": "deferral timed out with no trigger running",
            }
            if task.trigger_id is not None:
                self.triggers.pop(task.trigger_id, None)
                gone.append(TriggerRef(task.trigger_id, task.queue))
            task.trigger_id = task.trigger_timeout = None
            task.updated_at = now
        return gone

    async def waiting_queues(self, grace: float) -> list[str]:
        now = self.clock()
        return sorted(
            {
                t.queue
                for t in self.triggers.values()
                if t.owner is None and not t.quarantined and t.dispatched_at < now - grace
            }
        )

    async def queue_consumers(self, queues: Sequence[str]) -> dict[str, int]:
        live = [
            p
            for pid, p in self.processes.items()
            if p.kind is ProcessKind.CONSUMER and self._alive(pid) and p.subscribed
        ]
        return {q: sum(1 for p in live if q in p.queues) for q in queues}
