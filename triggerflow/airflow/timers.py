"""Airflow's own timer triggers on triggerflow's timer heap.

``DateTimeTrigger`` (and ``TimeDeltaTrigger``, which stores itself as a ``DateTimeTrigger``)
only waits for ``moment``. Run as Airflow runs it, each waiting one is a coroutine that wakes
every few seconds; here it becomes one heap entry, and the event is what Airflow's ``run()``
would have yielded: ``TriggerEvent(self.moment)`` — a UTC ``pendulum.DateTime`` — or, with
``end_from_trigger``, ``TaskSuccessEvent()`` (no XComs).

A templated ``target_time`` (``start_from_trigger`` with a Jinja template) is not mapped: the
trigger runs as Airflow's coroutine, rendered first as Airflow's triggerer renders it
(``task_context``).

Importing this module imports Airflow (``triggerflow[airflow]``).
"""

from __future__ import annotations

import functools
from typing import Any

import pendulum
from airflow._shared.timezones import timezone
from airflow.providers.standard.triggers.temporal import DateTimeTrigger, TimeDeltaTrigger

from triggerflow.model import EventKind
from triggerflow.triggers.base import TimerTrigger, TriggerEvent


@functools.lru_cache(maxsize=1024)
def _moment(deadline: float) -> Any:
    """The moment Airflow's run() yields: convert_to_utc of the parsed or given datetime.

    Cached: a burst shares one deadline, so its events share one immutable DateTime, which
    ``codec`` then encodes once (building it was a third of a fired event's cost)."""
    return timezone.convert_to_utc(pendulum.from_timestamp(deadline, tz="UTC"))


class AirflowMoment(TimerTrigger):
    """``DateTimeTrigger(moment)``: resumes the task with the moment, as a UTC DateTime."""

    def __init__(self, deadline: float) -> None:
        self._deadline = deadline

    def deadline(self) -> float:
        return self._deadline

    @staticmethod
    def timer_payload(deadline: float) -> Any:
        return _moment(deadline)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{type(self).__module__}.{type(self).__qualname__}", {"deadline": self._deadline}

    async def run(self) -> Any:  # never called: the runner keeps timers on its heap
        raise NotImplementedError
        yield TriggerEvent()  # pragma: no cover - makes this an async generator


class AirflowMomentSuccess(AirflowMoment):
    """``DateTimeTrigger(moment, end_from_trigger=True)``: ends the task successfully."""

    timer_kind = EventKind.SUCCESS

    @staticmethod
    def timer_payload(deadline: float) -> Any:
        return None  # TaskSuccessEvent() carries no XComs


def as_timer(trigger: Any) -> TimerTrigger | None:
    """The heap timer standing for an Airflow trigger, or None when it must run as itself."""
    if type(trigger) not in (DateTimeTrigger, TimeDeltaTrigger):  # a subclass may override run()
        return None
    # ``target_time`` (templated or ISO text) exists from provider 1.21 on; older releases
    # only have ``moment``.
    target = getattr(trigger, "target_time", None)
    if getattr(trigger, "_moment", None) is None and isinstance(target, str) and "{" in target:
        return None  # an unrendered template
    try:
        deadline = trigger.moment.timestamp()
    except (TypeError, ValueError):
        return None  # let Airflow's run() raise it, as it would in Airflow's triggerer
    cls = AirflowMomentSuccess if trigger.end_from_trigger else AirflowMoment
    return cls(deadline)
