"""What Airflow's users look at, on a real Airflow 3.3.2 (scheduler, API server,
dag-processor, LocalExecutor; tests/airflow_dags/triggerflow_ops.py):

- a deferred task's trigger logs, read through Airflow's REST API (what its UI shows) while
  the task is deferred and after it resumed: under ``airflow triggerer`` (the oracle) and
  under ``triggerflow consume --airflow`` (no Airflow triggerer) the trigger's own lines are
  there, its masked secret is not;
- the triggerer's health under triggerflow: a task deferred on a queue no consumer serves
  makes Airflow's health endpoint and ``airflow jobs check --job-type TriggererJob`` report
  the triggerer unhealthy; a consumer for that queue makes both healthy again.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from testbed.airflow_stack import AirflowStack, airflow_bin
from tests.airflow_dags.triggerflow_ops import MARKER, QUEUE, SECRET, UNSERVED
from tests.airflow_support import airflow_template, serve_with_triggerflow, stack_database
from tests.conftest import FAST, ROOT

__all__ = ["airflow_template"]

# A stack start (in the first test), a DAG run and, for triggerflow, two health transitions,
# on a machine other suites load too.
pytestmark = [pytest.mark.timeout(900), pytest.mark.airflow_stack]

DAGS = ROOT / "tests" / "airflow_dags"
THRESHOLD = 10  # [triggerer] triggerer_health_check_threshold, seconds, for this stack
WAIT = 180.0


@pytest.fixture(scope="module")
def ops_stack(pg_server: str, airflow_template: str) -> Iterator[AirflowStack]:
    stack = AirflowStack(
        pg_server,
        DAGS,
        extra_env={
            "PYTHONPATH": str(ROOT),
            "AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD": str(THRESHOLD),
            # not Airflow's default 8794: other stacks of the suite may run at the same time
            "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(_free_port()),
        },
    )
    with stack_database(stack, airflow_template):
        stack.start()
        stack.wait_for_dags(["tf_ops_logs", "tf_ops_unserved"])
        yield stack
    assert stack.leftovers() == [], "Airflow processes outlived the stack"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def api(stack: AirflowStack, method: str, path: str, **kwargs: Any) -> httpx.Response:
    """One API call, tried again on a timeout: the single API server worker stalls for tens of
    seconds when the machine is loaded (load average 35+ seen here)."""
    for attempt in range(6):
        try:
            return httpx.request(method, f"{stack.base_url}/api/v2/{path}", timeout=60.0, **kwargs)
        except httpx.TimeoutException:
            if attempt == 5:
                raise
            time.sleep(2.0)
    raise AssertionError("unreachable")


def start_run(stack: AirflowStack, dag_id: str) -> str:
    """A DAG run with an id of ours, so a POST retried after a timeout cannot start two."""
    run_id = f"manual__{uuid.uuid4().hex[:12]}"
    body = {"dag_run_id": run_id, "logical_date": None, "conf": {}}
    response = api(stack, "POST", f"dags/{dag_id}/dagRuns", json=body, headers=stack._headers())
    assert response.status_code in (200, 409), response.text  # 409: the first try got there
    return run_id


def ti_row(stack: AirflowStack, dag_id: str, run_id: str, task_id: str) -> tuple[str | None, int]:
    """The task instance's state and try number."""
    import psycopg2  # type: ignore[import-untyped]

    conn = psycopg2.connect(stack.database_url)
    try:
        with conn.cursor() as cur:
            cur.execute(
                "SELECT state, try_number FROM task_instance WHERE dag_id = %s AND run_id = %s AND task_id = %s",
                (dag_id, run_id, task_id),
            )
            row = cur.fetchone()
    finally:
        conn.close()
    return (None, 0) if row is None else (row[0], int(row[1]))


def ti_state(stack: AirflowStack, dag_id: str, run_id: str, task_id: str) -> str | None:
    return ti_row(stack, dag_id, run_id, task_id)[0]


def wait_state(stack: AirflowStack, dag_id: str, run_id: str, task_id: str, states: set[str]) -> str:
    deadline = time.monotonic() + WAIT
    state = None
    while time.monotonic() < deadline:
        stack.check_alive()
        state = ti_state(stack, dag_id, run_id, task_id)
        if state in states:
            return state
        time.sleep(0.5)
    raise AssertionError(f"{dag_id}.{task_id} still {state}, not {states}\n{stack.tail_logs()}")


def task_log(stack: AirflowStack, dag_id: str, run_id: str, task_id: str, try_number: int) -> str:
    """The log of a try as the API serves the UI: each structured line's event text."""
    response = api(
        stack,
        "GET",
        f"dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/logs/{try_number}",
        headers={**stack._headers(), "Accept": "application/json"},
    )
    response.raise_for_status()
    content = response.json().get("content") or []
    return "\n".join(
        str(line.get("event", line)) if isinstance(line, dict) else str(line) for line in content
    )


