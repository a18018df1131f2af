"""End to end on a real Airflow 3.3.2 (scheduler, API server, dag-processor, LocalExecutor):
triggers that call back into Airflow (tests/airflow_dags/triggerflow_runtime.py) end as they
do under ``airflow triggerer`` when ``triggerflow consume --airflow`` serves them instead.

The connection and the variable are stored through Airflow's REST API, so they live in its
database; no ``AIRFLOW_CONN_*``/``AIRFLOW_VAR_*`` variable is set for any process. The
baseline runs the DAGs under Airflow's own triggerer on the same stack.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

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
from triggerflow.settings import AIRFLOW_RESUME_DELAY

__all__ = ["airflow_template"]

# A real Airflow stack (scheduler, API server, DAG processor): `make test-airflow`'s stage.
pytestmark = [pytest.mark.airflow_stack, pytest.mark.timeout(420)]

DAGS = ROOT / "tests" / "airflow_dags"
QUEUE = "tf-runtime"  # the DAGs' queue (tests/airflow_dags/triggerflow_runtime.py)
RUN_TIMEOUT = 240.0  # under the test's timeout, so a miss prints the states and the logs
CONN_ID, VARIABLE, PASSWORD = "tf_runtime_conn", "tf_runtime_variable", "pa55-in-airflow-db"
VARIABLE_VALUE = "set through the REST API"
RUNS = {"tf_runtime_reads": "success", "tf_runtime_missing": "failed",
        "tf_runtime_dagrun": "success", "tf_runtime_hitl": "success",
        "tf_runtime_http": "success"}
HITL = ("tf_runtime_hitl", "approve")  # waits in awaiting_input, answered through the API
# ... at a human's pace: Airflow 3.3.2 fails the task when the answer lands before its
# scheduler has processed the worker's exit (answered 0.1 s after awaiting_input, with no
# triggerer at all: scheduled, queued, failed).
HITL_ANSWER_AFTER = 10.0
# The state a waiting HITL task shows: Airflow 3.3's awaiting_input; 3.2 has no such state.
HITL_WAITS = "deferred" if airflow_minor() == "3.2" else "awaiting_input"
HTTP = ("tf_runtime_http", "http_sensor")
HTTP_CONN_ID, HTTP_ENDPOINT = "tf_runtime_http_conn", "ready"
HTTP_READY_AFTER = 5.0  # seconds the sensor waits deferred before the endpoint answers 200
EXPECTED = {
    ("tf_runtime_reads", "reads_sync"): "success",
    ("tf_runtime_reads", "reads_sync_to_async"): "success",
    ("tf_runtime_reads", "reads_connection_get"): "success",
    ("tf_runtime_missing", "missing_conn"): "failed",
    ("tf_runtime_dagrun", "trigger_target"): "success",
    ("tf_runtime_dagrun", "external_sensor"): "success",
    HITL: "success",
    HTTP: "success",
}


class Endpoint(ThreadingHTTPServer):
    """``GET /ready``: 404 until ``ready`` is set, then 200; counts both answers."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.answers = {404: 0, 200: 0}
        super().__init__(("127.0.0.1", 0), EndpointHandler)

    def reset(self) -> None:
        self.ready.clear()
        self.answers = {404: 0, 200: 0}


class EndpointHandler(BaseHTTPRequestHandler):
    server: Endpoint

    def do_GET(self) -> None:
        code = 200 if self.server.ready.is_set() and self.path == f"/{HTTP_ENDPOINT}" else 404
        self.server.answers[code] += 1
        self.send_response(code)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: object) -> None:
        return None


