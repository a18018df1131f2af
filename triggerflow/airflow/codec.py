"""Turn what an Airflow trigger yields (or raises) into an ``AirflowEvent`` body, with
Airflow's own serialisers, on the consumer side; the writer then only moves JSON.

Importing this module imports Airflow (``triggerflow[airflow]``).
"""

from __future__ import annotations

import json
from datetime import datetime
from traceback import format_exception
from typing import Any

from airflow.models.trigger import TriggerFailureReason
from airflow.models.xcom import XComModel
from airflow.sdk.serde import serialize
from airflow.triggers.base import BaseTaskEndEvent, TriggerEvent

from triggerflow.model import EventKind


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


class _OncePerObject:
    """Wire values of heap-timer outcomes, encoded once per payload object.

    ``timers`` hands every trigger of one deadline the same immutable ``DateTime`` (and an
    ``end_from_trigger`` timer ``None``), so a burst of 10,000 is one serde call, not
    10,000: the same object always encodes to the same text, byte for byte. Keyed by
    identity and holding the object, so an id is never reused while its entry lives;
    bounded, since deadlines keep coming.
    """

    LIMIT = 1024

    def __init__(self) -> None:
        self._values: dict[tuple[EventKind, int], tuple[Any, Any]] = {}

    def value(self, kind: EventKind, payload: Any) -> Any:
        key = (kind, id(payload))
        hit = self._values.get(key)
        if hit is not None and hit[0] is payload:
            return hit[1]
        value = json.loads(encode_outcome(kind, payload)[1])
        if len(self._values) >= self.LIMIT:
            self._values.clear()
        self._values[key] = (payload, value)
        return value


_timer_values = _OncePerObject()


def failure_body(exc: BaseException | list[str] | None) -> str:
    """``next_kwargs`` of a ``__fail__`` resume, as ``Trigger.submit_failure`` writes it."""
    if isinstance(exc, BaseException):
        traceback: list[str] | None = format_exception(type(exc), exc, exc.__traceback__)
    else:
        traceback = exc
    return json.dumps({"error": TriggerFailureReason.TRIGGER_FAILURE.value, "traceback": traceback})


def encode_outcome(kind: EventKind, payload: Any) -> tuple[str, str]:
    """``(kind, body)`` for what ``TriggerRunner`` emits when it runs Airflow triggers.

    Heap timers (``timers``) emit ``RESUME`` with the moment or ``SUCCESS`` with no XComs;
    a coroutine trigger's Airflow event comes through ``encode_event``. A runner failure
    (``FAIL``, built by ``runner.failure``) becomes ``submit_failure``'s shape: Airflow keeps
    only the reason and the traceback lines.
    """
    if kind is EventKind.RESUME:
        return "resume", resume_body(payload)
    if kind is EventKind.FAIL:
        lines = payload.get("traceback") or [payload.get("message", "")]
        return "fail", json.dumps({"error": TriggerFailureReason.TRIGGER_FAILURE.value,
                                   "traceback": lines})
    xcoms = None
    if payload:
        xcoms = {key: XComModel.serialize_value(value) for key, value in payload.items()}
    return str(kind), json.dumps({"xcoms": xcoms, "serde_xcoms": serialize(payload)})


class Encoded:
    """A payload already in the wire form ``AirflowStore`` applies (built by
    ``loader.AirflowCoroutine``): ``wire_outcome`` passes it through instead of encoding it
    again."""

    __slots__ = ("value",)

    def __init__(self, body: str) -> None:
        self.value = json.loads(body)


def wire_outcome(kind: EventKind, payload: Any) -> tuple[EventKind, Any]:
    """The consumer's ``Outcomes`` hook in Airflow mode: what the runner emitted -> the kind
    and JSON value ``AirflowStore.apply_events`` reads as the event body.

    A payload ``loader.AirflowCoroutine`` already encoded passes through; heap timers and the
    runner's own failures (exited without an event, could not be loaded) are encoded here.
    """
    if isinstance(payload, Encoded):
        return kind, payload.value
    if (kind is EventKind.RESUME and isinstance(payload, datetime)) or (
            kind is EventKind.SUCCESS and payload is None):
        return kind, _timer_values.value(kind, payload)  # heap timers: immutable payloads
    encoded_kind, body = encode_outcome(kind, payload)
    return EventKind(encoded_kind), json.loads(body)
