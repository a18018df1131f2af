"""DAGs whose tasks' ends must stop their triggers (tests/test_airflow_cancel_e2e.py): each
task defers on a ``MarkerTrigger`` that never fires. ``tf_cancel_timeout``'s deferral times
out after 5 s (the scheduler fails it); the test clears, marks success, marks failed
``tf_cancel_hand``'s tasks and deletes ``tf_cancel_delete``'s run while they are deferred.
The marker folder is ``TF_CANCEL_MARKERS`` (set by the test for every process)."""

from __future__ import annotations

import os
from datetime import datetime, timedelta

from airflow.sdk import DAG

from tests.airflow_cancel_triggers import DeferToMarker

FOLDER = os.environ.get("TF_CANCEL_MARKERS", "/tmp/tf-cancel-markers")
QUEUE = "tf-cancel"  # a queue of its own (see triggerflow_runtime.py)
# Retries: under load a task can fail to start (its first execution-API call times out, the
# scheduler then fails it while queued); a retry absorbs that. A timed-out task retries too,
# and times out again.
ARGS = {"retries": 2, "retry_delay": timedelta(seconds=2), "queue": QUEUE}
START = datetime(2026, 1, 1)

with DAG("tf_cancel_timeout", schedule=None, start_date=START, catchup=False, default_args=ARGS):
    DeferToMarker(task_id="timeout", folder=FOLDER, timeout_seconds=5)

with DAG("tf_cancel_hand", schedule=None, start_date=START, catchup=False, default_args=ARGS):
    for task_id in ("clear", "mark_success", "mark_failed"):
        DeferToMarker(task_id=task_id, folder=FOLDER)

with DAG("tf_cancel_delete", schedule=None, start_date=START, catchup=False, default_args=ARGS):
    DeferToMarker(task_id="delete", folder=FOLDER)
