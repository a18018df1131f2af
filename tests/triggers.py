"""Triggers that misbehave on purpose, importable by consumer subprocesses in tests."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from triggerflow.triggers import (
    BaseTrigger,
    TaskFailedEvent,
    TaskSkippedEvent,
    TaskSuccessEvent,
    TriggerEvent,
)


class _Simple(BaseTrigger):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.kwargs = kwargs

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}", self.kwargs)


class EventAfter(_Simple):
    """Yields ``kind`` event (resume/success/failed/skipped) with ``payload`` after ``delay``."""

    async def run(self) -> AsyncIterator[TriggerEvent]:
        await asyncio.sleep(self.kwargs.get("delay", 0))
        kind, payload = self.kwargs.get("kind", "resume"), self.kwargs.get("payload")
        if kind == "success":
            yield TaskSuccessEvent(xcoms=payload)
        elif kind == "failed":
            yield TaskFailedEvent(xcoms=payload)
        elif kind == "skipped":
            yield TaskSkippedEvent(xcoms=payload)
        else:
            yield TriggerEvent(payload)


class Raises(_Simple):
    async def run(self) -> AsyncIterator[TriggerEvent]:
        await asyncio.sleep(self.kwargs.get("delay", 0))
        raise ValueError(self.kwargs.get("message", "trigger exploded"))
        yield  # pragma: no cover


class WaitsForever(_Simple):
    """Never fires; writes a marker file when cleanup() runs (cancel, timeout, hand-over)."""

    async def run(self) -> AsyncIterator[TriggerEvent]:
        Path(self.kwargs["marker_dir"], f"started-{self.trigger_id}").touch()
        await asyncio.Event().wait()
        yield TriggerEvent(None)  # pragma: no cover

    async def cleanup(self) -> None:
        Path(self.kwargs["marker_dir"], f"cleanup-{self.trigger_id}").touch()


class Killer(_Simple):
    """Kills its whole consumer process (a segfaulting C extension, an OOM kill)."""

    async def run(self) -> AsyncIterator[TriggerEvent]:
        await asyncio.sleep(self.kwargs.get("delay", 0.2))
        os._exit(137)
        yield TriggerEvent(None)  # pragma: no cover


class BlocksLoop(_Simple):
    """Calls time.sleep on the loop (the classic badly-written trigger)."""

    async def run(self) -> AsyncIterator[TriggerEvent]:
        await asyncio.sleep(self.kwargs.get("delay", 0.1))
        time.sleep(self.kwargs.get("seconds", 1.0))
        yield TriggerEvent("woke")


class Spins(_Simple):
    """Never yields control: ``while True: pass``. With ``once`` (a path) only the first run
    spins; a run that finds the path waits quietly, so the consumer it moves to stays healthy."""

    async def run(self) -> AsyncIterator[TriggerEvent]:
        await asyncio.sleep(self.kwargs.get("delay", 0.1))
        once = self.kwargs.get("once")
        if once is not None:
            if Path(once).exists():
                await asyncio.Event().wait()
            Path(once).touch()
        while True:
            pass
        yield TriggerEvent(None)  # pragma: no cover


class BadPayload(_Simple):
    """Fires with a payload jsonb cannot store (NUL) or that is not JSON at all."""

    async def run(self) -> AsyncIterator[TriggerEvent]:
        if self.kwargs.get("mode") == "object":
            yield TriggerEvent(object())
        else:
            yield TriggerEvent({"text": "a\x00b"})


class Mistaken(_Simple):
    """Ends without a valid event: raises CancelledError itself, or yields None or a dict."""

    async def run(self) -> AsyncIterator[TriggerEvent]:
        mistake = self.kwargs["mistake"]
        if mistake == "cancelled":
            raise asyncio.CancelledError
        yield None if mistake == "none" else {"status": "done"}  # type: ignore[misc]


class ReportsPid(_Simple):
    """Fires at ``at`` (epoch seconds) with the pid of the process that ran it: an event
    that says which attempt it comes from."""

    async def run(self) -> AsyncIterator[TriggerEvent]:
        await asyncio.sleep(max(0.0, self.kwargs["at"] - time.time()))
        yield TriggerEvent({"pid": os.getpid()})


class NotATrigger:
    def __init__(self, **kwargs: Any) -> None:
        pass
