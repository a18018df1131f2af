"""The e2e DAGs: every kind of deferral the Airflow mode must serve, with unchanged Airflow
operators. Triggered by tests/test_airflow_e2e.py, which asserts the states below.

``tf_e2e_succeeds`` (the run ends ``success``): DateTimeSensorAsync, TimeDeltaSensorAsync with
``end_from_trigger=True`` (the trigger ends the task, no worker), a deferrable FileSensor (the
test creates the file once the sensor waits), and a mapped DateTimeSensorAsync of 20
instances on each of two team queues.

``tf_e2e_fails`` (the run ends ``failed``): a trigger that raises (the task fails through
Airflow's ``__fail__`` resume) and a deferral that times out (the scheduler times it out).
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta

from airflow.providers.standard.sensors.date_time import DateTimeSensorAsync
from airflow.providers.standard.sensors.filesystem import FileSensor
from airflow.providers.standard.sensors.time_delta import TimeDeltaSensorAsync
from airflow.sdk import DAG

from tests.airflow_triggers import DeferToRaisingTrigger

# Each timer fires WAIT seconds after its own task started (``ti.start_date``), not after the
# run started: on a loaded 2-core machine the last of these 45 tasks started 36 s after the
# run. The margin must cover the task deferring (DAG parse included: up to 8 s measured) and
# the scheduler seeing the worker exit after it deferred: Airflow 3.3.2's scheduler fails a
# task whose trigger fired and which was queued again before that exit event was processed
# ("task-state-changed-externally"); that lag reached 5 s here. The test checks it saw every
# instance deferred.
WAIT = int(os.environ.get("TF_E2E_WAIT_SECONDS", "20"))
# TimeDeltaSensorAsync counts from the run's start (run_after) and returns at once, without
# deferring, when that time has passed when it starts: it gets a longer delta.
DELTA = 3 * WAIT
LATER = WAIT  # the raising trigger and the timeout, after the deferral
TEAMS = ("team-ml", "team-data-eng")
MAPPED = 20
AT = "{{ (ti.start_date + macros.timedelta(seconds=" + str(WAIT) + ")).isoformat() }}"

with DAG("tf_e2e_succeeds", schedule=None, start_date=datetime(2026, 1, 1), catchup=False,
         max_active_tasks=64, default_args={"retries": 0}):
    DateTimeSensorAsync(task_id="datetime_sensor", target_time=AT)
    TimeDeltaSensorAsync(task_id="timedelta_sensor_end_from_trigger",
                         delta=timedelta(seconds=DELTA), end_from_trigger=True)
    FileSensor(task_id="file_sensor", filepath="{{ dag_run.conf['path'] }}", deferrable=True,
               poke_interval=1)
    for team in TEAMS:
        # Mapped over a harmless argument: the partial target_time is templated like any other.
        DateTimeSensorAsync.partial(task_id=f"mapped_{team.replace('-', '_')}", queue=team,
                                    target_time=AT).expand(poke_interval=[60.0] * MAPPED)

with DAG("tf_e2e_fails", schedule=None, start_date=datetime(2026, 1, 1), catchup=False,
         default_args={"retries": 0}):
    DeferToRaisingTrigger(task_id="raising_trigger", raise_after=LATER)
    TimeDeltaSensorAsync(task_id="deferral_times_out", delta=timedelta(hours=1), timeout=LATER)
