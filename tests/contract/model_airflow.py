"""The Airflow store as a system for the model-based test (``test_model.py``): Airflow mode's
store over a copy of the migrated Airflow template database, its rows seeded as Airflow's API
server writes them (``tests.airflow_support``), read back in the model's terms.

Where Airflow mode legitimately differs from the model (``triggerflow.airflow.mode``'s
``Capabilities``, ``docs/airflow-reference.md``), ``DIFFERENCES`` names the machine's rules
this system does not run, each with its reason; ``content``, ``canonical_task`` and
``rows`` map what Airflow stores differently (its trigger class and kwargs, its way of failing
a task) to one form both sides share. Everything else is compared as for the other stores.
"""

from __future__ import annotations

import re
import time
from typing import Any

import asyncpg

from tests import airflow_support as af
from tests.contract.airflow_backend import DATETIME_TRIGGER
from tests.contract.backends import CLASSPATH, NEXT_KWARGS, _shift
from tests.contract.model_systems import Rows, sql_rows
from triggerflow.airflow.schema import SCHEMA
from triggerflow.airflow.store import AirflowStore
from triggerflow.model import FAIL_METHOD, FailureReason
from triggerflow.store import Store

MODEL_KWARGS = {"x": 1}  # what the model's seeded triggers decode to (backends._deferral)

# Rule of StoreMachine -> why it does not run against the Airflow store.
DIFFERENCES = {
    "cancel": "Airflow mode serves no DeferralStore: tasks are cleared or marked through "
              "Airflow (store.roles; the contract cases skip cancel there too)",
    "time_out_orphans": "Airflow's scheduler times deferred tasks out; the store's "
                        "time_out_orphans does nothing (Capabilities.times_out_orphans=False)",
    "sweep_cancelled": "the sweep reads Airflow's cancel log (Capabilities.cancel_signal): a "
                       "superset of what the owner runs, dropping no trigger, where the model "
                       "drops its owner's triggers whose task ended",
    "forget": "forget follows the sweep for triggers whose task ended; Airflow mode drops only "
              "triggerflow's bookkeeping (the trigger row is Airflow's), so on a trigger whose "
              "task still waits, as here, Airflow claims it afresh where the model has none",
    "attempt 0": "triggerflow's bookkeeping row of an Airflow trigger is made by its first "
                 "claim: an event or strike of attempt 0 (which no consumer can fire) finds "
                 "none, where the model's unclaimed trigger is at attempt 0",
    "end_task_by_hand": "Airflow's claim, take-over and fence take only rows a deferred task "
                        "waits on (test_an_airflow_trigger_without_a_deferred_task_is_never_"
                        "claimed); the model serves them until the sweep, which Airflow mode "
                        "replaces by its cancel log (see sweep_cancelled)",
}

# Airflow's trigger rows in the model's terms: a row with no bookkeeping yet was never claimed
# (attempt 0). Compared are the rows a task instance still refers to, and quarantined ones:
# Airflow detaches a task failed by quarantine from its row, the model keeps the row.
_ROWS = f"""
SELECT
  (SELECT coalesce(json_agg(json_build_object(
       'id', t.id, 'owner_id', s.owner_id, 'attempt', coalesce(s.attempt, 0),
       'failures', coalesce(s.failures, 0), 'q', s.quarantined_at IS NOT NULL,
       'blocked_attempts', coalesce(s.blocked_attempts, '{{}}'),
       'rejected_by', coalesce(s.rejected_by, '{{}}'))), '[]')
   FROM "trigger" t LEFT JOIN {SCHEMA}.trigger_state s ON s.trigger_id = t.id
   WHERE s.quarantined_at IS NOT NULL
      OR EXISTS (SELECT 1 FROM task_instance ti WHERE ti.trigger_id = t.id))::text AS triggers,
  (SELECT coalesce(json_agg(json_build_object(
       'task_id', task_id, 'state', state, 'next_method', next_method,
       'next_kwargs', next_kwargs)), '[]') FROM task_instance)::text AS tasks,
  (SELECT coalesce(json_agg(id), '[]') FROM {SCHEMA}.consumer)::text AS processes
"""

_SHIFTS = (
    _shift(f"{SCHEMA}.consumer", "registered_at", "renewed_at", "expires_at"),
    _shift(f"{SCHEMA}.trigger_state", "claimed_at", "published_at", "quarantined_at"),
    _shift('"trigger"', "created_date"),
    _shift("task_instance", "updated_at", "start_date"),
)

# Why each store failed a task, from its next_kwargs: the model names the reason in "error"
# ("Trigger quarantined", "Trigger could not be loaded"); Airflow mode fails as Airflow's
# Trigger.submit_failure does ("Trigger failure") with the reason in the traceback's text.
_AIRFLOW_REASONS = (
    ("triggerflow quarantined this trigger", FailureReason.TRIGGER_QUARANTINED),
    ("triggerflow could not load this trigger", FailureReason.TRIGGER_UNLOADABLE),
)


