"""The in-memory :class:`~triggerflow.store.DeferralStore`."""

from __future__ import annotations

import json
from collections.abc import Sequence

from triggerflow.model import TaskKey, TaskState
from triggerflow.store.interface import (
    Cancelled,
    NewDeferral,
)
from triggerflow.store.memory.state import MemoryState, StoredTask, StoredTrigger


class MemoryDeferrals(MemoryState):
    async def defer(self, deferrals: Sequence[NewDeferral]) -> list[int]:
        now = self.clock()
        ids = []
        for d in deferrals:
            trigger_id = next(self._ids)
            timeout_at = now + d.timeout
            self.triggers[trigger_id] = StoredTrigger(
                trigger_id, d.classpath, d.stored_kwargs, d.queue, timeout_at, d.traceparent, now
            )
            key = TaskKey(d.dag_id, d.task_id, d.run_id, d.map_index)
            self.tasks[key, d.queue] = StoredTask(
                key,
                TaskState.DEFERRED,
                d.queue,
                d.next_method,
                json.loads(d.next_kwargs),
                trigger_id,
                timeout_at,
                now,
            )
            ids.append(trigger_id)
        return ids

    async def undo_defer(self, ids: Sequence[int], error: str) -> None:
        for trigger_id in ids:
            t = self.triggers.get(trigger_id)
            if t is None or t.owner is not None:
                continue
            del self.triggers[trigger_id]
            task = self._task_on(trigger_id)
            if task is not None and task.state == TaskState.DEFERRED:
                task.state, task.next_method, task.next_kwargs = TaskState.FAILED, None, {"error": error}
                task.trigger_id = task.trigger_timeout = None

    async def cancel(self, ids: Sequence[int], state: str) -> list[Cancelled]:
        out = []
        for trigger_id in dict.fromkeys(ids):  # each once, as the SQL's ANY() does
            task = self._task_on(trigger_id)
            moved = task is not None and task.state == TaskState.DEFERRED
            if task is not None and moved:
                task.state, task.next_method = state, None
                task.trigger_id = task.trigger_timeout = None
            t = self.triggers.get(trigger_id)
            if t is None:
                continue
            if t.owner is None or not self._alive(t.owner):
                del self.triggers[trigger_id]
                out.append(Cancelled(trigger_id, None, moved, t.queue))
            else:
                out.append(Cancelled(trigger_id, t.owner, moved, t.queue))
        return out
