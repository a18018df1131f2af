"""Trigger rows with no task on a real Airflow 3.3.2 stack (scheduler, API server,
dag-processor, LocalExecutor): DAGs scheduled by assets whose watchers are
``FileDeleteTrigger``, ``DirectoryFileDeleteTrigger`` and a watcher that counts its fires
in its asset's state store (``tests/airflow_asset_dags/triggerflow_assets.py``) and triggerflow's
``RabbitMQQueueTrigger`` (``triggerflow_rabbitmq.py``), and a deadline alert whose
``AsyncCallback`` runs on the triggerer (``triggerflow_deadline.py``).

Each test has two phases on one stack, Airflow's own triggerer first as the oracle:
1. ``airflow triggerer`` (no ``--queues``: the only triggerer that takes queue-less rows);
2. no Airflow triggerer at all: ``triggerflow writer --airflow`` and ``consume --airflow
   --queue default`` with ``--default-queue default``.
In each phase each watched file is created twice, the second time after the first DAG run
ended: the watcher must fire, stay (be started again after its ``run()`` ended, as Airflow
does) and fire again. Compared between the phases: the asset events (``extra``, source
columns), the DAG runs they created (``run_type``, ``triggered_by``, state, the asset event
each consumed) and the task's result (how many asset events triggered it). For the deadline:
the callback row Airflow's scheduler created (state, output, trigger detached) and the
callable's own marker line.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from testbed.airflow_stack import AirflowStack, airflow_bin
from testbed.broker import delete_queues
from tests.airflow_support import (
    airflow_3_3_only,
    airflow_template,
    serve_with_triggerflow,
    stack_database,
)
from tests.conftest import ROOT
from triggerflow.airflow.schema import SCHEMA

__all__ = ["airflow_template"]
# Two phases of DAG runs per test: past the suite's 300 s per test under this machine's load.
pytestmark = [pytest.mark.timeout(1500), pytest.mark.airflow_stack]

DAGS = ROOT / "tests" / "airflow_asset_dags"
DAG_ID = "tf_asset_scheduled"
ASSET = "tf_asset_flag"
INBOX_DAG_ID = "tf_asset_inbox_scheduled"
INBOX_ASSET = "tf_asset_inbox"
COUNTED_DAG_ID, COUNTED_ASSET = "tf_asset_counted_scheduled", "tf_asset_counted"
FIRES = 2
RABBIT_DAG_ID, RABBIT_ASSET = "tf_rabbitmq_scheduled", "tf_rabbitmq_orders"
SOURCE_QUEUE = f"tf-asset-source-{os.getpid()}"  # on the suite's broker, this module's own
WAIT = 300.0  # seconds for one fire to become an ended DAG run, under load

EVENTS = """
SELECT ae.id, ae.extra, ae.source_dag_id, ae.source_task_id, ae.source_run_id,
       ae.source_map_index
FROM asset_event ae JOIN asset a ON a.id = ae.asset_id WHERE a.name = %s ORDER BY ae.id
"""
RUNS = """
SELECT dr.run_id, dr.run_type, dr.triggered_by, dr.state,
       array(SELECT dae.event_id FROM dagrun_asset_event dae WHERE dae.dag_run_id = dr.id
             ORDER BY dae.event_id) AS events,
       (SELECT x.value FROM xcom x WHERE x.dag_run_id = dr.id AND x.key = 'return_value')
