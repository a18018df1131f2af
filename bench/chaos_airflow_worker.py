"""``python -m bench.chaos_airflow_worker RUN_ID``: the Airflow side of ``triggerflow bench
chaos --mode airflow``, the process that plays Airflow's workers and users against the
metadata database (its environment is the stack's ``AIRFLOW__*``).

It creates the run of the chaos DAG (``CHAOS_DAG``, stored by ``airflow dags reserialize``):
every task instance the schedule will defer, with Airflow's ``create_dagrun``. Then it reads
one JSON request a line and answers each on a line starting ``CHAOS `` (Airflow's own log
lines may share stdout), several at a time in threads:

- ``defer``: the deferral a task's try makes, written as the execution API's deferral route
  writes it (a ``Trigger`` row with the serde'd kwargs as its JSON text, the task instance
  ``deferred`` on it with ``next_method``, the serde'd ``next_kwargs`` and the task's queue on
  the trigger row). A task that ran before is first cleared by Airflow's
  ``clear_task_instances`` (a TaskInstanceHistory row, a new task instance id) and defers on
  its next try (``try_number`` + 1), in the same transaction;
- ``cancel``: the task marked ``failed`` (``TaskInstance.set_state``, as marking it by hand
  does) if it is still deferred on that trigger; ``moved`` says whether it was.

A request that meets a PostgreSQL restart or a closed connection is tried again for up to
``RETRY`` seconds, each time in a new transaction.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

DAG_ID = "tf_chaos"
RETRY = 25.0  # seconds a request is tried again through a restart
THREADS = 8  # requests in flight: one waiting on a locked row holds up no other
# The chaos DAG: one mapped sensor per team queue, as many map indexes as the schedule has
# tasks of that team (filled in by the caller before it is parsed).
CHAOS_DAG = '''
from datetime import datetime

from airflow.providers.standard.sensors.date_time import DateTimeSensorAsync
from airflow.sdk import DAG

with DAG("{dag_id}", schedule=None, start_date=datetime(2026, 1, 1), catchup=False):
    for team, queue, n in {teams!r}:
        DateTimeSensorAsync.partial(
            task_id=f"wait_{{team}}", queue=queue, target_time="2026-01-01T00:00:00+00:00",
        ).expand(poke_interval=[60.0] * n)
'''

_out = threading.Lock()


def chaos_dag(teams: list[tuple[str, str, int]]) -> str:
    """The DAG file for ``(team, queue, tasks)`` per team."""
    return CHAOS_DAG.format(dag_id=DAG_ID, teams=teams)


def _say(obj: dict[str, Any]) -> None:
    with _out:
        sys.stdout.write("CHAOS " + json.dumps(obj) + "\n")
        sys.stdout.flush()


def create_run(run_id: str) -> int:
    from airflow.models.serialized_dag import SerializedDagModel
    from airflow.sdk import timezone
    from airflow.utils.session import create_session
    from airflow.utils.state import DagRunState
    from airflow.utils.types import DagRunTriggeredByType, DagRunType

    with create_session() as session:
        dag = SerializedDagModel.get_dag(DAG_ID, session=session)
        if dag is None:
            raise RuntimeError(f"{DAG_ID} is not in the database (airflow dags reserialize?)")
        run = dag.create_dagrun(run_id=run_id, run_after=timezone.utcnow(),
                                run_type=DagRunType.MANUAL,
                                triggered_by=DagRunTriggeredByType.TEST,
                                state=DagRunState.RUNNING, session=session)
        return len(run.get_task_instances(session=session))


def _task(session: Any, run_id: str, task_id: str, map_index: int) -> Any:
    from airflow.models.taskinstance import TaskInstance as TI
    from sqlalchemy import select

    return session.scalars(select(TI).where(
        TI.dag_id == DAG_ID, TI.run_id == run_id, TI.task_id == task_id,
        TI.map_index == map_index).with_for_update()).one()


def defer(run_id: str, req: dict[str, Any]) -> dict[str, Any]:
    from airflow.models.taskinstance import TaskInstance as TI
    from airflow.models.taskinstance import clear_task_instances
    from airflow.models.trigger import Trigger
    from airflow.providers.standard.triggers.temporal import DateTimeTrigger
    from airflow.sdk import timezone
    from airflow.sdk.serde import serialize
    from airflow.utils.session import create_session
    from airflow.utils.state import TaskInstanceState
    from sqlalchemy import update

    from bench.chaos_airflow_trigger import ChaosWait

    with create_session() as session:
        ti = _task(session, run_id, req["task_id"], req["map_index"])
        cleared = ti.state is not None
        if cleared:  # its next try: cleared as Airflow clears, then run again and deferred
            clear_task_instances([ti], session, dag_run_state=False)
            session.flush()
        due = req["due"]  # the parent's: a request that waited keeps its moment
        trigger = (DateTimeTrigger(moment=datetime.fromtimestamp(due, UTC))
                   if req["kind"] == "timer" else ChaosWait(due, req["d"], end=req["kind"] == "end"))
        classpath, kwargs = trigger.serialize()
        row = Trigger(classpath=classpath, kwargs={}, queue=ti.queue, team_name=None)
        row.encrypted_kwargs = json.dumps(serialize(kwargs))  # the route json.dumps the dict
        session.add(row)
        session.flush()
        session.execute(update(TI).where(TI.id == ti.id).values(
            state=TaskInstanceState.DEFERRED, trigger_id=row.id, next_method="execute_complete",
            next_kwargs=serialize({"d": req["d"]}), trigger_timeout=None,
            try_number=(ti.try_number or 0) + 1, start_date=timezone.utcnow(),
            end_date=None))  # as the try's start (the execution API's ti_run) clears it
        trigger_id = int(row.id)
    return {"trigger_id": trigger_id, "cleared": cleared}


def cancel(run_id: str, req: dict[str, Any]) -> dict[str, Any]:
    from airflow.utils.session import create_session
    from airflow.utils.state import TaskInstanceState

    with create_session() as session:
        ti = _task(session, run_id, req["task_id"], req["map_index"])
        if ti.state != TaskInstanceState.DEFERRED or ti.trigger_id != req["trigger_id"]:
            return {"moved": False}
        ti.set_state(TaskInstanceState.FAILED, session=session)
    return {"moved": True}


def handle(run_id: str, req: dict[str, Any]) -> None:
    deadline = time.monotonic() + RETRY
    while True:
        try:
            result = (defer if req["op"] == "defer" else cancel)(run_id, req)
            _say({"id": req["id"], "ok": True, **result, "done": time.time()})
            return
        except Exception as exc:  # a restart, a closed connection, a deadlock: again
            if time.monotonic() > deadline:
                _say({"id": req["id"], "ok": False, "error": repr(exc)[:300],
                      "done": time.time()})
                return
            time.sleep(0.5)


def main(run_id: str) -> None:
    _say({"ready": True, "tasks": create_run(run_id)})
    with ThreadPoolExecutor(THREADS) as pool:
        for line in sys.stdin:
            if line.strip():
                pool.submit(handle, run_id, json.loads(line))


if __name__ == "__main__":
    main(sys.argv[1])
