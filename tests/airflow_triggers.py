"""Airflow-side test helpers that must be importable by Airflow's processes and triggerflow's
consumer alike (``tests.airflow_triggers``, the repository root on ``PYTHONPATH``): a trigger
that raises, and the operator that defers to it. Imported by ``tests/airflow_dags/``; never
collected by pytest (no ``test_`` prefix)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from airflow.sdk import BaseOperator
from airflow.triggers.base import BaseTrigger, TriggerEvent


class RaisingTrigger(BaseTrigger):
    """Raises after ``delay`` seconds: Airflow resumes the task with ``__fail__`` and the
    traceback, and the task fails."""

    def __init__(self, message: str, delay: float = 0.0) -> None:
        super().__init__()
        self.message = message
        self.delay = delay

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("tests.airflow_triggers.RaisingTrigger", {"message": self.message, "delay": self.delay})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        await asyncio.sleep(self.delay)
        raise RuntimeError(self.message)
        yield TriggerEvent(None)  # unreachable: makes run() an async generator


class DeferToRaisingTrigger(BaseOperator):
    """Defers at once to ``RaisingTrigger``; ``execute_complete`` is never reached."""

    def __init__(self, *, raise_after: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.raise_after = raise_after

    def execute(self, context: Any) -> None:
        self.defer(trigger=RaisingTrigger(message=f"raised on purpose by {self.task_id}",
                                          delay=self.raise_after),
                   method_name="execute_complete")

    def execute_complete(self, context: Any, event: Any = None) -> Any:
        return event
