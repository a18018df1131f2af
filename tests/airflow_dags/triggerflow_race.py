"""The scheduler race DAG: triggers that fire the moment their task defers.

Each mapped DateTimeSensorAsync waits for a moment long past, so its DateTimeTrigger fires as
soon as a triggerer runs it: with triggerflow, milliseconds after the deferral, before Airflow's
scheduler may have seen the worker that deferred exit. tests/test_airflow_race.py asserts that
every instance still ends ``success`` (see docs/airflow-race.md).
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta

from airflow.providers.standard.sensors.date_time import DateTimeSensorAsync
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
