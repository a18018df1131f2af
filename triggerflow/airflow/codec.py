"""Turn what an Airflow trigger yields (or raises) into an ``AirflowEvent`` body, with
Airflow's own serialisers, on the consumer side; the writer then only moves JSON.

Importing this module imports Airflow (``triggerflow[airflow]``).
"""

from __future__ import annotations

import json
from traceback import format_exception
from typing import Any

from airflow.models.trigger import TriggerFailureReason
from airflow.models.xcom import XComModel
from airflow.sdk.serde import serialize
from airflow.triggers.base import BaseTaskEndEvent, TriggerEvent


def encode_event(event: TriggerEvent) -> tuple[str, str]:
    """``(kind, body)`` for what a trigger yielded: a resume or a task-end event."""
    if isinstance(event, BaseTaskEndEvent):
        xcoms = None
        if event.xcoms:
            # XComModel.set stores serialize_value's JSON text as a JSON string.
            xcoms = {key: XComModel.serialize_value(value) for key, value in event.xcoms.items()}
        # serde_xcoms: the values themselves, for the events applied by Airflow's own code
        # (events.needs_airflow), which pushes them again as XComModel.set does.
        return str(event.task_instance_state), json.dumps(
            {"xcoms": xcoms, "serde_xcoms": serialize(event.xcoms)})
    return "resume", json.dumps(serialize(event.payload))


def resume_body(payload: Any) -> str:
    """The body of a resume whose payload is known without running the trigger (timers)."""
    return json.dumps(serialize(payload))


def failure_body(exc: BaseException | list[str] | None) -> str:
    """``next_kwargs`` of a ``__fail__`` resume, as ``Trigger.submit_failure`` writes it."""
    if isinstance(exc, BaseException):
        traceback: list[str] | None = format_exception(type(exc), exc, exc.__traceback__)
    else:
        traceback = exc
    return json.dumps({"error": TriggerFailureReason.TRIGGER_FAILURE.value, "traceback": traceback})
