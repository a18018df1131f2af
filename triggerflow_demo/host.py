"""The host's side, for the demo: an Airflow-shaped operator and a resumer.

An operator defers in ``execute()`` by raising ``TaskDeferred`` (as Airflow's
``self.defer()`` does) and continues in ``execute_complete(context, event)``. The ``Host``
runs tasks, turns ``TaskDeferred`` into an SDK deferral, and resumes ``scheduled`` task
instances by calling their ``next_method`` — what Airflow's scheduler and workers do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from triggerflow.model import FAIL_METHOD, TaskKey, TaskState
from triggerflow.sdk import Deferral, TriggerflowClient
from triggerflow.store.postgres import Database
from triggerflow.store.postgres.admin import FINISH_TASKS, PICK_SCHEDULED
from triggerflow.triggers.base import BaseTrigger
from triggerflow.wire import decode_json, encode_json

log = logging.getLogger(__name__)


class TaskDeferred(Exception):
    def __init__(self, *, trigger: BaseTrigger, method_name: str,
                 kwargs: dict[str, Any] | None = None,
                 timeout: timedelta | float | None = None) -> None:
        super().__init__(f"deferred on {trigger!r}")
        self.trigger = trigger
        self.method_name = method_name
        self.kwargs = kwargs or {}
        self.timeout = timeout


class TaskFailure(Exception):
    """Raised by ``__fail__``: the trigger failed or timed out."""


class BaseOperator:
    """Minimal Airflow-like operator: ``execute``, ``defer``, ``execute_complete``."""

    queue: str = "default"

    def __init__(self, task_id: str, *, queue: str | None = None) -> None:
        self.task_id = task_id
        if queue:
            self.queue = queue

    def execute(self, context: dict[str, Any]) -> Any:
        raise NotImplementedError

    def defer(self, *, trigger: BaseTrigger, method_name: str = "execute_complete",
              kwargs: dict[str, Any] | None = None,
              timeout: timedelta | float | None = None) -> None:
        raise TaskDeferred(trigger=trigger, method_name=method_name, kwargs=kwargs,
                           timeout=timeout)

    def execute_complete(self, context: dict[str, Any], event: Any = None) -> Any:
        return event


class Host:
    """Runs operators and resumes them when their trigger has fired.

    ``operators`` maps (dag_id, task_id) to the operator; ``on_finish`` is told each final
    state (the demo counts them).
    """

    def __init__(self, client: TriggerflowClient, db: Database,
                 operators: dict[tuple[str, str], BaseOperator],
                 on_finish: Callable[[TaskKey, str, Any], None] | None = None) -> None:
        self.client = client
        self.db = db
        self.operators = operators
        self.on_finish = on_finish

    async def start(self, keys: list[TaskKey]) -> None:
        """Execute tasks; collect their deferrals into one batch ``defer_many``."""
        deferrals: list[Deferral] = []
        for key in keys:
            op = self.operators[(key.dag_id, key.task_id)]
            try:
                op.execute({"task": key})
            except TaskDeferred as d:
                deferrals.append(Deferral(key, d.trigger, op.queue, d.method_name, d.kwargs,
                                          d.timeout))
        await self.client.defer_many(deferrals)

    async def resume_forever(self, stop: asyncio.Event, interval: float = 0.05) -> None:
        while not stop.is_set():
            n = await self.resume_once()
            if n == 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(interval):
                        await stop.wait()

    async def resume_once(self, limit: int = 1000) -> int:
        rows = await self.db.fetch(PICK_SCHEDULED, limit)
        if not rows:
            return 0
        finished: tuple[list[int], list[str], list[str | None]] = ([], [], [])
        deferrals: list[Deferral] = []
        for row in rows:
            key = TaskKey(row["dag_id"], row["task_id"], row["run_id"], row["map_index"])
            op = self.operators.get((key.dag_id, key.task_id))
            kwargs = decode_json(row["next_kwargs"]) if row["next_kwargs"] else {}
            try:
                if op is None:
                    raise TaskFailure(f"no operator {key.dag_id}.{key.task_id} on this host")
                if row["next_method"] == FAIL_METHOD:
                    raise TaskFailure(f"{kwargs.get('error')}: {kwargs.get('message', '')}")
                result = getattr(op, row["next_method"] or "execute_complete")(
                    {"task": key}, **kwargs)
                state: str = TaskState.SUCCESS
            except TaskDeferred as d:
                assert op is not None
                deferrals.append(Deferral(key, d.trigger, op.queue, d.method_name, d.kwargs,
                                          d.timeout))
                continue
            except Exception as exc:
                state, result = TaskState.FAILED, {"error": str(exc)}
            finished[0].append(row["id"])
            finished[1].append(state)
            finished[2].append(encode_json(result))
            if self.on_finish:
                self.on_finish(key, state, result)
        if finished[0]:
            await self.db.execute(FINISH_TASKS, *finished)
        if deferrals:
            await self.client.defer_many(deferrals)
        return len(rows)
