"""Event-driven scheduling from a RabbitMQ queue, the example of docs/airflow-reference.md:
``RabbitMQQueueTrigger`` (``triggerflow/airflow/rabbitmq.py``) makes each message of the
queue one asset event, acked only once that event is committed, and each asset event
schedules a run of the DAG. The broker is the Airflow connection ``tf_rabbitmq``; the queue's
name comes from the environment the stack's processes share (``TF_ASSET_QUEUE``).
tests/test_airflow_assets.py runs it under ``airflow triggerer`` and under triggerflow.
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta

from airflow.sdk import DAG, Asset, AssetWatcher, task

from triggerflow.airflow.rabbitmq import RabbitMQQueueTrigger

QUEUE = os.environ.get("TF_ASSET_QUEUE", "tf-asset-source")

orders = Asset("tf_rabbitmq_orders", watchers=[
    AssetWatcher(name="tf_orders_queue",
                 trigger=RabbitMQQueueTrigger(queue=QUEUE, conn_id="tf_rabbitmq")),
])

with DAG("tf_rabbitmq_scheduled", schedule=[orders], start_date=datetime(2026, 1, 1),
         catchup=False, default_args={"retries": 2, "retry_delay": timedelta(seconds=1)}):

    @task
    def read_orders(**context: object) -> list[str]:
        """The bodies of the messages behind this run (the asset events' payloads)."""
        events = context["triggering_asset_events"]
        return [event.extra["payload"]["body"]  # type: ignore[attr-defined]
                for batch in events.values() for event in batch]  # type: ignore[attr-defined]

    read_orders()
