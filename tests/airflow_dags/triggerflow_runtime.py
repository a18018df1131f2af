"""The runtime DAGs: triggers that call back into Airflow (connections, variables, DAG-run
and task states). Triggered by tests/test_airflow_runtime_e2e.py, which stores the connection
and the variable through Airflow's REST API (its database, not the environment).

``tf_runtime_reads`` (``success``): a trigger reads the connection and the variable with
``BaseHook.get_connection``/``Variable.get`` called straight from its coroutine, through
``sync_to_async``, and with ``Connection.get``; each task returns what its trigger read.

``tf_runtime_missing`` (``failed``): the trigger asks for a connection nobody defined.

``tf_runtime_dagrun`` (``success``): ``TriggerDagRunOperator(deferrable=True,
wait_for_completion=True)`` starts ``tf_runtime_target`` and waits on it; beside it,
``ExternalTaskSensor(deferrable=True)`` waits for that run's task.

``tf_runtime_hitl`` (``success``): a ``HITLOperator`` answered through Airflow's REST API. On
Airflow 3.3 it waits in ``awaiting_input`` with no trigger (the API's answer resumes it), so
it must end the same with no Airflow triggerer running at all.

``tf_runtime_http`` (``success``): ``HttpSensor(deferrable=True)`` on a connection stored in
Airflow's database (its host and port: the test's own HTTP server), answered 404 until the
task is deferred and its trigger has polled, then 200: ``HttpSensorTrigger`` reads the
connection through the runtime and polls.

``tf_runtime_latency``: ``LATENCY_TRIGGERS`` triggers at once, each timing ``LATENCY_REQUESTS``
connection and variable reads (``triggerflow bench airflow`` reads their XComs:
bench/airflow_runtime.py).
"""

from __future__ import annotations

import os
import time
from datetime import datetime

from airflow.providers.http.sensors.http import HttpSensor
from airflow.providers.standard.operators.hitl import HITLOperator
from airflow.providers.standard.operators.python import PythonOperator
from airflow.providers.standard.operators.trigger_dagrun import TriggerDagRunOperator
from airflow.providers.standard.sensors.external_task import ExternalTaskSensor
from airflow.sdk import DAG

from tests.airflow_triggers import DeferToTrigger

CONN_ID, VARIABLE = "tf_runtime_conn", "tf_runtime_variable"
HTTP_CONN_ID, HTTP_ENDPOINT = "tf_runtime_http_conn", "ready"
TARGET = "tf_runtime_target"
# A queue of their own: RabbitMQ queue names are not namespaced, and another module of the
# suite declares "default" with its namespace's dead-letter exchange.
QUEUE = "tf-runtime"
ARGS = {"retries": 0, "queue": QUEUE}
START = datetime(2026, 1, 1)
HOLD = 5.0  # seconds each reading trigger waits before it reads and fires

with DAG("tf_runtime_reads", schedule=None, start_date=START, catchup=False, default_args=ARGS):
    for style in ("sync", "sync_to_async", "connection_get"):
        DeferToTrigger(task_id=f"reads_{style}", trigger="RuntimeReadingTrigger",
                       trigger_kwargs={"conn_id": CONN_ID, "variable": VARIABLE, "style": style,
                                       "hold": HOLD})

with DAG("tf_runtime_missing", schedule=None, start_date=START, catchup=False,
         default_args=ARGS):
    DeferToTrigger(task_id="missing_conn", trigger="RuntimeReadingTrigger",
                   trigger_kwargs={"conn_id": "tf_no_such_conn", "variable": VARIABLE,
                                   "hold": HOLD})


def pause() -> None:
    time.sleep(8)  # long enough that both waiting triggers see the run unfinished first


with DAG(TARGET, schedule=None, start_date=START, catchup=False, default_args=ARGS):
    PythonOperator(task_id="done", python_callable=pause)

with DAG("tf_runtime_dagrun", schedule=None, start_date=START, catchup=False, default_args=ARGS):
    # The target run gets this run's run_after as its logical date: the sensor's default date.
    TriggerDagRunOperator(task_id="trigger_target", trigger_dag_id=TARGET,
                          logical_date="{{ dag_run.run_after.isoformat() }}",
                          deferrable=True, wait_for_completion=True, poke_interval=2)
    ExternalTaskSensor(task_id="external_sensor", external_dag_id=TARGET,
                       external_task_id="done", deferrable=True, poke_interval=2, timeout=180)

with DAG("tf_runtime_hitl", schedule=None, start_date=START, catchup=False, default_args=ARGS):
    HITLOperator(task_id="approve", subject="Ship it?", options=["yes", "no"])

with DAG("tf_runtime_http", schedule=None, start_date=START, catchup=False, default_args=ARGS):
    HttpSensor(task_id="http_sensor", http_conn_id=HTTP_CONN_ID, endpoint=HTTP_ENDPOINT,
               deferrable=True, poke_interval=1, timeout=180)

# `bench airflow --quick` asks for fewer requests per trigger (TF_LATENCY_REQUESTS)
LATENCY_TRIGGERS = 10
LATENCY_REQUESTS = int(os.environ.get("TF_LATENCY_REQUESTS", "100"))
with DAG("tf_runtime_latency", schedule=None, start_date=START, catchup=False,
         default_args=ARGS, max_active_tasks=LATENCY_TRIGGERS):
    DeferToTrigger.partial(task_id="latency", trigger="LatencyTrigger").expand(trigger_kwargs=[
        {"conn_id": CONN_ID, "variable": VARIABLE, "requests": LATENCY_REQUESTS}
    ] * LATENCY_TRIGGERS)
