"""Event-driven scheduling: a DAG scheduled on an asset whose watcher is a trigger.

``FileDeleteTrigger`` (providers-standard) fires once when its file appears, deletes it and
ends; Airflow's triggerer then starts it again from its row, so each new file is one more
asset event and one more DAG run. The trigger row has no queue (asset watchers never have):
``airflow triggerer`` without ``--queues`` serves it, or triggerflow with ``--default-queue``.
tests/test_airflow_assets.py runs it both ways. The file's path comes from the environment
the stack's processes share (``TF_ASSET_FLAG``).

``DirectoryFileDeleteTrigger`` does the same for a file name in a directory
(``TF_ASSET_INBOX``), on a directory scan shared by every such watcher of the directory
(``shared_stream_key``), under Airflow's triggerer and under triggerflow alike.

``CountingFileTrigger`` (tests/airflow_triggers.py) counts its fires in its asset's state
store (``asset_state_store``, which the triggerer gives a watcher), file ``TF_ASSET_COUNTED``.
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta

from airflow.providers.standard.triggers.file import DirectoryFileDeleteTrigger, FileDeleteTrigger
from airflow.sdk import DAG, Asset, AssetWatcher, task

from tests.airflow_triggers import CountingFileTrigger

FLAG = os.environ.get("TF_ASSET_FLAG", "/tmp/tf-asset-flag")
INBOX = os.environ.get("TF_ASSET_INBOX", "/tmp/tf-asset-inbox")
COUNTED = os.environ.get("TF_ASSET_COUNTED", "/tmp/tf-asset-counted")


def scheduled_on(asset: Asset, dag_id: str, task_id: str) -> DAG:
    """A DAG run by each event of ``asset``; its task returns how many asset events
    triggered the run."""
    with DAG(dag_id, schedule=[asset], start_date=datetime(2026, 1, 1), catchup=False,
             # A retry absorbs a start the API server's one worker fails under load (a 400
             # on the task's start after a minute, seen here); the tests compare what the
             # runs did.
             default_args={"retries": 2, "retry_delay": timedelta(seconds=1)}) as dag:

        @task(task_id=task_id)
        def consume(**context: object) -> int:
            events = context["triggering_asset_events"]
            return sum(len(v) for v in events.values())  # type: ignore[attr-defined]

        consume()
    return dag


flag_dag = scheduled_on(Asset("tf_asset_flag", watchers=[
    AssetWatcher(name="tf_flag_watcher", trigger=FileDeleteTrigger(filepath=FLAG,
                                                                   poke_interval=0.5)),
]), "tf_asset_scheduled", "consume_event")

inbox_dag = scheduled_on(Asset("tf_asset_inbox", watchers=[
    AssetWatcher(name="tf_inbox_watcher", trigger=DirectoryFileDeleteTrigger(
        directory=INBOX, filename="go", poke_interval=0.5)),
]), "tf_asset_inbox_scheduled", "consume_inbox_event")

counted_dag = scheduled_on(Asset("tf_asset_counted", watchers=[
    AssetWatcher(name="tf_counted_watcher", trigger=CountingFileTrigger(filepath=COUNTED)),
]), "tf_asset_counted_scheduled", "consume_counted_event")
