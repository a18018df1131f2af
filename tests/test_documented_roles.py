"""The grants docs/security.md prints are the grants the processes need.

The SQL block is read from the document itself and run with role names of this test's own,
then a writer, a consumer, the SDK and ``status`` run as those roles: a statement that needs a
privilege the docs do not grant fails here (a cancel sweep that locked the cancel log under a
SELECT/DELETE grant logged "permission denied" every few seconds and left cancelled triggers
running).
"""

from __future__ import annotations

import re
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from yarl import URL

from tests.conftest import ROOT, Processes, admin_sql, settings_env, wait_until
from tests.triggers import EventAfter, WaitsForever
from triggerflow.model import TaskKey
from triggerflow.sdk import TriggerflowClient
from triggerflow.settings import Settings
from triggerflow.store.postgres import Database

DOC = ROOT / "docs" / "security.md"
ROLES = ("tf_sdk", "tf_consumer", "tf_writer", "tf_ops")


def documented_grants() -> str:
    """The ```sql block of "Database privileges" that creates the shared roles."""
    blocks = re.findall(r"```sql\n(.*?)```", DOC.read_text(), re.S)
    found = [b for b in blocks if "CREATE ROLE tf_sdk LOGIN" in b]
    assert len(found) == 1, "docs/security.md lost its grants block"
    return found[0]


async def exists(path: Path) -> bool:
    return path.exists()


def as_role(dsn: str, role: str) -> str:
    return str(URL(dsn).with_user(role))


@pytest.fixture
async def roles(dsn: str, pg_server: str) -> AsyncIterator[dict[str, str]]:
    """The documented roles, renamed for this test (roles are cluster-wide)."""
    suffix = uuid.uuid4().hex[:8]
    names = {r: f"{r}_{suffix}" for r in ROLES}
    sql = re.sub(r"\b(" + "|".join(ROLES) + r")\b", lambda m: names[m.group(1)], documented_grants())
    db = await Database.connect(dsn, max_size=1)
    try:
        await db.execute(sql)
    finally:
        await db.close()
    yield names
    database = URL(dsn).path.lstrip("/")
    for name in names.values():
        await admin_sql(pg_server, f'REVOKE ALL ON DATABASE "{database}" FROM "{name}"')
    db = await Database.connect(dsn, max_size=1)
    try:
        for name in names.values():
            await db.execute(f'DROP OWNED BY "{name}"')
    finally:
        await db.close()
    await admin_sql(pg_server, *(f'DROP ROLE IF EXISTS "{n}"' for n in names.values()))


async def test_every_component_runs_on_the_documented_grants(
    roles: dict[str, str], dsn: str, settings: Settings, procs: Processes, db: Database,
    teams: list[str], tmp_path: Path,
) -> None:
    writer = procs.writer(database_url=as_role(dsn, roles["tf_writer"]))
    consumer = procs.consume(teams[0], database_url=as_role(dsn, roles["tf_consumer"]))
    sdk = TriggerflowClient(Settings(**{**settings.model_dump(),
                                        "database_url": as_role(dsn, roles["tf_sdk"])}))
    try:
        await sdk.defer(TaskKey("d", "fires", "r"), EventAfter(delay=0.2, payload=1), queue=teams[0])
        by_sdk = await sdk.defer(TaskKey("d", "cancelled", "r"),
                                 WaitsForever(marker_dir=str(tmp_path)), queue=teams[0])
        by_host = await sdk.defer(TaskKey("d", "cleared", "r"),
                                  WaitsForever(marker_dir=str(tmp_path)), queue=teams[0])
        await wait_until(lambda: db.fetchval(
            "SELECT state = 'scheduled' FROM task_instance WHERE task_id = 'fires'"), 15)
        for tid in (by_sdk, by_host):
            await wait_until(lambda t=tid: exists(tmp_path / f"started-{t}"), 15)
        # Through the SDK role: a control message to the owner.
        assert await sdk.cancel([by_sdk]) == 1
        # Behind triggerflow's back, as a host clearing a task: only the consumer's sweep of
        # the cancel log sees it.
        await db.execute("UPDATE task_instance SET state = 'failed' WHERE task_id = 'cleared'")
        for tid in (by_sdk, by_host):
            await wait_until(lambda t=tid: exists(tmp_path / f"cleanup-{t}"), 15,
                             message=f"cleanup of trigger {tid}")
    finally:
        await sdk.close()
    status = subprocess.run(
        [sys.executable, "-m", "triggerflow", "status", "--json"], capture_output=True,
        env=settings_env(settings, database_url=as_role(dsn, roles["tf_ops"])), timeout=60)
    assert status.returncode in (0, 3), status.stderr.decode()
    procs.stop_all()
    logs = procs.log(writer) + procs.log(consumer) + status.stderr.decode()
    assert "permission denied" not in logs