def failure_reason(next_kwargs: Any) -> Any:
    """The reason a store failed a task (``__fail__``), or the failing event's payload as it
    is (an event of kind ``fail`` writes its payload as next_kwargs on every store)."""
    if not isinstance(next_kwargs, dict):
        return next_kwargs
    error = next_kwargs.get("error")
    if error in (FailureReason.TRIGGER_QUARANTINED, FailureReason.TRIGGER_UNLOADABLE):
        return ("failed by the store", str(error))
    traceback = next_kwargs.get("traceback")
    if error == FailureReason.TRIGGER_FAILURE and isinstance(traceback, list) and traceback:
        for prefix, reason in _AIRFLOW_REASONS:
            if str(traceback[0]).startswith(prefix):
                return ("failed by the store", str(reason))
    return next_kwargs


class AirflowSystem:
    """Airflow mode's store (``AirflowStore``) on a database of its own, with an admin
    connection for seeding, moving time and reading rows back."""

    name = "airflow"
    differences = DIFFERENCES

    def __init__(self, dsn: str, store: AirflowStore, admin: asyncpg.Connection,
                 kwargs: str, decoded: Any) -> None:
        self.dsn = dsn
        self.airflow = store
        self.store: Store = store  # type: ignore[assignment]  # the rules it runs only
        self.admin = admin
        self._kwargs = kwargs  # one encrypted value for every trigger (decoded once)
        self._decoded = decoded
        self._synced = time.time()

    @classmethod
    async def open(cls, database: str) -> AirflowSystem:
        from triggerflow.airflow.kwargs import decode_kwargs, encrypt_kwargs

        dsn = af.dsn_of(database)
        await af.prepare(dsn)  # triggerflow's schema, then the DAG run tasks defer in
        admin = await asyncpg.connect(dsn)
        kwargs = encrypt_kwargs({"moment": "2030-01-01T00:00:00+00:00"})
        return cls(dsn, await AirflowStore.connect(dsn, max_size=2), admin, kwargs,
                   decode_kwargs(kwargs, DATETIME_TRIGGER))

    async def reset(self) -> None:
        # The DAG run stays; Airflow's rows the steps write (task ends' callbacks and XComs)
        # and triggerflow's go, ids restarting (the machine maps them anyway).
        await self.admin.execute(
            f'TRUNCATE "trigger", task_instance, callback, xcom, {SCHEMA}.consumer, '
            f"{SCHEMA}.trigger_state, {SCHEMA}.cancel_log RESTART IDENTITY CASCADE")
        self.airflow.watchers.clear()
        self._synced = time.time()

    async def defer(self, name: str, queue: str, timeout: float) -> int:
        # timeout: Airflow's scheduler times deferred tasks out (DIFFERENCES["time_out_orphans"])
        task = await af.add_deferred_task(self.admin, name, DATETIME_TRIGGER, self._kwargs,
                                          queue=queue, next_kwargs=NEXT_KWARGS)
        return task.trigger_id

    async def settle(self) -> None:
        """After an apply: the writer's clean-up of the batch's unused trigger rows, at once
        (the store runs it after a quiet moment, which would land at a random later step)."""
        await self.airflow.unused.flush()

    async def travel(self, seconds: float) -> None:
        now = time.time()
        spent, self._synced = now - self._synced, now
        await self.admin.execute(";".join(
            statement.replace("$1", repr(float(seconds - spent))) for statement in _SHIFTS))

    async def end_task(self, name: str, state: str) -> None:
        await self.admin.execute("UPDATE task_instance SET state = $1 WHERE task_id = $2",
                                 state, name)

    def content(self, classpath: str, kwargs: Any, task: str | None) -> tuple[Any, Any, Any]:
        """A claimed trigger's class, kwargs and task in the model's terms: the rows seeded
        here are an Airflow DateTimeTrigger of an Airflow DAG run, the model's a test class."""
        if classpath == DATETIME_TRIGGER:
            classpath = CLASSPATH
        if kwargs == self._decoded:
            kwargs = MODEL_KWARGS
        if task is not None:
            task = re.sub(rf"^{af.DAG_ID}\.(.*)@{af.RUN_ID}$", r"dag.\1@run", task)
        return classpath, kwargs, task

    @staticmethod
    def canonical_task(state: str | None, next_method: str | None,
                       next_kwargs: Any) -> tuple[Any, Any, Any]:
        """A task row in the form both sides are compared in (applied to the model's too)."""
        if next_method == FAIL_METHOD:
            return state, next_method, failure_reason(next_kwargs)
        if state in ("success", "failed", "skipped"):
            # Airflow's TaskInstance.set_state keeps the deferral's next_method/next_kwargs;
            # the model clears them. The state is what the event decided.
            return state, None, None
        return state, next_method, next_kwargs

    async def rows(self) -> Rows:
        return await sql_rows(self.admin, _ROWS)

    async def close(self) -> None:
        await self.airflow.close()
        await self.admin.close()
