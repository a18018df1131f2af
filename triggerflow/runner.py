"""Runs triggers on one event loop: timers on a heap, everything else as a task.

No I/O here: the runner calls ``emit`` with each outcome and the consumer decides what to
publish. A ``TimerTrigger`` (that keeps the default ``cleanup``) costs one slotted object and
one heap entry — no coroutine, no task — which is what lets one process hold 100k waits.
Coroutine triggers get a task each; their timeouts share the same heap.
"""

from __future__ import annotations

import asyncio
import contextvars
import heapq
import logging
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from triggerflow.loop import HeapTimedTask
from triggerflow.model import EventKind, FailureReason
from triggerflow.triggers.base import BaseTrigger, TimerTrigger, TriggerEvent, usable_deadline

log = logging.getLogger(__name__)


class Held:
    """One trigger this process runs. Slotted: 100k of these must stay small."""

    __slots__ = ("attempt", "classpath", "deadline", "id", "queue", "task", "task_key",
                 "timeout_at", "timer_cls", "traceparent")

    def __init__(
        self, id: int, attempt: int, queue: str, classpath: str, task_key: str | None,
        timeout_at: float | None, traceparent: str | None,
    ) -> None:
        self.id = id
        self.attempt = attempt
        # Every trigger of a queue and class would otherwise carry its own copy of the
        # same strings (each decoded from its own row): ~130 B per held trigger.
        self.queue = sys.intern(queue)
        self.classpath = sys.intern(classpath)
        self.task_key = task_key
        self.timeout_at = timeout_at
        self.traceparent = traceparent
        self.deadline: float | None = None  # set for heap-only timers
        self.timer_cls: type[TimerTrigger] | None = None
        self.task: asyncio.Task[None] | None = None  # coroutine triggers only; it holds them

    def log_context(self) -> dict[str, Any]:
        return {"trigger_id": self.id, "task": self.task_key, "queue": self.queue,
                "attempt": self.attempt}


Outcome = tuple[EventKind, Any]
EmitFn = Callable[[Held, EventKind, Any], None]
# One outcome for many triggers: the timers of one class due at one instant (a burst).
EmitManyFn = Callable[[list[Held], EventKind, Any], None]


def failure(reason: FailureReason, message: str, tb: str | None = None) -> dict[str, Any]:
    """The ``next_kwargs`` of a ``__fail__`` resume, as Airflow builds it."""
    return {"error": str(reason), "message": message,
            **({"traceback": tb.splitlines()} if tb else {})}


# Due timers fired per loop pass. 50,000 due at one instant fired in one callback held the
# loop for seconds: the lease renewal starved (the consumer fenced itself mid-burst) and no
# event was published until the last had fired. Between slices the loop sends the messages
# already full and renews, so the writers start on the first events ~10 ms after the instant.
_FIRE_SLICE = 1000

# One name shared by every trigger task: an unnamed task gets its own "Task-<n>" string,
# and the watchdog finds a blocking trigger from the stack, not from the task name.
_TASK_NAME = "trigger"


_unregister_task: Callable[[asyncio.Task[Any]], None] = getattr(
    asyncio.tasks, "_unregister_task", lambda task: None)


class _TriggerTask(HeapTimedTask):
    """A coroutine trigger waiting for its first event, and what ending it needs.

    It steps the trigger's ``run().__anext__()`` itself: no wrapper coroutine and frame per
    trigger (~240 B each). Slotted, so the trigger travels with its task without a dict.
    Still an ordinary task: ``current_task()``, ``asyncio.timeout()`` and the libraries
    built on them (Airflow triggers using aiohttp) see no difference.
    """

    __slots__ = ("agen", "held", "trigger")
    agen: Any
    held: Held
    trigger: BaseTrigger


def _first_step(agen: Any) -> Any:
    """``agen.__anext__()`` without the loop's first-iteration hook: asyncio would keep every
    trigger's generator in a WeakSet of its own (~185 B each) to close them at shutdown; the
    runner closes its triggers itself. The finalizer hook stays (a generator dropped while
    suspended is still closed on the loop)."""
    firstiter, finalizer = sys.get_asyncgen_hooks()
    if firstiter is None:
        return agen.__anext__()
    sys.set_asyncgen_hooks(firstiter=None, finalizer=finalizer)
    try:
        return agen.__anext__()
    finally:
        sys.set_asyncgen_hooks(firstiter=firstiter, finalizer=finalizer)


