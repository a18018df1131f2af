"""Trigger API and built-in triggers."""

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
from triggerflow.triggers.http import HttpTrigger
from triggerflow.triggers.temporal import DateTimeTrigger, TimeDeltaTrigger

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
