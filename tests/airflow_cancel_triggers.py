"""A trigger that never fires and leaves a marker file at each step of its life, and the
operator that defers to it (with an optional deferral timeout): what
tests/test_airflow_cancel_e2e.py reads to see when a triggerer ran, cancelled, killed and
cleaned it up. Importable by Airflow's processes and triggerflow's consumer alike (the
repository root on ``PYTHONPATH``); never collected by pytest."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

from airflow.sdk import BaseOperator
from airflow.triggers.base import BaseTrigger, TriggerEvent

STEPS = ("run", "cancel", "on_kill", "cleanup")


def mark(folder: str, name: str, trigger_id: object, step: str) -> None:
    """``<folder>/<name>.<trigger id>.<step>`` holding the wall-clock time of the step."""
    Path(folder, f"{name}.{trigger_id}.{step}").write_text(repr(time.time()))


class MarkerTrigger(BaseTrigger):
    """Waits for ever; marks ``run`` as it starts, ``cancel`` when cancelled, ``on_kill`` and
    ``cleanup`` when its triggerer calls them."""

    def __init__(self, folder: str, name: str) -> None:
        super().__init__()
        self.folder = folder
        self.name = name

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("tests.airflow_cancel_triggers.MarkerTrigger", {"folder": self.folder, "name": self.name})

    def _mark(self, step: str) -> None:
        mark(self.folder, self.name, getattr(self, "trigger_id", None), step)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        self._mark("run")
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self._mark("cancel")
            raise
        yield TriggerEvent(None)  # unreachable

    async def on_kill(self) -> None:
        self._mark("on_kill")

    async def cleanup(self) -> None:
        self._mark("cleanup")


class DeferToMarker(BaseOperator):
    """Defers at once to ``MarkerTrigger`` (named after the task), ``timeout`` seconds."""

    def __init__(self, *, folder: str, timeout_seconds: float | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.folder = folder
        self.timeout_seconds = timeout_seconds

    def execute(self, context: Any) -> None:
        timeout = None if self.timeout_seconds is None else timedelta(seconds=self.timeout_seconds)
        self.defer(
            trigger=MarkerTrigger(folder=self.folder, name=self.task_id),
            method_name="execute_complete",
            timeout=timeout,
        )

    def execute_complete(self, context: Any, event: Any = None) -> Any:
        return event
