"""Airflow-side test helpers that must be importable by Airflow's processes and triggerflow's
consumer alike (``tests.airflow_triggers``, the repository root on ``PYTHONPATH``): a trigger
that raises, and the operator that defers to it. Imported by ``tests/airflow_dags/``; never
collected by pytest (no ``test_`` prefix)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import AsyncIterator
from typing import Any

from airflow.sdk import BaseOperator
from airflow.triggers.base import BaseEventTrigger, BaseTrigger, StartTriggerArgs, TriggerEvent


class RaisingTrigger(BaseTrigger):
    """Raises after ``delay`` seconds: Airflow resumes the task with ``__fail__`` and the
    traceback, and the task fails."""

    def __init__(self, message: str, delay: float = 0.0) -> None:
        super().__init__()
        self.message = message
        self.delay = delay

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("tests.airflow_triggers.RaisingTrigger", {"message": self.message, "delay": self.delay})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        await asyncio.sleep(self.delay)
        raise RuntimeError(self.message)
        yield TriggerEvent(None)  # unreachable: makes run() an async generator


class DeferToRaisingTrigger(BaseOperator):
    """Defers at once to ``RaisingTrigger``; ``execute_complete`` is never reached."""

    def __init__(self, *, raise_after: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.raise_after = raise_after

    def execute(self, context: Any) -> None:
        self.defer(trigger=RaisingTrigger(message=f"raised on purpose by {self.task_id}",
                                          delay=self.raise_after),
                   method_name="execute_complete")

    def execute_complete(self, context: Any, event: Any = None) -> Any:
        return event


class RuntimeReadingTrigger(BaseTrigger):
    """Reads a Connection and a Variable as provider triggers do, in one of three styles:
    ``sync`` (``BaseHook.get_connection`` and ``Variable.get`` called straight from the
    coroutine), ``sync_to_async`` (the same calls wrapped), ``connection_get``
    (``Connection.get``). Fires with what it read; a missing id raises what Airflow raises.
    ``hold`` seconds pass first: a trigger that fires at once can lose its task to Airflow's
    scheduler (issue 18, item 4), which is not what the runtime tests look at."""

    def __init__(self, conn_id: str, variable: str, style: str = "sync",
                 hold: float = 0.0) -> None:
        super().__init__()
        self.conn_id = conn_id
        self.variable = variable
        self.style = style
        self.hold = hold

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("tests.airflow_triggers.RuntimeReadingTrigger",
                {"conn_id": self.conn_id, "variable": self.variable, "style": self.style,
                 "hold": self.hold})

    def read(self) -> dict[str, Any]:
        from airflow.sdk import BaseHook, Connection, Variable

        if self.style == "connection_get":
            conn = Connection.get(self.conn_id)
        else:
            conn = BaseHook.get_connection(self.conn_id)
        return {"login": conn.login, "password": conn.password, "host": conn.host,
                "variable": Variable.get(self.variable)}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from asgiref.sync import sync_to_async

        await asyncio.sleep(self.hold)
        if self.style == "sync_to_async":
            yield TriggerEvent(await sync_to_async(self.read)())
        else:
            yield TriggerEvent(self.read())


class DeferToTrigger(BaseOperator):
    """Defers at once to ``trigger`` (a trigger class of this module) built with
    ``trigger_kwargs``; returns the event's payload (an XCom)."""

    def __init__(self, *, trigger: str, trigger_kwargs: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.trigger = trigger
        self.trigger_kwargs = trigger_kwargs

    def execute(self, context: Any) -> None:
        self.defer(trigger=globals()[self.trigger](**self.trigger_kwargs),
                   method_name="execute_complete")

    def execute_complete(self, context: Any, event: Any = None) -> Any:
        return event


class LatencyTrigger(BaseTrigger):
    """Times ``requests`` reads of a connection (``BaseHook.get_connection``, sync from the
    coroutine) and of a variable (``Variable.get`` through ``sync_to_async``), one after the
    other, and fires with the milliseconds each took: the runtime's latency as trigger code
    sees it, under whichever triggerer runs it (bench/airflow_runtime.py)."""

    def __init__(self, conn_id: str, variable: str, requests: int) -> None:
        super().__init__()
        self.conn_id = conn_id
        self.variable = variable
        self.requests = requests

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("tests.airflow_triggers.LatencyTrigger",
                {"conn_id": self.conn_id, "variable": self.variable, "requests": self.requests})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        import time

        from airflow.sdk import BaseHook, Variable
        from asgiref.sync import sync_to_async

        connection_ms, variable_ms = [], []
        for _ in range(self.requests):
            t0 = time.perf_counter()
            BaseHook.get_connection(self.conn_id)
            t1 = time.perf_counter()
            await sync_to_async(Variable.get)(self.variable)
            t2 = time.perf_counter()
            connection_ms.append(round((t1 - t0) * 1000, 3))
            variable_ms.append(round((t2 - t1) * 1000, 3))
        yield TriggerEvent({"connection_ms": connection_ms, "variable_ms": variable_ms})


async def deadline_missed(marker: str, context: Any = None) -> str:
    """A deadline alert's ``AsyncCallback`` (``tests/airflow_asset_dags``): run by a
    triggerer in a ``CallbackTrigger``; appends the DAG run it was called for to ``marker``
    and returns what Airflow stores as the callback's output."""
    await asyncio.to_thread(_append, marker, f"{context!r}\n")
    return "deadline missed"


def _append(path: str, text: str) -> None:
    with open(path, "a") as out:
        out.write(text)


class TaskInstanceTrigger(BaseTrigger):
    """Fires with what it reads from ``self.task_instance`` (set by the triggerer) and its
    ``message`` (a templated field of ``StartsInTrigger``, rendered by the triggerer when the
    task starts from the trigger). ``hold`` as in ``RuntimeReadingTrigger``."""

    def __init__(self, message: str, hold: float = 0.0) -> None:
        super().__init__()
        self.message = message
        self.hold = hold

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("tests.airflow_triggers.TaskInstanceTrigger",
                {"message": self.message, "hold": self.hold})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        await asyncio.sleep(self.hold)
        ti = self.task_instance
        yield TriggerEvent({
            "message": self.message,
            "ti": None if ti is None else {
                "dag_id": ti.dag_id, "task_id": ti.task_id, "run_id": ti.run_id,
                "map_index": ti.map_index, "try_number": ti.try_number},
            # a RuntimeTaskInstance (start_from_trigger) carries its task; the DTO does not
            "task": getattr(getattr(ti, "task", None), "task_id", None),
        })


class StartsInTrigger(BaseOperator):
    """Starts in the triggerer (``start_from_trigger``, no worker) on ``TaskInstanceTrigger``
    with a templated ``message``; ``execute_complete`` returns the event (the XCom compared).
    With ``start_from_trigger=False`` a worker runs ``execute`` and defers to the same
    trigger with the message rendered by the worker."""

    template_fields = ("message",)
    start_trigger_args = StartTriggerArgs(
        trigger_cls="tests.airflow_triggers.TaskInstanceTrigger",
        trigger_kwargs={"message": "", "hold": 0.0}, next_method="execute_complete",
        next_kwargs=None, timeout=None)
    start_from_trigger = False

    def __init__(self, *, message: str, hold: float = 0.0, start_from_trigger: bool = True,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.message = message
        self.hold = hold
        self.start_from_trigger = start_from_trigger
        self.start_trigger_args = dataclasses.replace(
            self.start_trigger_args, trigger_kwargs={"message": message, "hold": hold})

    def execute(self, context: Any) -> None:
        self.defer(trigger=TaskInstanceTrigger(message=self.message, hold=self.hold),
                   method_name="execute_complete")

    def execute_complete(self, context: Any, event: Any = None) -> Any:
        return event


class LoggingTrigger(BaseTrigger):
    """Logs a line through its own logger (``self.log``, structlog), one through ``logging``
    and one naming a secret it masked (``mask_secret``), holds ``hold`` seconds (its task is
    deferred meanwhile), then fires with ``marker``."""

    def __init__(self, marker: str, secret: str, hold: float) -> None:
        super().__init__()
        self.marker, self.secret, self.hold = marker, secret, hold

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{__name__}.LoggingTrigger",
            {"marker": self.marker, "secret": self.secret, "hold": self.hold},
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        import logging

        from airflow.sdk.log import mask_secret

        self.log.info("trigger says %s", self.marker)
        logging.getLogger(__name__).warning("stdlib says %s", self.marker)
        mask_secret(self.secret)
        self.log.info("the secret is %s", self.secret)
        await asyncio.sleep(self.hold)
        yield TriggerEvent(self.marker)


class CountingFileTrigger(BaseEventTrigger):
    """An asset watcher that keeps a count in its asset's state store: when ``filepath``
    appears it deletes it, reads ``fires`` with the async accessor, writes it plus one with
    the sync one (through the greenback portal, as under Airflow's triggerer), and fires with
    the new count. The count lives in Airflow's database, so a second triggerer (triggerflow
    after ``airflow triggerer``) goes on from the first one's."""

    def __init__(self, filepath: str, poke_interval: float = 0.5) -> None:
        super().__init__()
        self.filepath = filepath
        self.poke_interval = poke_interval

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{__name__}.CountingFileTrigger",
                {"filepath": self.filepath, "poke_interval": self.poke_interval})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        while True:  # a poll, as FileDeleteTrigger's
            if os.path.exists(self.filepath):
                break
            await asyncio.sleep(self.poke_interval)
        os.remove(self.filepath)
        store = self.asset_state_store
        if store is None:
            raise RuntimeError("no asset_state_store given to the watcher")
        fires = int(await store.aget("fires", 0)) + 1  # type: ignore[arg-type]
        store.set("fires", fires)
        yield TriggerEvent({"fires": fires})
