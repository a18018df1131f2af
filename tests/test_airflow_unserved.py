"""A trigger row nothing serves is named, not healthy in silence
(``triggerflow/airflow/statements/unserved.py``), on real Airflow 3.3.2 databases: an asset
watcher (no queue) beside consumers of named queues only and no ``--default-queue`` makes
``triggerflow status --airflow`` exit 3 naming it, withholds the writer's ``TriggererJob``
heartbeat and shows in the ``triggerflow_unserved_triggers`` gauge; with a default queue a
live consumer serves, none of that."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import asyncpg
from pydantic import SecretStr

from tests import airflow_support as af
from tests.airflow_support import airflow_db, airflow_template
from tests.conftest import ROOT, settings_env
from triggerflow.airflow import heartbeat, liveness
from triggerflow.airflow.kwargs import encrypt_kwargs
from triggerflow.airflow.schema import SCHEMA
from triggerflow.airflow.statements.unserved import NO_QUEUE, STATUS_UNSERVED
from triggerflow.airflow.store import AirflowStore
from triggerflow.cli.status_report import collect_status
from triggerflow.settings import Settings
from triggerflow.store import ProcessKind
from triggerflow.telemetry import UNSERVED_TRIGGERS, get_metrics

__all__ = ["airflow_db", "airflow_template"]

FILE_DELETE = "airflow.providers.standard.triggers.file.FileDeleteTrigger"
ADD_CONSUMER = f"""
INSERT INTO {SCHEMA}.consumer (kind, host, pid, queues, capacity, expires_at, subscribed)
VALUES ('consumer', 'test', 1, $1, 100, now() + make_interval(secs => $2), $3) RETURNING id
"""
# An Airflow triggerer's job row, its heartbeat $1 seconds old.
ADD_TRIGGERER = """
INSERT INTO job (state, job_type, start_date, latest_heartbeat, hostname, unixname)
VALUES ('running', 'TriggererJob', now(), now() - make_interval(secs => $1), 'af', 'af')
RETURNING id
"""


async def add_asset_watcher(conn: asyncpg.Connection, name: str, age: float = 0.0) -> int:
    """An asset watcher's trigger row as Airflow's dag-processor writes it (no queue), created
    ``age`` seconds ago."""
    trigger_id = await conn.fetchval(
        """INSERT INTO "trigger" (classpath, kwargs, created_date)
           VALUES ($1, $2, now() - make_interval(secs => $3)) RETURNING id""",
        FILE_DELETE, encrypt_kwargs({"filepath": f"/tmp/{name}"}), age)
    asset_id = await conn.fetchval(
        """INSERT INTO asset (name, uri, "group", extra, created_at, updated_at)
           VALUES ($1, $1, 'asset', '{}', now(), now()) RETURNING id""", name)
    await conn.execute("INSERT INTO asset_watcher (name, asset_id, trigger_id) VALUES ($1, $2, $3)",
                       name, asset_id, trigger_id)
    return int(trigger_id)


def unserved_gauge() -> dict[tuple[str, str], float]:
    observe = get_metrics()._gauges[UNSERVED_TRIGGERS]
    return {(labels["queue"], labels["reason"]): value for value, labels in observe()}


async def test_an_asset_watcher_with_no_default_queue_is_named_by_status_heartbeat_and_gauge(
        airflow_db: str, settings: Settings, teams: list[str]) -> None:
    dsn = af.dsn_of(airflow_db)
    await af.prepare(dsn)
    conn = await asyncpg.connect(dsn)
    store = await AirflowStore.connect(dsn)
    airflow = settings.model_copy(update={"airflow": True, "database_url": SecretStr(dsn)})
    try:
        # consume --airflow --queue <ml> --queue <data-eng>, no --default-queue
        consumer = await store.register(ProcessKind.CONSUMER, "h", 1, teams, 100, "t", 30)
        await store.renew(consumer, 30, 0, teams, subscribed=True)
        # one lease period old: status names it now
        watcher = await add_asset_watcher(conn, "inbox", settings.lease_ttl.total_seconds())

        job_id = await heartbeat.start_job(conn)
        stamped = await conn.fetchval("SELECT latest_heartbeat FROM job WHERE id = $1", job_id)
        withheld = await liveness.served_beat(None)(conn, job_id)
        gauge_unserved = unserved_gauge()
        served = await liveness.served_beat(teams[0])(conn, job_id)
        gauge_served = unserved_gauge()
        resumed = await conn.fetchval("SELECT latest_heartbeat FROM job WHERE id = $1", job_id)
        with_default = await collect_status(airflow.model_copy(
            update={"default_queue": teams[0]}))
    finally:
        await store.close()
        await conn.close()

    # The command itself, as on-call runs it: exit 3, the row named with its reason.
    done = subprocess.run([sys.executable, "-m", "triggerflow", "status", "--airflow", "--json"],
                          env=settings_env(airflow), cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 3, done.stderr[-3000:]
    printed = json.loads(done.stdout)
    line = (f"queue {NO_QUEUE}: 1 trigger row(s) nothing serves, no queue and no "
            "--default-queue (a consumer serves only its --queue queues, as `airflow triggerer "
            f"--queues` does): trigger {watcher} (asset watcher, {FILE_DELETE})")
    assert line in printed["problems"], printed["problems"]
    assert [(u["id"], u["reason"]) for u in printed["unserved"]] == [(watcher, "no-queue")]

    # The writer's TriggererJob heartbeat is withheld (Airflow then reads no alive triggerer:
    # tests/test_airflow_liveness.py), and the gauge counts the row.
    assert withheld is False
    assert gauge_unserved == {(NO_QUEUE, "no-queue"): 1.0}
    # With a default queue a live consumer serves: stamped, the series at 0, status silent.
    assert served is True and resumed > stamped
    assert gauge_served == {}
    assert with_default["unserved"] == []
    assert not any("nothing serves" in p for p in with_default["problems"]), with_default


async def test_which_rows_are_unserved_and_why(airflow_db: str) -> None:
    dsn = af.dsn_of(airflow_db)
    await af.prepare(dsn)
    conn = await asyncpg.connect(dsn)
    try:
        kwargs = encrypt_kwargs({"x": 1})
        live_af = await conn.fetchval(ADD_TRIGGERER, 1.0)
        dead_af = await conn.fetchval(ADD_TRIGGERER, 300.0)
        team_a = await conn.fetchval(ADD_CONSUMER, ["team-a"], 60.0, True)
        # at capacity: unsubscribed, yet it runs what it holds
        team_b = await conn.fetchval(ADD_CONSUMER, ["team-b"], 60.0, False)
        no_queue = await add_asset_watcher(conn, "a")
        held_by_airflow = await add_asset_watcher(conn, "b")
        held_by_dead = await add_asset_watcher(conn, "c")
        await conn.execute('UPDATE "trigger" SET triggerer_id = $1 WHERE id = $2', live_af,
                           held_by_airflow)
        await conn.execute('UPDATE "trigger" SET triggerer_id = $1 WHERE id = $2', dead_af,
                           held_by_dead)
        nobody = (await af.add_deferred_task(conn, "nobody", "m.T", kwargs, queue="team-b")).trigger_id
        owned = (await af.add_deferred_task(conn, "owned", "m.T", kwargs, queue="team-b")).trigger_id
        refused = (await af.add_deferred_task(conn, "refused", "m.T", kwargs, queue="team-a")).trigger_id
        await af.add_deferred_task(conn, "waiting", "m.T", kwargs, queue="team-a")
        done = await af.add_deferred_task(conn, "done", "m.T", kwargs, queue="team-c")
        await conn.execute("UPDATE task_instance SET state = 'success' WHERE task_id = $1",
                           done.task_id)
        await conn.executemany(
            f"INSERT INTO {SCHEMA}.trigger_state (trigger_id, owner_id, attempt, rejected_by) "
            "VALUES ($1, $2, 1, $3)", [(owned, team_b, []), (refused, None, [team_a])])

        unserved, _ = await liveness.beat_if_served(conn, None, [], None)
        with_default, _ = await liveness.beat_if_served(conn, "team-a", [], None)
        scoped = await liveness.unserved_queues(conn, None, ["team-a"])
        named = await conn.fetch(STATUS_UNSERVED, None, 0.0)
        young = await conn.fetch(STATUS_UNSERVED, None, 600.0)
    finally:
        await conn.close()

    assert {(u.queue, u.reason): u.triggers for u in unserved} == {
        (NO_QUEUE, "no-queue"): 2, ("team-b", "no-consumer"): 1, ("team-a", "unloadable"): 1}
    assert {(u.queue, u.reason): u.triggers for u in with_default} == {
        ("team-b", "no-consumer"): 1, ("team-a", "unloadable"): 1}
    assert scoped == ["team-a"]  # a writer scoped with --queue vouches for its queues only
    assert sorted((r["id"], r["reason"], r["kind"]) for r in named) == sorted([
        (no_queue, "no-queue", "asset watcher"), (held_by_dead, "no-queue", "asset watcher"),
        (nobody, "no-consumer", "task"), (refused, "unloadable", "task")])
    assert Counter(r["total"] for r in named) == {2: 2, 1: 2}
    assert young == []  # within the grace a starting consumer or Airflow's triggerer takes it
