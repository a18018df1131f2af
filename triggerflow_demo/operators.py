"""Operators that defer through the SDK and continue in ``execute_complete``."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from triggerflow.triggers import BaseTrigger, DateTimeTrigger
from triggerflow_demo.host import BaseOperator


class WaitUntilOperator(BaseOperator):
    """Sleeps until ``seconds`` from now without holding a worker slot."""

    def __init__(self, task_id: str, seconds: float, **kw: Any) -> None:
        super().__init__(task_id, **kw)
        self.seconds = seconds

    def execute(self, context: dict[str, Any]) -> Any:
        moment = datetime.now(UTC) + timedelta(seconds=self.seconds)
        self.defer(trigger=DateTimeTrigger(moment), method_name="execute_complete",
                   kwargs={"planned": moment.isoformat()})

    def execute_complete(self, context: dict[str, Any], event: Any = None,
                         planned: str | None = None) -> Any:
        return {"fired": event, "planned": planned}


class TriggerOperator(BaseOperator):
    """Defers on any given trigger (the demo uses it for each outcome)."""

    def __init__(self, task_id: str, trigger: BaseTrigger, timeout: float | None = None,
                 **kw: Any) -> None:
        super().__init__(task_id, **kw)
        self.trigger = trigger
        self.timeout = timeout

    def execute(self, context: dict[str, Any]) -> Any:
        self.defer(trigger=self.trigger, method_name="execute_complete", timeout=self.timeout)

    def execute_complete(self, context: dict[str, Any], event: Any = None) -> Any:
        return event