FROM dag_run dr WHERE dr.dag_id = %s ORDER BY dr.id
"""
WATCHER_ROWS = """
SELECT t.id, t.queue FROM "trigger" t JOIN asset_watcher aw ON aw.trigger_id = t.id
"""


@pytest.fixture(scope="module")
def flag() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="tf-asset-") as tmp:
        yield Path(tmp) / "flag"


@pytest.fixture(scope="module")
def asset_stack(pg_server: str, airflow_template: str, flag: Path, amqp_server: str,
                services: Any) -> Iterator[AirflowStack]:
    """The stack, its broker connection ``tf_rabbitmq`` and the RabbitMQ watcher's queue
    made first, so that watcher waits quietly (no failing restarts) in every test."""
    inbox = flag.with_name("inbox")
    inbox.mkdir()
    stack = AirflowStack(pg_server, DAGS, extra_env={
        "PYTHONPATH": str(ROOT), "TF_ASSET_FLAG": str(flag), "TF_ASSET_INBOX": str(inbox),
        "TF_ASSET_COUNTED": str(flag.with_name("counted")),
        "TF_DEADLINE_MARKER": str(flag.with_name("deadline-marker")),
        "TF_ASSET_QUEUE": SOURCE_QUEUE})
    with stack_database(stack, airflow_template):
        stack.start()
        host, port = amqp_server.rsplit("@", 1)[1].split("/")[0].split(":")
        stack.api("POST", "connections", json={
            "connection_id": "tf_rabbitmq", "conn_type": "amqp", "host": host,
            "port": int(port), "login": "guest", "password": "guest"})
        _source(amqp_server, services.management)
        yield stack
    delete_queues(amqp_server, [SOURCE_QUEUE])
    assert stack.leftovers() == [], "Airflow processes outlived the stack"


def _query(stack: AirflowStack, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    import psycopg2  # type: ignore[import-untyped]

    conn = psycopg2.connect(stack.database_url)
    try:
        with conn.cursor() as cur:
            cur.execute(sql, args)
            return list(cur.fetchall())
    finally:
        conn.close()


def _wait(stack: AirflowStack, what: str, check: Any, timeout: float = WAIT) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stack.check_alive()
        found = check()
        if found:
            return found
        time.sleep(0.3)
    raise AssertionError(f"{what} not within {timeout:.0f}s\n{stack.tail_logs()}\n"
                         f"{_rows_now(stack)}")


def _rows_now(stack: AirflowStack) -> str:
    """The trigger, callback and triggerflow bookkeeping rows, for a failure's message."""
    lines = ["----- rows now"]
    for sql in ('SELECT id, classpath, queue, triggerer_id, created_date FROM "trigger"',
                "SELECT id, state, trigger_id, created_at FROM callback",
                f"SELECT * FROM {SCHEMA}.trigger_state",
                "SELECT id, job_type, state, latest_heartbeat FROM job "
                "WHERE job_type = 'TriggererJob'"):
        try:
            lines += [sql, *map(repr, _query(stack, sql))]
        except Exception as exc:  # the message must not hide the failure it explains
            lines.append(f"{sql}: {exc!r}")
    return "\n".join(lines)


def fire_twice(stack: AirflowStack, fire: Callable[[int], object], fired: Callable[[], bool],
               asset: str, dag_id: str) -> dict[str, Any]:
    """``fire(n)`` ``FIRES`` times, each once ``fired()`` and after the previous DAG run
    ended; returns the asset events and DAG runs that appeared, in the shape both phases are
    compared in."""
    events_before = {r[0] for r in _query(stack, EVENTS, asset)}
    runs_before = {r[0] for r in _query(stack, RUNS, dag_id)}
    seconds = []
    for n in range(1, FIRES + 1):
        fire(n)
        t0 = time.monotonic()
        _wait(stack, f"fire {n}: the watcher taking it", fired)
        _wait(stack, f"fire {n}: DAG run {n} ended", lambda n=n: len(
            [r for r in _query(stack, RUNS, dag_id)
             if r[0] not in runs_before and r[3] in ("success", "failed")]) >= n)
        seconds.append(time.monotonic() - t0)
    time.sleep(3.0)  # anything extra (a duplicate event, a third run) shows up by now
    events = [r for r in _query(stack, EVENTS, asset) if r[0] not in events_before]
    runs = [r for r in _query(stack, RUNS, dag_id) if r[0] not in runs_before]
    index = {row[0]: i for i, row in enumerate(events)}  # event ids differ between phases
    return {
        "events": [row[1:] for row in events],
        "runs": [(run_type, triggered_by, state, [index.get(e) for e in consumed],
                  json.loads(value) if isinstance(value, str) else value)
                 for _, run_type, triggered_by, state, consumed, value in runs],
        "seconds": seconds,
    }


def file_fires(flag: Path) -> tuple[Callable[[int], object], Callable[[], bool]]:
    """A watched file created (fire n) and deleted by its watcher (fired)."""
    return (lambda n: flag.write_text(f"fire {n}\n")), (lambda: not flag.exists())


def serve_triggerflow(stack: AirflowStack, amqp_server: str) -> list[str]:
    """Queue-less rows to triggerflow's ``default`` queue; ``CallbackTrigger`` allowed."""
    return serve_with_triggerflow(
        stack, amqp_server, ["default"], f"tfas{os.getpid()}", default_queue="default",
        allowed_modules=["airflow.providers.standard.triggers", "airflow.triggers.callback",
                         "triggerflow.airflow.rabbitmq", "tests.airflow_triggers"])


Outcome = dict[str, Any]


