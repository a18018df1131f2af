"""``python -m bench.airflow_seed N LEAD QUEUE [INSTANT]``: N deferred DateTimeSensorAsync
task instances with their trigger rows exactly as Airflow writes them, built with Airflow's
own code, in the metadata database of the environment (``AIRFLOW__*``, set by AirflowStack).

Run in a child process so that only it imports and configures Airflow. The instant is LEAD
seconds after the task instances exist and before they defer (the native burst's rule: the
deferral itself is inside the lead), or INSTANT (ISO 8601) when given. Prints one JSON line:
``{"run_id", "n", "instant", "create_s", "defer_s"}``.

How the rows are made, so that they are Airflow's and still take seconds for 10,000:

- the DAG (``BENCH_DAG``: one DateTimeSensorAsync mapped N ways) is parsed and stored by
  ``airflow dags reserialize`` (run by the caller), and the run and its N task instances are
  created by Airflow's ``SerializedDAG.create_dagrun``;
- the deferral is the sensor's own: ``DateTimeSensorAsync.execute`` raises ``TaskDeferred``,
  whose trigger and kwargs are encoded as the task runner's ``_defer_task`` does (serde), and
  the rows are written with the values the execution API's deferral route writes (trigger
  kwargs stored as that JSON, the task's queue since ``queues_enabled``, state ``deferred``,
  ``trigger_id``, ``next_method``, ``next_kwargs``, ``trigger_timeout``). Only the statement
  shape differs: one multi-row INSERT and a batched UPDATE instead of one API call per task.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from typing import Any

DAG_ID = "tf_bench_airflow"
TASK_ID = "wait"
# The bench's DAG file: {n} and {queue} are filled in by the caller before it is parsed.
BENCH_DAG = '''
from datetime import datetime

from airflow.providers.standard.sensors.date_time import DateTimeSensorAsync
from airflow.sdk import DAG

with DAG("{dag_id}", schedule=None, start_date=datetime(2026, 1, 1), catchup=False):
    DateTimeSensorAsync.partial(
        task_id="{task_id}", queue="{queue}", target_time="{{{{ dag_run.conf['instant'] }}}}",
    ).expand(poke_interval=[60.0] * {n})
'''


def bench_dag(n: int, queue: str) -> str:
    return BENCH_DAG.format(dag_id=DAG_ID, task_id=TASK_ID, queue=queue, n=n)


def seed(n: int, lead: float, queue: str, at: str | None = None) -> dict[str, Any]:
    from airflow.models.dagrun import DagRun
    from airflow.models.serialized_dag import SerializedDagModel
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.trigger import Trigger
    from airflow.providers.standard.sensors.date_time import DateTimeSensorAsync
    from airflow.sdk import timezone
    from airflow.sdk.exceptions import TaskDeferred
    from airflow.sdk.serde import serialize
    from airflow.utils.session import create_session
    from airflow.utils.state import DagRunState, TaskInstanceState
    from airflow.utils.types import DagRunTriggeredByType, DagRunType
    from sqlalchemy import insert, select, update

    t0 = time.monotonic()
    now = timezone.utcnow()
    run_id = f"bench_{n}_{now:%Y%m%dT%H%M%S}"
    with create_session() as session:
        dag = SerializedDagModel.get_dag(DAG_ID, session=session)
        if dag is None:
            raise RuntimeError(f"{DAG_ID} is not in the database (airflow dags reserialize?)")
        run = dag.create_dagrun(run_id=run_id, run_after=now, run_type=DagRunType.MANUAL,
                                triggered_by=DagRunTriggeredByType.TEST,
                                state=DagRunState.RUNNING, session=session)
    create_s = time.monotonic() - t0

    t1 = time.monotonic()
    instant = timezone.parse(at) if at else timezone.utcnow() + timedelta(seconds=lead)
    sensor = DateTimeSensorAsync(task_id=TASK_ID, target_time=instant.isoformat(), queue=queue)
    try:
        sensor.execute({})
    except TaskDeferred as deferred:
        defer = deferred
    else:
        raise RuntimeError("DateTimeSensorAsync.execute did not defer")
    classpath, trigger_kwargs = defer.trigger.serialize()
    kwargs_column = json.dumps(serialize(trigger_kwargs))  # the API route json.dumps the dict
    next_kwargs = serialize(defer.kwargs or {})
    timeout = now + defer.timeout if defer.timeout is not None else None

    with create_session() as session:
        session.execute(update(DagRun).where(DagRun.id == run.id)
                        .values(conf={"instant": instant.isoformat()}))
        ti_ids = list(session.scalars(
            select(TaskInstance.id).where(TaskInstance.dag_id == DAG_ID, TaskInstance.run_id == run_id,
                                          TaskInstance.task_id == TASK_ID)
            .order_by(TaskInstance.map_index)))
        if len(ti_ids) != n:
            raise RuntimeError(f"create_dagrun made {len(ti_ids)} task instances, not {n}")
        trigger_ids = list(session.scalars(
            insert(Trigger).returning(Trigger.id, sort_by_parameter_order=True),
            [{"classpath": classpath, "encrypted_kwargs": kwargs_column, "created_date": now,
              "queue": queue, "team_name": None}] * n))
        session.execute(update(TaskInstance), [
            {"id": ti_id, "state": TaskInstanceState.DEFERRED, "trigger_id": trigger_id,
             "next_method": defer.method_name, "next_kwargs": next_kwargs,
             "trigger_timeout": timeout, "try_number": 1, "start_date": now}
            for ti_id, trigger_id in zip(ti_ids, trigger_ids, strict=True)])
    return {"run_id": run_id, "n": n, "instant": instant.isoformat(), "create_s": create_s,
            "defer_s": time.monotonic() - t1}


if __name__ == "__main__":
    print(json.dumps(seed(int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], *sys.argv[4:5])))
