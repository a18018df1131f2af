"""MemoryStore: the :class:`~triggerflow.store.Store` in one process, for tests and trials.

Mirrors the native PostgreSQL store's semantics with plain dicts: fencing by attempt (an
event applies only to the current attempt on the event's own queue, while its task is still
deferred on that trigger), leases that expire by ``clock`` (pass a :class:`ManualClock` to
move time by hand), probation in halving groups, quarantine of triggers blamed alone or too
often, refusal of an event whose payload is not JSON (as ``jsonb`` refuses it). All calls
complete at once and never raise ``StoreUnavailable``; wrap it to inject failures.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

from triggerflow.codec import KwargsCodec, MissingKey
from triggerflow.model import FAIL_METHOD, TaskKey, TaskState
from triggerflow.store.interface import (
    Applied,
    Cancelled,
    ClaimResult,
    EventRefused,
    FreedTrigger,
    KwargsError,
    KwargsProblem,
    NewDeferral,
    ProcessKind,
    Reaped,
    Renewal,
    Taker,
    TriggerRef,
    TriggerSpec,
)
from triggerflow.wire import EVENT_KINDS, Event

FINAL = {"success", "failed", "skipped"}
ORPHAN_SLACK = 2.0  # seconds past its timeout before a deferred task is failed as orphaned
SUSPECT_FAILURES = 2  # ungraceful losses that make a trigger a suspect (run on probation)


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
    failures: int = 0
    rejected_by: set[int] = field(default_factory=set)
    quarantined: bool = False
    last_error: str | None = None


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
    presence: str | None = None  # its broker connection's presence queue


class MemoryStore:
    """The store as dicts. ``clock`` gives epoch seconds (leases, timeouts, dispatch times)."""

    def __init__(self, clock: Callable[[], float] = time.time,
                 codec: KwargsCodec | None = None) -> None:
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
        return TriggerSpec(t.id, t.attempt, t.queue, t.classpath, kwargs, problem,
                           str(task.key) if task else None, t.timeout_at, t.traceparent)

    def _take(self, t: StoredTrigger, me: int) -> TriggerSpec:
        t.owner = me
        t.attempt += 1
        return self._spec(t)

    @staticmethod
    def _in_scope(queue: str, queues: Sequence[str] | None) -> bool:
        return queues is None or queue in queues

    # -- a process's lease ----------------------------------------------------------------

    async def register(self, kind: ProcessKind, host: str, pid: int, queues: Sequence[str],
                       capacity: int, version: str, ttl: float) -> int:
        me = next(self._process_ids)
        now = self.clock()
        self.processes[me] = Process(ProcessKind(kind), list(queues), now + ttl, started_at=now,
                                     ttl=ttl)
        return me

    async def renew(self, me: int, ttl: float, running: int, queues: Sequence[str], *,
                    subscribed: bool = True, clock_skew: float | None = None) -> Renewal | None:
        if not self._alive(me):
            return None
        now = self.clock()
        mine = self.processes[me]
        mine.expires_at, mine.running, mine.ttl = now + ttl, running, ttl
        mine.subscribed, mine.clock_skew = subscribed, clock_skew
        same_set = [p for p in self.processes.values() if set(p.queues) == set(queues)]
        dead = [p for p in self.processes.values() if p.expires_at <= now
                and (not queues or set(p.queues) & set(queues))]
        live = [p for p in same_set if p.kind is ProcessKind.CONSUMER and p.expires_at > now
                and p.subscribed]
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
        gone = [pid for pid, p in self.processes.items()
                if p.presence == presence and p.expires_at > now and set(p.queues) & set(queues)]
        for pid in gone:
            self.processes[pid].expires_at = now
        return gone

    # -- consumer ------------------------------------------------------------------------

    async def claim(self, me: int, ids: Sequence[int], queues: Sequence[str]) -> ClaimResult:
        result = ClaimResult()
        for trigger_id in sorted(set(ids)):
            t = self.triggers.get(trigger_id)
            if (t is None or t.queue not in queues or t.quarantined
                    or (t.owner is not None and self._alive(t.owner))):
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

    async def claim_probation(self, me: int, queues: Sequence[str],
                              limit: int | None = None) -> list[TriggerSpec]:
        waiting = [t for t in self.triggers.values() if t.queue in queues and t.owner is None
                   and not t.quarantined and t.failures >= SUSPECT_FAILURES]
        if not waiting:  # an empty group is recorded too, as the SQL does
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

    async def release(self, me: int, ids: Sequence[int] | None = None, *,
                      cannot_load: bool = False, reason: str | None = None) -> list[TriggerRef]:
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

    async def release_lost(self, me: int, ids: Sequence[int],
                           attempts: Sequence[int]) -> list[TriggerRef]:
        refs = []
        for trigger_id, attempt in zip(ids, attempts, strict=True):
            t = self.triggers.get(trigger_id)
            if t is not None and t.owner == me and t.attempt == attempt:
                t.owner, t.dispatched_at = None, self.clock()
                refs.append(TriggerRef(t.id, t.queue))
        return refs

    async def fail_unloadable(self, me: int, ids: Sequence[int]) -> list[int]:
        failed = []
        for trigger_id in ids:
            t = self.triggers.get(trigger_id)
            if (t is None or t.owner is not None or me not in t.rejected_by
                    or await self.other_loaders(trigger_id, me)):
                continue
            del self.triggers[trigger_id]
            failed.append(trigger_id)
            task = self._task_on(trigger_id)
            if task is not None and task.state == TaskState.DEFERRED:
                task.state, task.next_method = TaskState.SCHEDULED, FAIL_METHOD
                task.next_kwargs = {
                    "error": "Trigger could not be loaded",
                    "message": f"trigger {t.id} ({t.classpath}): no live consumer of queue "
                               f"{t.queue} can load it ({t.last_error or 'unknown'})"}
                task.trigger_id = task.trigger_timeout = None
        return failed

    async def other_loaders(self, trigger_id: int, me: int) -> int:
        t = self.triggers.get(trigger_id)
        if t is None:
            return 0
        return sum(1 for pid, p in self.processes.items()
                   if p.kind is ProcessKind.CONSUMER and self._alive(pid) and t.queue in p.queues
                   and pid not in t.rejected_by and pid != me)

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

    async def strike(self, me: int, trigger_id: int, attempt: int, blocked: float,
                     max_failures: int) -> FreedTrigger | None:
        t = self.triggers.get(trigger_id)
        if t is None or t.attempt != attempt or t.owner not in (me, None) or t.quarantined:
            return None
        seconds = _tenths(blocked)
        t.failures += 1
        t.owner, t.attempt, t.dispatched_at = None, t.attempt + 1, self.clock()
        t.quarantined = t.failures >= max_failures
        t.last_error = (f"it blocked the event loop for {seconds} s on consumer {me} "
                        f"({t.failures} failures)")
        if t.quarantined:
            self._fail_quarantined(t, f"trigger {t.id} ({t.classpath}) was quarantined after it "
                                      f"blocked the event loop for {seconds} s ({t.failures} "
                                      "failures)")
        return FreedTrigger(t.id, t.queue, t.classpath, t.failures, t.quarantined)

    # -- writer --------------------------------------------------------------------------

    async def apply_events(self, events: Sequence[Event]) -> list[Applied]:
        # Only what moves a task has its content read (as the SQL casts only those rows):
        # a stale, duplicate or unknown event changes nothing, whatever its payload.
        current = [ev for ev in sorted(events, key=lambda ev: ev.trigger_id) if self._fenced_in(ev)]
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
        return (t is not None and t.attempt == ev.attempt and t.queue == ev.queue
                and ev.kind in EVENT_KINDS)  # as the SQL: an unknown kind never becomes a state

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

    # -- reaper ----------------------------------------------------------------------------

    async def reap_dead(self, queues: Sequence[str] | None, max_failures: int,
                        limit: int | None = None, taker: Taker | None = None) -> Reaped:
        # all at once: no batches here
        now = self.clock()
        dead = {pid: p for pid, p in self.processes.items() if p.expires_at < now
                and (queues is None or set(p.queues) & set(queues))}
        # Witnessed: someone stayed alive across the expiry; else it was an outage for all.
        witnessed = {pid: any(other != pid and p.expires_at > now and p.started_at < d.expires_at
                              and p.ttl <= d.ttl for other, p in self.processes.items())
                     for pid, d in dead.items()}
        freed: list[FreedTrigger] = []
        taken: list[TriggerSpec] = []
        room = taker.room if taker else 0
        for t in sorted(self.triggers.values(), key=lambda t: t.id):
            owner = dead.get(t.owner) if t.owner is not None else None
            if owner is None or t.owner is None:
                continue
            blame = witnessed[t.owner] and (not owner.probation or t.id in owner.probation)
            alone = owner.probation == [t.id]
            if blame:
                t.quarantined = alone or t.failures + 1 >= max_failures
                t.failures += 1
                t.last_error = (f"consumer {t.owner} died while running it "
                                f"({t.failures} ungraceful losses)")
            t.owner, t.dispatched_at = None, now
            if t.quarantined:
                self._fail_quarantined(t, f"trigger {t.id} ({t.classpath}) was quarantined after "
                                          f"its consumers died {t.failures} time(s) while "
                                          "running it")
            elif (taker is not None and queues is not None and t.queue in queues
                  and t.failures < SUSPECT_FAILURES and taker.me not in t.rejected_by and len(taken) < room):
                taken.append(self._take(t, taker.me))
                continue
            freed.append(FreedTrigger(t.id, t.queue, t.classpath, t.failures, t.quarantined))
        for pid in dead:
            del self.processes[pid]
        return Reaped(freed, len(dead), taken)

    def _fail_quarantined(self, t: StoredTrigger, message: str) -> None:
        task = self._task_on(t.id)
        if task is None or task.state != TaskState.DEFERRED:
            return
        task.next_kwargs = {
            "error": "Trigger quarantined", "message": message,
            "deferred_next_method": task.next_method, "deferred_next_kwargs": task.next_kwargs}
        task.state, task.next_method = TaskState.SCHEDULED, FAIL_METHOD
        task.trigger_timeout, task.updated_at = None, self.clock()

    async def resend_unclaimed(self, queues: Sequence[str] | None, grace: float,
                               limit: int) -> list[TriggerRef]:
        now = self.clock()
        due = sorted((t for t in self.triggers.values()
                      if t.owner is None and not t.quarantined and t.dispatched_at < now - grace
                      and self._in_scope(t.queue, queues)), key=lambda t: t.dispatched_at)[:limit]
        for t in due:
            t.dispatched_at = now
        return [TriggerRef(t.id, t.queue) for t in due]

    async def time_out_orphans(self, queues: Sequence[str] | None,
                               max_deferral: float) -> list[TriggerRef]:
        now = self.clock()
        gone = []
        for task in self.tasks.values():
            if task.state != TaskState.DEFERRED or not self._in_scope(task.queue, queues):
                continue
            late = (task.trigger_timeout < now - ORPHAN_SLACK if task.trigger_timeout is not None
                    else task.updated_at < now - max_deferral)
            t = self.triggers.get(task.trigger_id) if task.trigger_id is not None else None
            held = t is not None and self._alive(t.owner)
            if not late or (task.trigger_timeout is None and held):
                continue
            task.state, task.next_method = TaskState.SCHEDULED, FAIL_METHOD
            task.next_kwargs = {"error": "Trigger timeout",
                                "message": "deferral timed out with no trigger running"}
            if task.trigger_id is not None:
                self.triggers.pop(task.trigger_id, None)
                gone.append(TriggerRef(task.trigger_id, task.queue))
            task.trigger_id = task.trigger_timeout = None
            task.updated_at = now
        return gone

    async def waiting_queues(self, grace: float) -> list[str]:
        now = self.clock()
        return sorted({t.queue for t in self.triggers.values() if t.owner is None
                       and not t.quarantined and t.dispatched_at < now - grace})

    async def queue_consumers(self, queues: Sequence[str]) -> dict[str, int]:
        live = [p for pid, p in self.processes.items()
                if p.kind is ProcessKind.CONSUMER and self._alive(pid) and p.subscribed]
        return {q: sum(1 for p in live if q in p.queues) for q in queues}

    # -- SDK -----------------------------------------------------------------------------

    async def defer(self, deferrals: Sequence[NewDeferral]) -> list[int]:
        now = self.clock()
        ids = []
        for d in deferrals:
            trigger_id = next(self._ids)
            timeout_at = now + d.timeout
            self.triggers[trigger_id] = StoredTrigger(
                trigger_id, d.classpath, d.stored_kwargs, d.queue, timeout_at, d.traceparent, now)
            key = TaskKey(d.dag_id, d.task_id, d.run_id, d.map_index)
            self.tasks[key, d.queue] = StoredTask(key, TaskState.DEFERRED, d.queue, d.next_method,
                                                   json.loads(d.next_kwargs), trigger_id, timeout_at, now)
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
        for trigger_id in ids:
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