def oracle_then_triggerflow(stack: AirflowStack, amqp_server: str,
                            case: Callable[[], Outcome],
                            then: Callable[[list[str]], None] | None = None,
                            ) -> tuple[Outcome, Outcome]:
    """``case`` under Airflow's own triggerer (no ``--queues``: it takes queue-less rows),
    then under triggerflow alone, no Airflow triggerer process: both outcomes. ``then``
    runs after triggerflow's ``case``, given its processes' names, before they stop."""
    stack.spawn("triggerer", [str(airflow_bin()), "triggerer"])
    try:
        stack.wait_healthy(["triggerer"], 120)
        oracle = case()
    finally:
        stack.stop_process("triggerer")
    names = serve_triggerflow(stack, amqp_server)
    try:
        assert "triggerer" not in stack.processes
        ours = case()
        if then is not None:
            then(names)
    finally:
        for name in names:
            stack.stop_process(name)
    return oracle, ours


# On 3.2: the standard provider's DirectoryFileDeleteTrigger (1.21.0) imports Airflow 3.3's
# shared streams, and the RabbitMQ source is an ack-mode shared stream.
@airflow_3_3_only
def test_asset_watcher_schedules_dag_runs_as_under_airflow_triggerer(
        asset_stack: AirflowStack, flag: Path, amqp_server: str) -> None:
    stack = asset_stack
    stack.wait_for_dags([DAG_ID, INBOX_DAG_ID, COUNTED_DAG_ID])
    rows = _wait(stack, "the watchers' trigger rows",  # file, directory, counted and queue
                 lambda: [r for r in [_query(stack, WATCHER_ROWS)] if len(r) == 4], 120)[0]
    assert [queue for _, queue in rows] == [None] * 4, rows  # a watcher's row has no queue
    go = flag.with_name("inbox") / "go"
    counted = flag.with_name("counted")

    def case() -> dict[str, Any]:
        return {"file": fire_twice(stack, *file_fires(flag), ASSET, DAG_ID),
                "directory": fire_twice(stack, *file_fires(go), INBOX_ASSET, INBOX_DAG_ID),
                "counted": fire_twice(stack, *file_fires(counted), COUNTED_ASSET,
                                      COUNTED_DAG_ID)}

    # The same trigger rows, first under the oracle, then under triggerflow alone.
    oracle, ours = oracle_then_triggerflow(stack, amqp_server, case)

    where = f"\noracle {oracle}\ntriggerflow {ours}"
    # The counting watcher's count is its asset's state store in Airflow's database:
    # triggerflow's fires go on from the oracle's (3 and 4 after 1 and 2).
    payloads = {"file": ([True] * FIRES, [True] * FIRES),
                "directory": ([{"filepath": str(go)}] * FIRES,) * 2,
                "counted": ([{"fires": n} for n in range(1, FIRES + 1)],
                            [{"fires": n} for n in range(FIRES + 1, 2 * FIRES + 1)])}
    for watcher, (under_airflow, under_triggerflow) in payloads.items():
        for outcome, expected in ((oracle, under_airflow), (ours, under_triggerflow)):
            assert outcome[watcher]["events"] == [
                ({"from_trigger": True, "payload": payload}, None, None, None, -1)
                for payload in expected], where
        assert oracle[watcher]["runs"] == [("asset_triggered", "ASSET", "success", [i], 1)
                                           for i in range(FIRES)], where
        assert ours[watcher]["runs"] == oracle[watcher]["runs"], where
        print(f"\n{watcher} watcher, seconds from the file to an ended DAG run: airflow "
              f"triggerer {oracle[watcher]['seconds']}, triggerflow {ours[watcher]['seconds']}")


CALLBACKS = """
SELECT cb.id, cb.type, cb.fetch_method, cb.state, cb.output, cb.trigger_id IS NULL,
       cb.data::text LIKE '%%tests.airflow_triggers.deadline_missed%%'
FROM callback cb ORDER BY cb.created_at
"""
DEADLINE_DAG = "tf_deadline_missed"


def miss_deadline(stack: AirflowStack, marker: Path) -> dict[str, Any]:
    """One DAG run that overruns its deadline; its callback's row once it ended."""
    before = {r[0] for r in _query(stack, CALLBACKS)}
    run_id = stack.trigger_dag(DEADLINE_DAG)
    rows = _wait(stack, "the deadline's callback ended", lambda: [
        r for r in _query(stack, CALLBACKS)
        if r[0] not in before and r[3] in ("success", "failed")])
    _wait(stack, "the DAG run ended", lambda: [r for r in _query(stack, RUNS, DEADLINE_DAG)
                                               if r[0] == run_id and r[3] == "success"])
    time.sleep(3.0)  # a second run of the callback would show by now
    lines = marker.read_text().splitlines() if marker.exists() else []
    return {"callbacks": [r[1:] for r in _query(stack, CALLBACKS) if r[0] not in before],
            # the callable ran once per miss, given its DAG run's context
            "marker": [run_id in line for line in lines], "ended": len(rows)}


