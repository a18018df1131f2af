"""What Airflow's users look at (tests/test_airflow_ops_e2e.py): a deferred task's trigger
logs, and the triggerer's health.

``tf_ops_logs``: a trigger logs through its own logger and ``logging``, masks a secret and
logs it, holds ``HOLD`` seconds (its task deferred), then fires.
``tf_ops_unserved``: the same on a queue no consumer serves until the test starts one.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import DAG

from tests.airflow_triggers import DeferToTrigger

QUEUE, UNSERVED = "tf-ops", "tf-ops-unserved"
MARKER, SECRET = "tf-ops-marker-7c1e", "tf-ops-secret-93ab"
HOLD = 45.0  # long enough to read the log through the API while deferred, under load
START = datetime(2026, 1, 1)
# One retry: under load the single API server worker can time out a task's start (as in
# tests/airflow_dags/triggerflow_race.py); the test reads the log of the try that deferred.
ARGS = {"retries": 1, "retry_delay": timedelta(seconds=2)}

with DAG(
    "tf_ops_logs", schedule=None, start_date=START, catchup=False, default_args={**ARGS, "queue": QUEUE}
):
    DeferToTrigger(
        task_id="logs",
        trigger="LoggingTrigger",
        trigger_kwargs={"marker": MARKER, "secret": SECRET, "hold": HOLD},
    )

with DAG(
    "tf_ops_unserved",
    schedule=None,
    start_date=START,
    catchup=False,
    default_args={**ARGS, "queue": UNSERVED},
):
    DeferToTrigger(
        task_id="waits",
        trigger="LoggingTrigger",
        trigger_kwargs={"marker": MARKER, "secret": SECRET, "hold": 1.0},
    )
