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

import asyncpg
import pytest
from yarl import URL

from tests.conftest import ROOT, Processes, admin_sql, settings_env, wait_until
from tests.triggers import EventAfter, WaitsForever
from triggerflow.model import TaskKey
from triggerflow.sdk import TriggerflowClient
from triggerflow.settings import Settings
from triggerflow.store.postgres import Database

DOC = ROOT / "docs" / "security.md"
ROLES = ("tf_sdk", "tf_consumer", "tf_writer", "tf_ops", "tf_consumer_ml", "tf_consumer_data_eng")
DOC_QUEUES = ("team-ml", "team-data-eng")


def documented_sql(marker: str) -> str:
    """The one ```sql block of docs/security.md that contains ``marker``."""
    blocks = re.findall(r"```sql\n(.*?)```", DOC.read_text(), re.S)
    found = [b for b in blocks if marker in b]
    assert len(found) == 1, f"docs/security.md lost its block with {marker!r}"
    return found[0]


def documented_grants() -> str:
    """The block of "Database privileges" that creates the shared roles."""
    return documented_sql("CREATE ROLE tf_sdk LOGIN")


def rename(sql: str, names: dict[str, str], queues: dict[str, str] | None = None) -> str:
    """The documented SQL with this test's role names (and queue names)."""
    sql = re.sub(r"\b(" + "|".join(ROLES) + r")\b", lambda m: names[m.group(1)], sql)
    for documented, ours in (queues or {}).items():
        sql = sql.replace(f"'{documented}'", f"'{ours}'")
    return sql


async def exists(path: Path) -> bool:
    return path.exists()


def as_role(dsn: str, role: str) -> str:
    return str(URL(dsn).with_user(role))


@pytest.fixture
async def roles(dsn: str, pg_server: str) -> AsyncIterator[dict[str, str]]:
    """The documented roles, renamed for this test (roles are cluster-wide)."""
    suffix = uuid.uuid4().hex[:8]
    names = {r: f"{r}_{suffix}" for r in ROLES}
    db = await Database.connect(dsn, max_size=1)
    try:
        await db.execute(rename(documented_grants(), names))
    finally:
        await db.close()
    yield names
    database = URL(dsn).path.lstrip("/")
    db = await Database.connect(dsn, max_size=1)
    try:
        existing = [r["rolname"] for r in await db.fetch(
            "SELECT rolname FROM pg_roles WHERE rolname = ANY($1::text[])", list(names.values()))]
        for name in existing:
            await admin_sql(pg_server, f'REVOKE ALL ON DATABASE "{database}" FROM "{name}"')
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


