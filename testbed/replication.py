"""A PostgreSQL primary and a streaming standby of their own, and the promotion scenario run
by ``tests/test_promotion.py`` (which checks what it found) and ``triggerflow bench promote``
(which prints how long it took).

The scenario: a writer and a consumer whose ``database_url`` lists both servers with
``target_session_attrs=read-write``; a burst of timers; the primary SIGKILLed (postmaster and
backends) in the middle of it; the standby promoted ``failover_delay`` seconds later, as an HA
manager would; a few more tasks deferred through the same SDK client after the promotion.
Every apply is logged by a row trigger on ``task_instance`` (replicated with everything else),
so "applied once" is counted on the new primary, not inferred.

Replication is synchronous (``synchronous_standby_names = '*'``): a commit returns only once
the standby has it, so nothing a writer committed (and then acked to the broker) is lost
with the primary. With asynchronous replication the last commits before the crash may be;
docs/upgrade-backup.md and docs/failure-modes.md say what that means.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg

from testbed.services import BASE, FAST_PG, PostgresCluster
from triggerflow.model import TaskKey
from triggerflow.sdk import Deferral, TriggerflowClient
from triggerflow.settings import Settings
from triggerflow.store.postgres import upgrade_schema
from triggerflow.store.postgres.schema import with_database
from triggerflow.supervise import Supervisor, child_env
from triggerflow.transport.rabbitmq import RabbitTransport, Topology
from triggerflow.triggers import DateTimeTrigger

ROOT = Path(__file__).resolve().parents[1]

# Each state change to 'scheduled' (an applied event) leaves a row: a task applied twice
# shows as two rows, whatever the final state of its task_instance looks like. ``port`` tells
# the server that applied it: the standby's port means after the promotion; ``due`` is the
# DateTimeTrigger's instant (its event), so ``at - due`` is how late the task was resumed.
APPLY_LOG = """
CREATE TABLE apply_log (task_id text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp(),
                        port int NOT NULL DEFAULT inet_server_port(), due timestamptz);
CREATE FUNCTION log_apply() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO apply_log (task_id, due) VALUES (NEW.task_id, (NEW.next_kwargs->>'event')::timestamptz);
    RETURN NEW;
END $$;
CREATE TRIGGER log_apply AFTER UPDATE OF state ON task_instance FOR EACH ROW
    WHEN (NEW.state = 'scheduled' AND OLD.state IS DISTINCT FROM 'scheduled')
    EXECUTE FUNCTION log_apply();
