"""The in-memory store's records and what every role of it shares: the dicts, the clock,
and how a claimed row becomes a :class:`~triggerflow.store.TriggerSpec`."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

from triggerflow.codec import KwargsCodec, MissingKey
from triggerflow.model import FAIL_METHOD, FailureReason, TaskKey, TaskState
from triggerflow.store.interface import (
    KwargsError,
    KwargsProblem,
    ProcessKind,
    TriggerSpec,
)


def _tenths(seconds: float) -> Decimal:
    """Seconds as the SQL's ``round(x::numeric, 1)`` gives them (half away from zero)."""
    return Decimal(repr(seconds)).quantize(Decimal("0.1"), ROUND_HALF_UP)


class ManualClock:
    """A clock that moves only when told to (epoch seconds, starting now)."""

    def __init__(self, start: float | None = None) -> None:
        self.now = time.time() if start is None else start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class StoredTrigger:
    id: int
    classpath: str
    kwargs: str
    queue: str
    timeout_at: float | None
    traceparent: str | None
    dispatched_at: float
    owner: int | None = None
    attempt: int = 0
    claimed_at: float = 0.0
    failures: int = 0
    rejected_by: set[int] = field(default_factory=set)
    quarantined: bool = False
    last_error: str | None = None
    blocked_attempts: list[int] = field(default_factory=list)  # runs that blocked a loop


@dataclass
class StoredTask:
    key: TaskKey
    state: str
    queue: str
    next_method: str | None
    next_kwargs: Any
    trigger_id: int | None
    trigger_timeout: float | None
    updated_at: float
    result: Any = None


@dataclass
class Process:
    kind: ProcessKind
    queues: list[str]
    expires_at: float
    running: int = 0
    probation: list[int] = field(default_factory=list)
    started_at: float = 0.0
    ttl: float = 0.0
    subscribed: bool = False  # on the broker, as of the last renewal (counted only then)
    clock_skew: float | None = None  # its clock minus ours, as it last measured
    warming: bool = False  # unsubscribed on purpose until its runtime answers
    presence: str | None = None  # its broker connection's presence queue


class MemoryState:
    """The store as dicts, which every role's mixin reads and writes. ``clock`` gives epoch
    seconds (leases, timeouts, dispatch times)."""

    def __init__(self, clock: Callable[[], float] = time.time, codec: KwargsCodec | None = None) -> None:
        self.clock = clock
        self.codec = codec or KwargsCodec()
        self.triggers: dict[int, StoredTrigger] = {}
        # Keyed per queue, as the native table (migration 0008): one team's keys never
        # collide with another's.
        self.tasks: dict[tuple[TaskKey, str], StoredTask] = {}
        self.processes: dict[int, Process] = {}
        self._ids = itertools.count(1)
        self._process_ids = itertools.count(1)

    async def close(self) -> None:
        """Nothing to release; the contents stay for inspection."""

    # -- helpers for tests ----------------------------------------------------------------

    def task(self, key: TaskKey, queue: str | None = None) -> StoredTask:
        """The task of ``key`` in ``queue`` (any queue when the key is in only one)."""
        if queue is not None:
            return self.tasks[key, queue]
        [task] = [t for (k, _), t in self.tasks.items() if k == key]
        return task

    def _task_on(self, trigger_id: int) -> StoredTask | None:
        return next((t for t in self.tasks.values() if t.trigger_id == trigger_id), None)

    def _alive(self, process_id: int | None) -> bool:
        p = self.processes.get(process_id) if process_id is not None else None
        return p is not None and p.expires_at > self.clock()

    def _spec(self, t: StoredTrigger) -> TriggerSpec:
        kwargs: dict[str, Any] | None = None
        problem: KwargsError | None = None
        try:
            kwargs = self.codec.decode(t.kwargs, t.queue)
        except MissingKey as exc:
            problem = KwargsError(KwargsProblem.UNREADABLE_HERE, str(exc))
        except Exception as exc:
            problem = KwargsError(KwargsProblem.INVALID, repr(exc))
        task = self._task_on(t.id)
        return TriggerSpec(
            t.id,
            t.attempt,
            t.queue,
            t.classpath,
            kwargs,
            problem,
            str(task.key) if task else None,
            t.timeout_at,
            t.traceparent,
        )

    def _take(self, t: StoredTrigger, me: int) -> TriggerSpec:
        t.owner = me
        t.attempt += 1
        t.claimed_at = self.clock()
        return self._spec(t)

    @staticmethod
    def _in_scope(queue: str, queues: Sequence[str] | None) -> bool:
        return queues is None or queue in queues

    def _fail_quarantined(self, t: StoredTrigger, message: str) -> None:
        """Fail the task of ``t``, just quarantined; a row no task points at (its task
        deferred again, or a retried deferral's spare) goes, as nothing waits on it."""
        task = self._task_on(t.id)
        if task is None:
            del self.triggers[t.id]
            return
        if task.state != TaskState.DEFERRED:
            return
        task.next_kwargs = {
            "error": FailureReason.TRIGGER_QUARANTINED,
            "message": message,
            "deferred_next_method": task.next_method,
            "deferred_next_kwargs": task.next_kwargs,
        }
        task.state, task.next_method = TaskState.SCHEDULED, FAIL_METHOD
        task.trigger_timeout, task.updated_at = None, self.clock()
