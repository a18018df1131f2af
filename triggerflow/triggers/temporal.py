"""Time-based triggers (Airflow's ``DateTimeTrigger`` and ``TimeDeltaTrigger``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

from triggerflow.triggers.base import TimerTrigger, TriggerEvent


def _aware(moment: datetime | str) -> datetime:
    if isinstance(moment, str):
        moment = datetime.fromisoformat(moment)
    if not isinstance(moment, datetime):
        raise TypeError(f"moment must be a datetime or ISO-8601 string, not {type(moment)!r}")
    if moment.tzinfo is None:
        raise ValueError(f"moment {moment.isoformat()} has no timezone; pass an aware datetime")
    return moment


class DateTimeTrigger(TimerTrigger):
    """Fires at ``moment`` (an aware datetime or an ISO-8601 string with offset)."""

    def __init__(self, moment: datetime | str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.moment = _aware(moment)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("triggerflow.triggers.temporal.DateTimeTrigger", {"moment": self.moment.isoformat()})

    def deadline(self) -> float:
        return self.moment.timestamp()

    async def run(self) -> AsyncIterator[TriggerEvent]:
        # Only used when a trigger runs outside a consumer (tests, ad-hoc use).
        await asyncio.sleep(max(0.0, self.deadline() - time.time()))
        yield TriggerEvent(self.moment)


class TimeDeltaTrigger(DateTimeTrigger):
    """Fires ``delta`` after it is created; serialized as the resulting moment."""

    def __init__(self, delta: timedelta | float, **kwargs: Any) -> None:
        seconds = delta.total_seconds() if isinstance(delta, timedelta) else float(delta)
        super().__init__(moment=datetime.now(UTC) + timedelta(seconds=seconds), **kwargs)