"""


@dataclass
class Replicated:
    primary: PostgresCluster
    standby: PostgresCluster

    def dsn(self, database: str) -> str:
        """Both servers, the read-write one wanted: what a user behind Patroni/RDS gives."""
        return (
            f"postgresql://postgres@127.0.0.1:{self.primary.port},"
            f"127.0.0.1:{self.standby.port}/{database}?target_session_attrs=read-write"
        )

    def fail_over(self, delay: float) -> None:
        """The primary dies (SIGKILL, as its host would) and, ``delay`` s later, its standby
        is promoted, as an HA manager would: the two swap roles, ``dsn`` finds the new one."""
        self.primary.kill()
        time.sleep(delay)
        self.standby.promote()
        self.primary, self.standby = self.standby, self.primary

    def rejoin(self) -> None:
        """After ``fail_over``: the old primary comes back as a fresh standby of the new one,
        on its own port (what Patroni's reinit does). Commits wait for it again only after
        ``synchronous_again``: the copy carries an empty ``synchronous_standby_names``."""
        old = self.standby
        shutil.rmtree(old.data, ignore_errors=True)
        # The SIGKILLed postmaster left its socket's lock file; should its pid be reused by
        # the time we start (a busy machine), the new server would take it for a live
        # postmaster and refuse to start.
        for stale in old.root.glob(".s.PGSQL.*"):
            stale.unlink(missing_ok=True)
        self.standby = self.primary.start_standby(old.root, old.port)


async def synchronous_again(pg: Replicated, within: float = 120.0) -> None:
    """Once the standby streams, make the primary's commits wait for it again (``ALTER
    SYSTEM``: the standby copied before it keeps an empty list, for its own promotion)."""
    conn = await asyncpg.connect(f"{pg.primary.url}/postgres")
    try:
        deadline = time.monotonic() + within
        while not await conn.fetchval(
                "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"no standby streaming from port {pg.primary.port}")
            await asyncio.sleep(0.2)
        await conn.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
        await conn.execute("SELECT pg_reload_conf()")
    finally:
        await conn.close()


@contextlib.contextmanager
def replicated_postgres() -> Iterator[Replicated]:
    """A primary with one synchronous streaming standby, under a directory of their own."""
    BASE.mkdir(parents=True, exist_ok=True)
    root = BASE / f"{os.getpid()}-promote{uuid.uuid4().hex[:6]}"
    root.mkdir(mode=0o755)
    primary = PostgresCluster(
        root / "postgres", settings={**FAST_PG, "synchronous_standby_names": "'*'", "wal_level": "replica"}
    )
    standby: PostgresCluster | None = None
    try:
        primary.start()
        standby = primary.start_standby(root / "standby")
        yield Replicated(primary, standby)
    finally:
        for cluster in (standby, primary):
            if cluster is not None:
                with contextlib.suppress(Exception):
                    cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


@dataclass
class PromotionRun:
    tasks: int
    applied_before_kill: int = 0
    applies: Counter[str] = field(default_factory=Counter)  # task id -> rows in apply_log
    events: Counter[int] = field(default_factory=Counter)  # trigger id -> events published
    stale_events: int = 0  # events of an attempt that was not the trigger's last
    killed_at: float = 0.0  # epoch seconds
    promoted_at: float = 0.0
    # seconds from the kill to the first apply on the promoted standby
    first_apply_after: float = float("nan")
    last_apply_after: float = float("nan")  # seconds from the kill to the last apply
    worst_late: float = float("nan")  # the largest apply - due of any task, in seconds
    complete: bool = False
    alive: bool = False  # the writer and consumer processes were still running at the end
    logs: dict[str, str] = field(default_factory=dict)

    @property
    def applied_once(self) -> int:
        return sum(1 for n in self.applies.values() if n == 1)

    @property
    def applied_twice(self) -> int:
        return sum(1 for n in self.applies.values() if n > 1)


async def poll(dsn: str, sql: str, *args: Any) -> Any:
    """One query on a fresh connection: None while no read-write server answers."""
    try:
        conn = await asyncio.wait_for(asyncpg.connect(dsn), 10)
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError):
        return None
    try:
        return await conn.fetchval(sql, *args)
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
        return None
    finally:
        conn.terminate()


async def wait_registered(dsn: str, processes: int, timeout: float) -> None:
    """Until ``processes`` writers and consumers hold leases in ``dsn``."""
    deadline = time.monotonic() + timeout
    while await poll(dsn, "SELECT count(*) FROM consumer") != processes:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the writer and consumers did not register ({processes})")
        await asyncio.sleep(0.2)


async def defer_spread(client: TriggerflowClient, dag_id: str, team: str, burst: int,
                       spread: float) -> None:
    """Defer ``burst`` timers due 4 s from now, spread evenly over ``spread`` seconds, and
    sleep until a third of them are due (the moment a scenario strikes)."""
    start = datetime.now(UTC) + timedelta(seconds=4)
    await client.defer_many([
        Deferral(TaskKey(dag_id, f"t{i}", "burst"),
                 DateTimeTrigger(start + timedelta(seconds=spread * i / burst)), team)
        for i in range(burst)
    ])
    await asyncio.sleep((start - datetime.now(UTC)).total_seconds() + spread / 3)


async def wait_all_applied(dsn: str, tasks: int, timeout: float) -> bool:
    """Until ``tasks`` distinct tasks are in the apply log (False: ``timeout`` first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await poll(dsn, "SELECT count(DISTINCT task_id) FROM apply_log") == tasks:
            return True
        await asyncio.sleep(0.2)
    return False


async def _prepare(dsn: str, namespace: str, amqp_url: str) -> Settings:
    admin = await asyncpg.connect(with_database(dsn, "postgres"))
    try:
        await admin.execute("CREATE DATABASE triggerflow")
    finally:
        await admin.close()
    await asyncio.to_thread(upgrade_schema, dsn)  # through the multi-host URL as a user would
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(APPLY_LOG)
    finally:
        await conn.close()
    team = f"{namespace}.team"
    settings = Settings(
        database_url=dsn,
        amqp_url=amqp_url,
        namespace=namespace,
        queues=[team],
        allowed_modules=["triggerflow.triggers"],
    )
    broker = RabbitTransport(settings.amqp_dsn(), Topology(namespace), name="promote")
    await broker.connect()
    await broker.declare([team])
    await broker.close()
    return settings


@contextlib.asynccontextmanager
async def _spy(settings: Settings, run: PromotionRun) -> AsyncIterator[None]:
    from testbed.spy import spy_on_events

    async with spy_on_events(settings) as spy:
        yield
    last: dict[int, int] = {}
    for _, tid, attempt, _ in spy.seen:
        run.events[tid] += 1
        last[tid] = max(last.get(tid, 0), attempt)
    run.stale_events = sum(1 for _, tid, attempt, _ in spy.seen if attempt < last[tid])


async def promote_mid_burst(
    amqp_url: str,
    logdir: Path,
    *,
    burst: int = 2_000,
    spread: float = 4.0,
    failover_delay: float = 1.0,
    after: int = 100,
    timeout: float = 120.0,
    settings: dict[str, Any] | None = None,
) -> PromotionRun:
    """Run the scenario once (see the module's docstring); ``settings``: the processes'
    overrides (the test's short leases; the bench passes none: shipped defaults)."""
    namespace = f"tfp{uuid.uuid4().hex[:8]}"
    run = PromotionRun(tasks=burst + after)
    # started and stopped in a thread: initdb, pg_basebackup and pg_ctl take seconds (tens
    # under load), and a blocked loop misses its broker heartbeats (the bench's connection)
    clusters = replicated_postgres()
    pg = await asyncio.to_thread(clusters.__enter__)
    try:
        dsn = pg.dsn("triggerflow")
        config = await _prepare(dsn, namespace, amqp_url)
        team = config.queues[0]
        sup = Supervisor(logdir, cwd=ROOT)
        env = child_env(config, pythonpath=str(ROOT), **(settings or {}))
        writer = sup.start("writer", env=env)
        consumer = sup.start("consume", "--queue", team, env=env)
        try:
            async with _spy(config, run), TriggerflowClient(config) as client:
                await wait_registered(dsn, 2, timeout=60)
                await defer_spread(client, "promote", team, burst, spread)
                # and the first applies in: on a loaded machine the writer runs behind the
                # instants (6 of 10 bench runs had applied nothing a third of the way in)
                deadline = time.monotonic() + 60
                while not run.applied_before_kill and time.monotonic() < deadline:
                    run.applied_before_kill = await poll(dsn, "SELECT count(*) FROM apply_log") or 0
                    await asyncio.sleep(0.05)
                run.killed_at = time.time()
                await asyncio.to_thread(pg.primary.kill)
                await asyncio.sleep(failover_delay)
                await asyncio.to_thread(pg.standby.promote)
                run.promoted_at = time.time()
                # the same client, whose pooled connections died with the primary
                soon = datetime.now(UTC) + timedelta(seconds=1)
                await client.defer_many(
                    [
                        Deferral(TaskKey("promote", f"a{i}", "after"), DateTimeTrigger(soon), team)
                        for i in range(after)
                    ]
                )
                run.complete = await wait_all_applied(dsn, run.tasks, timeout)
                await asyncio.sleep(2)  # a late duplicate apply would land by now
            rows = await asyncpg.connect(dsn)
            try:
                for r in await rows.fetch("SELECT task_id, count(*) AS n FROM apply_log GROUP BY 1"):
                    run.applies[r["task_id"]] = r["n"]
                times = await rows.fetchrow(
                    "SELECT extract(epoch FROM min(at) FILTER (WHERE port = $1))::float8 AS first, "
                    "extract(epoch FROM max(at))::float8 AS last, "
                    "extract(epoch FROM max(at - due))::float8 AS late FROM apply_log",
                    pg.standby.port,
                )
            finally:
                await rows.close()
            assert times is not None
            if times["first"] is not None:
                run.first_apply_after = times["first"] - run.killed_at
                run.last_apply_after = times["last"] - run.killed_at
                run.worst_late = times["late"]
            run.alive = writer.poll() is None and consumer.poll() is None
        finally:
            await asyncio.to_thread(sup.stop_all)
            from testbed.broker import delete_topology

            await delete_topology(config.amqp_dsn(), Topology(namespace), [team])
            run.logs = {"writer": sup.log(writer), "consumer": sup.log(consumer)}
    finally:
        await asyncio.to_thread(clusters.__exit__, None, None, None)
    return run
