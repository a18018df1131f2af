"""End to end on a real Airflow 3.3.2 (scheduler, API server, dag-processor, LocalExecutor):
triggers that call back into Airflow (tests/airflow_dags/triggerflow_runtime.py) end as they
do under ``airflow triggerer`` when ``triggerflow consume --airflow`` serves them instead.

The connection and the variable are stored through Airflow's REST API, so they live in its
database; no ``AIRFLOW_CONN_*``/``AIRFLOW_VAR_*`` variable is set for any process. The
baseline runs the DAGs under Airflow's own triggerer on the same stack.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from tests.airflow_stack import AirflowStack
from tests.airflow_support import airflow_template, serve_with_triggerflow, stack_database
from tests.conftest import ROOT

__all__ = ["airflow_template"]

DAGS = ROOT / "tests" / "airflow_dags"
QUEUE = "tf-runtime"  # the DAGs' queue (tests/airflow_dags/triggerflow_runtime.py)
RUN_TIMEOUT = 300.0
CONN_ID, VARIABLE, PASSWORD = "tf_runtime_conn", "tf_runtime_variable", "pa55-in-airflow-db"
VARIABLE_VALUE = "set through the REST API"
RUNS = {"tf_runtime_reads": "success", "tf_runtime_missing": "failed",
        "tf_runtime_dagrun": "success"}
EXPECTED = {
    ("tf_runtime_reads", "reads_sync"): "success",
    ("tf_runtime_reads", "reads_sync_to_async"): "success",
    ("tf_runtime_reads", "reads_connection_get"): "success",
    ("tf_runtime_missing", "missing_conn"): "failed",
    ("tf_runtime_dagrun", "trigger_target"): "success",
    ("tf_runtime_dagrun", "external_sensor"): "success",
}


@dataclass
class Outcome:
    states: dict[tuple[str, str], str] = field(default_factory=dict)
    deferred: set[tuple[str, str]] = field(default_factory=set)
    run_states: dict[str, str] = field(default_factory=dict)
    run_ids: dict[str, str] = field(default_factory=dict)
    xcoms: dict[str, str] = field(default_factory=dict)  # task_id -> return_value JSON text
    seconds: float = 0.0


@pytest.fixture(scope="module")
def runtime_stack(pg_server: str, airflow_template: str) -> Iterator[AirflowStack]:
    stack = AirflowStack(pg_server, DAGS, extra_env={"PYTHONPATH": str(ROOT)})
    with stack_database(stack, airflow_template):
        stack.start()
        stack.api("POST", "connections", json={
            "connection_id": CONN_ID, "conn_type": "http", "host": "api.example",
            "login": "svc", "password": PASSWORD})
        stack.api("POST", "variables", json={"key": VARIABLE, "value": VARIABLE_VALUE})
        yield stack
    assert stack.leftovers() == [], "Airflow processes outlived the stack"


def run_dags(stack: AirflowStack) -> Outcome:
    import psycopg2  # type: ignore[import-untyped]

    stack.wait_for_dags([*RUNS, "tf_runtime_target"])
    t0 = time.monotonic()
    out = Outcome(run_ids={dag_id: stack.trigger_dag(dag_id) for dag_id in RUNS})
    conn = psycopg2.connect(stack.database_url)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            while time.monotonic() - t0 < RUN_TIMEOUT:
                stack.check_alive()
                cur.execute("SELECT dag_id, task_id, state FROM task_instance "
                            "WHERE run_id = ANY(%s) AND dag_id = ANY(%s)",
                            (list(out.run_ids.values()), list(RUNS)))
                for dag_id, task_id, state in cur.fetchall():
                    out.states[dag_id, task_id] = state
                    if state == "deferred":
                        out.deferred.add((dag_id, task_id))
                cur.execute("SELECT dag_id, state FROM dag_run WHERE run_id = ANY(%s)",
                            (list(out.run_ids.values()),))
                out.run_states = {d: s for d, s in cur.fetchall() if d in RUNS}
                if len(out.run_states) == len(RUNS) and all(
                        s in ("success", "failed") for s in out.run_states.values()):
                    break
                time.sleep(0.5)
            cur.execute("SELECT task_id, value::text FROM xcom WHERE dag_id = 'tf_runtime_reads' "
                        "AND run_id = %s AND key = 'return_value'",
                        (out.run_ids["tf_runtime_reads"],))
            out.xcoms = dict(cur.fetchall())
    finally:
        conn.close()
    out.seconds = time.monotonic() - t0
    return out


def assert_outcome(out: Outcome, stack: AirflowStack) -> None:
    where = f"\n(after {out.seconds:.0f}s; states {out.states})\n{stack.tail_logs()}"
    assert out.run_states == RUNS, f"DAG runs {out.run_states}{where}"
    assert out.states == EXPECTED, where
    assert out.deferred == set(EXPECTED), f"never seen deferred: {set(EXPECTED) - out.deferred}"
    for task_id in ("reads_sync", "reads_sync_to_async", "reads_connection_get"):
        value = out.xcoms.get(task_id, "")
        assert PASSWORD in value and VARIABLE_VALUE in value and "svc" in value, out.xcoms
    logs = "\n".join(p.read_text(errors="replace") for p in (stack.home / "logs").rglob("*")
                     if p.is_file() and "task_id=missing_conn" in str(p)
                     and f"run_id={out.run_ids['tf_runtime_missing']}" in str(p))
    assert "The conn_id `tf_no_such_conn` isn't defined" in logs, logs[-3000:]


def test_runtime_dags_with_airflow_triggerer(runtime_stack: AirflowStack) -> None:
    """Baseline: Airflow's own triggerer answers the triggers' requests."""
    try:
        runtime_stack.start_triggerer([QUEUE])
        out = run_dags(runtime_stack)
    finally:
        runtime_stack.stop_process("triggerer")
    assert_outcome(out, runtime_stack)


def test_runtime_dags_with_triggerflow(runtime_stack: AirflowStack, amqp_server: str) -> None:
    """No ``airflow triggerer``: ``consume --airflow`` answers them."""
    names = serve_with_triggerflow(runtime_stack, amqp_server, [QUEUE], f"tfrt{os.getpid()}")
    try:
        out = run_dags(runtime_stack)
    finally:
        for name in names:
            runtime_stack.stop_process(name)
    assert_outcome(out, runtime_stack)
