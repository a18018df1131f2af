"""Defer -> consume -> fire -> write, with real consumer and writer processes."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.conftest import ROOT, Processes, settings_env, wait_until
from tests.triggers import EventAfter, Mistaken, Raises, WaitsForever
from triggerflow.model import TaskKey
from triggerflow.sdk import Deferral, TriggerflowClient
from triggerflow.settings import Settings
from triggerflow.store.postgres import Database
from triggerflow.triggers import DateTimeTrigger, HttpTrigger
from triggerflow.wire import Event, encode_events


def key(i: int, dag: str = "dag") -> TaskKey:
    return TaskKey(dag, f"task{i}", "run1")


async def ti(db: Database, trigger_or_task: TaskKey) -> dict[str, object]:
    row = await db.fetchrow(
        "SELECT state, next_method, next_kwargs::text AS nk, result::text AS result, trigger_id "
        "FROM task_instance WHERE dag_id = $1 AND task_id = $2 AND run_id = $3",
        trigger_or_task.dag_id, trigger_or_task.task_id, trigger_or_task.run_id)
    assert row is not None
    d = dict(row)
    d["nk"] = json.loads(d["nk"]) if d["nk"] else None
    d["result"] = json.loads(d["result"]) if d["result"] else None
    return d


async def test_resume_event_schedules_task_with_next_method_and_kwargs(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str]
) -> None:
    procs.writer()
    procs.consume(teams[0])
    moment = datetime.now(UTC) + timedelta(seconds=1)
    await client.defer(key(1), DateTimeTrigger(moment), queue=teams[0],
                       method_name="resume_here", kwargs={"carry": 42})
    await client.defer(key(2), EventAfter(delay=0.2, payload={"answer": 7}), queue=teams[0])
    await wait_until(
        lambda: db.fetchval("SELECT count(*) = 2 FROM task_instance WHERE state = 'scheduled'"),
        15, message="both scheduled")
    first = await ti(db, key(1))
    assert first["next_method"] == "resume_here"
    assert first["nk"]["carry"] == 42
    assert datetime.fromisoformat(first["nk"]["event"]) == moment.replace(microsecond=moment.microsecond)
    second = await ti(db, key(2))
    assert second["nk"] == {"event": {"answer": 7}}
    assert second["next_method"] == "execute_complete"
    assert await db.fetchval("SELECT count(*) FROM trigger") == 0  # finished triggers removed


async def test_task_end_events_set_final_state_and_xcom(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str]
) -> None:
    procs.writer()
    procs.consume(teams[0])
    for i, kind in enumerate(["success", "failed", "skipped"]):
        await client.defer(key(i), EventAfter(kind=kind, payload={"rows": i}), queue=teams[0])
    await wait_until(lambda: db.fetchval(
        "SELECT count(*) = 3 FROM task_instance WHERE state <> 'deferred'"), 15)
    for i, kind in enumerate(["success", "failed", "skipped"]):
        row = await ti(db, key(i))
        assert row["state"] == kind
        assert row["result"] == {"rows": i}
        assert row["next_method"] is None and row["trigger_id"] is None


async def test_raising_trigger_resumes_into_fail_with_traceback(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str]
) -> None:
    procs.writer()
    procs.consume(teams[0])
    await client.defer(key(1), Raises(message="kaput"), queue=teams[0])
    await wait_until(lambda: db.fetchval(
        "SELECT state = 'scheduled' FROM task_instance"), 15)
    row = await ti(db, key(1))
    assert row["next_method"] == "__fail__"
    assert row["nk"]["error"] == "Trigger failure"
    assert "kaput" in row["nk"]["message"] and "tests.triggers.Raises" in row["nk"]["message"]
    assert any("ValueError: kaput" in line for line in row["nk"]["traceback"])


async def test_trigger_ending_without_a_valid_event_fails_its_task_naming_the_mistake(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str]
) -> None:
    """CancelledError raised by the trigger itself, None or a dict yielded: each task ends in
    __fail__ at once (not at its 7-day timeout) and the consumer goes on serving."""
    procs.writer()
    procs.consume(teams[0])
    mistakes = {"cancelled": "raised CancelledError itself", "none": "yielded NoneType",
                "dict": "yielded dict"}
    await client.defer_many([Deferral(key(i), Mistaken(mistake=m), teams[0])
                             for i, m in enumerate(mistakes)])
    await client.defer(key(9), EventAfter(delay=0.2, payload="after"), queue=teams[0])
    await wait_until(lambda: db.fetchval(
        "SELECT count(*) = 4 FROM task_instance WHERE state = 'scheduled'"), 15)
    for i, words in enumerate(mistakes.values()):
        row = await ti(db, key(i))
        assert row["next_method"] == "__fail__", row
        assert words in row["nk"]["message"] and "tests.triggers.Mistaken" in row["nk"]["message"]
    assert (await ti(db, key(9)))["nk"] == {"event": "after"}


async def test_timeout_fails_task_and_runs_cleanup(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str], tmp_path: Path
) -> None:
    procs.writer()
    procs.consume(teams[0])
    trigger_id = await client.defer(key(1), WaitsForever(marker_dir=str(tmp_path)),
                                    queue=teams[0], timeout=1.5)
    await wait_until(lambda: db.fetchval("SELECT state = 'scheduled' FROM task_instance"), 15)
    row = await ti(db, key(1))
    assert row["next_method"] == "__fail__" and row["nk"]["error"] == "Trigger timeout"
    await wait_until(lambda: asyncio.sleep(0, (tmp_path / f"cleanup-{trigger_id}").exists()), 15,
                     message="cleanup() ran after the timeout")


@pytest.mark.serial  # timing bound (cleanup within 3 s): runs alone, after the parallel part
async def test_cancel_runs_cleanup_on_the_owner(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str], tmp_path: Path
) -> None:
    procs.writer()
    procs.consume(teams[0])
    trigger_id = await client.defer(key(1), WaitsForever(marker_dir=str(tmp_path)),
                                    queue=teams[0])
    await wait_until(lambda: asyncio.sleep(0, (tmp_path / f"started-{trigger_id}").exists()), 10)
    started = time.monotonic()
    assert await client.cancel([trigger_id]) == 1
    await wait_until(lambda: asyncio.sleep(0, (tmp_path / f"cleanup-{trigger_id}").exists()), 5)
    assert time.monotonic() - started < 3
    assert (await ti(db, key(1)))["state"] == "removed"
    await wait_until(lambda: db.fetchval("SELECT count(*) = 0 FROM trigger"), 5)
    assert await client.cancel([trigger_id]) == 0  # idempotent


async def test_team_consumer_never_runs_another_teams_triggers(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str]
) -> None:
    ml, data = teams
    procs.writer()
    procs.consume(ml)
    soon = datetime.now(UTC) + timedelta(seconds=0.5)
    await client.defer_many([Deferral(key(i, "ml"), DateTimeTrigger(soon), ml) for i in range(20)])
    await client.defer_many(
        [Deferral(key(i, "data"), DateTimeTrigger(soon), data) for i in range(20)])
    await wait_until(lambda: db.fetchval(
        "SELECT count(*) = 20 FROM task_instance WHERE dag_id = 'ml' AND state = 'scheduled'"), 15)
    await asyncio.sleep(1.5)
    assert await db.fetchval(
        "SELECT count(*) FROM task_instance WHERE dag_id = 'data' AND state = 'deferred'") == 20
    assert await db.fetchval(
        "SELECT count(*) FROM trigger WHERE queue = $1 AND owner_id IS NOT NULL", data) == 0


async def test_duplicate_and_stale_events_change_nothing(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str],
    settings: Settings,
) -> None:
    """Deliver the same event twice, then a stale attempt: only the first counts."""
    from triggerflow.transport.rabbitmq import RabbitTransport, Topology

    procs.writer()
    tid = await client.defer(key(1), EventAfter(), queue=teams[0])
    tid2 = await client.defer(key(2), EventAfter(), queue=teams[0])
    # Pretend a consumer claimed both (attempt 1), as the claim statement would.
    await db.execute("UPDATE trigger SET attempt = 1")
    broker = RabbitTransport(settings.amqp_dsn(), Topology(settings.namespace))
    await broker.connect()
    first = Event(tid, 1, teams[0], "resume", json.dumps({"n": 1}), time.time())
    again = Event(tid, 1, teams[0], "resume", json.dumps({"n": 2}), time.time())
    stale = Event(tid2, 0, teams[0], "resume", json.dumps({"n": 3}), time.time())
    await broker.publish(broker.topology.events, teams[0], encode_events([first]))
    await wait_until(lambda: db.fetchval("SELECT state = 'scheduled' FROM task_instance "
                                         "WHERE task_id = 'task1'"), 10)
    await broker.publish(broker.topology.events, teams[0], encode_events([again, stale]))
    await broker.publish(broker.topology.events, teams[0], encode_events([first]))
    await asyncio.sleep(1.5)
    await broker.close()
    one = await ti(db, key(1))
    assert one["nk"] == {"event": {"n": 1}}
    two = await ti(db, key(2))
    assert two["state"] == "deferred"  # stale attempt 0 fenced out
    assert await db.fetchval("SELECT count(*) FROM trigger WHERE id = $1", tid2) == 1


async def test_cli_defer_1000_all_resolved(
    db: Database, procs: Processes, teams: list[str], settings: Settings
) -> None:
    procs.writer()
    procs.consume(teams[0])
    moment = (datetime.now(UTC) + timedelta(seconds=2)).isoformat()
    out = subprocess.run(
        [sys.executable, "-m", "triggerflow", "defer", "--queue", teams[0],
         "--trigger", "triggerflow.triggers.temporal.DateTimeTrigger",
         "--kwargs", json.dumps({"moment": moment}), "--count", "1000"],
        env=settings_env(settings), cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "deferred 1000 task(s)" in out.stdout
    await wait_until(lambda: db.fetchval(
        "SELECT count(*) = 1000 FROM task_instance WHERE state = 'scheduled'"), 30,
        message="1000 scheduled")
    assert await db.fetchval("SELECT count(*) FROM trigger") == 0


class HeldHandler(BaseHTTPRequestHandler):
    """Answers only once the test releases it: a target that is slow for as long as needed."""

    received = threading.Event()
    release = threading.Event()

    def do_GET(self) -> None:
        type(self).received.set()
        type(self).release.wait(60)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


async def test_io_trigger_does_not_delay_timers(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str]
) -> None:
    """1,000 timers fire and are applied while an HTTP trigger's request is still unanswered:
    I/O in one trigger holds up no other (no wall-clock bound, so load cannot fail it)."""
    HeldHandler.received.clear()
    HeldHandler.release.clear()
    server = ThreadingHTTPServer(("127.0.0.1", 0), HeldHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        procs.writer()
        procs.consume(teams[0])
        url = f"http://127.0.0.1:{server.server_address[1]}/ready"
        await client.defer(TaskKey("http", "wait", "r"), HttpTrigger(url, poke_interval=0.2),
                           queue=teams[0])
        await asyncio.to_thread(HeldHandler.received.wait, 30)
        assert HeldHandler.received.is_set(), "the HTTP trigger never sent its request"
        moment = datetime.now(UTC) + timedelta(seconds=1)
        await client.defer_many(
            [Deferral(key(i), DateTimeTrigger(moment), teams[0]) for i in range(1000)])
        await wait_until(lambda: db.fetchval(
            "SELECT count(*) = 1000 FROM task_instance WHERE dag_id = 'dag' "
            "AND state = 'scheduled'"), 30, message="1000 timers applied")
        assert await db.fetchval(
            "SELECT state FROM task_instance WHERE dag_id = 'http'") == "deferred", \
            "the HTTP request was still unanswered, so its task must still be deferred"
        HeldHandler.release.set()
        await wait_until(lambda: db.fetchval(
            "SELECT state = 'scheduled' FROM task_instance WHERE dag_id = 'http'"), 15)
    finally:
        HeldHandler.release.set()
        server.shutdown()


def _defer_in_child(client: object, queue: str, out: object) -> None:
    from triggerflow.sdk import SyncClient

    assert isinstance(client, SyncClient)
    try:
        trigger_id: object = client.defer(TaskKey("fork", "child", "r"), EventAfter(), queue=queue)
    except Exception as exc:  # reported to the parent, which fails the test with it
        trigger_id = repr(exc)
    out.put(trigger_id)  # type: ignore[attr-defined]


async def test_sync_client_works_in_parent_and_forked_child(
    db: Database, settings: Settings, teams: list[str], topology: object
) -> None:
    """Prefork workers: a SyncClient made before fork() keeps working in the child."""
    import multiprocessing

    from triggerflow.sdk import SyncClient

    def run() -> tuple[int, int]:
        client = SyncClient(settings)
        parent_id = client.defer(TaskKey("fork", "parent", "r"), EventAfter(), queue=teams[0])
        ctx = multiprocessing.get_context("fork")
        out = ctx.Queue()
        child = ctx.Process(target=_defer_in_child, args=(client, teams[0], out))
        child.start()
        child.join(timeout=30)
        child_id = out.get(timeout=5)
        assert isinstance(child_id, int), child_id
        client.close()
        return parent_id, child_id

    parent_id, child_id = await asyncio.to_thread(run)
    assert parent_id != child_id
    rows = await db.fetch("SELECT task_id, state FROM task_instance ORDER BY task_id")
    assert [(r["task_id"], r["state"]) for r in rows] == [("child", "deferred"), ("parent", "deferred")]
