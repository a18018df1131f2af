"""A task's end stops its trigger promptly (issue 18, item 5), on a real Airflow 3.3.2 stack
(scheduler, API server, dag-processor, LocalExecutor).

Each task defers on ``MarkerTrigger`` (tests/airflow_cancel_triggers.py), which never fires and
leaves a marker file when it starts, is cancelled, and when its triggerer calls ``on_kill()``
and ``cleanup()``. The cases (tests/airflow_cancel_dags/triggerflow_cancel.py): a 5 s deferral
timeout (the scheduler fails the task), a task cleared, marked success, marked failed through
the REST API while deferred, and a deferred task's DAG run deleted (with its DAG: the API refuses to delete a running run).

A poller reads each task instance every 20 ms; the row change happened after the last poll
that still saw the task deferred on its trigger, so ``cleanup - that poll's start`` bounds the
time from the row change to ``cleanup()`` from above.

- ``test_task_ends_stop_triggers_as_under_airflow_triggerer``: once under ``airflow
  triggerer`` (the oracle), once under triggerflow (no Airflow triggerer); the same final
  states and the same markers per case, and under triggerflow ``cleanup()`` within 1 s of
  the row change. triggerflow's periodic cancel sweep is set to 60 s here, so what stops the
  trigger is the notification.
- ``test_either_order_of_writer_clean_up_and_consumer``: the consumer stopped (SIGSTOP)
  while the writer's clean-up deletes the trigger row and triggerflow's bookkeeping, then
  resumed: ``cleanup()`` and ``on_kill()`` within 1 s of resuming; and the writer stopped
  while the consumer cancels: within 1 s of the row change, bookkeeping gone, and the
  writer's clean-up deletes the trigger row once resumed.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from testbed.airflow_stack import AirflowStack
from tests.airflow_conformance import TaskEnd, TaskKey, assert_conforms, ends
from tests.airflow_support import (
    airflow_minor,
    airflow_template,
    serve_with_triggerflow,
    stack_database,
)
from tests.conftest import ROOT

pytestmark = pytest.mark.airflow_stack  # make test-airflow (one stack at a time)

__all__ = ["airflow_template"]

DAGS = ROOT / "tests" / "airflow_cancel_dags"
QUEUE = "tf-cancel"  # RabbitMQ queue names are not namespaced: one namespace for the module
BOUND = 1.0  # seconds from the row change to cleanup()
WAIT = 240.0
# Airflow 3.3: a user's action calls on_kill(); 3.2's triggerer never calls it
KILLED = {"run", "cancel", "cleanup"} | ({"on_kill"} if airflow_minor() != "3.2" else set())
TIMED_OUT = {"run", "cancel", "cleanup"}  # Airflow: a timeout kills without on_kill()
CASES = {  # task -> (dag, markers Airflow's triggerer leaves, final state; None: row deleted)
    "timeout": ("tf_cancel_timeout", TIMED_OUT, "failed"),
    "clear": ("tf_cancel_hand", KILLED, "deferred"),  # cleared: runs again, defers again
    "mark_success": ("tf_cancel_hand", KILLED, "success"),
    "mark_failed": ("tf_cancel_hand", KILLED, "failed"),
    "delete": ("tf_cancel_delete", KILLED, None),
}
ALLOWED = ["airflow.providers.standard.triggers", "tests.airflow_triggers", "tests.airflow_cancel_triggers"]


@pytest.fixture(scope="module")
def markers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("markers")
    folder.chmod(0o777)
    return folder


@pytest.fixture(scope="module")
def cancel_stack(pg_server: str, airflow_template: str, markers: Path) -> Iterator[AirflowStack]:
    stack = AirflowStack(
        pg_server, DAGS, extra_env={"PYTHONPATH": str(ROOT), "TF_CANCEL_MARKERS": str(markers)}
    )
    with stack_database(stack, airflow_template):
        stack.start()
        stack.wait_for_dags(["tf_cancel_timeout", "tf_cancel_hand", "tf_cancel_delete"])
        yield stack
    assert stack.leftovers() == [], "Airflow processes outlived the stack"


@dataclass
class Watch:
    """Per task: the trigger it first deferred on, the start of the last poll that saw it
    deferred on that trigger, and its state since."""

    trigger: int | None = None
    last_deferred: float = 0.0
    state: str | None = "absent"
    seen: bool = False


@dataclass
class Poller:
    stack: AirflowStack
    run_ids: dict[str, str]
    tasks: dict[str, Watch] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.tasks = {task: Watch() for task in CASES}
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import psycopg2  # type: ignore[import-untyped]

        conn = psycopg2.connect(self.stack.database_url)
        conn.autocommit = True
        try:
            with conn.cursor() as cur:
                while not self.stop.is_set():
                    started = time.time()
                    cur.execute(
                        "SELECT task_id, state, trigger_id FROM task_instance WHERE run_id = ANY(%s)",
                        (list(self.run_ids.values()),),
                    )
                    found = {task: (state, trigger) for task, state, trigger in cur.fetchall()}
                    for task, watch in self.tasks.items():
                        state, trigger = found.get(task, ("absent", None))
                        watch.state = state
                        if state == "deferred" and watch.trigger is None:
                            watch.trigger = trigger
                        if state == "deferred" and trigger == watch.trigger:
                            watch.last_deferred, watch.seen = started, True
                    time.sleep(0.02)
        finally:
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


def steps(markers: Path, task: str, trigger: int | None) -> dict[str, float]:
    return {
        p.suffix[1:]: float(p.read_text() or 0) for p in markers.glob(f"{task}.{trigger}.*") if p.read_text()
    }


def wait_for(
    what: str, check: object, stack: AirflowStack, timeout: float = WAIT, seen: object = None
) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{what} not within {timeout:.0f}s (seen: {seen() if callable(seen) else None})\n"
                + stack.tail_logs()
            )
        stack.check_alive()
        time.sleep(0.1)


def cleaned_up(stack: AirflowStack, markers: Path, task: str, trigger: int | None) -> dict[str, float]:
    """The trigger's markers once it has been cleaned up (30 s at most)."""
    wait_for(
        f"{task}'s trigger cleaned up", lambda: "cleanup" in steps(markers, task, trigger), stack, timeout=30
    )
    return steps(markers, task, trigger)


