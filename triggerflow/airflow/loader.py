"""Claimed Airflow trigger rows -> what the consumer's runner runs.

Airflow's ``DateTimeTrigger``/``TimeDeltaTrigger`` become heap timers (``timers.as_timer``);
every other Airflow trigger runs as itself inside ``AirflowCoroutine``, which hands the
runner the event already encoded by Airflow's serialisers (``codec``), and an exception as
the ``__fail__`` body ``Trigger.submit_failure`` writes (the ``format_exception`` list).
The allow-list is checked on the classpath before anything is imported, as in native mode.

Importing this module imports Airflow (``triggerflow[airflow]``).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import greenback

from triggerflow.airflow.codec import Encoded, encode_event, failure_body
from triggerflow.airflow.kwargs import load_trigger_class
from triggerflow.airflow.runtime import CURRENT_TRIGGER
from triggerflow.airflow.timers import as_timer
from triggerflow.loader import AllowedClasses, Disallowed, Unloadable
from triggerflow.model import EventKind
from triggerflow.store.interface import TriggerSpec
from triggerflow.triggers.base import BaseTrigger, TriggerEvent

_REQUEUES = (EventKind.RESUME, EventKind.FAIL)  # events that put the task back to scheduled


class EncodedEvent(TriggerEvent):
    """What ``AirflowCoroutine`` yields: the runner reads ``kind`` and ``payload``."""

    def __init__(self, kind: EventKind, body: str) -> None:
        super().__init__(Encoded(body))
        self.kind = kind  # type: ignore[misc]  # per instance: the Airflow event decides


class AirflowCoroutine(BaseTrigger):
    """An Airflow trigger object run by triggerflow's runner, first event only, as Airflow's
    triggerer runs it (``run()`` then ``cleanup()``).

    ``not_before`` (epoch seconds) holds an event that puts the task back to ``scheduled``
    (resume, ``__fail__``) until then: Airflow 3.3.2's scheduler fails a task that it queues
    again before it has seen the worker that deferred it exit (docs/airflow.md, "The
    scheduler race"). Task-end events never requeue the task and are not held.
    """

    def __init__(self, trigger: Any, not_before: float | None = None) -> None:
        self.trigger = trigger
        self.not_before = not_before

    def serialize(self) -> tuple[str, dict[str, Any]]:
        classpath, kwargs = self.trigger.serialize()
        return str(classpath), dict(kwargs)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        self.trigger.trigger_id = self.trigger_id
        # As Airflow's TriggerRunner.run_trigger: the portal lets trigger code call the sync
        # SDK (SUPERVISOR_COMMS.send) from inside this coroutine; the variable is the
        # runtime's per-trigger bound (runtime.RuntimeComms).
        CURRENT_TRIGGER.set(self.trigger_id)
        if os.environ.get("AIRFLOW_DISABLE_GREENBACK_PORTAL", "").lower() != "true":
            await greenback.ensure_portal()
        agen = self.trigger.run()
        try:
            try:
                event = await anext(agen)
            except StopAsyncIteration:
                raise  # the runner's "exited without sending an event"
            except Exception as exc:
                encoded = EncodedEvent(EventKind.FAIL, failure_body(exc))
            else:
                kind, body = encode_event(event)
                encoded = EncodedEvent(EventKind(kind), body)
            if self.not_before is not None and encoded.kind in _REQUEUES:
                await asyncio.sleep(self.not_before - time.time())  # negative: no wait
            yield encoded
        finally:
            await agen.aclose()

    async def cleanup(self) -> None:
        await self.trigger.cleanup()


class AirflowLoader(AllowedClasses):
    """``TriggerLoader``'s contract for Airflow rows: ``build`` raises ``Disallowed``,
    ``Unloadable`` or ``BadKwargs`` exactly where the native loader does."""

    def load(self, classpath: str) -> type[Any]:
        try:
            return load_trigger_class(classpath)
        except (ImportError, AttributeError) as exc:
            raise Unloadable(f"cannot import trigger class {classpath!r}: {exc}") from exc
        except TypeError as exc:
            raise Disallowed(str(exc)) from exc

    def build(self, spec: TriggerSpec) -> BaseTrigger:
        trigger = self.instantiate(spec)
        # A timer keeps only its deadline; the Airflow object is dropped here. One that would
        # fire within the scheduler race's hold runs as itself instead, held (rare: only
        # deferrals younger than the hold, whose timer is due within it).
        timer = as_timer(trigger)
        if timer is not None and (spec.not_before is None or timer.deadline() >= spec.not_before):
            return timer
        return AirflowCoroutine(trigger, spec.not_before)