@dataclass
class Outcome:
    states: dict[tuple[str, str], str] = field(default_factory=dict)
    deferred: set[tuple[str, str]] = field(default_factory=set)
    awaiting_since: float | None = None  # monotonic time the HITL task was seen awaiting input
    http_deferred_since: float | None = None  # ... the HTTP sensor was seen deferred
    answered: bool = False
    run_states: dict[str, str] = field(default_factory=dict)
    run_ids: dict[str, str] = field(default_factory=dict)
    xcoms: dict[str, str] = field(default_factory=dict)  # task_id -> return_value JSON text
    ends: dict[TaskKey, TaskEnd] = field(default_factory=dict)  # how each instance ended
    answers: dict[int, int] = field(default_factory=dict)  # the endpoint's, by status
    seconds: float = 0.0


@pytest.fixture(scope="module")
def endpoint() -> Iterator[Endpoint]:
    server = Endpoint()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def runtime_stack(pg_server: str, airflow_template: str,
                  endpoint: Endpoint) -> Iterator[AirflowStack]:
    stack = AirflowStack(pg_server, DAGS, extra_env={"PYTHONPATH": str(ROOT)})
    with stack_database(stack, airflow_template):
        stack.start()
        stack.api("POST", "connections", json={
            "connection_id": CONN_ID, "conn_type": "http", "host": "api.example",
            "login": "svc", "password": PASSWORD})
        stack.api("POST", "connections", json={
            "connection_id": HTTP_CONN_ID, "conn_type": "http", "host": "127.0.0.1",
            "port": endpoint.server_address[1], "schema": "http"})
        stack.api("POST", "variables", json={"key": VARIABLE, "value": VARIABLE_VALUE})
        yield stack
    assert stack.leftovers() == [], "Airflow processes outlived the stack"


def answer_hitl(stack: AirflowStack, out: Outcome) -> None:
    """Answer the HITL task "yes" through the REST API once it has waited long enough."""
    if out.states.get(HITL) == HITL_WAITS:
        out.awaiting_since = out.awaiting_since or time.monotonic()
    if out.awaiting_since and not out.answered and \
            time.monotonic() - out.awaiting_since > HITL_ANSWER_AFTER:
        stack.api("PATCH", f"dags/{HITL[0]}/dagRuns/{out.run_ids[HITL[0]]}/"
                  f"taskInstances/{HITL[1]}/-1/hitlDetails", json={"chosen_options": ["yes"]})
        out.answered = True


def open_endpoint(endpoint: Endpoint, out: Outcome) -> None:
    """Answer 200 once the HTTP sensor has been deferred a while and its trigger has polled
    (a 404 after the worker's own first poke). Not sooner: a trigger that fires right after
    the deferral meets Airflow's scheduler race (docs/airflow-race.md), under either triggerer,
    and the suite's triggerflow runs without the hold (tests/conftest.py FAST)."""
    if out.states.get(HTTP) == "deferred":
        out.http_deferred_since = out.http_deferred_since or time.monotonic()
    if out.http_deferred_since and endpoint.answers[404] >= 2 \
            and time.monotonic() - out.http_deferred_since > HTTP_READY_AFTER:
        endpoint.ready.set()


def run_dags(stack: AirflowStack, endpoint: Endpoint) -> Outcome:
    import psycopg2  # type: ignore[import-untyped]

    endpoint.reset()
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
                answer_hitl(stack, out)
                open_endpoint(endpoint, out)
                cur.execute("SELECT dag_id, state FROM dag_run WHERE run_id = ANY(%s)",
                            (list(out.run_ids.values()),))
                out.run_states = {d: s for d, s in cur.fetchall() if d in RUNS}
                if len(out.run_states) == len(RUNS) and all(
                        s in ("success", "failed") for s in out.run_states.values()):
                    break
                time.sleep(0.5)
            cur.execute("SELECT task_id, value::text FROM xcom WHERE key = 'return_value' "
                        "AND (dag_id, run_id) IN (('tf_runtime_reads', %s), ('tf_runtime_hitl', %s))",
                        (out.run_ids["tf_runtime_reads"], out.run_ids["tf_runtime_hitl"]))
            out.xcoms = dict(cur.fetchall())
    finally:
        conn.close()
    out.seconds = time.monotonic() - t0
    out.ends = ends(stack.database_url, out.run_ids)
    out.answers = dict(endpoint.answers)
    return out