def api(stack: AirflowStack, method: str, path: str, body: object = None) -> None:
    response = httpx.request(
        method, f"{stack.base_url}/api/v2/{path}", json=body, headers=stack._headers(), timeout=180.0
    )
    assert response.status_code < 300, f"{method} {path}: {response.status_code} {response.text}"


def end_by_hand(stack: AirflowStack, task: str, run_id: str) -> None:
    dag = CASES[task][0]
    if task == "clear":
        api(
            stack,
            "POST",
            f"dags/{dag}/clearTaskInstances",
            {
                "dry_run": False,
                "dag_run_id": run_id,
                "task_ids": [task],
                "only_failed": False,
                "reset_dag_runs": False,
            },
        )
    elif task == "delete":
        # Airflow 3.3.2's API refuses to delete a running DAG run (409); deleting the DAG
        # deletes its runs and task instances, deferred ones included (only running ones
        # refuse). The dag-processor parses it again afterwards.
        api(stack, "DELETE", f"dags/{dag}")
    else:
        api(
            stack,
            "PATCH",
            f"dags/{dag}/dagRuns/{run_id}/taskInstances/{task}",
            {"new_state": task.removeprefix("mark_")},
        )


def start_runs(stack: AirflowStack, markers: Path, tasks: list[str]) -> Poller:
    stack.wait_for_dags({CASES[t][0] for t in tasks}, timeout=WAIT)  # a deleted one is back
    run_ids = {dag: stack.trigger_dag(dag) for dag in {CASES[t][0] for t in tasks}}
    poller = Poller(stack, run_ids)
    poller.tasks = {t: poller.tasks[t] for t in tasks}
    try:
        wait_for(
            "tasks deferred and their triggers running",
            lambda: all(
                w.trigger is not None and "run" in steps(markers, t, w.trigger)
                for t, w in poller.tasks.items()
            ),
            stack,
            seen=lambda: (poller.tasks, sorted(p.name for p in markers.iterdir())),
        )
    except BaseException:
        poller.close()  # left polling, it fails the next test when the stack's database goes
        raise
    return poller


@dataclass
class Result:
    markers: dict[str, set[str]]
    states: dict[str, str | None]
    lags: dict[str, float]  # row change -> cleanup(), upper bound
    ends: dict[TaskKey, TaskEnd]  # how each instance ended (the cleared one: deferred again)


def run_cases(stack: AirflowStack, markers: Path) -> Result:
    poller = start_runs(stack, markers, list(CASES))
    try:
        for task in CASES:
            if task != "timeout":
                end_by_hand(stack, task, poller.run_ids[CASES[task][0]])
        wait_for(
            "every first trigger cleaned up",
            lambda: all("cleanup" in steps(markers, t, w.trigger) for t, w in poller.tasks.items()),
            stack,
        )
        wait_for(
            "final states",
            lambda: all(
                (w.state == "absent" if CASES[t][2] is None else w.state == CASES[t][2])
                for t, w in poller.tasks.items()
            ),
            stack,
        )
        time.sleep(2)  # an on_kill() after cleanup() would show now
        out = Result({}, {}, {}, ends(stack.database_url, poller.run_ids))
        for task, watch in poller.tasks.items():
            seen = steps(markers, task, watch.trigger)
            out.markers[task] = set(seen)
            out.states[task] = None if watch.state == "absent" else watch.state
            out.lags[task] = seen["cleanup"] - watch.last_deferred
        # the cleared task deferred again on a new trigger: end it, so the run finishes
        api(
            stack,
            "PATCH",
            f"dags/tf_cancel_hand/dagRuns/{poller.run_ids['tf_cancel_hand']}/taskInstances/clear",
            {"new_state": "failed"},
        )
        return out
    finally:
        poller.close()