def _is_heap_timer(trigger: BaseTrigger) -> bool:
    cls = type(trigger)
    return isinstance(trigger, TimerTrigger) and cls.cleanup is BaseTrigger.cleanup


class TriggerRunner:
    """Starts, times out, cancels and finishes triggers; reports outcomes through ``emit``.
    Deadlines and timeouts are read on ``clock`` (the wall clock the lease checks)."""

    def __init__(self, emit: EmitFn, emit_many: EmitManyFn | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self._emit = emit
        self._clock = clock
        self._emit_many = emit_many
        self.running: dict[int, Held] = {}
        self._heap: list[tuple[float, int, int]] = []  # (when, trigger id, attempt)
        self._stale = 0  # heap entries whose trigger ended before its time (lazy deletion)
        self._wakeup: asyncio.TimerHandle | None = None
        self._wakeup_at = float("inf")
        self._cleanups: set[asyncio.Task[Any]] = set()
        self._callback_context = contextvars.Context()

    def __len__(self) -> int:
        return len(self.running)

    # -- starting ------------------------------------------------------------------------

    def start(self, held: Held, trigger: BaseTrigger) -> None:
        """Run ``trigger``; a deadline it cannot give fails only its own task."""
        trigger.trigger_id = held.id
        trigger.task_key = held.task_key
        previous = self.running.get(held.id)
        if previous is not None:  # re-delivered to us: one run per trigger, never two
            self.cancel([held.id])
        if _is_heap_timer(trigger):
            assert isinstance(trigger, TimerTrigger)
            try:
                deadline = usable_deadline(trigger)
            except Exception as exc:
                self._emit_safely(held, EventKind.FAIL, failure(
                    FailureReason.TRIGGER_FAILURE,
                    f"trigger {held.classpath}: {exc}"))
                return
            self.running[held.id] = held
            held.deadline = deadline
            held.timer_cls = type(trigger)
            when = deadline if held.timeout_at is None else min(deadline, held.timeout_at)
        else:
            agen = trigger.run()
            task = _TriggerTask(_first_step(agen),  # a coroutine by ABC
                                loop=asyncio.get_running_loop(), name=_TASK_NAME)
            # asyncio keeps every task in a process-wide WeakSet for all_tasks() (~130-200 B
            # each at 10k, tracemalloc); held.task keeps ours and cancel() stops them all.
            # A private function: where a Python lacks it, tasks just stay registered.
            _unregister_task(task)
            task.agen, task.held, task.trigger = agen, held, trigger
            # one shared bound method and context: a per-task copy would cost ~290 B each
            task.add_done_callback(self._on_done, context=self._callback_context)
            self.running[held.id] = held
            held.task = task
            if held.timeout_at is None:
                return
            when = held.timeout_at
        self._push(when, held)

    def _push(self, when: float, held: Held) -> None:
        heapq.heappush(self._heap, (when, held.id, held.attempt))
        if when < self._wakeup_at:
            self._arm()

    def _arm(self) -> None:
        if self._wakeup is not None:
            self._wakeup.cancel()
            self._wakeup = None
        if not self._heap:
            self._wakeup_at = float("inf")
            return
        self._wakeup_at = self._heap[0][0]
        delay = max(0.0, self._wakeup_at - self._clock())
        self._wakeup = asyncio.get_running_loop().call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._wakeup = None
        now = self._clock()
        budget = _FIRE_SLICE
        # Fired timers grouped by (class, deadline): a burst is mostly one group, whose event
        # is built, validated and stamped once (per timer, that was ~3 us of a ~5 us fire).
        due: dict[tuple[type[TimerTrigger], float], list[Held]] = {}
        try:
            # self._heap each time round: a compaction may replace the list meanwhile
            while self._heap and self._heap[0][0] <= now and budget:
                budget -= 1
                _, trigger_id, attempt = heapq.heappop(self._heap)
                held = self.running.get(trigger_id)
                if held is None or held.attempt != attempt:
                    self._stale = max(0, self._stale - 1)
                    continue  # finished or cancelled already (lazy deletion)
                if held.deadline is not None and held.deadline <= now:
                    del self.running[trigger_id]
                    assert held.timer_cls is not None
                    due.setdefault((held.timer_cls, held.deadline), []).append(held)
                elif held.timeout_at is not None and held.timeout_at <= now:
                    self._time_out(held)
        finally:  # whatever one trigger did, the heap keeps waking up for the others
            for (timer_cls, deadline), helds in due.items():
                self._fire_timers(timer_cls, deadline, helds)
            self._arm()  # still due: called again on the next loop pass, after I/O

    def _fire_timers(self, timer_cls: type[TimerTrigger], deadline: float,
                     helds: list[Held]) -> None:
        try:
            payload = timer_cls.timer_payload(deadline)
        except Exception as exc:
            for held in helds:
                self._emit_safely(held, EventKind.FAIL, failure(
                    FailureReason.TRIGGER_FAILURE,
                    f"trigger {held.classpath} could not build its event: {exc!r}"))
            return
        kind = timer_cls.timer_kind
        if self._emit_many is not None:
            try:
                self._emit_many(helds, kind, payload)
                return
            except Exception:  # one at a time instead: each gets its event or its failure
                log.exception("emitting %d events of %s at once failed", len(helds),
                              timer_cls.__qualname__)
        for held in helds:
            self._emit_safely(held, kind, payload)

    def _emit_safely(self, held: Held, kind: EventKind, payload: Any) -> None:
        """Emit; an outcome that cannot be emitted becomes a ``__fail__`` of its own task."""
        try:
            self._emit(held, kind, payload)
            return
        except Exception as exc:
            log.exception("emitting the outcome of %s failed", held.classpath,
                          extra=held.log_context())
            fallback = failure(FailureReason.TRIGGER_FAILURE,
                               f"the outcome of trigger {held.classpath} could not be sent: {exc!r}")
        try:
            self._emit(held, EventKind.FAIL, fallback)
        except Exception:  # the reaper's deferral timeout still ends the task
            log.exception("emitting the failure of %s failed", held.classpath,
                          extra=held.log_context())

    def _time_out(self, held: Held) -> None:
        del self.running[held.id]
        if held.task is not None:
            held.task.cancel()
        self._emit_safely(held, EventKind.FAIL, failure(
            FailureReason.TRIGGER_TIMEOUT, f"trigger {held.classpath} timed out"))

    # -- coroutine triggers ----------------------------------------------------------------

    def _on_done(self, task: asyncio.Task[Any]) -> None:
        """The trigger's first event, exception or cancellation: finish it, then close it."""
        assert isinstance(task, _TriggerTask)
        held = task.held
        if self._next_event(task):
            return
        if task.cancelled():
            # Every cancel of ours takes the trigger out of ``running`` first: one still
            # there raised CancelledError itself, and would leave its task deferred.
            self._finish(held, EventKind.FAIL, failure(
                FailureReason.TRIGGER_FAILURE,
                f"trigger {held.classpath} raised CancelledError itself"))
        else:
            exc = task.exception()
            if exc is None:
                event = task.result()
                if isinstance(event, TriggerEvent):
                    self._finish(held, event.kind, event.payload)
                else:
                    self._finish(held, EventKind.FAIL, failure(
                        FailureReason.TRIGGER_FAILURE,
                        f"trigger {held.classpath} yielded {type(event).__name__}, "
                        "not a TriggerEvent"))
            elif isinstance(exc, StopAsyncIteration) and task.trigger.keeps_running:
                self._finish_quietly(held)  # ran to its end after its events: nothing to say
            elif isinstance(exc, StopAsyncIteration):
                self._finish(held, EventKind.FAIL, failure(
                    FailureReason.TRIGGER_FAILURE,
                    f"trigger {held.classpath} exited without sending an event"))
            else:
                log.warning("trigger %s raised %r", held.classpath, exc, extra=held.log_context())
                self._finish(held, EventKind.FAIL, failure(
                    FailureReason.TRIGGER_FAILURE, f"trigger {held.classpath} raised {exc!r}",
                    "".join(traceback.format_exception(exc))))
        closing = asyncio.get_running_loop().create_task(
            self._close(held, task.trigger, task.agen))
        self._cleanups.add(closing)
        closing.add_done_callback(self._cleanups.discard)

    def _next_event(self, task: _TriggerTask) -> bool:
        """A ``keeps_running`` trigger's event: emitted, its generator stepped on in a new task."""
        held = task.held
        if not (task.trigger.keeps_running and not task.cancelled()
                and task.exception() is None and self.running.get(held.id) is held
                and isinstance(event := task.result(), TriggerEvent)):
            return False
        self._emit_safely(held, event.kind, event.payload)
        if self.running.get(held.id) is not held:  # cancelled by what the emit did
            return False
        following = _TriggerTask(task.agen.__anext__(), loop=asyncio.get_running_loop(),
                                 name=_TASK_NAME)
        _unregister_task(following)
        following.agen, following.held, following.trigger = task.agen, held, task.trigger
        following.add_done_callback(self._on_done, context=self._callback_context)
        held.task = following
        return True

    async def _close(self, held: Held, trigger: BaseTrigger, agen: Any) -> None:
        try:
            await agen.aclose()
        except BaseException:
            log.debug("aclose failed", exc_info=True, extra=held.log_context())
        try:
            await trigger.cleanup()
        except Exception:
            log.warning("cleanup of %s failed", held.classpath, exc_info=True,
                        extra=held.log_context())

    def _finish(self, held: Held, kind: EventKind, payload: Any) -> None:
        if self.running.get(held.id) is held:
            del self.running[held.id]
            self._forget_heap_entry(held)
            self._emit_safely(held, kind, payload)

    def _finish_quietly(self, held: Held) -> None:
        if self.running.get(held.id) is held:
            del self.running[held.id]
            self._forget_heap_entry(held)

    def _forget_heap_entry(self, held: Held) -> None:
        """Count the entry of a trigger that ended early; compact once most are stale.

        Coroutine triggers carry the deferral timeout (7 days by default) on the heap, so
        without this every finished one would stay there until then.
        """
        if held.timeout_at is None and held.deadline is None:
            return  # never pushed
        self._stale += 1
        if self._stale > 1024 and self._stale * 2 > len(self._heap):
            running = self.running
            self._heap = [e for e in self._heap
                          if (h := running.get(e[1])) is not None and h.attempt == e[2]]
            heapq.heapify(self._heap)
            self._stale = 0
            self._arm()

    # -- stopping ------------------------------------------------------------------------

    def cancel(self, ids: list[int] | None = None) -> list[Held]:
        """Stop triggers without an event (their ``cleanup()`` still runs)."""
        targets = list(self.running) if ids is None else [i for i in ids if i in self.running]
        stopped = []
        for trigger_id in targets:
            held = self.running.pop(trigger_id)
            if ids is not None:
                self._forget_heap_entry(held)
            if held.task is not None and not held.task.done():
                held.task.cancel()
                self._cleanups.add(held.task)
                held.task.add_done_callback(self._cleanups.discard)
            stopped.append(held)
        if ids is None:
            self._heap.clear()
            self._stale = 0
            self._arm()
        return stopped

    async def wait_cleanups(self, timeout: float = 10.0) -> None:
        """Wait for cancelled triggers to end, then for their ``cleanup()`` (a task of its own)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._cleanups and (left := deadline - loop.time()) > 0:
            await asyncio.wait(list(self._cleanups), timeout=left)

    def holding(self, trigger: BaseTrigger) -> Held | None:
        """What runs this very trigger object now (not a later attempt of its id), if any."""
        held = self.running.get(trigger.trigger_id) if trigger.trigger_id is not None else None
        task = held.task if held is not None else None
        return held if isinstance(task, _TriggerTask) and task.trigger is trigger else None

    def current_task_count(self) -> int:
        return sum(1 for h in self.running.values() if h.task is not None)
