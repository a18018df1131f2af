"""Backup and restore in native mode, as docs/upgrade-backup.md ("Backup and restore") says, its
SQL run as printed: N deferrals, ``pg_dump``, M more whose events wait in the broker (the
writer stopped), the database dropped and restored, K new deferrals, then consumers and a
writer again. The N complete, the M are gone, and no event from before the restore moves
one of the K (their trigger ids would be the M's again without the procedure's SQL)."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
from datetime import datetime
from pathlib import Path

import pytest

from testbed.services import pg_bin
from testbed.spy import spy_on_events
from tests.conftest import ROOT, START_WAIT, Processes, admin_sql, drop_database_sql, wait_until
from tests.release import audit, audited
from tests.test_faults import timers
from tests.test_rolling_upgrade import cli, registered
from triggerflow.sdk import TriggerflowClient
from triggerflow.settings import Settings
from triggerflow.store.postgres import Database, database_name

N, M, K = 20, 20, 20


def restore_sql() -> str:
    """The SQL block of the docs' restore procedure."""
    page = (ROOT / "docs" / "upgrade-backup.md").read_text()
    section = page.split("## Backup and restore", 1)[1].split("\n## ", 1)[0]
    found = re.search(r"```sql\n(.*?)```", section, re.S)
    assert found is not None, "docs/upgrade-backup.md: no SQL in 'Backup and restore'"
    return found.group(1)


async def held(db: Database, dag: str, n: int) -> bool:
    """All ``n`` triggers of ``dag``'s tasks claimed by a consumer."""
    return await db.fetchval(  # type: ignore[no-any-return]
        "SELECT count(*) = $2 FROM trigger t JOIN task_instance ti ON ti.trigger_id = t.id "
        "WHERE ti.dag_id = $1 AND t.owner_id IS NOT NULL", dag, n)


@pytest.mark.slow
async def test_restore_completes_what_the_backup_holds_and_applies_nothing_stale(
    settings: Settings, dsn: str, pg_server: str, client: TriggerflowClient, procs: Processes,
    teams: list[str], tmp_path: Path,
) -> None:
    queue = teams[0]
    dump = f"{tmp_path}/triggerflow.dump"
    db = await Database.connect(dsn, max_size=2)
    try:
        writer = procs.writer()
        consumers = [procs.consume(queue) for _ in range(2)]
        await registered(db, writer, "writer")
        for c in consumers:
            await registered(db, c, "consumer")
        await client.defer_many(timers(N, 6, queue, dag="backed-up"))
        await wait_until(lambda: held(db, "backed-up", N), START_WAIT, message="the N claimed")
        subprocess.run([str(pg_bin() / "pg_dump"), "--format=custom", f"--file={dump}", dsn],
                       check=True, capture_output=True, timeout=60)

        # After the backup: the writer is down, so the M's events wait in the broker.
        await procs.supervisor.stop_async(writer)
        async with spy_on_events(settings) as spy:
            lost = set(await client.defer_many(timers(M, 0.2, queue, dag="lost")))
            await wait_until(lambda: asyncio.sleep(0, lost <= {s[1] for s in spy.seen}),
                             START_WAIT, message="the M fired")
        for c in consumers:
            await procs.supervisor.stop_async(c)
    finally:
        await db.close()

    # The failure, and the restore as documented.
    name = database_name(dsn)
    await admin_sql(pg_server, drop_database_sql(name), f'CREATE DATABASE "{name}"')
    subprocess.run([str(pg_bin() / "pg_restore"), f"--dbname={dsn}", dump], check=True,
                   capture_output=True, timeout=60)
    db = await Database.connect(dsn, max_size=2)
    try:
        await db.execute(restore_sql())
        cli(settings, ROOT, "db", "upgrade")
        await audit(db)

        # A worker defers before the fleet is back; the consumers claim (attempt 1) before a
        # writer reads the M's events, whose ids and attempt these would repeat.
        after = timers(K, 3, queue, dag="after")
        async with TriggerflowClient(settings) as sdk:
            await sdk.defer_many(after)
        for _ in range(2):
            await registered(db, procs.consume(queue), "consumer")
        await wait_until(lambda: held(db, "after", K), START_WAIT, message="the K claimed")
        await registered(db, procs.writer(), "writer")

        await wait_until(lambda: db.fetchval(
            "SELECT count(*) = $1 FROM task_instance WHERE state = 'scheduled'", N + K),
            START_WAIT, message="the N restored and the K new scheduled")
        await asyncio.sleep(1.0)  # a late duplicate would land meanwhile
        dags = {r["dag_id"]: r["n"] for r in await db.fetch(
            "SELECT dag_id, count(*) AS n FROM task_instance GROUP BY 1")}
        assert dags == {"backed-up": N, "after": K}, "the M are lost with the database"
        assert await db.fetchval("SELECT count(*) FROM trigger") == 0
        writes = await audited(db)
        once = [("deferred", "scheduled", "execute_complete")]
        assert {ti: w for ti, w in writes.items() if w != once} == {}
        # each of the K resumed by its own timer's event, none by a lost deferral's
        moments = [datetime.fromisoformat(json.loads(r["nk"])["event"]) for r in await db.fetch(
            "SELECT next_kwargs::text AS nk FROM task_instance WHERE dag_id = 'after'")]
        assert moments == [after[0].trigger.moment] * K  # type: ignore[attr-defined]
    finally:
        await db.close()
