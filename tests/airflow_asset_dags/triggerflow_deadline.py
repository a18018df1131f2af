"""A deadline alert whose callback runs on the triggerer: the DAG run's one task sleeps
past the deadline (5 s after the run was queued), so Airflow's scheduler creates a
``Callback`` row with a ``CallbackTrigger`` row (no queue, no task) for a triggerer to run
``tests.airflow_triggers.deadline_missed``. tests/test_airflow_assets.py runs it under
``airflow triggerer`` and under triggerflow (``--default-queue``)."""

from __future__ import annotations

import os
import time
from datetime import datetime, timedelta

from airflow.sdk import DAG, AsyncCallback, DeadlineAlert, DeadlineReference, task

MARKER = os.environ.get("TF_DEADLINE_MARKER", "/tmp/tf-deadline-marker")

with DAG("tf_deadline_missed", schedule=None, start_date=datetime(2026, 1, 1), catchup=False,
         # A retry absorbs a start the API server's one worker fails under load (a 400 on
         # the task's start after a minute, seen here); the tests compare what the runs did.
         default_args={"retries": 2, "retry_delay": timedelta(seconds=1)},
         deadline=DeadlineAlert(reference=DeadlineReference.DAGRUN_QUEUED_AT,
                                interval=timedelta(seconds=5),
                                callback=AsyncCallback("tests.airflow_triggers.deadline_missed",
                                                       kwargs={"marker": MARKER}))):

    @task
    def overruns() -> None:
        time.sleep(20)

    overruns()
