"""``start_from_trigger`` on a real Airflow 3.3.2 stack (scheduler, API server, dag-processor,
LocalExecutor): the DAG of tests/airflow_dags/triggerflow_start.py runs once under Airflow's
own triggerers (the oracle) and once under triggerflow (no Airflow triggerer), and every task
ends the same (tests/airflow_conformance.py: state, try number, XComs, history rows).

Airflow 3.3.2's scheduler writes a ``start_from_trigger`` task's trigger row with no queue,
so the oracle needs an ``airflow triggerer`` without ``--queues`` beside the one serving the
team queues (the worker-deferred task's row carries its queue). Under triggerflow the writer
gives those rows their task's queue (``triggerflow/airflow/adopt.py``) and the consumer
renders the templated kwargs and sets ``task_instance`` as Airflow's triggerer does
(``triggerflow/airflow/task_context.py``).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from testbed.airflow_stack import AirflowStack, airflow_bin
from tests.airflow_conformance import TaskEnd, TaskKey, assert_conforms, ends
from tests.airflow_support import airflow_template, serve_with_triggerflow, stack_database
from tests.conftest import ROOT
from tests.test_airflow_e2e import serving
from triggerflow.settings import AIRFLOW_RESUME_DELAY

pytestmark = pytest.mark.airflow_stack  # make test-airflow (one stack at a time)

__all__ = ["airflow_template"]

DAG_ID = "tf_start_from_trigger"
QUEUES = ("default", "team-ml")
RUN_TIMEOUT = 240.0
# task -> (final state, the queue of its task, started in the trigger: no queue on Airflow's row)
EXPECTED = {
    "fixed": ("success", "default", True),
    "templated": ("success", "default", True),
    "templated_end": ("success", "team-ml", True),
    "time_sensor": ("success", "default", True),
    "reads_ti": ("success", "default", True),
    "reads_ti_worker": ("success", "default", False),
}

TI_QUERY = """
SELECT ti.task_id, ti.state, ti.try_number, t.queue, t.id
FROM task_instance ti LEFT JOIN trigger t ON t.id = ti.trigger_id
WHERE ti.dag_id = %s AND ti.run_id = %s
"""
XCOM_QUERY = "SELECT task_id, key, value FROM xcom WHERE dag_id = %s AND run_id = %s"


@dataclass
class Run:
    """What one DAG run did, polled from Airflow's tables."""

    run_id: str = ""
    state: str | None = None
    tasks: dict[str, tuple[str | None, int]] = field(default_factory=dict)  # state, try
    queues: dict[str, set[str | None]] = field(default_factory=dict)  # while deferred
    xcoms: dict[str, Any] = field(default_factory=dict)  # "task/key" -> value
    ends: dict[TaskKey, TaskEnd] = field(default_factory=dict)  # how each instance ended
    seconds: float = 0.0


@pytest.fixture(scope="module")
def airflow_stack(pg_server: str, airflow_template: str) -> Iterator[AirflowStack]:
    """The e2e DAG folder (this DAG is in it), no triggerer running. A worker waits up to
    120 s for the execution API (Airflow's default is 5 s): at load average 30-45 the API
    server took 41 s to answer a stack's first ``PATCH .../run``, the worker retried, the
    retry got 400 (the first had already started the task) and the task failed, under
    Airflow's own triggerer as under triggerflow."""
    stack = AirflowStack(
        pg_server,
        ROOT / "tests" / "airflow_dags",
        extra_env={"PYTHONPATH": str(ROOT), "AIRFLOW__WORKERS__EXECUTION_API_TIMEOUT": "120"},
    )
    with stack_database(stack, airflow_template):
        stack.start()
        yield stack
    assert not stack.leftovers(), "Airflow processes outlived the stack"


