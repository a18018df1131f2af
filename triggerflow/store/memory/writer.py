"""The in-memory :class:`~triggerflow.store.EventStore`: fencing by attempt and queue."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from triggerflow.model import FAIL_METHOD, TaskState
from triggerflow.store.interface import (
    Applied,
    EventRefused,
)
from triggerflow.store.memory.state import MemoryState, StoredTask
from triggerflow.wire import EVENT_KINDS, Event, first_per_attempt


class MemoryEvents(MemoryState):
    async def apply_events(self, events: Sequence[Event]) -> list[Applied]:
        # Only what moves a task has its content read (as the SQL casts only those rows):
        # a stale, duplicate or unknown event changes nothing, whatever its payload.
        # One event per (trigger, attempt), the first, as the SQL stores take them: a later
        # one of the same attempt is neither applied nor read.
        firsts = sorted(first_per_attempt(events), key=lambda ev: ev.trigger_id)
        current = [ev for ev in firsts if self._fenced_in(ev)]
        # Read before anything changes: bad content refuses the whole batch (one transaction).
        payloads = {id(ev): self._payload(ev) for ev in current if self._deferred_on(ev.trigger_id)}
        applied = []
        for ev in current:
            if self.triggers.pop(ev.trigger_id, None) is None:
                continue  # a duplicate of an event of this batch
            task = self._task_on(ev.trigger_id)
            if task is None or task.state != TaskState.DEFERRED:
                continue
            self._move(task, ev.kind, payloads[id(ev)])
            applied.append(Applied(ev.kind, ev.queue, max(0.0, time.time() - ev.fired_at)))
        return applied

    async def apply_unlocked(self, events: Sequence[Event]) -> tuple[list[Applied], list[Event]]:
        return await self.apply_events(events), []  # nothing here holds a row

    def _fenced_in(self, ev: Event) -> bool:
        """The event's (trigger, attempt, queue) is the current one, and its kind is ours."""
        t = self.triggers.get(ev.trigger_id)
        return (
            t is not None and t.attempt == ev.attempt and t.queue == ev.queue and ev.kind in EVENT_KINDS
        )  # as the SQL: an unknown kind never becomes a state

    def _deferred_on(self, trigger_id: int) -> bool:
        task = self._task_on(trigger_id)
        return task is not None and task.state == TaskState.DEFERRED

    @staticmethod
    def _payload(ev: Event) -> Any:
        try:
            if "\\u0000" in ev.payload:
                raise ValueError("unsupported Unicode escape sequence \\u0000")
            return json.loads(ev.payload)
        except ValueError as exc:
            raise EventRefused(f"invalid input syntax for type json: {exc}") from exc

    def _move(self, task: StoredTask, kind: str, payload: Any) -> None:
        if kind == "resume":
            task.state = TaskState.SCHEDULED
            task.next_kwargs = {**(task.next_kwargs or {}), "event": payload}
        elif kind == "fail":
            task.state, task.next_method, task.next_kwargs = TaskState.SCHEDULED, FAIL_METHOD, payload
        else:
            task.state, task.next_method, task.next_kwargs = kind, None, None
            task.result = payload
        task.trigger_id = task.trigger_timeout = None
        task.updated_at = self.clock()
