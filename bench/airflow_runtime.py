"""The trigger runtime's request latency, as trigger code sees it, under Airflow's own
triggerer and under ``triggerflow consume --airflow``, on one real Airflow 3.3.2 stack (part
of ``triggerflow bench airflow``; alone: ``python -m bench.airflow_runtime``).

``tf_runtime_latency`` (tests/airflow_dags/triggerflow_runtime.py) runs its mapped
``LatencyTrigger``s under each in turn, and each trigger returns the milliseconds of its
``BaseHook.get_connection`` (sync, from the coroutine) and ``Variable.get``
(``sync_to_async``) calls, read back from the tasks' XComs. The connection and the variable
are created through the REST API, so both servers read them from Airflow's database. Each
trigger's first request also waits for the runtime to start (Airflow's in-process API,
triggerflow's runtime process): reported apart from the steady state.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.airflow_serve import serve_with_triggerflow
from bench.common import CHECKOUT
from testbed.airflow_stack import AirflowStack

DAG_ID = "tf_runtime_latency"
CONN_ID, VARIABLE = "tf_runtime_conn", "tf_runtime_variable"
QUEUE = "tf-runtime"  # the DAG's queue (tests/airflow_dags/triggerflow_runtime.py)
REQUESTS = (("connection_ms", "GetConnection (sync)"),
            ("variable_ms", "GetVariable (sync_to_async)"),
            ("first_ms", "each trigger's first GetConnection"))


def percentile(values: list[float], q: int) -> float:
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
    out: dict[str, list[float]] = {"connection_ms": [], "variable_ms": [], "first_ms": []}
    for value in values:
        out["first_ms"].append(value["connection_ms"][0])
        out["connection_ms"].extend(value["connection_ms"][1:])
        out["variable_ms"].extend(value["variable_ms"])
    return out


def _serve_with_airflow(stack: AirflowStack) -> Callable[[], None]:
    stack.start_triggerer([QUEUE])
    return lambda: stack.stop_process("triggerer")


def _serve_with_triggerflow(amqp_url: str) -> Callable[[AirflowStack], Callable[[], None]]:
    def serve(stack: AirflowStack) -> Callable[[], None]:
        served = serve_with_triggerflow(stack, amqp_url, queue=QUEUE, allowed_modules=[
            "airflow.providers.standard.triggers", "tests.airflow_triggers"], scheduler=True)

        def stop() -> None:
            for name in ("tf-writer", served.process):
                stack.stop_process(name)
        return stop
    return serve


TRIGGERS, REQUESTS_EACH = 10, 100  # the DAG's LatencyTriggers; each one's requests of a kind


def measure_runtime(server_url: str, amqp_url: str, log: Any = print,
                    requests: int = REQUESTS_EACH) -> list[dict[str, Any]]:
    """One row per (served by, request): n, p50, p99 and max in milliseconds; each trigger
    times ``requests`` requests of each kind."""
    dags = Path(tempfile.mkdtemp(prefix="tf-runtime-latency-dags-"))
    (dags / "triggerflow_runtime.py").symlink_to(
        CHECKOUT / "tests" / "airflow_dags" / "triggerflow_runtime.py")
    stack = AirflowStack(server_url, dags, extra_env={"PYTHONPATH": str(CHECKOUT),
                                                      "TF_LATENCY_REQUESTS": str(requests)})
    rows: list[dict[str, Any]] = []
    try:
        stack.migrate()
        stack.start()
        stack.api("POST", "connections", json={"connection_id": CONN_ID, "conn_type": "http",
                                               "host": "h", "login": "l", "password": "p4ss"})
        stack.api("POST", "variables", json={"key": VARIABLE, "value": "v"})
        stack.wait_for_dags([DAG_ID])
        for name, serve in (("airflow triggerer", _serve_with_airflow),
                            ("triggerflow", _serve_with_triggerflow(amqp_url))):
            log(f"runtime latency: {DAG_ID} served by {name}")
            stop = serve(stack)
            try:
                got = run_once(stack)
            finally:
                stop()
            for key, label in REQUESTS:
                values = got[key]
                rows.append({"served_by": name, "request": label, "n": len(values),
                             **({"p50": percentile(values, 50), "p99": percentile(values, 99),
                                 "max": max(values)} if values else {})})
    finally:
        stack.stop()
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| served by | request | n | p50 | p99 | max |", "|---|---|---|---|---|---|"]
    for r in rows:
        cells = (f"{r['p50']:.2f} ms | {r['p99']:.2f} ms | {r['max']:.2f} ms" if r["n"]
                 else "- | - | -")
        lines.append(f"| {r['served_by']} | {r['request']} | {r['n']} | {cells} |")
    return "\n".join(lines)


def main() -> int:
    from triggerflow.settings import Settings

    settings = Settings()
    server = settings.database_dsn().rsplit("/", 1)[0]
    print(markdown(measure_runtime(server, settings.amqp_dsn())), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