def run_dag(stack: AirflowStack) -> Run:
    import psycopg2  # type: ignore[import-untyped]

    stack.wait_for_dags([DAG_ID])
    t0 = time.monotonic()
    run = Run(run_id=stack.trigger_dag(DAG_ID))
    with contextlib.closing(psycopg2.connect(stack.database_url)) as conn:
        conn.autocommit = True
        cur = conn.cursor()
        while time.monotonic() - t0 < RUN_TIMEOUT:
            stack.check_alive()
            cur.execute(TI_QUERY, (DAG_ID, run.run_id))
            for task_id, state, try_number, queue, trigger_id in cur.fetchall():
                run.tasks[task_id] = (state, try_number)
                if state == "deferred" and trigger_id is not None:
                    run.queues.setdefault(task_id, set()).add(queue)
            cur.execute("SELECT state FROM dag_run WHERE dag_id = %s AND run_id = %s", (DAG_ID, run.run_id))
            run.state = cur.fetchone()[0]
            if run.state in ("success", "failed"):
                break
            time.sleep(0.3)
        cur.execute(XCOM_QUERY, (DAG_ID, run.run_id))
        run.xcoms = {f"{t}/{k}": v for t, k, v in cur.fetchall()}
    run.seconds = time.monotonic() - t0
    run.ends = ends(stack.database_url, {DAG_ID: run.run_id})
    return run


def check(run: Run, stack: AirflowStack, *, adopted: bool) -> None:
    """Every task ended as expected, after waiting deferred on a row of the right queue
    (none on Airflow's own rows of tasks started in the trigger; the task's once adopted)."""
    where = f"\n(after {run.seconds:.0f}s: {run.tasks}, queues {run.queues})\n{stack.tail_logs()}"
    assert run.state == "success", f"DAG run {run.state}{where}"
    assert {t: s for t, (s, _) in run.tasks.items()} == {t: e[0] for t, e in EXPECTED.items()}, where
    for task, (_, queue, starts) in EXPECTED.items():
        seen = run.queues.get(task, set())
        allowed: set[str | None]
        if not starts:
            allowed = {queue}  # a worker's deferral: the task's queue, under both
        elif adopted:
            allowed = {None, queue}  # no queue until the writer gives it the task's
        else:
            allowed = {None}  # Airflow's scheduler writes no queue
        assert seen <= allowed, f"{task}: deferred on queues {seen}{where}"
        # Those that wait WAIT seconds were seen deferred; under triggerflow on their queue.
        if task not in ("fixed", "time_sensor"):
            assert seen, f"{task}: never seen deferred{where}"
            if adopted:
                assert queue in seen, f"{task}: deferred on queues {seen}{where}"
    rendered = run.xcoms["reads_ti/return_value"]
    assert rendered["message"] == f"run {run.run_id} of {DAG_ID}, try 1", rendered
    assert rendered["ti"]["task_id"] == "reads_ti" and rendered["task"] == "reads_ti", rendered
    by_worker = run.xcoms["reads_ti_worker/return_value"]
    assert by_worker["ti"]["task_id"] == "reads_ti_worker", by_worker


@pytest.fixture(scope="module")
def under_airflow(airflow_stack: AirflowStack) -> Run:
    """The oracle: ``airflow triggerer --queues default,team-ml`` and ``airflow triggerer``
    (rows with no queue), both Airflow 3.3.2's own."""
    stack = airflow_stack
    with serving(stack, ["triggerer", "triggerer-no-queue"]):
        stack.start_triggerer(QUEUES)
        stack.spawn("triggerer-no-queue", [str(airflow_bin()), "triggerer", "--skip-serve-logs"])
        time.sleep(2)  # its first heartbeat; the health endpoint already says healthy
        run = run_dag(stack)
    return run


def test_start_from_trigger_under_airflow_triggerer(airflow_stack: AirflowStack, under_airflow: Run) -> None:
    check(under_airflow, airflow_stack, adopted=False)


def test_start_from_trigger_under_triggerflow_ends_as_under_airflow(
    airflow_stack: AirflowStack, under_airflow: Run, amqp_server: str
) -> None:
    """No Airflow triggerer: the rows with no queue run on their task's queue, templated
    kwargs rendered, ``task_instance`` set; every task ends as under Airflow's triggerer."""
    names = serve_with_triggerflow(airflow_stack, amqp_server, list(QUEUES), f"tfsft{os.getpid()}",
                                   airflow_resume_delay=AIRFLOW_RESUME_DELAY)  # the shipped hold
    with serving(airflow_stack, names):
        airflow_stack.wait_healthy(["triggerer"], 60)
        run = run_dag(airflow_stack)
    check(run, airflow_stack, adopted=True)
    assert_conforms(under_airflow.ends, run.ends, f"\n{airflow_stack.tail_logs()}")
