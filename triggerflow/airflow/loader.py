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
import functools
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

import greenback

from triggerflow.airflow import task_context
from triggerflow.airflow.cancels import KILLS
from triggerflow.airflow.codec import Encoded, encode_event, failure_body
from triggerflow.airflow.kwargs import load_trigger_class
from triggerflow.airflow.runtime import CURRENT_TRIGGER
from triggerflow.airflow.schema import installed_release
from triggerflow.airflow.timers import as_timer
from triggerflow.airflow.watchers import watcher
from triggerflow.airflow.witness import WITNESS
from triggerflow.loader import AllowedClasses, Disallowed, Unloadable
from triggerflow.model import EventKind
from triggerflow.store.interface import TriggerSpec
from triggerflow.triggers.base import BaseTrigger, TriggerEvent

log = logging.getLogger(__name__)

_REQUEUES = (EventKind.RESUME, EventKind.FAIL)  # events that put the task back to scheduled
# Fetching a trigger's task instance (task_context.workload) through a database blip: tries
# and the pause before each retry, seconds.
_WORKLOAD_TRIES = 3
_WORKLOAD_PAUSE = 1.0


class EncodedEvent(TriggerEvent):
    """What ``AirflowCoroutine`` yields: the runner reads ``kind`` and ``payload``."""

    def __init__(self, kind: EventKind, body: str) -> None:
        super().__init__(Encoded(body))
        self.kind = kind  # type: ignore[misc]  # per instance: the Airflow event decides


class AirflowCoroutine(BaseTrigger):
    """An Airflow trigger object run by triggerflow's runner, first event only, as Airflow's
    triggerer runs it (``run()`` then ``cleanup()``).

    ``not_before`` (epoch seconds) holds an event that puts the task back to ``scheduled``
    (resume, ``__fail__``) until the scheduler's own writes show it has handled the exit of
    the worker that deferred it (``witness``), or until then at the latest: Airflow 3.3.2's
    scheduler fails a task that it queues again before it has seen that worker exit
    (docs/airflow-race.md). Task-end events never requeue the task and are not held.
    """

    def __init__(self, trigger: Any, not_before: float | None = None, *,
                 with_task: bool = False) -> None:
        self.trigger = trigger
        self.not_before = not_before
        self.with_task = with_task  # read its task instance from Airflow's database first

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
        agen: AsyncIterator[Any] | None = None
        try:
            try:
                context = await self._attach_task() if self.with_task else None
                # As Airflow's run_trigger: a failure to render is the trigger's failure.
                task_context.render(self.trigger, context)
                agen = self.trigger.run()
                event = await anext(agen)
            except StopAsyncIteration:
                raise  # the runner's "exited without sending an event"
            except asyncio.CancelledError:
                # its task ended, before its timeout (taken from KILLS on every release)
                if KILLS.take(self.trigger_id) and _calls_on_kill():
                    await self._on_kill()
                raise
            except Exception as exc:
                encoded = EncodedEvent(EventKind.FAIL, failure_body(exc))
            else:
                kind, body = encode_event(event)
                encoded = EncodedEvent(EventKind(kind), body)
            if self.not_before is not None and encoded.kind in _REQUEUES:
                await WITNESS.hold(self.trigger_id, self.not_before)
            yield encoded
        finally:
            if agen is not None:
                await agen.aclose()  # type: ignore[attr-defined]

    async def _attach_task(self) -> Any:
        """``task_instance`` (and a ``start_from_trigger`` task's template context) as
        Airflow's triggerer gives it; the database work runs in a thread."""
        for tries_left in range(_WORKLOAD_TRIES - 1, -1, -1):
            try:
                work = await asyncio.to_thread(task_context.workload, int(self.trigger_id or 0))
                break
            except Exception as exc:
                if not tries_left:
                    raise
                log.warning("task instance of trigger %s not read (%r); retrying",
                            self.trigger_id, exc)
                await asyncio.sleep(_WORKLOAD_PAUSE)
        return None if work is None else task_context.attach(self.trigger, work)

    async def cleanup(self) -> None:
        await self.trigger.cleanup()

    async def _on_kill(self) -> None:
        """As Airflow's ``TriggerRunner.run_trigger`` on a user-action cancel: ``on_kill()``
        bounded by ``[triggerer] on_kill_timeout``, its failures logged, not raised."""
        on_kill = getattr(self.trigger, "on_kill", None)
        if on_kill is None:
            return
        log.info("trigger %s cancelled by its task's end, invoking on_kill", self.trigger_id)
        try:
            await asyncio.wait_for(on_kill(), timeout=_on_kill_timeout())
        except TimeoutError:
            log.warning("on_kill() of trigger %s timed out", self.trigger_id)
        except asyncio.CancelledError:
            pass  # cancelled again (shutdown) while in on_kill: the first cancel goes on
        except Exception:
            log.warning("on_kill() of trigger %s raised", self.trigger_id, exc_info=True)


@functools.cache
def _calls_on_kill() -> bool:
    """Airflow's triggerer calls a cancelled trigger's ``on_kill()`` from 3.3 on; 3.2's never
    does, so on 3.2 neither does triggerflow (its oracle is 3.2's triggerer)."""
    return installed_release() != "3.2"


def _on_kill_timeout() -> int:
    from airflow.configuration import conf

    return conf.getint("triggerer", "on_kill_timeout", fallback=30)


class AirflowLoader(AllowedClasses):
    """``TriggerLoader``'s contract for Airflow rows: ``build`` raises ``Disallowed``,
    ``Unloadable`` or ``BadKwargs`` exactly where the native loader does.

    ``with_task`` (``consume --airflow``): a trigger that runs as itself first gets its task
    instance from Airflow's database (``task_context``), as under Airflow's triggerer.
    """

    def __init__(self, allowed_modules: list[str], *, with_task: bool = False) -> None:
        super().__init__(allowed_modules)
        self.with_task = with_task

    def load(self, classpath: str) -> type[Any]:
        try:
            return load_trigger_class(classpath)
        except (ImportError, AttributeError) as exc:
            raise Unloadable(f"cannot import trigger class {classpath!r}: {exc}") from exc
        except TypeError as exc:
            raise Disallowed(str(exc)) from exc

    def build(self, spec: TriggerSpec) -> BaseTrigger:
        trigger = self.instantiate(spec)
        if spec.task is None:  # an asset watcher's or a callback's row: no task to resume
            return watcher(self, spec, trigger,
                           task_context.watched_assets if self.with_task else None)
        # A timer keeps only its deadline; the Airflow object is dropped here. One that would
        # fire within the scheduler race's hold runs as itself instead, held (rare: only
        # deferrals younger than the hold, whose timer is due within it).
        timer = as_timer(trigger)
        if timer is not None and (spec.not_before is None or timer.deadline() >= spec.not_before):
            return timer
        return AirflowCoroutine(trigger, spec.not_before,
                                with_task=self.with_task and spec.task is not None)
