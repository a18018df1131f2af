"""End to end against a real Airflow 3.3.2 (scheduler, API server, dag-processor, LocalExecutor):
the DAGs of tests/airflow_dags/ run to the states Airflow itself gives their tasks.

The baseline serves the triggers with Airflow's own ``airflow triggerer``: it proves the stack
and the expected states. The triggerflow variant runs the same DAGs with no ``airflow
triggerer`` at all, served by ``triggerflow writer --airflow`` and one ``triggerflow consume
--airflow --queue Q`` per team queue.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from testbed.airflow_stack import AirflowStack
from tests.airflow_conformance import TaskEnd, TaskKey, assert_conforms, ends
from tests.airflow_support import airflow_template, serve_with_triggerflow, stack_database
from tests.conftest import ROOT
from triggerflow.settings import AIRFLOW_RESUME_DELAY

__all__ = ["airflow_template"]

# A real Airflow stack (scheduler, API server, DAG processor): `make test-airflow`'s stage.
pytestmark = pytest.mark.airflow_stack

DAGS = ROOT / "tests" / "airflow_dags"
TEAMS = ("team-ml", "team-data-eng")
QUEUES = ("default", *TEAMS)
MAPPED = 20
RUN_TIMEOUT = 240.0  # seconds for both DAG runs to finish
FILE_AFTER = 20.0  # seconds the FileSensor waits, deferred, before its file appears

SUCCEEDS, FAILS = "tf_e2e_succeeds", "tf_e2e_fails"
# (dag_id, task_id) -> the state Airflow gives every instance of it.
EXPECTED = {
    (SUCCEEDS, "datetime_sensor"): "success",
    (SUCCEEDS, "timedelta_sensor_end_from_trigger"): "success",
    (SUCCEEDS, "file_sensor"): "success",
    (SUCCEEDS, "mapped_team_ml"): "success",
    (SUCCEEDS, "mapped_team_data_eng"): "success",
    (FAILS, "raising_trigger"): "failed",
    (FAILS, "deferral_times_out"): "failed",
}
RUN_STATES = {SUCCEEDS: "success", FAILS: "failed"}
TEAM_OF = {"mapped_team_ml": "team-ml", "mapped_team_data_eng": "team-data-eng"}

TI_QUERY = """
SELECT ti.dag_id, ti.task_id, ti.map_index, ti.state, t.queue
FROM task_instance ti LEFT JOIN trigger t ON t.id = ti.trigger_id
WHERE ti.run_id = ANY(%s)
"""


@dataclass
class Outcome:
    """What the DAG runs did, as seen by polling Airflow's tables."""

    states: dict[tuple[str, str, int], str] = field(default_factory=dict)
    deferred: set[tuple[str, str, int]] = field(default_factory=set)
    trigger_queues: dict[tuple[str, str, int], str | None] = field(default_factory=dict)
    run_states: dict[str, str] = field(default_factory=dict)
    run_ids: dict[str, str] = field(default_factory=dict)  # dag_id -> this test's run
    ends: dict[TaskKey, TaskEnd] = field(default_factory=dict)  # how each instance ended
    seconds: float = 0.0


@pytest.fixture(scope="module")
def airflow_stack(pg_server: str, airflow_template: str) -> Iterator[AirflowStack]:
    """A migrated, running Airflow stack with no triggerer, shared by this module's tests:
    each triggers its own DAG runs and stops the triggerer processes it started. Stopped and
    dropped afterwards (TRIGGERFLOW_TEST_KEEP_AIRFLOW_HOME=1 keeps its home for a
    post-mortem)."""
    stack = AirflowStack(pg_server, DAGS, extra_env={
        "PYTHONPATH": str(ROOT),  # tests.airflow_triggers, for workers and triggerers alike
        "AIRFLOW_CONN_FS_DEFAULT": json.dumps({"conn_type": "fs", "extra": {"path": "/"}}),
    })
    with stack_database(stack, airflow_template):
        stack.start()
        yield stack
    assert stack.leftovers() == [], "Airflow processes outlived the stack"


@contextlib.contextmanager
def serving(stack: AirflowStack, names: list[str]) -> Iterator[None]:
    """Stop the named processes (the triggerer side a test started) when the test ends, so
    the next test on the shared stack starts with no triggerer."""
    try:
        yield
    finally:
        for name in names:
            stack.stop_process(name)


