"""The trigger runtime's request latency, as trigger code sees it, under Airflow's own
triggerer and under ``triggerflow consume --airflow``, on one real Airflow 3.3.2 stack:
``tf_runtime_latency`` (tests/airflow_dags/triggerflow_runtime.py) runs its mapped
``LatencyTrigger``s under each in turn, and each trigger returns the milliseconds of its
``BaseHook.get_connection`` (sync, from the coroutine) and ``Variable.get`` (``sync_to_async``)
calls. Not a test: prints a table.

    python -m tests.services -- python -m tests.airflow_runtime_latency
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tests.airflow_stack import AirflowStack
from tests.airflow_support import serve_with_triggerflow
from tests.conftest import ROOT

DAG_ID = "tf_runtime_latency"
CONN_ID, VARIABLE = "tf_runtime_conn", "tf_runtime_variable"
QUEUE = "tf-runtime"  # the DAGs' queue (tests/airflow_dags/triggerflow_runtime.py)


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if q < 100 else max(values)


def run_once(stack: AirflowStack) -> dict[str, list[float]]:
    import psycopg2  # type: ignore[import-untyped]

    run_id = stack.trigger_dag(DAG_ID)
    deadline = time.monotonic() + 600
    conn = psycopg2.connect(stack.database_url)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            while time.monotonic() < deadline:
                cur.execute("SELECT state FROM dag_run WHERE run_id = %s", (run_id,))
                if cur.fetchone()[0] in ("success", "failed"):
                    break
                time.sleep(1)
            cur.execute("SELECT value::text FROM xcom WHERE dag_id = %s AND run_id = %s "
                        "AND key = 'return_value'", (DAG_ID, run_id))
            values = [json.loads(json.loads(v)) if v.startswith('"') else json.loads(v)
                      for (v,) in cur.fetchall()]
    finally:
        conn.close()
    # Each trigger's first request also waits for the runtime to start (Airflow's in-process
    # API, triggerflow's child process): reported apart from the steady state.
    out: dict[str, list[float]] = {"connection_ms": [], "variable_ms": [], "first_ms": []}
    for value in values:
        out["first_ms"].append(value["connection_ms"][0])
        out["connection_ms"].extend(value["connection_ms"][1:])
        out["variable_ms"].extend(value["variable_ms"])
    return out


def serve_with_airflow(stack: AirflowStack) -> Callable[[], None]:
    stack.start_triggerer([QUEUE])
    return lambda: stack.stop_process("triggerer")


def with_triggerflow(stack: AirflowStack) -> Callable[[], None]:
    names = serve_with_triggerflow(stack, os.environ["TRIGGERFLOW_AMQP_URL"], [QUEUE],
                                   f"tflat{os.getpid()}")

    def stop() -> None:
        for name in names:
            stack.stop_process(name)
    return stop


def main() -> int:
    server = os.environ["TRIGGERFLOW_DATABASE_URL"].rsplit("/", 1)[0]
    dags = tempfile.mkdtemp(prefix="tf-runtime-latency-dags-")
    os.symlink(ROOT / "tests" / "airflow_dags" / "triggerflow_runtime.py",
               os.path.join(dags, "triggerflow_runtime.py"))
    stack = AirflowStack(server, Path(dags),
                         extra_env={"PYTHONPATH": str(ROOT)})
    try:
        stack.migrate()
        stack.start()
        stack.api("POST", "connections", json={"connection_id": CONN_ID, "conn_type": "http",
                                               "host": "h", "login": "l", "password": "p4ss"})
        stack.api("POST", "variables", json={"key": VARIABLE, "value": "v"})
        stack.wait_for_dags([DAG_ID])
        print("| served by | request | n | p50 | p99 | max |")
        print("|---|---|---|---|---|---|")
        for name, serve in (("airflow triggerer", serve_with_airflow),
                            ("triggerflow", with_triggerflow)):
            stop = serve(stack)
            try:
                got = run_once(stack)
            finally:
                stop()
            for key, label in (("connection_ms", "GetConnection (sync)"),
                               ("variable_ms", "GetVariable (sync_to_async)"),
                               ("first_ms", "each trigger's first GetConnection")):
                values = got[key]
                if not values:
                    print(f"| {name} | {label} | 0 | - | - | - |")
                    continue
                print(f"| {name} | {label} | {len(values)} | {percentile(values, 50):.2f} ms "
                      f"| {percentile(values, 99):.2f} ms | {max(values):.2f} ms |", flush=True)
    finally:
        stack.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
