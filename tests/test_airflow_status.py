"""``triggerflow status --airflow``: triggerflow's part of an Airflow deployment, read from its
schema beside Airflow's rows (native mode's statements meet no such tables there); a consumer
warming up beside a peer (unsubscribed on purpose until its trigger runtime answers) is
listed as warming, not named as one the broker refused, and not counted by the
``triggerflow_queue_unsubscribed`` gauge."""

from __future__ import annotations

import json
import subprocess
import sys

import asyncpg
import pytest
from pydantic import SecretStr

from tests import airflow_support as af
from tests.airflow_support import airflow_db, airflow_template
from tests.conftest import ROOT, settings_env
from triggerflow.airflow.mode import AirflowMode
from triggerflow.airflow.store import AirflowStore
from triggerflow.cli.status_report import collect_status
from triggerflow.modes import NativeMode
from triggerflow.settings import Settings
from triggerflow.store import ProcessKind
from triggerflow.transport.rabbitmq import Topology

__all__ = ["airflow_db", "airflow_template"]

DATETIME_TRIGGER = "airflow.providers.standard.triggers.temporal.DateTimeTrigger"


async def test_status_reads_airflow_mode_and_lists_a_warming_consumer(
        airflow_db: str, settings: Settings, topology: Topology, teams: list[str]) -> None:
    from triggerflow.airflow.kwargs import encrypt_kwargs

    dsn = af.dsn_of(airflow_db)
    await af.prepare(dsn)
    team = teams[0]
    conn = await asyncpg.connect(dsn)
    store = await AirflowStore.connect(dsn)
    try:
        kwargs = encrypt_kwargs({"moment": "2026-11-30T12:00:00+00:00"})
        owned, orphaned, quarantined, _unclaimed = [
            await af.add_deferred_task(conn, name, DATETIME_TRIGGER, kwargs, queue=team)
            for name in ("owned", "orphaned", "quarantined", "unclaimed")]
        # A queue Airflow's own triggerer serves: no bookkeeping of ours, no consumer of ours.
        await af.add_deferred_task(conn, "theirs", DATETIME_TRIGGER, kwargs, queue="airflow-own")
        await conn.execute("UPDATE task_instance SET trigger_timeout = now() - interval '2 min'"
                           " WHERE task_id = 'unclaimed'")
        warming = await store.register(ProcessKind.CONSUMER, "h", 1, [team], 100, "t", 30)
        await store.renew(warming, 30, 0, [team], subscribed=False, warming=True)
        refused = await store.register(ProcessKind.CONSUMER, "h", 2, [team], 100, "t", 30)
        await store.renew(refused, 30, 1, [team], subscribed=False)
        dead = await store.register(ProcessKind.CONSUMER, "h", 3, [team], 100, "t", 30)
        await conn.execute("UPDATE triggerflow.consumer SET expires_at = now() - interval "
                           "'1 min' WHERE id = $1", dead)
        # Registered long enough ago to be subscribed by now.
        await conn.execute("UPDATE triggerflow.consumer SET registered_at = now() - "
                           "interval '1 min'")
        await conn.executemany(
            "INSERT INTO triggerflow.trigger_state (trigger_id, owner_id, attempt, failures, "
            "quarantined_at, last_error) VALUES ($1, $2, 1, $3, $4, $5)",
            [(owned.trigger_id, refused, 0, None, None),
             (orphaned.trigger_id, dead, 0, None, None),
             (quarantined.trigger_id, None, 3, None, "boom")])
        await conn.execute("UPDATE triggerflow.trigger_state SET quarantined_at = now() "
                           "WHERE last_error = 'boom'")

        airflow = settings.model_copy(update={"airflow": True, "database_url": SecretStr(dsn)})
        report = await collect_status(airflow)
        source = await AirflowMode(airflow).connect_gauges()
        try:
            leases = await source.leases([team], 3.0)
        finally:
            await source.close()
        # What native mode's statements meet in this database: the bug the mode removes.
        with pytest.raises(asyncpg.UndefinedTableError):
            await collect_status(settings.model_copy(update={"database_url": SecretStr(dsn)}))
        assert NativeMode(airflow).status_statements() is not AirflowMode(airflow).status_statements()
    finally:
        await store.close()
        await conn.close()

    queues = {q["queue"]: q for q in report["queues"]}
    assert "airflow-own" not in queues, queues
    assert {k: queues[team][k] for k in ("triggers", "running", "unclaimed", "quarantined",
                                        "dead_owner", "consumers")} == {
        "triggers": 4, "running": 1, "unclaimed": 1, "quarantined": 1, "dead_owner": 1,
        "consumers": 0}
    assert report["warming"] == [warming]
    assert [c["warming"] for c in report["consumers"] if c["id"] == warming] == [True]
    problems = report["problems"]
    assert not any(f"consumer {warming} " in p for p in problems), problems
    assert any(f"consumer {refused} on h (pid 2)" in p for p in problems) or any(
        f"queue {team}: 1 consumer(s) hold a lease below capacity" in p for p in problems), problems
    for line in (f"queue {team}: 1 triggers held by dead owners", "1 quarantined trigger(s)",
                 "1 deferred task(s) past their timeout"):
        assert line in problems, problems
    assert any(p.startswith("no live writer") for p in problems), problems
    [q] = report["quarantined"]
    assert (q["id"], q["queue"], q["classpath"], q["failures"], q["last_error"]) == (
        quarantined.trigger_id, team, DATETIME_TRIGGER, 3, "boom")
    assert leases.queues[team].expected == 1  # the refused one: not the warming, not the dead

    # The command itself, as on-call runs it; exit 3: attention.
    env = settings_env(airflow)
    done = subprocess.run([sys.executable, "-m", "triggerflow", "status", "--airflow", "--json"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 3, done.stderr[-3000:]
    printed = json.loads(done.stdout)
    assert {q["queue"]: q["triggers"] for q in printed["queues"]}[team] == 4
    assert printed["warming"] == [warming]
    refused_ids = subprocess.run(
        [sys.executable, "-m", "triggerflow", "status", "--airflow", "--ids", "quarantined"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert refused_ids.returncode == 2 and "--ids lists native mode's triggers" in \
        refused_ids.stderr, refused_ids.stderr