def test_deadline_callback_runs_as_under_airflow_triggerer(
        asset_stack: AirflowStack, flag: Path, amqp_server: str) -> None:
    stack = asset_stack
    marker = flag.with_name("deadline-marker")
    stack.wait_for_dags([DEADLINE_DAG])

    def case() -> dict[str, Any]:
        try:
            return miss_deadline(stack, marker)
        finally:
            marker.unlink(missing_ok=True)

    oracle, ours = oracle_then_triggerflow(stack, amqp_server, case)

    where = f"\noracle {oracle}\ntriggerflow {ours}"
    assert oracle["callbacks"] == [
        ("triggerer", "import_path", "success", "deadline missed", True, True)], where
    assert oracle["marker"] == [True], where  # called once, given its DAG run's context
    assert ours == oracle, where


def _source(amqp_server: str, management: str, *, publish: str | None = None,
            message_id: str | None = None) -> dict[str, int]:
    """Declare the source queue (idempotent), publish one message if asked; returns its
    counts from the management API (ready, unacked), refreshed each second in the suite."""
    import asyncio

    import aio_pika
    import httpx

    async def go() -> None:
        conn = await aio_pika.connect(amqp_server)
        async with conn:
            channel = await conn.channel()
            await channel.declare_queue(SOURCE_QUEUE)
            if publish is not None:
                await channel.default_exchange.publish(
                    aio_pika.Message(publish.encode(), message_id=message_id), SOURCE_QUEUE)

    asyncio.run(go())
    info = httpx.get(f"{management.rstrip('/')}/api/queues/%2F/{SOURCE_QUEUE}", timeout=10).json()
    return {"ready": int(info.get("messages_ready", 0)),
            "unacked": int(info.get("messages_unacknowledged", 0))}


@airflow_3_3_only  # an ack-mode shared stream: Airflow 3.3's
def test_rabbitmq_queue_schedules_dag_runs_as_under_airflow_triggerer(
        asset_stack: AirflowStack, amqp_server: str, services: Any) -> None:
    """Each message of a RabbitMQ queue one asset event and one DAG run, under both; under
    triggerflow, a message is acked only once its asset event is committed (the writer
    stopped: taken, not acked, no event; resumed: the event, then the ack)."""
    stack = asset_stack
    management = services.management
    stack.wait_for_dags([RABBIT_DAG_ID])

    def drained() -> bool:
        counts = _source(amqp_server, management)
        return counts == {"ready": 0, "unacked": 0}

    def case() -> dict[str, Any]:
        return fire_twice(stack, lambda n: _source(amqp_server, management, publish=f"order {n}",
                                                   message_id=f"order-{n}"),
                          drained, RABBIT_ASSET, RABBIT_DAG_ID)

    spied: dict[str, Any] = {}

    def acked_after_commit(names: list[str]) -> None:
        writer = stack.processes["tf-writer"].popen.pid
        before = len(_query(stack, EVENTS, RABBIT_ASSET))
        os.killpg(writer, signal.SIGSTOP)
        try:
            _source(amqp_server, management, publish="order 3", message_id="order-3")
            spied["taken"] = _wait(stack, "the message taken, not acked", lambda: (
                _source(amqp_server, management) == {"ready": 0, "unacked": 1}), 60)
            time.sleep(3.0)  # an ack or an event without the writer would show by now
            spied["held"] = _source(amqp_server, management)
            spied["events_while_stopped"] = len(_query(stack, EVENTS, RABBIT_ASSET)) - before
        finally:
            os.killpg(writer, signal.SIGCONT)
        _wait(stack, "the event committed and the message acked", lambda: drained() and len(
            _query(stack, EVENTS, RABBIT_ASSET)) == before + 1, 60)

    oracle, ours = oracle_then_triggerflow(stack, amqp_server, case, acked_after_commit)

    where = f"\noracle {oracle}\ntriggerflow {ours}\nspied {spied}"
    assert [event[0]["payload"]["body"] for event in oracle["events"]] == [
        "order 1", "order 2"], where
    assert oracle["runs"] == [("asset_triggered", "ASSET", "success", [i], [f"order {i + 1}"])
                              for i in range(FIRES)], where
    assert ours["events"] == oracle["events"], where
    assert ours["runs"] == oracle["runs"], where
    assert spied["held"] == {"ready": 0, "unacked": 1}, where
    assert spied["events_while_stopped"] == 0, where
