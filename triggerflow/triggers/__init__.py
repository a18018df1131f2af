"""Trigger API and built-in triggers.

Importing the API pulls in no network client: ``HttpTrigger`` (httpx) loads on first use.
"""

from typing import TYPE_CHECKING, Any

from triggerflow.triggers.base import (
    BaseTaskEndEvent,
    BaseTrigger,
    TaskFailedEvent,
    TaskSkippedEvent,
    TaskSuccessEvent,
    TimerTrigger,
    TriggerEvent,
)
from triggerflow.triggers.file import FileTrigger
from triggerflow.triggers.temporal import DateTimeTrigger, TimeDeltaTrigger

if TYPE_CHECKING:
    from triggerflow.triggers.http import HttpTrigger

__all__ = [
    "BaseTaskEndEvent",
    "BaseTrigger",
    "DateTimeTrigger",
    "FileTrigger",
    "HttpTrigger",
    "TaskFailedEvent",
    "TaskSkippedEvent",
    "TaskSuccessEvent",
    "TimeDeltaTrigger",
    "TimerTrigger",
    "TriggerEvent",
]


def __getattr__(name: str) -> Any:
    if name == "HttpTrigger":
        from triggerflow.triggers.http import HttpTrigger

        return HttpTrigger
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
