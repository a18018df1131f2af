"""The scheduler race DAG: triggers that fire the moment their task defers.

Each mapped DateTimeSensorAsync waits for a moment long past, so its DateTimeTrigger fires as
soon as a triggerer runs it: with triggerflow, milliseconds after the deferral, before Airflow's
scheduler may have seen the worker that deferred exit. tests/test_airflow_race.py asserts that
every instance still ends ``success`` (see docs/airflow-race.md).

TF_RACE_GROUPS="W:N,..." adds one DAG per W, ``tf_race_wait_W``, of N mapped sensors whose
triggers fire W seconds after their deferral (``triggerflow bench airflow-waits``).
"""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from typing import Any

from airflow.providers.standard.sensors.date_time import DateTimeSensorAsync
from airflow.providers.standard.triggers.temporal import DateTimeTrigger
from airflow.sdk import DAG

RACERS = int(os.environ.get("TF_RACE_TASKS", "100"))
PAST = "2000-01-01T00:00:00+00:00"
# TF_RACE_WAIT=S: each trigger fires S seconds after its task started (a short wait), not at once.
WAIT = int(os.environ.get("TF_RACE_WAIT", "0"))
MOMENT = f"{{{{ macros.datetime.utcnow() + macros.timedelta(seconds={WAIT}) }}}}" if WAIT else PAST

with DAG("tf_race_fires_at_once", schedule=None, start_date=datetime(2026, 1, 1),
         catchup=False, max_active_tasks=RACERS,
         # A retry absorbs a start that fails for another reason (the one API server worker
         # timing out under load); the test counts the race's failures in the log table.
         default_args={"retries": 1, "retry_delay": timedelta(seconds=1)}):
    # Mapped over a harmless argument, as the e2e DAG's team sensors.
    DateTimeSensorAsync.partial(task_id="fires_at_once", target_time=MOMENT).expand(
        poke_interval=[60.0] * RACERS)


class WaitAfterDeferral(DateTimeSensorAsync):
    """Defers to a moment ``wait`` seconds from now, taken in ``execute`` just before the
    deferral (not when the template is rendered at the task's start): the trigger fires
    ``wait`` seconds after its deferral however long the task took to start."""

    def __init__(self, *, wait: int = 0, **kwargs: Any) -> None:
        super().__init__(target_time=PAST, **kwargs)
        self.wait = wait

    def execute(self, context: Any) -> None:  # type: ignore[override]
        moment = datetime.now(UTC) + timedelta(seconds=self.wait)
        self.defer(method_name="execute_complete",
                   trigger=DateTimeTrigger(moment=moment, end_from_trigger=False))


for group in filter(None, os.environ.get("TF_RACE_GROUPS", "").split(",")):
    wait, tasks = (int(x) for x in group.split(":"))
    with DAG(f"tf_race_wait_{wait}", schedule=None, start_date=datetime(2026, 1, 1),
             catchup=False, max_active_tasks=tasks,
             default_args={"retries": 1, "retry_delay": timedelta(seconds=1)}):
        WaitAfterDeferral.partial(task_id="waits", wait=wait).expand(
            poke_interval=[60.0] * tasks)
