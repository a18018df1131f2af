"""Airflow's own event functions, applied in a process configured for one database.

``python -m tests.airflow_oracle '{"task": trigger_id, ...}'`` applies ``events_by_task()``
to those triggers with ``Trigger.submit_event`` / ``submit_failure`` (one session per event,
as Airflow's triggerer does), then ``Trigger.clean_unused``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import pendulum


def _boom() -> BaseException:
    try:
        raise RuntimeError("the trigger broke")
    except RuntimeError as exc:
        return exc


def events_by_task() -> dict[str, Any]:
    """One event of every kind, keyed by the task that receives it."""
    from airflow.triggers.base import (
        TaskFailedEvent,
        TaskSkippedEvent,
        TaskSuccessEvent,
        TriggerEvent,
    )

    moment = pendulum.datetime(2026, 11, 30, 12, 0, 0, 123456, tz="UTC")
    return {
        "resume": TriggerEvent(moment),
        "resume_dict": TriggerEvent({"status": "ok", "at": moment, "n": [1, 2.5, None]}),
        "resume_kwargs": TriggerEvent("plain"),
        "fail": _boom(),
        "success_xcom": TaskSuccessEvent(xcoms={"return_value": {"rows": 3}, "extra": "x"}),
        "success": TaskSuccessEvent(),
        "failed": TaskFailedEvent(xcoms={"why": [1, 2]}),
        # may retry (try 1 of max_tries 1): Airflow's handler decides, with the DAG it finds
        "failed_retry": TaskFailedEvent(xcoms={"why": "again"}),
        "skipped": TaskSkippedEvent(),
    }


def main(tasks: dict[str, int]) -> None:
    from airflow.models.trigger import Trigger
    from airflow.utils.session import create_session

    for name, event in events_by_task().items():
        with create_session() as session:
            if isinstance(event, BaseException):
                Trigger.submit_failure(tasks[name], event, session=session)
            else:
                Trigger.submit_event(tasks[name], event, session=session)
    with create_session() as session:
        Trigger.clean_unused(session=session)


def serialize_dag(dag_id: str, retrying_task: str) -> None:
    """Store a serialized version of the DAG in which ``retrying_task`` has one retry (Airflow's
    handler reads it to decide whether a failed task retries)."""
    from airflow.models.serialized_dag import SerializedDagModel
    from airflow.providers.standard.operators.empty import EmptyOperator
    from airflow.sdk import DAG
    from airflow.serialization.serialized_objects import LazyDeserializedDAG
    from airflow.utils.session import create_session

    with DAG(dag_id, schedule=None) as dag:
        EmptyOperator(task_id=retrying_task, retries=1)
    with create_session() as session:
        SerializedDagModel.write_dag(LazyDeserializedDAG.from_dag(dag), bundle_name="dags-folder",
                                     session=session)


def apply_with_triggerflow_orm(dsn: str, events_json: str) -> None:
    """triggerflow's ORM path (orm.apply_with_airflow), in a process configured for ``dsn``."""
    from triggerflow.airflow.events import AirflowEvent
    from triggerflow.airflow.orm import apply_with_airflow

    events = [AirflowEvent(**e) for e in json.loads(events_json)]
    moved = apply_with_airflow(dsn, events, "default")
    print(json.dumps([e.trigger_id for e in moved]))


if __name__ == "__main__":
    if sys.argv[1] == "--serialize-dag":
        serialize_dag(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "--triggerflow-orm":
        apply_with_triggerflow_orm(sys.argv[2], sys.argv[3])
    else:
        main(json.loads(sys.argv[1]))
