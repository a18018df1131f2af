"""The coroutine trigger of ``triggerflow bench chaos --mode airflow``: an Airflow trigger
(``airflow.triggers.base``) that waits until a moment and names its deferral in its event,
as ``bench.chaos_trigger.ChaosWait`` does in native mode. Imported only by the processes
that load Airflow's classes (``consume --airflow``, the bench's Airflow worker)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TaskSuccessEvent, TriggerEvent


class ChaosWait(BaseTrigger):
    """Fires at ``until`` (POSIX time; a run taken over waits for the same moment) with
    ``{"d": token}``: a resume, or with ``end`` a task-end ``success`` carrying it as XComs."""

    def __init__(self, until: float, token: str, end: bool = False) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # Airflow's, untyped
        self.until = until
        self.token = token
        self.end = end

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("bench.chaos_airflow_trigger.ChaosWait",
                {"until": self.until, "token": self.token, "end": self.end})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        await asyncio.sleep(max(0.0, self.until - time.time()))
        if self.end:
            yield TaskSuccessEvent(xcoms={"d": self.token})
        else:
            yield TriggerEvent({"d": self.token})  # type: ignore[no-untyped-call]
