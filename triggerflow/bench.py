"""`triggerflow bench`: the numbers users choose a triggerer by, measured end to end.

Every scenario starts the real ``triggerflow consume`` / ``triggerflow writer`` CLI processes
(default logging and telemetry), defers through the SDK, and reads its results from
PostgreSQL: latency is ``task_instance.updated_at`` (database clock) minus the trigger's
instant (``next_kwargs->>'event'`` of a ``DateTimeTrigger``), statements come from
``pg_stat_statements`` (BEGIN/COMMIT and the pool's reset statements included).

Isolation: its own database (``<database>_bench``, dropped, created and migrated at start),
its own namespace (``tfbench``, or ``<namespace>-bench``) and queues, deleted at the end.
Per-process statement counts: consumers, writers and the SDK log in as their own database
roles (``tfbench_consumer``, ``tfbench_writer``, ``tfbench_sdk``), so ``pg_stat_statements``
(which has no pid) still tells them apart; the bench's own polling runs as the given user
and is never counted.

Scenarios: capacity, burst, steady, dbload, defer, failover (default: all). ``--quick``
runs tiny sizes (a smoke test). Raw results go to ``bench-results/``; a full run also
plots the burst latency distributions to ``docs/img/burst-latency.png``.

This module is also the process the ``defer`` scenario runs 1 or 8 of
(``python -m triggerflow.bench sdk-worker ...``) and holds ``SleepTrigger``, the coroutine
trigger of the capacity scenario; keep its top-level imports light, consumers import it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from triggerflow.triggers.base import BaseTrigger, TriggerEvent

if TYPE_CHECKING:
    import asyncpg
    from rich.console import Console
    from rich.table import Table

    from triggerflow.rabbitmq import Broker
    from triggerflow.sdk import TriggerflowClient
    from triggerflow.settings import Settings

SCENARIOS = ("capacity", "burst", "steady", "dbload", "defer", "failover")
ROLES = ("consumer", "writer", "sdk")
FAR = 3600.0  # seconds ahead for triggers that must only wait
PLOT = Path(__file__).resolve().parents[1] / "docs" / "img" / "burst-latency.png"


class SleepTrigger(BaseTrigger):
    """A coroutine trigger (one task each), for the coroutine row of the capacity scenario."""

    def __init__(self, seconds: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seconds = seconds

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("triggerflow.bench.SleepTrigger", {"seconds": self.seconds})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        await asyncio.sleep(self.seconds)
        yield TriggerEvent(None)


# ----------------------------------------------------------------------------- sizes


@dataclass(frozen=True)
class Sizes:
    capacity: tuple[int, ...] = (10_000, 50_000, 100_000)
    capacity_coroutines: int = 10_000
    cpu_window: float = 5.0
    burst: tuple[int, ...] = (1_000, 10_000)
    repeats: int = 3
    steady_rate: int = 1_000
    steady_seconds: float = 30.0
    waiting: int = 100_000
    idle_window: float = 30.0
    dbload_burst: int = 10_000
    dbload_steady_seconds: float = 10.0
    writer_events: int = 50_000
    defer_single: int = 1_000
    defer_batched: int = 20_000
    defer_batch: int = 1_000
    defer_procs: int = 8
    defer_seconds: float = 5.0
    failover: int = 10_000
    failover_repeats: int = 3
    failover_timeout: float = 120.0
    quiet_wait: float = 60.0  # longest wait for other work on the machine to finish
    settle: float = 3.0  # seconds a process is left alone before RSS/CPU/counts are read
    lead: float = 2.5  # seconds between deferring and the first instant (plus per-trigger)
    worker_stagger: float = 0.3  # extra start delay per SDK worker process (imports, connect)
    baseline_each: bool = True  # a fresh empty consumer's RSS before every capacity case


FULL = Sizes()
QUICK = Sizes(
    capacity=(200,), capacity_coroutines=200, cpu_window=1.0, burst=(200,), repeats=1,
    steady_rate=100, steady_seconds=2.0, waiting=500, idle_window=2.0, dbload_burst=200,
    dbload_steady_seconds=1.0, writer_events=1_000, defer_single=50, defer_batched=1_000,
    defer_batch=100, defer_procs=8, defer_seconds=1.0, failover=200, failover_repeats=1,
    failover_timeout=60.0, quiet_wait=0.0, settle=1.0, lead=1.0, worker_stagger=0.15,
    baseline_each=False,
)

# What the issue asks for, and Airflow 3.3.2's triggerer measured in DESIGN.md.
TARGETS: dict[str, tuple[str, str]] = {
    "capacity_n": ("≥ 100,000 timers in one consumer", "-"),
    "kb_timer": ("≤ 1 KB", "27-37 KB (435 MiB empty)"),
    "kb_coroutine": ("≤ 3 KB", "27-37 KB"),
    "cpu_waiting": ("≤ 2 % of a core", "-"),
    "claim_rate": ("≥ 10,000 /s", "125/s at 1k, 35/s at 10k"),
    "burst_1k": ("all ≤ 100 ms", "p50 5.6 s, p99 8.2 s, all 8.4 s"),
    "burst_10k": ("all ≤ 0.5 s", "p50 181 s, all 205-218 s"),
    "steady": ("p50 ≤ 10 ms, p99 ≤ 50 ms", "cannot sustain (~185 commits/s)"),
    "stmts_idle": ("≤ 2 /s per process", "209/s with 1k, 290-370/s with 10k"),
    "stmts_burst": ("≤ 0.02 per event", "14-20 per event"),
    "stmts_steady": ("≤ 0.5 per event", "14-20 per event"),
    "defer_p50": ("p50 ≤ 5 ms", "-"),
    "defer_batched": ("≥ 5,000 /s", "-"),
    "failover_kill": ("≤ 5 s", "26 s (median of 3)"),
    "failover_term": ("≤ 1 s", "-"),
}


# ----------------------------------------------------------------------------- helpers


def pct(values: list[float], p: float) -> float:
    """Percentile with linear interpolation (``values`` need not be sorted)."""
    if not values:
        return math.nan
    v = sorted(values)
    k = (len(v) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def dist(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "p50": pct(values, 50), "p95": pct(values, 95),
            "p99": pct(values, 99), "max": max(values) if values else math.nan}


def median_of(runs: list[dict[str, Any]], key: str) -> float:
    vals = [r[key] for r in runs if r.get(key) is not None and not _isnan(r[key])]
    return statistics.median(vals) if vals else math.nan


def _isnan(x: Any) -> bool:
    return isinstance(x, float) and math.isnan(x)


def ms(seconds: float | None) -> str:
    if seconds is None or _isnan(seconds):
        return "-"
    if seconds >= 10:
        return f"{seconds:.1f} s"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1000:.1f} ms"


def num(x: float | None, digits: int = 0) -> str:
    if x is None or _isnan(x):
        return "-"
    return f"{x:,.{digits}f}"


def _norm(sql: str) -> str:
    return " ".join(sql.split())


_LITERAL = re.compile(r"'(?:[^']|'')*'|\$\d+|\b\d+(?:\.\d+)?\b|\b(?:NULL|true|false|epoch)\b",
                      re.IGNORECASE)


def _shape(sql: str) -> str:
    """pg_stat_statements replaces literals by $n: compare statements with both erased."""
    return _norm(_LITERAL.sub("?", sql)).rstrip(";")


def _with_user(dsn: str, user: str) -> str:
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(dsn)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit(parts._replace(netloc=f"{user}@{host}"))


def _proc_rss(pid: int) -> int:
    """Resident set size in bytes (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _proc_cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime (fields 14, 15)


def _cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    values = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    total = sum(values[:8])
    return total - idle, total


async def machine_busy(seconds: float = 0.5) -> float:
    """Share of all cores busy over ``seconds`` (0..1)."""
    b0, t0 = _cpu_times()
    await asyncio.sleep(seconds)
    b1, t1 = _cpu_times()
    return (b1 - b0) / max(1, t1 - t0)


async def cpu_percent(pids: list[int], seconds: float) -> list[float]:
    """CPU use of each process over ``seconds``, in % of one core."""
    tck = os.sysconf("SC_CLK_TCK")
    before = [_proc_cpu_ticks(p) for p in pids]
    t0 = time.monotonic()
    await asyncio.sleep(seconds)
    elapsed = time.monotonic() - t0
    return [100.0 * (_proc_cpu_ticks(p) - b) / tck / elapsed
            for p, b in zip(pids, before, strict=True)]


def _statement_names() -> dict[str, str]:
    from triggerflow import consumer, postgres

    names: dict[str, str] = {}
    for module in (postgres, consumer):
        for key, value in vars(module).items():
            if key.isupper() and isinstance(value, str) and re.search(
                    r"\b(SELECT|UPDATE|DELETE|INSERT)\b", value):
                names[_shape(value)] = key
    return names


_POOL_RESET = ("SELECT pg_advisory_unlock_all()", "CLOSE ALL", "UNLISTEN *", "RESET ALL")


def _name_of(query: str, names: dict[str, str]) -> str:
    """The constant a pg_stat_statements entry came from, else its abbreviated text."""
    import difflib

    text = _norm(query).rstrip(";")
    if text in _POOL_RESET:
        return f"{text} (asyncpg pool reset)"
    if "typeinfo_tree" in text or "set_config" in text:
        return "(asyncpg type introspection)"
    shape = _shape(query)
    if shape in names:
        return names[shape]
    if len(shape) > 60:
        close = difflib.get_close_matches(shape, list(names), n=1, cutoff=0.9)
        if close:
            return names[close[0]]
    return text[:48]


# ----------------------------------------------------------------------------- processes


@dataclass
class Proc:
    kind: str
    popen: subprocess.Popen[bytes]
    log: Path
    role: str

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None


class BenchError(RuntimeError):
    pass


class _Rollback(Exception):
    pass


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
    broker: Broker | None = None
    client: TriggerflowClient | None = None
    dbid: int = 0
    broker_losses: int = 0  # times the bench's broker connection dropped (broker restarted)
    _n: int = 0
    _watch: asyncio.Task[None] | None = None

    # -- set-up ---------------------------------------------------------------------------

    @classmethod
    def create(cls, settings: Settings, sizes: Sizes, console: Console, out: Path) -> Bench:
        from pydantic import SecretStr

        from triggerflow.postgres import _with_database, database_name

        dsn = settings.database_dsn()
        name = database_name(dsn)
        bench_db = name if name.endswith("_bench") else f"{name}_bench"
        ns = "tfbench" if settings.namespace == "triggerflow" else f"{settings.namespace}-bench"
        admin = _with_database(dsn, bench_db)
        allowed = [*settings.allowed_modules, "triggerflow.triggers", "triggerflow.bench"]
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

        from triggerflow.postgres import (
            _with_database,
            database_name,
            ensure_database,
            upgrade_schema,
        )
        from triggerflow.rabbitmq import Broker, Topology
        from triggerflow.sdk import TriggerflowClient

        name = database_name(self.admin_dsn)
        self.log(f"database {name}: recreating and migrating")
        conn = await asyncpg.connect(_with_database(self.admin_dsn, "postgres"))
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
        self.broker = Broker(self.settings.amqp_dsn(), Topology(self.namespace), name="bench")
        await self.broker.connect()
        await self.broker.declare([self.queue, self.idle_queue])
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
            while True:
                await asyncio.sleep(1)
                try:
                    await self.broker.connect()
                    break
                except Exception:  # keep trying until the broker is back
                    continue

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
        for queue in (self.queue, self.idle_queue, t.events_queue, t.dead_queue):
            ch = await self.broker.connection.channel()
            with contextlib.suppress(Exception):
                await ch.queue_delete(queue)
            if not ch.is_closed:
                await ch.close()
        for exchange in t.exchanges():
            ch = await self.broker.connection.channel()
            with contextlib.suppress(Exception):
                await ch.exchange_delete(exchange)
            if not ch.is_closed:
                await ch.close()

    async def reset(self) -> None:
        """No processes, no rows, empty queues: the start of every measurement."""
        await self.stop_all()
        await self.purge()
        await self.db().execute("TRUNCATE task_instance, trigger, consumer")

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

    # -- processes ------------------------------------------------------------------------

    def env(self, role: str, **overrides: Any) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRIGGERFLOW_")}
        values = self.role_settings(role).model_dump()
        values.pop("queues", None)
        values.update(overrides)
        for key, value in values.items():
            if value is None:
                continue
            if hasattr(value, "get_secret_value"):
                value = value.get_secret_value()
            if isinstance(value, list | dict):
                value = json.dumps(value)
            env[f"TRIGGERFLOW_{key.upper()}"] = str(value)
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def start(self, kind: str, *args: str) -> Proc:
        self._n += 1
        role = "writer" if kind == "writer" else "consumer"
        path = self.out / f"{self._n:03d}-{kind}.log"
        with open(path, "wb") as log:
            popen = subprocess.Popen([sys.executable, "-m", "triggerflow", kind, *args],
                                     env=self.env(role), stdout=log, stderr=subprocess.STDOUT)
        proc = Proc(kind, popen, path, role)
        self.procs.append(proc)
        return proc

    async def start_consumer(self, queue: str | None = None, *, ready: bool = True) -> Proc:
        queue = queue or self.queue
        before = await self.broker_consumers(queue)
        proc = self.start("consume", "--queue", queue)
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
        if proc.alive():
            proc.popen.send_signal(sig)
            try:
                await asyncio.wait_for(asyncio.to_thread(proc.popen.wait), grace)
            except TimeoutError:
                proc.popen.kill()
                await asyncio.to_thread(proc.popen.wait)
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
        await self.db().execute("SELECT pg_stat_statements_reset(0, $1, 0)", self.dbid)

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

    async def analyze(self) -> None:
        await self.db().execute("ANALYZE trigger; ANALYZE task_instance; ANALYZE consumer")


# ----------------------------------------------------------------------------- scenarios


def _run_id(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}"


async def scenario_capacity(b: Bench) -> dict[str, Any]:
    """One consumer holding N waiting triggers: RSS per trigger, CPU, claim+start time."""
    rows = []
    cases: list[tuple[str, int]] = [("timer", n) for n in b.sizes.capacity]
    cases.append(("coroutine", b.sizes.capacity_coroutines))
    base_rss, base_cpu = 0, 0.0
    for i, (kind, n) in enumerate(cases):
        await b.reset()
        if i == 0 or b.sizes.baseline_each:
            # Empty baseline: a fresh consumer with nothing to run, settled.
            empty = await b.start_consumer()
            await asyncio.sleep(b.sizes.settle)
            base_rss = _proc_rss(empty.pid)
            base_cpu = (await cpu_percent([empty.pid], b.sizes.cpu_window))[0]
            await b.stop(empty)
            await b.db().execute("TRUNCATE consumer")
        # Backlog first, then the consumer: the time below is claim+start, not defer speed.
        b.log(f"capacity: {kind} N={n:,}: deferring (no consumer running)")
        run = _run_id("cap")
        make = (lambda i: SleepTrigger(FAR)) if kind == "coroutine" else None
        defer_s = await b.defer(n, run, trigger=make)
        b.log(f"capacity: {kind} N={n:,}: deferred in {defer_s:.1f}s; starting the consumer")
        busy = await b.quiet()
        proc = await b.start_consumer(ready=False)
        ok, t_all = await b.wait_for("SELECT count(*) FROM trigger WHERE owner_id IS NOT NULL",
                                     n, 300)
        reg = await b.db().fetchrow(
            "SELECT extract(epoch FROM started_at)::float8 AS t FROM consumer WHERE pid = $1",
            proc.pid)
        claim = await b.db().fetchrow(
            "SELECT extract(epoch FROM min(claimed_at))::float8 AS first, "
            "extract(epoch FROM max(claimed_at))::float8 AS last FROM trigger")
        if not ok or reg is None or claim is None:
            raise BenchError(f"consumer claimed only {await b.owned():,} of {n:,}; see {proc.log}")
        claim_s = t_all - reg["t"]
        # Started = the runner holds them (reported by the next renewals).
        await b.wait_for("SELECT coalesce(max(running), 0) FROM consumer WHERE pid = $1", n, 30,
                         proc.pid, interval=0.2)
        await asyncio.sleep(b.sizes.settle)
        rss = _proc_rss(proc.pid)
        cpu = (await cpu_percent([proc.pid], b.sizes.cpu_window))[0]
        row = {"kind": kind, "n": n, "defer_s": defer_s, "base_rss": base_rss, "rss": rss,
               "bytes_per_trigger": (rss - base_rss) / n, "cpu_empty_pct": base_cpu,
               "cpu_pct": cpu, "claim_s": claim_s, "claim_rate": n / claim_s,
               "claim_span_s": claim["last"] - claim["first"], "machine_busy_before": busy}
        rows.append(row)
        b.log(f"capacity: {kind} N={n:,}: {row['bytes_per_trigger']:.0f} B/trigger, "
              f"CPU {cpu:.2f}%, all claimed in {claim_s:.2f}s ({row['claim_rate']:,.0f}/s)")
        await b.stop(proc)
    return {"rows": rows}


def table_capacity(res: dict[str, Any]) -> Table:
    from rich.table import Table

    t = Table(title="Capacity: one consumer holding N waiting triggers (DateTimeTrigger far "
              "ahead; coroutine row: a 1-task-each trigger)")
    for col in ("trigger", "N", "RSS empty", "RSS with N", "per trigger", "CPU empty",
                "CPU waiting", "claim+start all N", "claims/s"):
        t.add_column(col, justify="right")
    for r in res["rows"]:
        t.add_row(r["kind"], num(r["n"]), f"{r['base_rss'] / 2**20:.1f} MiB",
                  f"{r['rss'] / 2**20:.1f} MiB", f"{r['bytes_per_trigger']:.0f} B",
                  f"{r['cpu_empty_pct']:.2f} %", f"{r['cpu_pct']:.2f} %", ms(r["claim_s"]),
                  num(r["claim_rate"]))
    t.caption = ("RSS = VmRSS of the consumer process (/proc/PID/status); per trigger = "
                 "(RSS with N - RSS of a fresh empty consumer) / N. CPU = utime+stime over "
                 "the window while waiting (/proc/PID/stat), % of one core. Claim+start = from "
                 "the consumer's registration (DB clock) until all N are owned, N deferred "
                 "beforehand with no consumer running.")
    return t


async def _burst_once(b: Bench, n: int) -> dict[str, Any]:
    await b.db().execute("TRUNCATE task_instance, trigger")
    busy = await b.quiet()
    lead = b.sizes.lead + n / 2500
    instant = datetime.now(UTC) + timedelta(seconds=lead)
    run = _run_id(f"burst{n}")
    await b.defer(n, run, lambda i: instant)
    ok, _ = await b.wait_for("SELECT count(*) FROM trigger WHERE owner_id IS NOT NULL", n,
                             max(0.0, instant.timestamp() - time.time() - 0.4))
    if not ok:
        b.log(f"[yellow]  only {await b.owned():,}/{n:,} claimed before the instant")
    await asyncio.sleep(max(0.0, instant.timestamp() - time.time() - 0.3))
    await b.stmt_reset()
    done, _ = await b.wait_for(
        "SELECT count(*) FROM task_instance WHERE state = 'scheduled'", n, 120, interval=0.1)
    stmts = await b.stmt_snapshot()
    lat, fired = await b.latencies(run)
    if not done:
        b.log(f"[red]  only {len(lat):,}/{n:,} applied after 120 s")
    d = dist(lat)
    return {**d, "all_applied": d["max"], "applied": len(lat), "claimed_before": ok,
            "fired_p50": pct(fired, 50), "fired_max": max(fired, default=math.nan),
            "machine_busy_before": busy,
            "statements": b.calls(stmts), "stmts_per_event": b.calls(stmts) / max(1, len(lat)),
            "by_statement": stmts, "latencies": [round(x, 5) for x in lat]}


async def scenario_burst(b: Bench) -> dict[str, Any]:
    """N timers firing at one instant; fire -> update percentiles, medians of repeats."""
    await b.reset()
    procs = [await b.start_writer(), await b.start_consumer()]
    out: dict[str, Any] = {"sizes": {}}
    for n in b.sizes.burst:
        runs = []
        for i in range(b.sizes.repeats):
            b.log(f"burst: N={n:,} run {i + 1}/{b.sizes.repeats}")
            r = await b.measured(f"burst {n}", functools.partial(_burst_once, b, n))
            runs.append(r)
            b.log(f"burst: N={n:,} run {i + 1}: p50 {ms(r['p50'])}, p99 {ms(r['p99'])}, all "
                  f"applied {ms(r['all_applied'])}, {r['statements']} statements")
        out["sizes"][str(n)] = {
            "runs": runs,
            **{k: median_of(runs, k) for k in ("p50", "p95", "p99", "max", "all_applied",
                                               "stmts_per_event", "statements", "fired_max")},
        }
    out["cpu_idle_pct"] = await cpu_percent([p.pid for p in procs], 1.0)
    return out


def table_burst(res: dict[str, Any], repeats: int) -> Table:
    from rich.table import Table

    t = Table(title=f"Burst: N DateTimeTriggers firing at one instant (median of {repeats} runs)")
    for col in ("N", "p50", "p95", "p99", "all applied", "all fired", "statements",
                "per event", "runs: all applied"):
        t.add_column(col, justify="right")
    for n, r in res["sizes"].items():
        t.add_row(num(int(n)), ms(r["p50"]), ms(r["p95"]), ms(r["p99"]),
                  ms(r["all_applied"]), ms(r["fired_max"]), num(r["statements"]),
                  f"{r['stmts_per_event']:.4f}", ", ".join(ms(x["all_applied"]) for x in r["runs"]))
    t.caption = ("Latency = task_instance.updated_at (DB clock) - the trigger's instant, one "
                 "consumer + one writer; all applied = max. All fired = last event_fired_at "
                 "(consumer clock, same host) - instant: the consumer's share. Statements: "
                 "pg_stat_statements calls of the consumer and writer roles from 0.3 s before "
                 "the instant until all applied.")
    return t


async def _steady_once(b: Bench, rate: int, seconds: float) -> dict[str, Any]:
    await b.db().execute("TRUNCATE task_instance, trigger")
    busy = await b.quiet()
    total = int(rate * seconds)
    lead = b.sizes.lead + 0.5 + total / 3000
    t0 = datetime.now(UTC) + timedelta(seconds=lead)
    run = _run_id("steady")
    b.log(f"steady: deferring {total:,} timers at {rate:,}/s from {lead:.0f}s ahead")
    await b.defer(total, run, lambda i: t0 + timedelta(seconds=i / rate))
    ok, _ = await b.wait_for("SELECT count(*) FROM trigger WHERE owner_id IS NOT NULL", total,
                             max(0.0, t0.timestamp() - time.time() - 0.6))
    if not ok:
        b.log(f"[yellow]  only {await b.owned():,}/{total:,} claimed before the first instant")
    await asyncio.sleep(max(0.0, t0.timestamp() - time.time() - 0.5))
    await b.stmt_reset()
    b.log(f"steady: firing for {seconds:.0f}s")
    await asyncio.sleep(seconds)
    await b.wait_for(
        "SELECT count(*) FROM task_instance WHERE state = 'scheduled'", total, 60, interval=0.1)
    stmts = await b.stmt_snapshot()
    lat, fired = await b.latencies(run)
    return {**dist(lat), "rate": rate, "seconds": seconds, "applied": len(lat),
            "fired_p50": pct(fired, 50), "fired_p99": pct(fired, 99),
            "machine_busy_before": busy,
            "claimed_before": ok, "statements": b.calls(stmts),
            "stmts_per_event": b.calls(stmts) / max(1, len(lat)), "by_statement": stmts,
            "latencies": [round(x, 5) for x in lat]}


async def scenario_steady(b: Bench) -> dict[str, Any]:
    await b.reset()
    await b.start_writer()
    await b.start_consumer()
    r = await b.measured("steady", lambda: _steady_once(b, b.sizes.steady_rate,
                                                         b.sizes.steady_seconds))
    b.log(f"steady: p50 {ms(r['p50'])}, p99 {ms(r['p99'])}, {r['stmts_per_event']:.3f} "
          "statements/event")
    return r


def table_steady(res: dict[str, Any]) -> Table:
    from rich.table import Table

    t = Table(title=f"Steady rate: {res['rate']:,} fires/s for {res['seconds']:.0f} s")
    for col in ("events", "p50", "p95", "p99", "max", "fired p50", "fired p99", "statements",
                "per event"):
        t.add_column(col, justify="right")
    t.add_row(num(res["applied"]), ms(res["p50"]), ms(res["p95"]), ms(res["p99"]),
              ms(res["max"]), ms(res["fired_p50"]), ms(res["fired_p99"]),
              num(res["statements"]), f"{res['stmts_per_event']:.3f}")
    t.caption = ("Instants spread evenly (1 ms apart at 1,000/s); latency = updated_at - "
                 "instant; fired = event_fired_at - instant (the consumer's share); statements "
                 "of consumer + writer over the whole window.")
    return t


# EXPLAIN targets: statement name -> how to build its arguments from the live data.
HOT = ("CLAIM", "RENEW", "REAP_DEAD", "REAP_DEAD (a dead owner)", "RESEND_UNCLAIMED",
       "TIMEOUT_ORPHANS",
       "TIMEOUT_ORPHANS (writer)", "SWEEP_CANCELLED", "APPLY_EVENTS", "DEFER")


async def _explain_all(b: Bench, me: int) -> list[dict[str, Any]]:
    from triggerflow import postgres as pg
    from triggerflow.wire import encode_json

    db = b.db()
    idle_ids = [r["id"] for r in await db.fetch(
        "SELECT id FROM trigger WHERE queue = $1 ORDER BY id LIMIT 2000", b.idle_queue)]
    owned = await db.fetch(
        "SELECT id, attempt, queue FROM trigger WHERE owner_id = $1 ORDER BY random() LIMIT 500",
        me)
    owned = sorted(owned, key=lambda r: r["id"])
    moment = encode_json(datetime.now(UTC))
    k = 1000
    uid = uuid.uuid4().hex[:8]
    args: dict[str, tuple[str, tuple[Any, ...]]] = {
        "CLAIM": (pg.CLAIM, (me, idle_ids, [b.idle_queue])),
        "RENEW": (pg.RENEW, (me, 3.0, 100_000, [b.queue])),
        "REAP_DEAD": (pg.REAP_DEAD, ([b.queue], False, 10)),
        # the consumer's lease expires inside the rolled-back transaction: what a peer's
        # reaper runs once after a crash, freeing everything it held
        "REAP_DEAD (a dead owner)": (pg.REAP_DEAD, ([b.queue], False, 10)),
        "RESEND_UNCLAIMED": (pg.RESEND_UNCLAIMED, ([b.queue], False, 15.0, 20_000)),
        "TIMEOUT_ORPHANS": (pg.TIMEOUT_ORPHANS, ([b.queue], False, 7 * 86400.0)),
        "TIMEOUT_ORPHANS (writer)": (pg.TIMEOUT_ORPHANS, ([], True, 7 * 86400.0)),
        "SWEEP_CANCELLED": (pg.SWEEP_CANCELLED, (me,)),
        "APPLY_EVENTS": (pg.APPLY_EVENTS, (
            [r["id"] for r in owned], [r["attempt"] for r in owned], [r["queue"] for r in owned],
            ["resume"] * len(owned), [moment] * len(owned), [time.time()] * len(owned))),
        "DEFER": (pg.DEFER, (
            ["bench"] * k, [f"x{i}" for i in range(k)], [f"explain-{uid}"] * k, [-1] * k,
            ["triggerflow.triggers.temporal.DateTimeTrigger"] * k,
            [json.dumps({"moment": "2030-01-01T00:00:00+00:00"})] * k, [b.queue] * k,
            ["execute_complete"] * k, ["{}"] * k, [604800.0] * k, [None] * k)),
    }
    out = []
    for name in HOT:
        sql, params = args[name]
        plan: list[str] = []
        for _ in range(2):  # the second run is the warm one we keep
            try:
                async with db.acquire() as conn, conn.transaction():
                    if name == "REAP_DEAD (a dead owner)":
                        await conn.execute("UPDATE consumer SET expires_at = now() - "
                                           "interval '1 second' WHERE id = $1", me)
                    rows = await conn.fetch("EXPLAIN (ANALYZE, BUFFERS) " + sql, *params)
                    plan = [r[0] for r in rows]
                    raise _Rollback
            except _Rollback:
                pass
        text = "\n".join(plan)
        ran = "\n".join(line for line in plan if "never executed" not in line)
        indexes = sorted(set(re.findall(r"(?:Index Scan|Index Only Scan|Bitmap Index Scan)"
                                        r"(?: Backward)? (?:using|on) (\w+)", ran)))
        seqs = sorted(set(re.findall(r"Seq Scan on (\w+)", ran)))
        exec_ms = re.search(r"Execution Time: ([\d.]+) ms", text)
        hits = sum(int(x) for x in re.findall(r"shared hit=(\d+)", plan[0] if plan else ""))
        out.append({"statement": name, "exec_ms": float(exec_ms.group(1)) if exec_ms else None,
                    "indexes": indexes, "seq_scans": seqs, "top_buffers_hit": hits,
                    "plan": plan})
    return out


async def _writer_rate(b: Bench, writers: int, run: str, limit: int) -> dict[str, Any]:
    """Publish one event for each of the first ``limit`` tasks still deferred in ``run``, with
    ``writers`` writers running; time until all are applied."""
    from triggerflow.wire import Event, encode_events, encode_json

    assert b.broker is not None
    ids = [(r["id"], r["attempt"]) for r in await b.db().fetch(
        "SELECT t.id, t.attempt FROM trigger t JOIN task_instance ti ON ti.trigger_id = t.id"
        " WHERE ti.run_id = $1 ORDER BY t.id", run)]
    ids = ids[:limit]
    procs = [await b.start_writer() for _ in range(writers)]
    payload = encode_json(datetime.now(UTC))
    batches = [ids[i:i + 500] for i in range(0, len(ids), 500)]
    await b.quiet()
    await b.stmt_reset()
    t0 = time.time()
    await asyncio.gather(*(b.broker.publish(
        b.broker.topology.events, b.queue,
        encode_events([Event(tid, att, b.queue, "resume", payload, time.time())
                       for tid, att in part]))
        for part in batches))
    publish_s = time.time() - t0
    done, _ = await b.wait_for(
        "SELECT count(*) FROM task_instance WHERE run_id = $1 AND state = 'scheduled' "
        "AND event_fired_at >= to_timestamp($2)", len(ids), 180, run, t0, interval=0.1)
    last = await b.db().fetchval(
        "SELECT extract(epoch FROM max(updated_at))::float8 FROM task_instance "
        "WHERE run_id = $1 AND state = 'scheduled' AND event_fired_at >= to_timestamp($2)",
        run, t0)
    stmts = await b.stmt_snapshot()
    for p in procs:
        await b.stop(p)
    elapsed = last - t0
    applies = sum(s["calls"] for s in stmts if s["statement"] == "APPLY_EVENTS")
    return {"writers": writers, "events": len(ids), "applied_all": done, "seconds": elapsed,
            "events_per_s": len(ids) / elapsed, "publish_s": publish_s,
            "apply_statements": applies, "statements": b.calls(stmts)}


async def scenario_dbload(b: Bench) -> dict[str, Any]:
    s = b.sizes
    out: dict[str, Any] = {}
    # 1. Statements per second per process while many triggers wait.
    await b.reset()
    writer = await b.start_writer()
    consumer = await b.start_consumer()
    me = await b.consumer_id(consumer)
    b.log(f"dbload: deferring {s.waiting:,} waiting timers (+2,000 to a queue nobody consumes)")
    await b.defer(s.waiting, _run_id("wait"))
    await b.defer(2_000, _run_id("idle"), queue=b.idle_queue)
    ok, _ = await b.wait_for("SELECT count(*) FROM trigger WHERE owner_id IS NOT NULL",
                             s.waiting, 300)
    if not ok:
        raise BenchError("consumer did not claim every waiting trigger")
    await asyncio.sleep(b.sizes.settle)
    await b.analyze()  # as autovacuum would have by now on a long-running system
    await b.quiet()
    b.log(f"dbload: {s.waiting:,} waiting; counting statements for {s.idle_window:.0f}s")
    await b.stmt_reset()
    cpu = await cpu_percent([consumer.pid, writer.pid], s.idle_window)
    idle = await b.stmt_snapshot()
    window = s.idle_window
    per_role = {role: sum(x["calls"] for x in idle if x["role"] == role) / window
                for role in ("consumer", "writer", "all")}
    out["idle"] = {"waiting": s.waiting, "window_s": window, "per_s": per_role,
                   "cpu_pct": {"consumer": cpu[0], "writer": cpu[1]}, "by_statement": idle}
    b.log(f"dbload: while waiting: consumer {per_role['consumer']:.2f}/s, writer "
          f"{per_role['writer']:.2f}/s")
    # 2. EXPLAIN (ANALYZE, BUFFERS) of the hot statements against this data.
    b.log("dbload: EXPLAIN ANALYZE of the hot statements")
    out["explain"] = await _explain_all(b, me)
    # 3. Statements per fired event: a burst and a steady rate (fresh processes, no backlog).
    await b.reset()
    await b.start_writer()
    await b.start_consumer()
    b.log(f"dbload: burst of {s.dbload_burst:,}")
    burst = await b.measured("burst", lambda: _burst_once(b, s.dbload_burst))
    burst.pop("latencies")
    out["burst"] = burst
    steady = await b.measured("steady", lambda: _steady_once(b, s.steady_rate,
                                                             s.dbload_steady_seconds))
    steady.pop("latencies")
    out["steady"] = steady
    # 4. Writer throughput: 1 writer right after the deferrals (planner statistics stale, as
    # after any big batch of deferrals), then 1 and 2 writers once the tables are analyzed.
    await b.reset()
    n = s.writer_events
    out["writers"] = []
    cases = (("stale", 1), ("analyzed", 1), ("analyzed", 2))
    for i, (stats, writers) in enumerate(cases):
        if i < 2:
            run = _run_id(f"w{i}")
            b.log(f"dbload: writer throughput: deferring {n:,} tasks")
            await b.defer(n if i == 0 else 2 * n, run)
            await b.purge()  # no consumer: the events below are what a consumer would publish
            if stats == "analyzed":
                await b.analyze()
        r = await _writer_rate(b, writers, run, n)
        r["stats"] = stats
        out["writers"].append(r)
        b.log(f"dbload: {writers} writer(s), statistics {stats}: {r['events_per_s']:,.0f} "
              "events/s")
    return out


def tables_dbload(res: dict[str, Any]) -> list[Table]:
    from rich.markup import escape
    from rich.table import Table

    idle = res["idle"]
    t1 = Table(title=f"Database load while {idle['waiting']:,} timers wait "
               f"({idle['window_s']:.0f} s window)")
    for col in ("process", "statement", "calls", "per second", "mean ms"):
        t1.add_column(col, justify="right" if col not in ("process", "statement") else "left")
    rows = sorted(idle["by_statement"], key=lambda x: (x["role"], -x["calls"]))
    for x in rows:
        t1.add_row(x["role"], escape(x["statement"]), num(x["calls"]),
                   f"{x['calls'] / idle['window_s']:.2f}", f"{x['total_ms'] / x['calls']:.2f}")
    for role in ("consumer", "writer"):
        if role in idle["per_s"]:
            t1.add_row(f"[b]{role}", "[b]total", "", f"[b]{idle['per_s'][role]:.2f}", "")
    t1.caption = ("pg_stat_statements calls per database role: the consumer and the writer log "
                  "in as their own roles, so each line is one process (one consumer, one writer).")
    t2 = Table(title="Statements per fired event")
    for col in ("case", "events", "consumer", "writer", "total", "per event"):
        t2.add_column(col, justify="right")
    for name, r in (("burst", res["burst"]), ("steady", res["steady"])):
        label = (f"burst of {r['applied']:,}" if name == "burst" else
                 f"steady {r['rate']:,}/s x {r['seconds']:.0f} s")
        by = r["by_statement"]
        t2.add_row(label, num(r["applied"]), num(Bench.calls(by, ("consumer",))),
                   num(Bench.calls(by, ("writer",))), num(r["statements"]),
                   f"{r['stmts_per_event']:.4f}")
    t3 = Table(title="Writer throughput (events published all at once, 500 per message)")
    for col in ("writers", "planner statistics", "events", "seconds", "events/s",
                "APPLY_EVENTS calls", "statements"):
        t3.add_column(col, justify="right")
    for r in res["writers"]:
        t3.add_row(str(r["writers"]), r.get("stats", "-"), num(r["events"]),
                   f"{r['seconds']:.2f}", num(r["events_per_s"]), num(r["apply_statements"]),
                   num(r["statements"]))
    t3.caption = ("seconds = first publish → last task_instance.updated_at (DB clock). Stale: "
                  "the tasks were deferred just before (autovacuum has not analyzed them yet, as "
                  "after any large batch of deferrals); analyzed: after ANALYZE.")
    t4 = Table(title="Hot statements: EXPLAIN (ANALYZE, BUFFERS) against the waiting data")
    for col in ("statement", "execution", "indexes used", "seq scans"):
        t4.add_column(col, justify="left")
    for r in res["explain"]:
        t4.add_row(r["statement"], f"{r['exec_ms']:.2f} ms" if r["exec_ms"] is not None else "-",
                   ", ".join(r["indexes"]) or "-", ", ".join(r["seq_scans"]) or "-")
    return [t1, t2, t3, t4]


async def _sdk_workers(b: Bench, procs: int, mode: str, *, count: int = 0,
                       seconds: float = 0.0, batch: int = 1) -> list[dict[str, Any]]:
    await b.quiet()
    # after every worker has imported and connected
    start_at = time.time() + b.sizes.lead + b.sizes.worker_stagger * procs
    run = _run_id(f"defer-{mode}")
    env = b.env("sdk")
    workers = [await asyncio.create_subprocess_exec(
        sys.executable, "-m", "triggerflow.bench", "sdk-worker", "--mode", mode,
        "--count", str(count), "--seconds", str(seconds), "--batch", str(batch),
        "--start-at", str(start_at), "--queue", b.queue, "--run-id", f"{run}-{i}",
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        for i in range(procs)]
    results = []
    for w in workers:
        stdout, stderr = await w.communicate()
        if w.returncode != 0:
            raise BenchError(f"sdk worker failed: {stderr.decode()[-2000:]}")
        results.append(json.loads(stdout.decode().strip().splitlines()[-1]))
    return results


def _combine(results: list[dict[str, Any]]) -> dict[str, Any]:
    lat = [x for r in results for x in r["latencies"]]
    n = sum(r["n"] for r in results)
    elapsed = max(r["end"] for r in results) - min(r["start"] for r in results)
    return {"procs": len(results), "n": n, "seconds": elapsed, "per_s": n / elapsed,
            **{f"lat_{k}": v for k, v in dist(lat).items() if k != "n"}}


async def scenario_defer(b: Bench) -> dict[str, Any]:
    s = b.sizes
    await b.reset()
    out: dict[str, Any] = {}
    b.log(f"defer: 1 process, {s.defer_single:,} single defer() calls")
    out["single"] = _combine(await _sdk_workers(b, 1, "single", count=s.defer_single))
    b.log(f"defer: 1 process, {s.defer_batched:,} in batches of {s.defer_batch:,}")
    out["batched"] = _combine(await _sdk_workers(b, 1, "batched", count=s.defer_batched,
                                                 batch=s.defer_batch))
    b.log(f"defer: {s.defer_procs} processes, single defer() for {s.defer_seconds:.0f}s")
    out["single_many"] = _combine(await _sdk_workers(b, s.defer_procs, "single",
                                                     seconds=s.defer_seconds))
    b.log(f"defer: {s.defer_procs} processes, batches of {s.defer_batch:,}")
    out["batched_many"] = _combine(await _sdk_workers(
        b, s.defer_procs, "batched", count=s.defer_batched // 2, batch=s.defer_batch))
    await b.purge()
    return out


def table_defer(res: dict[str, Any], batch: int) -> Table:
    from rich.table import Table

    t = Table(title="Deferral through the SDK (TriggerflowClient; no consumer running)")
    for col in ("case", "processes", "deferrals", "seconds", "deferrals/s", "call p50",
                "call p99"):
        t.add_column(col, justify="right")
    for key, label in (("single", "defer(), one at a time"),
                       ("batched", f"defer_many(), {batch:,} a call"),
                       ("single_many", "defer(), one at a time"),
                       ("batched_many", f"defer_many(), {batch:,} a call")):
        r = res[key]
        t.add_row(label, str(r["procs"]), num(r["n"]), f"{r['seconds']:.2f}", num(r["per_s"]),
                  ms(r["lat_p50"]), ms(r["lat_p99"]))
    t.caption = ("Each call: one DEFER statement (trigger rows + task instances 'deferred'), "
                 "then a confirmed, mandatory publish of the wake-up; measured in separate SDK "
                 "processes started together (plain asyncio loop).")
    return t


async def _failover_once(b: Bench, sig: signal.Signals) -> dict[str, Any]:
    n = b.sizes.failover
    await b.reset()
    victim = await b.start_consumer()
    peer = await b.start_consumer()
    vid, pid_ = await b.consumer_id(victim), await b.consumer_id(peer)
    await b.defer(2 * n, _run_id("failover"))
    ok, _ = await b.wait_for("SELECT count(*) FROM trigger WHERE owner_id IS NOT NULL", 2 * n, 120)
    if not ok:
        raise BenchError("the two consumers did not claim every trigger")
    await asyncio.sleep(b.sizes.settle)  # renewals report the counts; rebalancing settles
    held = await b.owned(vid)
    busy = await b.quiet()
    t0 = float(await b.db().fetchval("SELECT extract(epoch FROM clock_timestamp())::float8"))
    victim.popen.send_signal(sig)
    done, t_all = await b.wait_for("SELECT count(*) FROM trigger WHERE owner_id = $1", 2 * n,
                                   b.sizes.failover_timeout, pid_)
    detail = await b.db().fetchrow(
        "SELECT extract(epoch FROM min(dispatched_at))::float8 AS freed, "
        "extract(epoch FROM max(claimed_at))::float8 AS last_claim, "
        "count(*) FILTER (WHERE quarantined_at IS NOT NULL) AS quarantined, "
        "count(*) FILTER (WHERE failures > 0) AS suspects "
        "FROM trigger WHERE claimed_at > to_timestamp($1) OR dispatched_at > to_timestamp($1)",
        t0)
    assert detail is not None
    moved = await b.owned(pid_)
    await b.stop(victim, signal.SIGKILL)
    await b.stop(peer)
    freed = (detail["freed"] - t0) if detail["freed"] else math.nan
    return {"signal": sig.name, "held": held, "machine_busy_before": busy, "moved": moved,
            "complete": done, "seconds": t_all - t0, "freed_after_s": freed,
            "quarantined": detail["quarantined"], "suspects_left": detail["suspects"]}


async def scenario_failover(b: Bench) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for sig in (signal.SIGKILL, signal.SIGTERM):
        runs = []
        for i in range(b.sizes.failover_repeats):
            r = await b.measured(f"failover {sig.name}", functools.partial(_failover_once, b, sig))
            runs.append(r)
            b.log(f"failover: {sig.name} run {i + 1}: {r['held']:,} triggers on the peer after "
                  f"{r['seconds']:.2f}s (freed after {r['freed_after_s']:.2f}s)"
                  + ("" if r["complete"] else " [red]INCOMPLETE"))
        out[sig.name] = {"runs": runs, "seconds": median_of(runs, "seconds"),
                         "freed_after_s": median_of(runs, "freed_after_s")}
    return out


def table_failover(res: dict[str, Any], n: int) -> Table:
    from rich.table import Table

    t = Table(title=f"Failover: a consumer holding ~{n:,} timers stops, its peer (also "
              f"holding ~{n:,}) takes them over")
    for col in ("signal", "held by victim", "freed (median)", "all on peer (median)", "runs",
                "complete"):
        t.add_column(col, justify="right")
    for name in ("SIGKILL", "SIGTERM"):
        r = res[name]
        t.add_row(name, num(statistics.median(x["held"] for x in r["runs"])),
                  ms(r["freed_after_s"]), ms(r["seconds"]),
                  ", ".join(ms(x["seconds"]) for x in r["runs"]),
                  "yes" if all(x["complete"] for x in r["runs"]) else "[red]NO")
    t.caption = ("From the signal (DB clock) until every trigger is owned by the peer (polled "
                 "every 50 ms). Freed = the reaper/release put the first one back "
                 "(trigger.dispatched_at). Default lease_ttl 3 s, renew_interval 1 s.")
    return t


# ----------------------------------------------------------------------------- summary


def _verdict(ok: bool | None) -> str:
    if ok is None:
        return "-"
    return "[green]met" if ok else "[bold red]missed"


Row = tuple[str, str, str, str, bool | None]


def _row(key: str, what: str, value: str, ok: bool | None) -> Row:
    target, airflow = TARGETS[key]
    return (what, value, target, airflow, ok)


def _summary_capacity(cap: dict[str, Any]) -> list[Row]:
    timers = [r for r in cap["rows"] if r["kind"] == "timer"]
    big = max(timers, key=lambda r: r["n"])
    worst = min(timers, key=lambda r: r["claim_rate"])
    rows = [
        _row("capacity_n", "waiting timers held by one consumer", num(big["n"]),
             big["n"] >= 100_000),
        _row("kb_timer", f"memory per waiting timer (N={big['n']:,})",
             f"{big['bytes_per_trigger'] / 1024:.2f} KB", big["bytes_per_trigger"] <= 1024),
    ]
    rows += [_row("kb_coroutine", f"memory per coroutine trigger (N={r['n']:,})",
                  f"{r['bytes_per_trigger'] / 1024:.2f} KB", r["bytes_per_trigger"] <= 3072)
             for r in cap["rows"] if r["kind"] == "coroutine"]
    rows += [
        _row("cpu_waiting", f"CPU while {big['n']:,} wait", f"{big['cpu_pct']:.2f} %",
             big["cpu_pct"] <= 2.0),
        _row("claim_rate", f"claim+start rate (slowest, N={worst['n']:,})",
             f"{worst['claim_rate']:,.0f} /s", worst["claim_rate"] >= 10_000),
    ]
    return rows


def _summary_latency(results: dict[str, Any]) -> list[Row]:
    rows = []
    for n, r in results.get("burst", {}).get("sizes", {}).items():
        key = "burst_1k" if int(n) <= 1_000 else "burst_10k"
        limit = 0.1 if key == "burst_1k" else 0.5
        rows.append(_row(key, f"burst of {int(n):,}: p50 / p99 / all applied",
                         f"{ms(r['p50'])} / {ms(r['p99'])} / {ms(r['all_applied'])}",
                         r["all_applied"] <= limit))
    steady = results.get("steady")
    if steady:
        rows.append(_row("steady", f"steady {steady['rate']:,}/s: p50 / p99",
                         f"{ms(steady['p50'])} / {ms(steady['p99'])}",
                         steady["p50"] <= 0.010 and steady["p99"] <= 0.050))
    return rows


def _summary_db(results: dict[str, Any]) -> list[Row]:
    rows = []
    db = results.get("dbload")
    if db:
        per = db["idle"]["per_s"]
        rows += [_row("stmts_idle", f"statements/s of the {role} while "
                      f"{db['idle']['waiting']:,} wait", f"{per[role]:.2f}", per[role] <= 2.0)
                 for role in ("consumer", "writer") if per.get(role)]
        rows.append(_row("stmts_burst", f"statements per event, burst of "
                         f"{db['burst']['applied']:,}", f"{db['burst']['stmts_per_event']:.4f}",
                         db["burst"]["stmts_per_event"] <= 0.02))
    steady = db["steady"] if db else results.get("steady")
    if steady:
        rows.append(_row("stmts_steady", f"statements per event, steady {steady['rate']:,}/s",
                         f"{steady['stmts_per_event']:.3f}", steady["stmts_per_event"] <= 0.5))
    return rows


def _summary_ops(results: dict[str, Any]) -> list[Row]:
    rows = []
    d = results.get("defer")
    if d:
        rows.append(_row("defer_p50", "single defer(): p50 / p99",
                         f"{ms(d['single']['lat_p50'])} / {ms(d['single']['lat_p99'])}",
                         d["single"]["lat_p50"] <= 0.005))
        rows.append(_row("defer_batched", "batched deferrals/s, one process",
                         num(d["batched"]["per_s"]), d["batched"]["per_s"] >= 5_000))
    f = results.get("failover")
    if f:
        rows.append(_row("failover_kill", "failover after SIGKILL (median)",
                         ms(f["SIGKILL"]["seconds"]), f["SIGKILL"]["seconds"] <= 5))
        rows.append(_row("failover_term", "handover after SIGTERM (median)",
                         ms(f["SIGTERM"]["seconds"]), f["SIGTERM"]["seconds"] <= 1))
    return rows


def summary_rows(results: dict[str, Any]) -> list[Row]:
    rows = _summary_capacity(results["capacity"]) if "capacity" in results else []
    return rows + _summary_latency(results) + _summary_db(results) + _summary_ops(results)


def table_summary(results: dict[str, Any]) -> Table:
    from rich.table import Table

    quick = bool(results.get("quick"))
    t = Table(title="Summary: triggerflow vs targets (issue 4) and Airflow 3.3.2's triggerer "
              "(DESIGN.md)")
    for col in ("metric", "triggerflow", "target", "Airflow triggerer", ""):
        t.add_column(col)
    for what, value, target, airflow, ok in summary_rows(results):
        t.add_row(what, value, target, airflow, "-" if quick else _verdict(ok))
    if quick:
        t.caption = "--quick: sizes far too small to judge the targets; run without it."
    return t


def plot_bursts(burst: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    sizes = list(burst["sizes"].items())
    fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4), squeeze=False)
    for ax, (n, r) in zip(axes[0], sizes, strict=True):
        for i, run in enumerate(r["runs"]):
            lat = sorted(x * 1000 for x in run["latencies"])
            ys = [(k + 1) / len(lat) for k in range(len(lat))]
            ax.plot(lat, ys, label=f"run {i + 1}: all in {run['all_applied'] * 1000:.0f} ms")
        limit = 100 if int(n) <= 1000 else 500
        ax.axvline(limit, color="red", linestyle="--", label=f"target: all ≤ {limit} ms")
        ax.set_title(f"{int(n):,} DateTimeTriggers at one instant")
        ax.set_xlabel("fire instant → task_instance updated (ms, DB clock)")
        ax.set_ylabel("fraction of tasks applied")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------- entry point

RUNNERS: dict[str, Callable[[Bench], Awaitable[dict[str, Any]]]] = {
    "capacity": scenario_capacity, "burst": scenario_burst, "steady": scenario_steady,
    "dbload": scenario_dbload, "defer": scenario_defer, "failover": scenario_failover,
}


def _tables(name: str, res: dict[str, Any], sizes: Sizes) -> list[Table]:
    if name == "capacity":
        return [table_capacity(res)]
    if name == "burst":
        return [table_burst(res, sizes.repeats)]
    if name == "steady":
        return [table_steady(res)]
    if name == "dbload":
        return tables_dbload(res)
    if name == "defer":
        return [table_defer(res, sizes.defer_batch)]
    return [table_failover(res, sizes.failover)]


def run_bench(settings: Settings, scenarios: list[str], quick: bool) -> int:
    """Run the named scenarios (default all), print tables, save results; exit code."""
    from rich.console import Console

    unknown = [s for s in scenarios if s not in SCENARIOS]
    console = Console(record=True, log_path=False,
                      width=None if sys.stdout.isatty() else 150)
    if unknown:
        console.print(f"[red]unknown scenario(s) {', '.join(unknown)}; choose from "
                      f"{', '.join(SCENARIOS)}")
        return 2
    chosen = [s for s in SCENARIOS if s in scenarios] if scenarios else list(SCENARIOS)
    return asyncio.run(_main(settings, chosen, quick, console))


async def _main(settings: Settings, chosen: list[str], quick: bool, console: Console) -> int:
    import logging

    from rich.markup import escape

    for noisy in ("aiormq", "aio_pika"):  # broker restarts are reported by the watcher
        logging.getLogger(noisy).setLevel(logging.CRITICAL)
    sizes = QUICK if quick else FULL
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    results_dir = Path("bench-results")
    out = results_dir / f"logs-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    b = Bench.create(settings, sizes, console, out)
    results: dict[str, Any] = {
        "started": datetime.now(UTC).isoformat(), "quick": quick, "scenarios": chosen,
        "sizes": sizes.__dict__, "machine": {"cpus": os.cpu_count(), "python": sys.version},
        "command": "triggerflow bench " + " ".join([*chosen, *(["--quick"] if quick else [])]),
    }
    failed: list[str] = []
    try:
        await b.setup()
        for name in chosen:
            console.rule(f"[b]{name}")
            t0 = time.monotonic()
            res = None
            for attempt in range(1, 4):
                losses = b.broker_losses
                try:
                    res = await RUNNERS[name](b)
                    break
                except Exception as exc:
                    await b.stop_all()
                    if attempt < 3 and b.broker_losses != losses:
                        console.log(f"[yellow]{name}: the broker restarted during the scenario "
                                    f"({escape(repr(exc))[:200]}); running it again")
                        await asyncio.sleep(5)
                        continue
                    if isinstance(exc, BenchError):
                        console.print(f"[red]{name} failed:[/] {escape(str(exc))}")
                    else:
                        console.print_exception(max_frames=5)
                    break
            if res is None:
                failed.append(name)
                continue
            res["duration_s"] = time.monotonic() - t0
            results[name] = res
            try:
                for table in _tables(name, res, sizes):
                    console.print(table)
            except Exception:
                console.print_exception(max_frames=5)
                failed.append(name)
            console.log(f"{name} took {res['duration_s']:.0f}s")
    finally:
        await b.teardown()
    console.rule("[b]summary")
    console.print(table_summary(results))
    if failed:
        console.print(f"[red]failed scenarios: {', '.join(failed)}")
    path = results_dir / f"bench-{stamp}{'-quick' if quick else ''}.json"
    path.write_text(json.dumps(results, indent=1, default=str))
    console.print(f"raw results: {path}")
    if "burst" in results and not quick and PLOT.parent.parent.is_dir() and plot_bursts(
            results["burst"], PLOT):
        console.print(f"burst latency plot: {PLOT}")
    (results_dir / f"bench-{stamp}{'-quick' if quick else ''}.txt").write_text(
        console.export_text())
    return 1 if failed else 0


# ----------------------------------------------------------------------------- SDK worker


async def _sdk_worker(args: Any) -> dict[str, Any]:
    from triggerflow.model import TaskKey
    from triggerflow.sdk import Deferral, TriggerflowClient
    from triggerflow.settings import Settings
    from triggerflow.triggers import DateTimeTrigger

    moment = datetime.now(UTC) + timedelta(seconds=FAR)
    async with TriggerflowClient(Settings(**{})) as client:  # from TRIGGERFLOW_* only
        for i in range(20):  # warm: connections, prepared statements, routability
            await client.defer(TaskKey("bench", f"warm{i}", args.run_id), DateTimeTrigger(moment),
                               queue=args.queue)
        await asyncio.sleep(max(0.0, args.start_at - time.time()))
        lat: list[float] = []
        n = 0
        start = time.time()
        if args.mode == "single":
            end_at = start + args.seconds if args.seconds else math.inf
            while (args.count and n < args.count) or (not args.count and time.time() < end_at):
                t = time.perf_counter()
                await client.defer(TaskKey("bench", f"s{n}", args.run_id), DateTimeTrigger(moment),
                                   queue=args.queue)
                lat.append(time.perf_counter() - t)
                n += 1
        else:
            while n < args.count:
                size = min(args.batch, args.count - n)
                t = time.perf_counter()
                await client.defer_many([
                    Deferral(TaskKey("bench", f"b{n + i}", args.run_id), DateTimeTrigger(moment),
                             args.queue) for i in range(size)])
                lat.append(time.perf_counter() - t)
                n += size
        end = time.time()
    return {"n": n, "start": start, "end": end, "latencies": lat}


def _worker_main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="triggerflow.bench sdk-worker")
    p.add_argument("--mode", choices=["single", "batched"], required=True)
    p.add_argument("--count", type=int, default=0)
    p.add_argument("--seconds", type=float, default=0.0)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--start-at", type=float, required=True)
    p.add_argument("--queue", required=True)
    p.add_argument("--run-id", required=True)
    args = p.parse_args(argv)
    print(json.dumps(asyncio.run(_sdk_worker(args))))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["sdk-worker"]:
        sys.exit("usage: python -m triggerflow.bench sdk-worker ...  (run `triggerflow bench`)")
    sys.exit(_worker_main(sys.argv[2:]))
