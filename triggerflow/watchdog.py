"""Names the trigger that blocks the event loop, while it is still blocking.

A thread expects the loop to tick every ``interval``; when a tick is late by more than the
threshold it reads the loop thread's current Python stack and finds the innermost frame
whose ``self`` is a ``BaseTrigger`` — so a ``time.sleep`` or a ``while True`` in a trigger is
reported by class and trigger id, not as "a badly-written trigger".
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType

from triggerflow.triggers.base import BaseTrigger

log = logging.getLogger(__name__)


def find_trigger(frame: FrameType | None) -> BaseTrigger | None:
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, BaseTrigger):
            return candidate
        frame = frame.f_back
    return None


class LoopWatchdog:
    """Measures loop lag and reports blocking triggers through ``on_blocked``."""

    def __init__(
        self,
        threshold: float,
        on_blocked: Callable[[BaseTrigger | None, float], None],
        on_lag: Callable[[float], None] | None = None,
        interval: float = 0.05,
    ) -> None:
        self.threshold = threshold
        self.interval = interval
        self.on_blocked = on_blocked
        self.on_lag = on_lag
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
                self._reported_for = 0.0
                continue
            late = now - self._last_tick - self.interval
            if late < self.threshold:
                self._reported_for = 0.0
                continue
            if self._reported_for and late < self._reported_for * 2:
                continue  # report again only as the block keeps doubling
            self._reported_for = late
            self.blocked_since = self._last_tick
            frame = sys._current_frames().get(self._loop_thread)
            try:
                self.on_blocked(find_trigger(frame), late)
            except Exception:
                log.exception("blocked-loop callback failed")