async def test_per_team_consumer_roles_as_documented_hold_team_a_to_its_own_rows(
    roles: dict[str, str], dsn: str, settings: Settings, procs: Processes, db: Database,
    teams: list[str], tmp_path: Path,
) -> None:
    """Each team's consumer on its own role, per docs/security.md; then team A, with its own
    consumer's credentials (what its trigger code can read), attacks team B."""
    queues = dict(zip(DOC_QUEUES, teams, strict=True))
    await db.execute(rename(documented_sql("CREATE ROLE tf_consumer_ml"), roles, queues))
    role_a, role_b = roles["tf_consumer_ml"], roles["tf_consumer_data_eng"]
    procs.writer(database_url=as_role(dsn, roles["tf_writer"]))
    procs.consume(teams[0], database_url=as_role(dsn, role_a))
    consumer_b = procs.consume(teams[1], database_url=as_role(dsn, role_b))
    async with TriggerflowClient(Settings(**{**settings.model_dump(),
                                            "database_url": as_role(dsn, roles["tf_sdk"])})) as sdk:
        for i, q in enumerate(teams):
            await sdk.defer(TaskKey("d", f"fires{i}", "r"), EventAfter(payload=i), queue=q)
        swept = await sdk.defer(TaskKey("d", "swept", "r"), WaitsForever(marker_dir=str(tmp_path)),
                                queue=teams[1])
        kept = await sdk.defer(TaskKey("d", "kept", "r"), WaitsForever(marker_dir=str(tmp_path)),
                               queue=teams[1])
    await wait_until(lambda: db.fetchval(
        "SELECT count(*) = 2 FROM task_instance WHERE state = 'scheduled'"), 15)
    await wait_until(lambda: exists(tmp_path / f"started-{swept}"), 15)
    # B's own sweep works on B's role: a task cleared behind triggerflow's back is cancelled.
    await db.execute("UPDATE task_instance SET state = 'failed' WHERE task_id = 'swept'")
    await wait_until(lambda: exists(tmp_path / f"cleanup-{swept}"), 15)

    consumer_b.terminate()  # B's sweep gone: the next cancel-log entry stays for A to try
    consumer_b.wait(30)
    await db.execute("UPDATE task_instance SET state = 'failed' WHERE task_id = 'kept'")
    a_id = await db.fetchval("SELECT id FROM consumer WHERE queues = ARRAY[$1]", teams[0])
    attacker = await asyncpg.connect(as_role(dsn, role_a))
    try:
        with pytest.raises(asyncpg.InsufficientPrivilegeError, match="row-level security"):
            await attacker.execute(  # an idle fake peer for B's consumers to shed to
                "INSERT INTO consumer (kind, host, pid, queues, capacity, version, expires_at) "
                "VALUES ('consumer', 'x', 1, ARRAY[$1], 100000, 'x', now() + interval '1 day')",
                teams[1])
        assert await attacker.execute(
            "UPDATE consumer SET expires_at = now() WHERE $1 = ANY(queues)", teams[1]) == "UPDATE 0"
        assert await attacker.execute(
            "DELETE FROM consumer WHERE kind = 'writer'") == "DELETE 0"
        assert await attacker.execute(
            "UPDATE trigger SET kwargs = '{}' WHERE queue = $1", teams[1]) == "UPDATE 0"
        assert await attacker.execute(
            "UPDATE task_instance SET state = 'success' WHERE queue = $1", teams[1]) == "UPDATE 0"
        assert await attacker.fetchval("SELECT count(*) FROM trigger_cancel_log") == 0
        from triggerflow.store.postgres.statements.claims import SWEEP_CANCELLED
        await attacker.fetch(SWEEP_CANCELLED, a_id)  # A's own sweep, run as A
    finally:
        await attacker.close()
    assert await db.fetchval("SELECT count(*) FROM trigger_cancel_log WHERE trigger_id = $1",
                             kept) == 1
    assert await db.fetchval("SELECT count(*) FROM consumer WHERE kind = 'writer'") == 1
    assert dict(await db.fetch("SELECT task_id, state FROM task_instance")) == {
        "fires0": "scheduled", "fires1": "scheduled", "swept": "failed", "kept": "failed"}
    procs.stop_all()
    assert "permission denied" not in "".join(procs.log(p) for p in procs.procs)


ROLES_SQL = ROOT / "deploy" / "postgres" / "roles.sql"


async def test_compose_roles_script_gives_each_process_its_own_listed_role(
    dsn: str, pg_server: str, db: Database,
) -> None:
    """compose.yaml's processes log in as the roles deploy/postgres/roles.sql makes (run twice:
    compose runs it on every `up`), and each consumer's role is listed for exactly the queue
    it consumes, so row security holds it there."""
    import yaml

    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    users: dict[str, list[str]] = {}
    for svc in compose["services"].values():
        url = (svc.get("environment") or {}).get("TRIGGERFLOW_DATABASE_URL")
        if url and svc.get("command", [""])[0] in ("consume", "writer"):
            queues = [a for i, a in enumerate(svc["command"]) if i and svc["command"][i - 1] == "--queue"]
            users[str(URL(url).user)] = queues
    assert users and "postgres" not in users, users
    made = re.findall(r"'(tf_[a-z_]+)'", ROLES_SQL.read_text())
    existed = {r["rolname"] for r in await db.fetch(
        "SELECT rolname FROM pg_roles WHERE rolname = ANY($1::text[])", made)}
    try:
        for _ in range(2):
            await db.execute(ROLES_SQL.read_text())
        listed: dict[str, set[str]] = {}
        for r in await db.fetch("SELECT role, queue FROM team_queue"):
            listed.setdefault(r["role"], set()).add(r["queue"])
        for user, queues in users.items():
            assert await db.fetchval("SELECT rolcanlogin FROM pg_roles WHERE rolname = $1", user)
            assert listed.get(user, set()) == set(queues), (user, queues)
    finally:
        database = URL(dsn).path.lstrip("/")
        for name in sorted(set(made) - existed):
            await admin_sql(pg_server, f'REVOKE ALL ON DATABASE "{database}" FROM "{name}"')
            await db.execute(f'DROP OWNED BY "{name}"')
            await admin_sql(pg_server, f'DROP ROLE IF EXISTS "{name}"')
