"""The native trigger API, shaped like Airflow's (Airflow's own classes run unchanged in Airflow mode).

A trigger is serialized to ``(classpath, kwargs)``, stored in PostgreSQL, rebuilt by a
consumer with ``cls(**kwargs)``, and run as an async generator whose first event ends it.
"""

from __future__ import annotations

import abc
import logging
import math
from collections.abc import AsyncIterator
from typing import Any, ClassVar

from triggerflow.model import EventKind


class TriggerEvent:
    """Resumes the task: ``next_kwargs["event"] = payload``, state ``scheduled``.

    ``payload`` must be JSON-serializable and at most ``max_event_bytes`` once encoded;
    otherwise the consumer does not raise into the trigger but sends a ``__fail__`` resume
    naming the trigger class instead (the task's failure handling runs).
    """

    kind: ClassVar[EventKind] = EventKind.RESUME

    def __init__(self, payload: Any = None) -> None:
        self.payload = payload

    def __repr__(self) -> str:
        return f"{type(self).__name__}<{self.payload!r}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TriggerEvent) and type(other) is type(self) and (
            other.payload == self.payload
        )

    __hash__ = None  # type: ignore[assignment]


class BaseTaskEndEvent(TriggerEvent):
    """Ends the task without a worker; ``xcoms`` is stored as the task's result.

    Use a subclass: :class:`TaskSuccessEvent`, :class:`TaskFailedEvent` or
    :class:`TaskSkippedEvent` set the task's final state. ``xcoms`` follows the payload
    rules of :class:`TriggerEvent` (JSON, size-bounded; a bad one becomes a ``__fail__``
    resume instead of a final state). Takes keyword arguments only (``TypeError`` otherwise).
    """

    def __init__(self, *, xcoms: dict[str, Any] | None = None) -> None:
        super().__init__(xcoms)
        self.xcoms = xcoms


class TaskSuccessEvent(BaseTaskEndEvent):
    """The task ends ``success`` with ``xcoms`` as its result; no worker runs it again."""

    kind = EventKind.SUCCESS


class TaskFailedEvent(BaseTaskEndEvent):
    """The task ends ``failed`` (no retry, no ``__fail__`` method call) with ``xcoms``."""

    kind = EventKind.FAILED


class TaskSkippedEvent(BaseTaskEndEvent):
    """The task ends ``skipped`` with ``xcoms`` as its result."""

    kind = EventKind.SKIPPED


class BaseTrigger(abc.ABC):
    """Base of every trigger.

    Subclasses implement ``serialize()`` and ``async run()``; ``cleanup()`` runs whenever the
    trigger ends, is cancelled, times out or is handed to another consumer. The consumer sets
    ``trigger_id`` and ``task_key`` before ``run()`` so log lines and the blocked-loop
    watchdog can name the trigger.

    What the consumer does with failures (nothing is raised to the deferring code):
    an exception from ``run()``, a ``run()`` that ends without an event, or the deferral's
    timeout resumes the task with ``next_method="__fail__"`` and the error (and traceback),
    as Airflow does. A class outside ``allowed_modules`` or kwargs that ``cls(**kwargs)``
    rejects fail the task the same way; a class this consumer cannot import is handed to
    another consumer of the queue, and fails the task only when none can load it. A
    ``run()`` that blocks the event loop is named in a log line and a metric. Exceptions from
    ``cleanup()`` are logged and otherwise ignored. The SDK raises ``DeferralError`` at defer
    time when ``serialize()`` names a class outside ``allowed_modules`` or kwargs that are not
    JSON or too big.
    """

    trigger_id: int | None = None
    task_key: str | None = None
    # False: the first event ends the trigger (a deferred task's). True: every event is
    # emitted and the trigger runs on until cancelled (Airflow's asset watchers and callback
    # triggers, which have no task to resume: ``triggerflow.airflow.watchers``).
    keeps_running: ClassVar[bool] = False

    def __init__(self, **kwargs: Any) -> None:  # noqa: B027 - subclasses take their own kwargs
        pass

    @property
    def log(self) -> logging.LoggerAdapter[logging.Logger]:
        """A logger whose lines carry this trigger's id, task and class."""
        return logging.LoggerAdapter(
            logging.getLogger(f"{type(self).__module__}.{type(self).__qualname__}"),
            {"trigger_id": self.trigger_id, "task": self.task_key},
        )

    @abc.abstractmethod
    def serialize(self) -> tuple[str, dict[str, Any]]:
        """Return ``(classpath, kwargs)``; ``cls(**kwargs)`` must rebuild the trigger."""

    @abc.abstractmethod
    def run(self) -> AsyncIterator[TriggerEvent]:
        """Yield events; the first one fires the trigger. Never block the event loop."""

    async def cleanup(self) -> None:  # noqa: B027 - optional hook, empty by design
        """Release what ``run()`` acquired. Called on fire, cancel, timeout and hand-over."""

    def __repr__(self) -> str:
        classpath, kwargs = self.serialize()
        return f"<{classpath} {kwargs!r}>"


class TimerTrigger(BaseTrigger):
    """A trigger that only waits for a moment.

    The consumer keeps such triggers on one timer heap instead of a coroutine each (a few
    hundred bytes per waiting trigger instead of a few KB), and never calls ``run()``; the
    event it emits is ``TriggerEvent(timer_payload(deadline))`` — or, for a subclass whose
    ``timer_kind`` is a task-end kind, that task-end event with ``timer_payload`` as its XComs.

    Overriding ``cleanup()`` takes a subclass off the heap: it then runs as a coroutine
    trigger (``run()`` is called, ``cleanup()`` after it), so it must implement a ``run()``
    that waits for ``deadline()`` itself. On the heap, ``deadline()`` is called once, when
    the consumer starts the trigger.
    """

    timer_kind: ClassVar[EventKind] = EventKind.RESUME

    @abc.abstractmethod
    def deadline(self) -> float:
        """POSIX timestamp at which the trigger fires."""

    @staticmethod
    def timer_payload(deadline: float) -> Any:
        from datetime import UTC, datetime

        return datetime.fromtimestamp(deadline, UTC)


def usable_deadline(trigger: TimerTrigger) -> float:
    """The timer's deadline, refused (``ValueError``) unless it is a finite time whose event
    can be built: a moment such as ``0001-01-01T00:00:00+14:00`` parses, but its event cannot."""
    try:
        deadline = float(trigger.deadline())
        if not math.isfinite(deadline):
            raise ValueError(f"deadline {deadline} is not a finite time")
        type(trigger).timer_payload(deadline)
    except (ArithmeticError, ValueError, TypeError, OSError) as exc:
        raise ValueError(f"{type(trigger).__qualname__} has no usable deadline: {exc}") from None
    return deadline
