"""``start_from_trigger`` tasks: Airflow's scheduler writes their trigger rows itself (no
worker runs first, the row has no queue) and the triggerer renders their templated trigger
kwargs. Triggered by tests/test_airflow_start_from_trigger.py, once under ``airflow
triggerer`` and once under triggerflow, which compares the two.

- ``fixed``: DateTimeSensorAsync with a fixed ``target_time`` (in the past: fires at once).
- ``templated``: DateTimeSensorAsync, ``target_time`` a template WAIT seconds after the run.
- ``templated_end``: the same on queue team-ml, ``end_from_trigger`` (no worker at all).
- ``time_sensor``: TimeSensor(deferrable=True, start_from_trigger=True).
- ``reads_ti``: a trigger reading ``self.task_instance`` with a templated field, started in
  the trigger (its XCom is what the trigger read: the rendered message, the task instance).
- ``reads_ti_worker``: the same trigger, deferred from a worker (Airflow gives it the task
  instance too, without its task).
"""

from __future__ import annotations

import os
from datetime import datetime, time

from airflow.providers.standard.sensors.date_time import DateTimeSensorAsync
from airflow.providers.standard.sensors.time import TimeSensor
from airflow.sdk import DAG

from tests.airflow_triggers import StartsInTrigger

WAIT = int(os.environ.get("TF_START_WAIT_SECONDS", "15"))
AT = "{{ (dag_run.run_after + macros.timedelta(seconds=" + str(WAIT) + ")).isoformat() }}"
MESSAGE = "run {{ run_id }} of {{ dag.dag_id }}, try {{ ti.try_number }}"

with DAG(
    "tf_start_from_trigger",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    default_args={"retries": 0},
):
    DateTimeSensorAsync(task_id="fixed", target_time="2026-01-01T00:00:00+00:00", start_from_trigger=True)
    DateTimeSensorAsync(task_id="templated", target_time=AT, start_from_trigger=True)
    DateTimeSensorAsync(
        task_id="templated_end",
        target_time=AT,
        start_from_trigger=True,
        end_from_trigger=True,
        queue="team-ml",
    )
    TimeSensor(task_id="time_sensor", target_time=time(0, 0), deferrable=True, start_from_trigger=True)
    StartsInTrigger(task_id="reads_ti", message=MESSAGE, hold=WAIT)
    StartsInTrigger(task_id="reads_ti_worker", message=MESSAGE, hold=WAIT, start_from_trigger=False)