def serve(stack: AirflowStack, amqp_server: str, **overrides: float) -> list[str]:
    """triggerflow's writer and consumer on QUEUE; the periodic sweep at 60 s, so what stops
    a trigger promptly is the notification."""
    return serve_with_triggerflow(
        stack,
        amqp_server,
        [QUEUE],
        f"tfcn{os.getpid()}",
        allowed_modules=ALLOWED,
        cancel_sweep_interval=60.0,
        **overrides,
    )


@pytest.mark.timeout(1800)  # a stack start, the cases under each triggerer, a stack stop
def test_task_ends_stop_triggers_as_under_airflow_triggerer(
    cancel_stack: AirflowStack, markers: Path, amqp_server: str
) -> None:
    try:
        cancel_stack.start_triggerer([QUEUE])
        oracle = run_cases(cancel_stack, markers)
    finally:
        cancel_stack.stop_process("triggerer")
    print(f"airflow triggerer: markers {oracle.markers}, lags {oracle.lags}")
    assert oracle.markers == {t: c[1] for t, c in CASES.items()}, oracle
    assert oracle.states == {t: c[2] for t, c in CASES.items()}, oracle

    names = serve(cancel_stack, amqp_server)
    try:
        ours = run_cases(cancel_stack, markers)
    finally:
        for name in names:
            cancel_stack.stop_process(name)
    print(f"triggerflow: markers {ours.markers}, lags {ours.lags}")
    assert ours.markers == oracle.markers, ours
    assert ours.states == oracle.states, ours
    assert_conforms(oracle.ends, ours.ends, f"\n{cancel_stack.tail_logs()}")
    assert all(lag <= BOUND for lag in ours.lags.values()), ours.lags


@pytest.mark.timeout(1200)
def test_either_order_of_writer_clean_up_and_consumer(
    cancel_stack: AirflowStack, markers: Path, amqp_server: str
) -> None:
    import psycopg2

    # a lease that outlives the SIGSTOP below: the consumer must not be fenced meanwhile
    names = serve(cancel_stack, amqp_server, lease_ttl=120.0, renew_interval=2.0)
    writer, consumer = (cancel_stack.processes[n].popen.pid for n in names)
    conn = psycopg2.connect(cancel_stack.database_url)
    conn.autocommit = True

    def rows(trigger: int | None) -> tuple[int, int]:
        with conn.cursor() as cur:
            cur.execute(
                'SELECT (SELECT count(*) FROM "trigger" WHERE id = %s), '
                "(SELECT count(*) FROM triggerflow.trigger_state WHERE trigger_id = %s)",
                (trigger, trigger),
            )
            found: tuple[int, int] = cur.fetchone()
            return found

    poller = start_runs(cancel_stack, markers, ["clear", "mark_success", "mark_failed"])
    run_id = poller.run_ids["tf_cancel_hand"]
    try:
        # 1. the writer's clean-up first: the consumer is stopped meanwhile
        first = poller.tasks["mark_success"]
        os.killpg(consumer, signal.SIGSTOP)
        try:
            end_by_hand(cancel_stack, "mark_success", run_id)
            wait_for(
                "trigger row and bookkeeping deleted by the writer",
                lambda: rows(first.trigger) == (0, 0),
                cancel_stack,
            )
            assert "cleanup" not in steps(markers, "mark_success", first.trigger)
        finally:
            resumed = time.time()
            os.killpg(consumer, signal.SIGCONT)
        seen = cleaned_up(cancel_stack, markers, "mark_success", first.trigger)
        print(f"writer first: resumed -> cleanup {seen['cleanup'] - resumed:.3f}s, {sorted(seen)}")
        assert set(seen) == KILLED
        assert seen["cleanup"] - resumed <= BOUND

        # 2. the consumer first: the writer is stopped meanwhile
        second = poller.tasks["mark_failed"]
        os.killpg(writer, signal.SIGSTOP)
        try:
            end_by_hand(cancel_stack, "mark_failed", run_id)
            seen = cleaned_up(cancel_stack, markers, "mark_failed", second.trigger)
            lag = seen["cleanup"] - second.last_deferred
            print(f"consumer first: row change -> cleanup <= {lag:.3f}s, {sorted(seen)}")
            assert set(seen) == KILLED
            assert lag <= BOUND
            wait_for(
                "bookkeeping deleted by the consumer",
                lambda: rows(second.trigger) == (1, 0),
                cancel_stack,
                timeout=10,
            )
        finally:
            os.killpg(writer, signal.SIGCONT)
        wait_for(
            "trigger row deleted by the resumed writer",
            lambda: rows(second.trigger) == (0, 0),
            cancel_stack,
            timeout=30,
        )
        api(
            cancel_stack,
            "PATCH",
            f"dags/tf_cancel_hand/dagRuns/{run_id}/taskInstances/clear",
            {"new_state": "failed"},
        )
    finally:
        poller.close()
        conn.close()
        for name in names:
            cancel_stack.stop_process(name)
