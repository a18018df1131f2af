"""Names the trigger that blocks the event loop, while it is still blocking.

A thread expects the loop to tick every ``interval``; when a tick is late by more than the
threshold it reads the loop thread's current Python stack and finds the innermost frame
whose ``self`` is a ``BaseTrigger`` — so a ``time.sleep`` or a ``while True`` in a trigger is
reported by class and trigger id, not as "a badly-written trigger".

A trigger found on the stack for longer than ``limit`` is also handed to ``on_overrun``, once
per block. That call is queued on the loop from this thread while the block still lasts, so
it runs as soon as the loop is free again: before anything the blocking step scheduled (the
trigger's own done-callback, its next step), so the trigger can be stopped before it fires
or blocks again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from triggerflow.triggers.base import BaseTrigger

log = logging.getLogger(__name__)


def find_trigger(frame: FrameType | None) -> BaseTrigger | None:
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, BaseTrigger):
            return candidate
        frame = frame.f_back
    return None


# Called on the loop with the trigger and when (time.monotonic()) its block began.
OverrunFn = Callable[[BaseTrigger, float], None]


class LoopWatchdog:
    """Measures loop lag and reports blocking triggers through ``on_blocked`` (from its
    thread, while blocked) and ``on_overrun`` (on the loop, past ``limit``)."""

    def __init__(
        self,
        threshold: float,
        on_blocked: Callable[[BaseTrigger | None, float], None],
        on_lag: Callable[[float], None] | None = None,
        interval: float = 0.05,
        limit: float | None = None,
        on_overrun: OverrunFn | None = None,
    ) -> None:
        self.threshold = threshold
        self.interval = interval
        self.on_blocked = on_blocked
        self.on_lag = on_lag
        self.limit = limit
        self.on_overrun = on_overrun
        # This block's culprits by id(): [trigger, start of its block, handed over yet]
        self._culprits: dict[int, list[Any]] = {}
        self._last_tick = time.monotonic()
        self._loop_thread = threading.get_ident()
        self._stop = threading.Event()
        self._reported_for = 0.0
        self._thread = threading.Thread(target=self._watch, name="loop-watchdog", daemon=True)
        self._handle: asyncio.TimerHandle | None = None
        self.blocked_since: float | None = None

    def start(self) -> None:
        """Start watching the running loop (call from inside it)."""
        self._loop_thread = threading.get_ident()
        self._loop = asyncio.get_running_loop()
        self._last_tick = time.monotonic()  # set-up time before start() is not lag
        self._handle = self._loop.call_later(self.interval, self._tick)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._handle is not None:
            self._handle.cancel()

    def _tick(self) -> None:
        now = time.monotonic()
        lag = now - self._last_tick - self.interval
        if self.on_lag is not None:
            self.on_lag(max(0.0, lag))
        self._last_tick = now
        self.blocked_since = None
        self._handle = self._loop.call_later(self.interval, self._tick)

    def _watch(self) -> None:
        woke = time.monotonic()
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            slept, woke = now - woke, now
            if slept > self.interval + self.threshold:
                # This thread overslept too: the whole process was paused (SIGSTOP, a VM
                # freeze), not the loop blocked by a trigger. Give the loop a tick to catch up.
                self._block_over()
                continue
            late = now - self._last_tick - self.interval
            if late < self.threshold:
                self._block_over()
                continue
            trigger = find_trigger(sys._current_frames().get(self._loop_thread))
            if trigger is not None and self.on_overrun is not None:
                self._check_limit(trigger, now, late)
            if self._reported_for and late < self._reported_for * 2:
                continue  # report again only as the block keeps doubling
            self._reported_for = late
            self.blocked_since = self._last_tick
            try:
                self.on_blocked(trigger, late)
            except Exception:
                log.exception("blocked-loop callback failed")

    def _block_over(self) -> None:
        self._reported_for = 0.0
        self._culprits.clear()

    def _check_limit(self, trigger: BaseTrigger, now: float, late: float) -> None:
        """Hand ``trigger`` to ``on_overrun`` once it has held the loop for ``limit``."""
        culprit = self._culprits.get(id(trigger))
        if culprit is None:
            # The block's first culprit has held the loop since its tick was due; one found
            # later in the same block (another trigger's step), since it was first seen.
            start = now - late if not self._culprits else now
            culprit = self._culprits[id(trigger)] = [trigger, start, False]
        if culprit[2] or self.limit is None or now - culprit[1] < self.limit:
            return
        culprit[2] = True
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing left to stop
            self._loop.call_soon_threadsafe(self._overrun, trigger, culprit[1])

    def _overrun(self, trigger: BaseTrigger, since: float) -> None:
        assert self.on_overrun is not None
        try:
            self.on_overrun(trigger, since)
        except Exception:
            log.exception("overrun callback failed")
