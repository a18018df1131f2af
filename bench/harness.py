"""`Bench`: the bench database, broker namespace, roles and the consume/writer processes."""


from __future__ import annotations

import asyncio
import contextlib
import signal
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.common import (
    CHECKOUT,
    FAR,
    ROLES,
    BenchError,
    Proc,
    Sizes,
    _name_of,
    _statement_names,
    _with_user,
    machine_busy,
)
from triggerflow.supervise import Supervisor, child_env
from triggerflow.triggers.base import BaseTrigger

if TYPE_CHECKING:
    import asyncpg
    from rich.console import Console

    from triggerflow.sdk import TriggerflowClient
    from triggerflow.settings import Settings
    from triggerflow.transport.rabbitmq import RabbitTransport

@dataclass
class Bench:
    """The isolated environment every scenario runs in, and the measuring helpers."""

    settings: Settings
    sizes: Sizes
    console: Console
    out: Path
    admin_dsn: str = ""
    namespace: str = ""
    queue: str = ""
    idle_queue: str = ""
    role_dsn: dict[str, str] = field(default_factory=dict)
    per_role: bool = True
    procs: list[Proc] = field(default_factory=list)
    mon: asyncpg.Pool | None = None
    broker: RabbitTransport | None = None
    client: TriggerflowClient | None = None
    dbid: int = 0
    supervisor: Supervisor | None = None
    broker_losses: int = 0  # times the bench's broker connection dropped (broker restarted)
    reference: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # runs by size
    _watch: asyncio.Task[None] | None = None

    # -- set-up ---------------------------------------------------------------------------

    @classmethod
    def create(cls, settings: Settings, sizes: Sizes, console: Console, out: Path) -> Bench:
        from pydantic import SecretStr

        from triggerflow.store.postgres import database_name, with_database

        dsn = settings.database_dsn()
        name = database_name(dsn)
        bench_db = name if name.endswith("_bench") else f"{name}_bench"
        ns = "tfbench" if settings.namespace == "triggerflow" else f"{settings.namespace}-bench"
        admin = with_database(dsn, bench_db)
        allowed = [*settings.allowed_modules, "triggerflow.triggers", "bench"]
        bench_settings = settings.model_copy(update={
            "database_url": SecretStr(admin), "namespace": ns, "queues": [],
            "allowed_modules": list(dict.fromkeys(allowed)),
        })
        b = cls(bench_settings, sizes, console, out)
        b.admin_dsn = admin
        b.namespace = ns
        b.queue = f"{ns}.bench"
        b.idle_queue = f"{ns}.idle"
        return b

    def log(self, msg: str) -> None:
        self.console.log(msg)

    async def setup(self) -> None:
        import asyncpg

        from triggerflow.sdk import TriggerflowClient
        from triggerflow.store.postgres import (
            database_name,
            ensure_database,
            upgrade_schema,
            with_database,
        )
        from triggerflow.transport.rabbitmq import RabbitTransport, Topology

        name = database_name(self.admin_dsn)
        self.log(f"database {name}: recreating and migrating")
        conn = await asyncpg.connect(with_database(self.admin_dsn, "postgres"))
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()
        await ensure_database(self.admin_dsn)
        await asyncio.to_thread(upgrade_schema, self.admin_dsn)
        self.mon = await asyncpg.create_pool(
            self.admin_dsn, min_size=1, max_size=3,
            server_settings={"application_name": "triggerflow-bench"})
        await self.mon.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        self.dbid = await self.mon.fetchval(
            "SELECT oid FROM pg_database WHERE datname = current_database()")
        await self._roles()
        self.broker = RabbitTransport(self.settings.amqp_dsn(), Topology(self.namespace), name="bench")
        await self.broker.connect()
        await self.broker.declare([self.queue, self.idle_queue])
        assert self.broker.connection is not None
        ch = await self.broker.connection.channel()
        await ch.declare_queue(f"{self.namespace}.reference", durable=True,
                               arguments={"x-queue-type": "quorum"})  # the burst reference's
        await ch.close()
        self.client = TriggerflowClient(self.role_settings("sdk"), max_connections=2)
        self._watch = asyncio.get_running_loop().create_task(self._watch_broker())
        self.log(f"namespace {self.namespace}, queue {self.queue}; process logs in {self.out}")

    async def _roles(self) -> None:
        import asyncpg

        for role in ROLES:
            user = f"tfbench_{role}"
            dsn = _with_user(self.admin_dsn, user)
            try:
                with contextlib.suppress(asyncpg.DuplicateObjectError,
                                         asyncpg.UniqueViolationError):
                    await self.mon.execute(f"CREATE ROLE {user} LOGIN")  # type: ignore[union-attr]
                await self.mon.execute(  # type: ignore[union-attr]
                    f"GRANT ALL ON ALL TABLES IN SCHEMA public TO {user}; "
                    f"GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO {user}")
                conn = await asyncpg.connect(dsn)
                await conn.close()
                self.role_dsn[role] = dsn
            except Exception as exc:  # no CREATEROLE, password auth...: one user for all
                self.log(f"[yellow]cannot use role {user} ({exc!r}); statements are counted "
                         "for all processes together")
                self.per_role = False
                self.role_dsn = {r: self.admin_dsn for r in ROLES}
                return

    async def _watch_broker(self) -> None:
        """Reconnect the bench's own broker connection and count the losses: a loss means
        someone restarted the broker, and a run it overlapped is measured again."""
        assert self.broker is not None
        while True:
            await self.broker.closed.wait()
            self.broker_losses += 1
            self.log("[yellow]the broker connection dropped (broker restarted?); reconnecting")
            from tenacity import AsyncRetrying, wait_exponential_jitter

            async for attempt in AsyncRetrying(  # until the broker is back
                    wait=wait_exponential_jitter(multiplier=0.5, max=5, jitter=0.5)):
                with attempt:
                    await self.broker.connect()

    async def quiet(self, limit: float = 0.3, wait: float | None = None) -> float:
        """Wait (up to ``wait`` s) until the machine is mostly idle; returns its busy share.

        Other work on the machine (a test suite, a build) would be measured as ours.
        """
        wait = self.sizes.quiet_wait if wait is None else wait
        deadline = time.monotonic() + wait
        busy = await machine_busy()
        if busy > limit:
            self.log(f"[yellow]machine {busy:.0%} busy before a measurement; waiting up to "
                     f"{wait:.0f}s for it to quieten")
        while busy > limit and time.monotonic() < deadline:
            busy = await machine_busy(1.0)
        return busy

    async def measured(self, what: str, run: Callable[[], Awaitable[dict[str, Any]]],
                       tries: int = 3) -> dict[str, Any]:
        """Run a measurement again when the broker restarted while it ran."""
        for attempt in range(1, tries + 1):
            losses = self.broker_losses
            try:
                result = await run()
            except Exception:
                if self.broker_losses == losses or attempt == tries:
                    raise
                self.log(f"[yellow]{what}: failed while the broker restarted; measuring again")
                await asyncio.sleep(5)
                continue
            if self.broker_losses == losses:
                result["retries"] = attempt - 1
                return result
            self.log(f"[yellow]{what}: the broker restarted during the run; measuring again")
            await asyncio.sleep(3)
        result["retries"] = tries - 1
        result["disturbed"] = True
        return result

    def role_settings(self, role: str) -> Settings:
        from pydantic import SecretStr

        return self.settings.model_copy(update={"database_url": SecretStr(self.role_dsn[role])})

    async def teardown(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        await self.stop_all()
        if self.client is not None:
            with contextlib.suppress(Exception):
                await self.client.close()
        if self.broker is not None:
            with contextlib.suppress(Exception):
                await self._delete_topology()
            await self.broker.close()
        if self.mon is not None:
            with contextlib.suppress(Exception):
                await self.mon.execute("TRUNCATE task_instance, trigger, consumer")
            await self.mon.close()

    async def _delete_topology(self) -> None:
        assert self.broker is not None and self.broker.connection is not None
        t = self.broker.topology
        for queue in (self.queue, self.idle_queue, t.events_queue, t.dead_queue,
                      f"{self.namespace}.reference"):
            ch = await self.broker.connection.channel()
            with contextlib.suppress(Exception):
                await ch.queue_delete(queue)
            if not ch.is_closed:
                await ch.close()
        for exchange in [*t.exchanges(), *t.team_exchanges(self.queue),
                         *t.team_exchanges(self.idle_queue)]:
            ch = await self.broker.connection.channel()
            with contextlib.suppress(Exception):
                await ch.exchange_delete(exchange)
            if not ch.is_closed:
                await ch.close()

    async def reset(self) -> None:
        """No processes, no rows, empty queues: the start of every measurement."""
        await self.stop_all()
        await self.purge()
        await self.truncate("task_instance", "trigger", "consumer")

    async def purge(self) -> None:
        assert self.broker is not None and self.broker.connection is not None
        for name in (self.queue, self.idle_queue, self.broker.topology.events_queue):
            ch = await self.broker.connection.channel()
            try:
                q = await ch.declare_queue(name, passive=True)
                await q.purge()
            finally:
                if not ch.is_closed:
                    await ch.close()

    def db(self) -> asyncpg.Pool:
        assert self.mon is not None
        return self.mon

    async def truncate(self, *tables: str) -> None:
        """Empty ``tables`` while consumers and writers may be sweeping them: a TRUNCATE that
        meets a sweep locking the tables in the other order loses a deadlock; run it again."""
        import asyncpg
        from tenacity import (
            AsyncRetrying,
            retry_if_exception_type,
            stop_after_attempt,
            wait_random_exponential,
        )

        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(asyncpg.DeadlockDetectedError),
            stop=stop_after_attempt(5), wait=wait_random_exponential(multiplier=0.05, max=1),
            reraise=True,
        ):
            with attempt:
                await self.db().execute(f"TRUNCATE {', '.join(tables)}")

    # -- processes ------------------------------------------------------------------------

    def env(self, role: str, **overrides: Any) -> dict[str, str]:
        env = child_env(self.role_settings(role), pythonpath=str(CHECKOUT), **overrides)
        env.pop("TRIGGERFLOW_QUEUES", None)  # each process gets its queues as flags
        return env

    def start(self, kind: str, *args: str, **overrides: Any) -> Proc:
        """Start ``triggerflow KIND ARGS``; ``overrides`` are settings for this process only."""
        role = "writer" if kind == "writer" else "consumer"
        if self.supervisor is None:
            self.supervisor = Supervisor(self.out)
        popen = self.supervisor.start(kind, *args, env=self.env(role, **overrides))
        proc = Proc(kind, popen, self.supervisor.log_path(popen), role)
        self.procs.append(proc)
        return proc

    async def start_consumer(self, queue: str | None = None, *, ready: bool = True,
                             **overrides: Any) -> Proc:
        queue = queue or self.queue
        before = await self.broker_consumers(queue)
        proc = self.start("consume", "--queue", queue, **overrides)
        if ready:
            await self.wait_ready(proc, queue, before + 1)
        return proc

    async def start_writer(self, *, ready: bool = True) -> Proc:
        assert self.broker is not None
        events = self.broker.topology.events_queue
        before = await self.broker_consumers(events)
        proc = self.start("writer")
        if ready:
            await self.wait_ready(proc, events, before + 1)
        return proc

    async def broker_consumers(self, queue: str) -> int:
        assert self.broker is not None
        info = await self.broker.queue_info(queue)
        return info[1] if info else 0

    async def subscribed(self, queue: str, expected: int, within: float = 10.0) -> int:
        """The broker's consumer count on ``queue`` once it reaches ``expected`` (or the last
        read after ``within`` s): a subscription being renewed is briefly absent from it."""
        deadline = time.monotonic() + within
        count = await self.broker_consumers(queue)
        while count < expected and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            count = await self.broker_consumers(queue)
        return count

    async def wait_ready(self, proc: Proc, queue: str, consumers: int,
                         within: float = 30) -> None:
        """Registered in the database and subscribed on the broker."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if not proc.alive():
                raise BenchError(f"{proc.kind} exited with {proc.popen.returncode}; see {proc.log}")
            row = await self.db().fetchval("SELECT id FROM consumer WHERE pid = $1", proc.pid)
            if row and await self.broker_consumers(queue) >= consumers:
                return
            await asyncio.sleep(0.05)
        raise BenchError(f"{proc.kind} not ready after {within}s; see {proc.log}")

    async def consumer_id(self, proc: Proc) -> int:
        return int(await self.db().fetchval("SELECT id FROM consumer WHERE pid = $1", proc.pid))

    async def stop(self, proc: Proc, sig: int = signal.SIGTERM, grace: float = 20) -> None:
        if self.supervisor is not None:
            await self.supervisor.stop_async(proc.popen, sig, grace)
        if proc in self.procs:
            self.procs.remove(proc)

    async def stop_all(self) -> None:
        await asyncio.gather(*(self.stop(p) for p in list(self.procs)))

    # -- deferring ------------------------------------------------------------------------

    async def defer(
        self, n: int, run_id: str, moment: Callable[[int], datetime] | None = None, *,
        queue: str | None = None, batch: int = 5_000,
        trigger: Callable[[int], BaseTrigger] | None = None,
    ) -> float:
        """Defer ``n`` tasks (timers at ``moment(i)`` by default) in batches; returns seconds."""
        from triggerflow.model import TaskKey
        from triggerflow.sdk import Deferral
        from triggerflow.triggers import DateTimeTrigger

        assert self.client is not None
        far = datetime.now(UTC) + timedelta(seconds=FAR)
        make = trigger or (lambda i: DateTimeTrigger(moment(i) if moment else far))
        started = time.perf_counter()
        last_log = started
        for lo in range(0, n, batch):
            await self.client.defer_many([
                Deferral(TaskKey("bench", f"t{i}", run_id), make(i), queue or self.queue)
                for i in range(lo, min(n, lo + batch))
            ])
            if time.perf_counter() - last_log > 5:
                last_log = time.perf_counter()
                self.log(f"  deferred {min(n, lo + batch):,}/{n:,}")
        return time.perf_counter() - started

    # -- measuring ------------------------------------------------------------------------

    async def wait_for(self, sql: str, target: int, within: float, *args: Any,
                       interval: float = 0.05) -> tuple[bool, float]:
        """Poll ``sql`` (a count) until it reaches ``target``; (reached, database time)."""
        deadline = time.monotonic() + within
        while True:
            row = await self.db().fetchrow(
                f"SELECT ({sql}) AS n, extract(epoch FROM clock_timestamp())::float8 AS t", *args)
            assert row is not None
            if row["n"] >= target:
                return True, row["t"]
            if time.monotonic() > deadline:
                return False, row["t"]
            await asyncio.sleep(interval)

    async def owned(self, owner: int | None = None) -> int:
        if owner is None:
            return int(await self.db().fetchval(
                "SELECT count(*) FROM trigger WHERE owner_id IS NOT NULL"))
        return int(await self.db().fetchval(
            "SELECT count(*) FROM trigger WHERE owner_id = $1", owner))

    async def latencies(self, run_id: str) -> tuple[list[float], list[float]]:
        """(instant -> task updated, instant -> event fired in the consumer) per task."""
        rows = await self.db().fetch(
            "SELECT extract(epoch FROM updated_at - (next_kwargs->>'event')::timestamptz)::float8"
            " AS l, extract(epoch FROM event_fired_at - (next_kwargs->>'event')::timestamptz)"
            "::float8 AS f FROM task_instance WHERE run_id = $1 AND state = 'scheduled'", run_id)
        return [r["l"] for r in rows], [r["f"] for r in rows if r["f"] is not None]

    async def stmt_reset(self) -> None:
        import asyncpg

        try:
            await self.db().execute("SELECT pg_stat_statements_reset(0, $1, 0)", self.dbid)
        except asyncpg.ObjectNotInPrerequisiteStateError as exc:
            raise RuntimeError(
                "statement counts need pg_stat_statements in shared_preload_libraries, which "
                "this PostgreSQL does not preload. `make bench` runs the bench on a cluster of "
                "its own that does (python -m testbed.services -- triggerflow bench); or add it "
                "to this server's configuration yourself and restart it") from exc

    async def stmt_snapshot(self) -> list[dict[str, Any]]:
        """Statements of the measured processes since the last reset, by role and statement."""
        rows = await self.db().fetch(
            "SELECT r.rolname AS role, s.query, s.calls, s.total_exec_time "
            "FROM pg_stat_statements s JOIN pg_roles r ON r.oid = s.userid "
            "WHERE s.dbid = $1 AND s.calls > 0", self.dbid)
        names = _statement_names()
        out = []
        for r in rows:
            role = r["role"].removeprefix("tfbench_") if self.per_role else "all"
            if self.per_role and role not in ROLES:
                continue  # the bench's own queries
            name = _name_of(r["query"], names)
            out.append({"role": role, "statement": name, "calls": int(r["calls"]),
                        "total_ms": float(r["total_exec_time"])})
        return out

    @staticmethod
    def calls(snapshot: list[dict[str, Any]], roles: tuple[str, ...] = ("consumer", "writer",
                                                                        "all")) -> int:
        return sum(s["calls"] for s in snapshot if s["role"] in roles)

    async def analyze(self, *, vacuum: bool = False) -> None:
        """Statistics as autovacuum keeps them; with ``vacuum``, also its cleanup: right
        after a mass claim every claimed row leaves a dead entry in ``trigger_unclaimed``
        until then, and the sweeps over that index step through them (`bench million` with
        ANALYZE only printed 1.479 ms/s of periodic work at a million held, 0.370 at 10k)."""
        what = "VACUUM (ANALYZE)" if vacuum else "ANALYZE"
        await self.db().execute(f"{what} trigger, task_instance, consumer")


# ----------------------------------------------------------------------------- scenarios


def _run_id(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}"