def task_log(stack: AirflowStack, run_id: str, task_id: str) -> str:
    """The task's own log files (what Airflow's UI shows for it)."""
    return "\n".join(p.read_text(errors="replace") for p in (stack.home / "logs").rglob("*")
                     if p.is_file() and f"task_id={task_id}" in str(p)
                     and f"run_id={run_id}" in str(p))


def assert_outcome(out: Outcome, stack: AirflowStack) -> None:
    wrong = [key for key, state in EXPECTED.items() if out.states.get(key) != state]
    where = (f"\n(after {out.seconds:.0f}s; states {out.states})\n{stack.tail_logs()}\n"
             + "\n".join(task_log(stack, out.run_ids[dag_id], task_id)[-4000:]
                         for dag_id, task_id in wrong or [HITL]))
    assert out.run_states == RUNS, f"DAG runs {out.run_states}{where}"
    assert out.states == EXPECTED, where
    deferring = set(EXPECTED) - ({HITL} if HITL_WAITS != "deferred" else set())
    assert out.deferred == deferring, f"never seen deferred: {deferring - out.deferred}"
    assert out.answered, "the HITL task was never seen awaiting input"
    assert '"yes"' in out.xcoms.get("approve", ""), out.xcoms
    for task_id in ("reads_sync", "reads_sync_to_async", "reads_connection_get"):
        value = out.xcoms.get(task_id, "")
        assert PASSWORD in value and VARIABLE_VALUE in value and "svc" in value, out.xcoms
    # the worker's first poke and at least one of the trigger's polls found 404; one 200 ended it
    assert out.answers[404] >= 2 and out.answers[200] >= 1, out.answers
    logs = task_log(stack, out.run_ids["tf_runtime_missing"], "missing_conn")
    assert "The conn_id `tf_no_such_conn` isn't defined" in logs, logs[-3000:]


@pytest.fixture(scope="module")
def under_airflow(runtime_stack: AirflowStack, endpoint: Endpoint) -> Outcome:
    """The oracle: Airflow's own triggerer answers the triggers' requests."""
    try:
        runtime_stack.start_triggerer([QUEUE])
        return run_dags(runtime_stack, endpoint)
    finally:
        runtime_stack.stop_process("triggerer")


def test_runtime_dags_with_airflow_triggerer(runtime_stack: AirflowStack,
                                            under_airflow: Outcome) -> None:
    """Baseline: the stack and the expected ends, under Airflow's own triggerer."""
    assert_outcome(under_airflow, runtime_stack)


def test_runtime_dags_with_triggerflow(runtime_stack: AirflowStack, amqp_server: str,
                                      endpoint: Endpoint, under_airflow: Outcome) -> None:
    """No ``airflow triggerer``: ``consume --airflow`` answers them, and every task instance
    ends as under Airflow's triggerer (state, try, XComs, history)."""
    names = serve_with_triggerflow(
        runtime_stack, amqp_server, [QUEUE], f"tfrt{os.getpid()}",
        allowed_modules=["airflow.providers.standard.triggers", "airflow.providers.http.triggers",
                         "tests.airflow_triggers"],
        # The shipped hold, not the suite's 0: these triggers fire seconds after their
        # deferral, inside the scheduler race's window on a loaded machine (a CI run had
        # `reads_connection_get` failed by the scheduler, never resumed, with the hold off).
        airflow_resume_delay=AIRFLOW_RESUME_DELAY)
    try:
        out = run_dags(runtime_stack, endpoint)
    finally:
        for name in names:
            runtime_stack.stop_process(name)
    assert_outcome(out, runtime_stack)
    assert_conforms(under_airflow.ends, out.ends, f"\n{runtime_stack.tail_logs()}")
