"""A rolling upgrade under live traffic, in the documented order (docs/upgrade-backup.md,
"Rolling restarts and upgrades"): the previous release's fleet (2 writers, 2 consumers, a
worker deferring with its SDK) runs on the previous migration head; ``db upgrade`` runs
under it; writers, then consumers are replaced one by one (SIGTERM, this release started);
the old worker keeps deferring throughout, and this release's SDK defers at the end. Every
task deferred ends exactly once: scheduled by its own timer's event, written once."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, START_WAIT, Processes, settings_env, wait_until
from tests.release import audit, audited, previous_release
from tests.test_faults import timers
from triggerflow.sdk import TriggerflowClient
from triggerflow.settings import Settings
from triggerflow.store.postgres import Database, current_revision, downgrade_schema, revisions
from triggerflow.supervise import Child, Supervisor

# A worker of the previous release: defers 10 timers (due 1.5 s later) every 0.2 s until the
# stop file appears, and keeps the count it deferred in the count file.
WORKER = """
import asyncio, sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from triggerflow.model import TaskKey
from triggerflow.sdk import Deferral, TriggerflowClient
from triggerflow.triggers import DateTimeTrigger

async def main(queue: str, stop: str, count: str) -> None:
    n = 0
    async with TriggerflowClient() as client:
        while not Path(stop).exists():
            moment = datetime.now(UTC) + timedelta(seconds=1.5)
            await client.defer_many([Deferral(TaskKey("old-sdk", f"t{n + i}", "r"),
                                              DateTimeTrigger(moment), queue)
                                     for i in range(10)])
            n += 10
            Path(count).write_text(str(n))
            await asyncio.sleep(0.2)

asyncio.run(main(*sys.argv[1:]))
"""


def start_worker(tree: Path, env: dict[str, str], queue: str, stop: Path,
                 count: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", WORKER, queue, str(stop), str(count)],
                            env=env, cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


async def registered(db: Database, proc: Child, kind: str) -> int:
    async def find() -> int | None:
        return await db.fetchval(  # type: ignore[no-any-return]
            "SELECT max(id) FROM consumer WHERE pid = $1 AND kind = $2 AND expires_at > now()",
            proc.pid, kind)

    return int(await wait_until(find, START_WAIT, message=f"{kind} pid {proc.pid} registered"))


def cli(settings: Settings, cwd: Path, *args: str) -> str:
    env = settings_env(settings)
    env["PYTHONPATH"] = f"{cwd}{os.pathsep}{ROOT}"
    done = subprocess.run([sys.executable, "-m", "triggerflow", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


async def replace(old: Supervisor, proc: Child, start_new: Child, db: Database, kind: str) -> None:
    """SIGTERM one old process, see it exit cleanly, wait for its replacement to register."""
    await old.stop_async(proc, grace=30)
    assert proc.returncode == 0, old.log(proc)[-3000:]
    await registered(db, start_new, kind)


@pytest.mark.slow
async def test_rolling_upgrade_from_the_previous_head_loses_and_repeats_nothing(
    settings: Settings, dsn: str, db: Database, client: TriggerflowClient, procs: Processes,
    teams: list[str], tmp_path: Path,
) -> None:
    queue = teams[0]
    old_tree = previous_release(tmp_path / "previous")
    # The previous release made this database: base, then its own `db upgrade`.
    await asyncio.to_thread(downgrade_schema, dsn, "base")
    cli(settings, old_tree, "db", "upgrade")
    shipped = [r for r, _ in revisions()]
    assert await current_revision(dsn) in shipped[:-1], "the previous release is at head"
    await audit(db)

    (tmp_path / "old-logs").mkdir()
    old = Supervisor(tmp_path / "old-logs", cwd=old_tree)
    env = settings_env(settings)
    env["PYTHONPATH"] = f"{old_tree}{os.pathsep}{env['PYTHONPATH']}"
    stop, count = tmp_path / "stop", tmp_path / "count"
    try:
        writers = [old.start("writer", env=env) for _ in range(2)]
        consumers = [old.start("consume", "--queue", queue, env=env) for _ in range(2)]
        for w in writers:
            await registered(db, w, "writer")
        for c in consumers:
            await registered(db, c, "consumer")
        worker = start_worker(old_tree, env, queue, stop, count)
        # fires in flight: some applied, more deferred and waiting
        await wait_until(lambda: db.fetchval(
            "SELECT count(*) FILTER (WHERE state = 'scheduled') > 0 "
            "AND count(*) FILTER (WHERE state = 'deferred') > 0 FROM task_instance"),
            START_WAIT, message="the old fleet applying while more wait")

        cli(settings, ROOT, "db", "upgrade")  # under the old fleet
        assert await current_revision(dsn) == shipped[-1]
        for w in writers:
            await replace(old, w, procs.writer(), db, "writer")
        for c in consumers:
            await replace(old, c, procs.consume(queue), db, "consumer")

        stop.touch()
        out, _ = await asyncio.to_thread(worker.communicate, timeout=60)
        assert worker.returncode == 0, out
        # this release's SDK, upgraded last
        await client.defer_many(timers(50, 1.0, queue, dag="new-sdk"))
    finally:
        stop.touch()
        old.stop_all(sig=9, grace=10)
    deferred = int(count.read_text()) + 50

    await wait_until(lambda: db.fetchval(
        "SELECT count(*) = $1 FROM task_instance WHERE state = 'scheduled'", deferred),
        START_WAIT, message=f"all {deferred} deferred tasks scheduled")
    await asyncio.sleep(1.0)  # a late duplicate would land meanwhile
    assert await db.fetchval("SELECT count(*) FROM trigger") == 0
    assert await db.fetchval("SELECT count(*) FROM task_instance") == deferred
    writes = await audited(db)
    wrong = {ti: w for ti, w in writes.items() if w != [("deferred", "scheduled", "execute_complete")]}
    assert wrong == {}, f"{len(wrong)} of {deferred} tasks not written exactly once"
