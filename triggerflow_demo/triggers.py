"""Triggers that show each outcome: a task-end event, a failure."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from triggerflow.triggers import BaseTrigger, TaskSuccessEvent, TriggerEvent


class TaskEndTrigger(BaseTrigger):
    """Waits ``delay`` seconds, then ends the task as successful with ``xcoms``."""

    def __init__(self, delay: float, xcoms: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.delay = delay
        self.xcoms = xcoms or {}

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("triggerflow_demo.triggers.TaskEndTrigger",
                {"delay": self.delay, "xcoms": self.xcoms})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        await asyncio.sleep(self.delay)
        yield TaskSuccessEvent(xcoms=self.xcoms)


class FailingTrigger(BaseTrigger):
    """Waits ``delay`` seconds, then raises: the task resumes into ``__fail__``."""

    def __init__(self, delay: float, message: str = "boom") -> None:
        super().__init__()
        self.delay = delay
        self.message = message

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("triggerflow_demo.triggers.FailingTrigger",
                {"delay": self.delay, "message": self.message})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        await asyncio.sleep(self.delay)
        raise RuntimeError(self.message)
        yield  # pragma: no cover - makes this an async generator
