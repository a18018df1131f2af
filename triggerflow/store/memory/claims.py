"""The in-memory :class:`~triggerflow.store.ClaimStore` and :class:`~triggerflow.store.ProbationStore`."""

from __future__ import annotations

from collections.abc import Sequence

from triggerflow.model import FAIL_METHOD, FailureReason, TaskState
from triggerflow.store.interface import (
    SUSPECT_FAILURES,
    ClaimResult,
    ProcessKind,
    Struck,
    TriggerRef,
    TriggerSpec,
)
from triggerflow.store.memory.state import MemoryState, _tenths


class MemoryClaims(MemoryState):
    async def claim(self, me: int, ids: Sequence[int], queues: Sequence[str]) -> ClaimResult:
        result = ClaimResult()
        if not self._alive(me):  # my lease is over in the store: nothing becomes mine
            return result
        for trigger_id in sorted(set(ids)):
            t = self.triggers.get(trigger_id)
            if (
                t is None
                or t.queue not in queues
                or t.quarantined
                or (t.owner is not None and self._alive(t.owner))
            ):
                continue
            refused = me in t.rejected_by
            if refused:
                if t.owner is None:
                    result.refused.append(TriggerRef(t.id, t.queue))
            elif t.failures >= SUSPECT_FAILURES:
                result.suspects.append(t.id)
            else:
                result.claimed.append(self._take(t, me))
        return result

    async def claim_probation(
        self, me: int, queues: Sequence[str], limit: int | None = None
    ) -> list[TriggerSpec]:
        waiting = [
            t
            for t in self.triggers.values()
            if t.queue in queues and t.owner is None and not t.quarantined and t.failures >= SUSPECT_FAILURES
        ]
        if not waiting or not self._alive(me):  # an empty group is recorded too, as the SQL does
            if me in self.processes:
                self.processes[me].probation = []
            return []
        worst = max(t.failures for t in waiting)
        level = [t for t in waiting if t.failures == worst]
        group = sorted((t for t in level if me not in t.rejected_by), key=lambda t: t.id)
        group = group[: min(max(1, (len(level) + 1) // 2), limit or len(level))]
        self.processes[me].probation = [t.id for t in group]
        return [self._take(t, me) for t in group]

    async def clear_probation(self, me: int, ids: Sequence[int]) -> None:
        for trigger_id in ids:
            t = self.triggers.get(trigger_id)
            if t is not None and t.owner == me:
                t.failures = 0
        if me in self.processes:
            self.processes[me].probation = []

    async def release(
        self,
        me: int,
        ids: Sequence[int] | None = None,
        *,
        cannot_load: bool = False,
        reason: str | None = None,
    ) -> list[TriggerRef]:
        wanted = None if ids is None else set(ids)
        refs = []
        for t in self.triggers.values():
            if t.owner == me and (wanted is None or t.id in wanted):
                t.owner, t.dispatched_at = None, self.clock()
                if cannot_load:
                    t.rejected_by.add(me)
                t.last_error = reason or t.last_error
                refs.append(TriggerRef(t.id, t.queue))
        return refs

    async def release_lost(self, me: int, ids: Sequence[int], attempts: Sequence[int]) -> list[TriggerRef]:
        refs = []
        for trigger_id, attempt in zip(ids, attempts, strict=True):
            t = self.triggers.get(trigger_id)
            if t is not None and t.owner == me and t.attempt == attempt:
                t.owner, t.dispatched_at = None, self.clock()
                refs.append(TriggerRef(t.id, t.queue))
        return refs

    async def taken_since(self, me: int, seconds: float) -> list[tuple[int, int]]:
        since = self.clock() - seconds
        return [(t.id, t.attempt) for t in self.triggers.values()
                if t.owner == me and t.claimed_at >= since]

    async def fail_unloadable(self, me: int, ids: Sequence[int]) -> list[int]:
        failed = []
        for trigger_id in ids:
            t = self.triggers.get(trigger_id)
            if (
                t is None
                or t.owner is not None
                or me not in t.rejected_by
                or await self.other_loaders(trigger_id, me)
            ):
                continue
            del self.triggers[trigger_id]
            failed.append(trigger_id)
            task = self._task_on(trigger_id)
            if task is not None and task.state == TaskState.DEFERRED:
                task.state, task.next_method = TaskState.SCHEDULED, FAIL_METHOD
                task.next_kwargs = {
                    "error": FailureReason.TRIGGER_UNLOADABLE,
                    "message": f"trigger {t.id} ({t.classpath}): no live consumer of queue "
                    f"{t.queue} can load it ({t.last_error or 'unknown'})",
                }
                task.trigger_id = task.trigger_timeout = None
        return failed

    async def other_loaders(self, trigger_id: int, me: int) -> int:
        t = self.triggers.get(trigger_id)
        if t is None:
            return 0
        return sum(
            1
            for pid, p in self.processes.items()
            if p.kind is ProcessKind.CONSUMER
            and self._alive(pid)
            and t.queue in p.queues
            and pid not in t.rejected_by
            and pid != me
        )

    async def forget(self, me: int, ids: Sequence[int]) -> None:
        for trigger_id in ids:
            t = self.triggers.get(trigger_id)
            if t is not None and t.owner == me:
                del self.triggers[trigger_id]

    async def sweep_cancelled(self, me: int) -> list[int]:
        gone = []
        for t in list(self.triggers.values()):
            task = self._task_on(t.id)
            if t.owner == me and (task is None or task.state != TaskState.DEFERRED):
                del self.triggers[t.id]
                gone.append(t.id)
        return gone

    async def strike(
        self, me: int, trigger_id: int, attempt: int, blocked: float, max_blocks: int,
        queues: Sequence[str],
    ) -> Struck | None:
        t = self.triggers.get(trigger_id)
        if (t is None or t.queue not in queues or t.quarantined or attempt > t.attempt
                or attempt in t.blocked_attempts):
            return None
        seconds = _tenths(blocked)
        t.blocked_attempts.append(attempt)
        blocks = len(t.blocked_attempts)
        t.quarantined = blocks >= max_blocks
        release = t.quarantined or (t.attempt == attempt and t.owner in (me, None))
        if release:
            t.owner, t.attempt, t.dispatched_at = None, t.attempt + 1, self.clock()
        t.last_error = f"it blocked the event loop for {seconds} s on consumer {me} ({blocks} runs blocked)"
        if t.quarantined:
            self._fail_quarantined(
                t,
                f"trigger {t.id} ({t.classpath}) was quarantined after it "
                f"blocked the event loop for {seconds} s ({blocks} runs blocked)",
            )
        return Struck(t.id, t.queue, t.classpath, blocks, t.quarantined, release and not t.quarantined)