def run_e2e_dags(stack: AirflowStack, tmp_path: Path) -> Outcome:
    """Trigger both DAGs, create the FileSensor's file once it waits, poll until both runs end."""
    import psycopg2  # type: ignore[import-untyped]

    stack.wait_for_dags([SUCCEEDS, FAILS])
    arrives = tmp_path / "arrives.txt"
    t0 = time.monotonic()
    run_ids = {SUCCEEDS: stack.trigger_dag(SUCCEEDS, {"path": str(arrives)}),
               FAILS: stack.trigger_dag(FAILS)}
    out = Outcome(run_ids=run_ids)
    file_waits_since: float | None = None
    conn = psycopg2.connect(stack.database_url)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            while time.monotonic() - t0 < RUN_TIMEOUT:
                stack.check_alive()
                cur.execute(TI_QUERY, (list(run_ids.values()),))
                for dag_id, task_id, map_index, state, queue in cur.fetchall():
                    key = (dag_id, task_id, map_index)
                    out.states[key] = state
                    if state == "deferred":
                        out.deferred.add(key)
                        out.trigger_queues[key] = queue
                if (SUCCEEDS, "file_sensor", -1) in out.deferred and file_waits_since is None:
                    file_waits_since = time.monotonic()
                # The file arrives well after the sensor deferred (see WAIT in the DAG file).
                if file_waits_since and time.monotonic() - file_waits_since > FILE_AFTER:
                    arrives.touch(exist_ok=True)
                cur.execute("SELECT dag_id, state FROM dag_run WHERE run_id = ANY(%s)",
                            (list(run_ids.values()),))
                out.run_states = dict(cur.fetchall())
                if all(s in ("success", "failed") for s in out.run_states.values()) and \
                        len(out.run_states) == 2:
                    break
                time.sleep(0.3)
    finally:
        conn.close()
    out.seconds = time.monotonic() - t0
    out.ends = ends(stack.database_url, run_ids)
    return out


def assert_airflow_outcome(out: Outcome, stack: AirflowStack) -> None:
    """Every task reached the state Airflow gives it, after waiting on a trigger."""
    where = f"\n(after {out.seconds:.0f}s; states {out.states})\n{stack.tail_logs()}"
    assert out.run_states == RUN_STATES, f"DAG runs {out.run_states}{where}"
    by_task: dict[tuple[str, str], list[tuple[int, str]]] = {}
    for (dag_id, task_id, map_index), state in out.states.items():
        by_task.setdefault((dag_id, task_id), []).append((map_index, state))
    assert set(by_task) == set(EXPECTED), where
    for task, instances in by_task.items():
        wrong = [(i, s) for i, s in instances if s != EXPECTED[task]]
        assert not wrong, f"{task}: expected {EXPECTED[task]}, got {wrong}{where}"
        # Each instance deferred first (not, say, a sensor that found its time already past).
        missed = [i for i, _ in instances if (*task, i) not in out.deferred]
        assert not missed, f"{task}: never seen deferred: map indexes {missed}{where}"
    for team_task, team in TEAM_OF.items():
        instances = sorted(i for (_, t, i) in out.states if t == team_task)
        assert instances == list(range(MAPPED)), f"{team_task}: {instances}"
        queues = {q for (_, t, _), q in out.trigger_queues.items() if t == team_task}
        assert queues == {team}, f"{team_task} trigger rows carried queues {queues}"
    # The raising trigger's traceback reached the worker through Airflow's __fail__ resume.
    logs = "\n".join(p.read_text(errors="replace") for p in (stack.home / "logs").rglob("*")
                     if p.is_file() and "task_id=raising_trigger" in str(p)
                     and f"run_id={out.run_ids[FAILS]}" in str(p))
    assert "raised on purpose by raising_trigger" in logs, f"raising_trigger's log:\n{logs[-3000:]}"


@pytest.fixture(scope="module")
def under_airflow(airflow_stack: AirflowStack, tmp_path_factory: pytest.TempPathFactory) -> Outcome:
    """The oracle: Airflow's own triggerer serves all three queues."""
    with serving(airflow_stack, ["triggerer"]):
        airflow_stack.start_triggerer(QUEUES)
        return run_e2e_dags(airflow_stack, tmp_path_factory.mktemp("oracle"))


def test_airflow_dags_reach_airflows_states_with_airflow_triggerer(
        airflow_stack: AirflowStack, under_airflow: Outcome) -> None:
    """Baseline: the stack and the expected states, under Airflow's own triggerer."""
    assert_airflow_outcome(under_airflow, airflow_stack)


def test_airflow_dags_reach_airflows_states_with_triggerflow(
        airflow_stack: AirflowStack, tmp_path: Path, amqp_server: str,
        under_airflow: Outcome) -> None:
    """No ``airflow triggerer``: triggerflow's writer and one consumer per queue serve, and
    every task instance ends as under Airflow's triggerer (state, try, XComs, history)."""
    # The shipped scheduler-race hold (a deployment's), not the suite's 0.
    names = serve_with_triggerflow(airflow_stack, amqp_server, list(QUEUES),
                                   f"tfaf{os.getpid()}", airflow_resume_delay=AIRFLOW_RESUME_DELAY)
    with serving(airflow_stack, names):
        # Airflow sees a healthy triggerer while triggerflow serves (the writer's heartbeat;
        # a triggerer stopped by an earlier test on this stack closed its job row).
        airflow_stack.wait_healthy(["triggerer"], 60)
        out = run_e2e_dags(airflow_stack, tmp_path)
    assert_airflow_outcome(out, airflow_stack)
    assert_conforms(under_airflow.ends, out.ends, f"\n{airflow_stack.tail_logs()}")
