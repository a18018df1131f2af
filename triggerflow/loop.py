"""The event loop of triggerflow's processes: uvloop (where it is installed), with the long
waits of coroutine triggers on one shared heap.

A waiting coroutine trigger is mostly its pending ``asyncio.sleep``: uvloop gives each a
timer handle, an args tuple, a context copy and a libuv timer (~640 B of the ~2.3 KB a
trigger costs, tracemalloc). Here the timers that a trigger task (a :class:`HeapTimedTask`)
sets at least ``SHARED_FROM`` seconds ahead are slotted entries on one heap, with one loop
timer armed for the earliest. Everything else -- the broker's and the database's timers,
short sleeps -- stays on the loop as it was.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import heapq
from collections.abc import Callable
from typing import Any

SHARED_FROM = 1.0  # seconds: shorter waits are in flight, not held
_SLEEP_DONE = getattr(asyncio.futures, "_set_result_unless_cancelled", None)
_COMPACT_MIN = 100  # cancelled entries before the heap is rebuilt without them


class HeapTimedTask(asyncio.Task):  # type: ignore[type-arg]
    """A task whose long timers the loop keeps on its shared heap (a trigger's task)."""

    __slots__ = ()


class SharedTimer:
    """What ``call_later`` returns for a shared timer: ``cancel``, ``cancelled`` and
    ``when`` behave as on an ``asyncio.TimerHandle``, which is all asyncio's sleeps,
    timeouts and ``wait_for`` use of one."""

    __slots__ = ("_args", "_callback", "_cancelled", "_context", "_loop", "_when")

    def __init__(self, when: float, callback: Callable[..., object], args: tuple[Any, ...],
                 context: contextvars.Context | None, loop: SharedTimers | None) -> None:
        self._when = when
        self._callback: Callable[..., object] | None = callback
        self._args = args
        self._context = context
        self._loop = loop  # None once off the heap (fired): a late cancel changes no count
        self._cancelled = False

    def __lt__(self, other: SharedTimer) -> bool:
        return self._when < other._when

    def when(self) -> float:
        return self._when

    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        if not self._cancelled:
            self._cancelled = True
            self._callback, self._args = None, ()  # what it holds goes now, not at its time
            if self._loop is not None:
                self._loop._timer_cancelled()


class SharedTimers:
    """The shared heap; mixed into a loop class ahead of the loop it extends."""

    _heap: list[SharedTimer]
    _armed: asyncio.TimerHandle | None
    _armed_at: float
    _cancelled_count: int

    def _shared_init(self) -> None:
        self._heap, self._armed, self._armed_at, self._cancelled_count = [], None, 0.0, 0

    # uvloop's call_at is call_later(when - time()): both come here.
    def call_later(self, delay: float, callback: Callable[..., object], *args: Any,
                   context: contextvars.Context | None = None) -> Any:
        loop: Any = self
        if delay >= SHARED_FROM and isinstance(asyncio.current_task(loop), HeapTimedTask):
            return self._share(loop.time() + delay, callback, args, context)
        return super().call_later(delay, callback, *args, context=context)  # type: ignore[misc]

    def _share(self, when: float, callback: Callable[..., object], args: tuple[Any, ...],
               context: contextvars.Context | None) -> SharedTimer:
        if context is None and callback is not _SLEEP_DONE:
            context = contextvars.copy_context()
        # asyncio.sleep's callback only resolves its future: it runs the same in any context,
        # so a sleeping trigger keeps no context copy of its own (~72 B each)
        timer = SharedTimer(when, callback, args, context, self)
        heapq.heappush(self._heap, timer)
        if self._armed is None or when < self._armed_at:
            self._arm(when)
        return timer

    def _arm(self, when: float) -> None:
        if self._armed is not None:
            self._armed.cancel()
        self._armed_at = when
        loop: Any = self
        self._armed = super().call_later(  # type: ignore[misc]
            max(0.0, when - loop.time()), self._fire)

    def _fire(self) -> None:
        self._armed = None
        loop: Any = self
        now = loop.time()
        heap = self._heap
        while heap and (heap[0]._cancelled or heap[0]._when <= now):
            timer = heapq.heappop(heap)
            timer._loop = None
            if timer._cancelled:
                self._cancelled_count -= 1
            else:  # as the loop runs a due handle: on its own, with its own error handling
                assert timer._callback is not None
                loop.call_soon(timer._callback, *timer._args, context=timer._context)
        if heap:
            self._arm(heap[0]._when)

    def _timer_cancelled(self) -> None:
        self._cancelled_count += 1
        if (self._cancelled_count > _COMPACT_MIN
                and self._cancelled_count * 2 > len(self._heap)):
            self._heap = [t for t in self._heap if not t._cancelled]
            heapq.heapify(self._heap)
            self._cancelled_count = 0


@functools.cache
def loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """uvloop's loop with the shared heap; asyncio's own where uvloop is not installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop

    class TriggerLoop(SharedTimers, uvloop.Loop):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self._shared_init()

    return TriggerLoop


def run(main: Any) -> Any:
    """``asyncio.run`` on a loop with the shared heap."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)