def deferred_and_logged(stack: AirflowStack) -> tuple[str, str, str, int]:
    """Runs tf_ops_logs; returns its log read while deferred, after success, the run id and
    the try that deferred."""
    run_id = start_run(stack, "tf_ops_logs")
    wait_state(stack, "tf_ops_logs", run_id, "logs", {"deferred"})
    try_number = ti_row(stack, "tf_ops_logs", run_id, "logs")[1]
    deadline = time.monotonic() + 60
    while True:  # the trigger logs at once, then holds HOLD seconds
        while_deferred = task_log(stack, "tf_ops_logs", run_id, "logs", try_number)
        # the last of the three lines waits for mask_secret's round trip to the runtime
        if "the secret is" in while_deferred or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    state = ti_state(stack, "tf_ops_logs", run_id, "logs")
    assert wait_state(stack, "tf_ops_logs", run_id, "logs", {"success", "failed"}) == "success"
    after = task_log(stack, "tf_ops_logs", run_id, "logs", try_number)
    assert state == "deferred", f"read while {state}: the hold was too short under this load"
    return while_deferred, after, run_id, try_number


def assert_trigger_lines(text: str) -> None:
    assert f"trigger says {MARKER}" in text, text[-3000:]
    assert f"stdlib says {MARKER}" in text, text[-3000:]
    assert "the secret is ***" in text, text[-3000:]
    assert SECRET not in text, text[-3000:]


def test_trigger_logs_in_the_api_under_airflow_triggerer(ops_stack: AirflowStack) -> None:
    """The oracle: Airflow's own triggerer."""
    try:
        ops_stack.start_triggerer([QUEUE])
        while_deferred, after, _, _ = deferred_and_logged(ops_stack)
    finally:
        ops_stack.stop_process("triggerer")
    assert_trigger_lines(while_deferred)
    assert_trigger_lines(after)


def jobs_check(stack: AirflowStack) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(airflow_bin()), "jobs", "check", "--job-type", "TriggererJob"],
        env=stack.env,
        cwd=stack.home,
        capture_output=True,
        text=True,
        timeout=120,
    )


def wait_health(stack: AirflowStack, status: str, timeout: float) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    report: dict[str, object] = {}
    while time.monotonic() < deadline:
        report = api(stack, "GET", "monitor/health").json().get("triggerer") or {}
        if report.get("status") == status:
            return report
        time.sleep(1.0)
    raise AssertionError(f"triggerer not {status} within {timeout:.0f}s: {report}\n" + stack.tail_logs())


def test_trigger_logs_and_health_under_triggerflow(ops_stack: AirflowStack, amqp_server: str) -> None:
    """No ``airflow triggerer``: triggerflow's writer and one consumer of QUEUE."""
    from triggerflow.settings import Settings

    namespace = f"tfops{os.getpid()}"
    names = serve_with_triggerflow(ops_stack, amqp_server, [QUEUE], namespace)
    try:
        while_deferred, after, run_id, try_number = deferred_and_logged(ops_stack)
        files = sorted(
            p.name for p in (ops_stack.home / "logs").rglob("*.trigger.*") if f"run_id={run_id}" in str(p)
        )
        wait_health(ops_stack, "healthy", 60)

        # A task deferred on a queue nobody consumes: the writer withholds the heartbeat.
        unserved_run = start_run(ops_stack, "tf_ops_unserved")
        wait_state(ops_stack, "tf_ops_unserved", unserved_run, "waits", {"deferred"})
        unhealthy = wait_health(ops_stack, "unhealthy", THRESHOLD + 60)
        check_down = jobs_check(ops_stack)
        assert ti_state(ops_stack, "tf_ops_unserved", unserved_run, "waits") == "deferred"

        # A consumer for it: the heartbeat resumes, the task resumes.
        settings = Settings(
            database_url=ops_stack.database_url,
            amqp_url=amqp_server,
            namespace=namespace,
            allowed_modules=["airflow.providers.standard.triggers", "tests.airflow_triggers"],
            **FAST,
        )
        env = {**ops_stack.env, **settings.as_env(), "PYTHONUNBUFFERED": "1"}
        tf = [sys.executable, "-m", "triggerflow"]
        subprocess.run([*tf, "topology", "apply", "--queue", UNSERVED], env=env, check=True, timeout=120)
        ops_stack.spawn("tf-consume-unserved", [*tf, "consume", "--airflow", "--queue", UNSERVED], env)
        names.append("tf-consume-unserved")
        wait_health(ops_stack, "healthy", 90)
        check_up = jobs_check(ops_stack)
        end = wait_state(ops_stack, "tf_ops_unserved", unserved_run, "waits", {"success", "failed"})
    finally:
        for name in names:
            ops_stack.stop_process(name)
    assert_trigger_lines(while_deferred)
    assert_trigger_lines(after)
    assert len(files) == 1 and files[0].startswith(f"attempt={try_number}.log.trigger.triggerflow-"), files
    assert unhealthy.get("latest_triggerer_heartbeat"), unhealthy
    assert check_down.returncode != 0, check_down.stdout
    assert "No alive jobs found." in check_down.stdout + check_down.stderr
    assert check_up.returncode == 0, check_up.stdout + check_up.stderr
    assert end == "success"
    withheld = (ops_stack.home / "tf-writer.log").read_text(errors="replace")
    assert f"no live consumer on {UNSERVED}" in withheld
