"""Admin and operator commands: status, health, trigger show, requeue, unquarantine, defer;
and the per-queue gauges (depth, consumers) every ``consume``/``writer`` process exports.

Kept apart from ``cli.py`` so that file stays the thin parse-and-dispatch layer. Everything
printed here goes through ``Redactor``: connection URLs may carry passwords.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import logging
import re
import socket
import sys
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from datetime import datetime
from typing import Any
from urllib.parse import unquote, urlsplit

import click

from triggerflow.model import TaskKey
from triggerflow.postgres import (
    ALL_QUEUES,
    HEALTH,
    LIVE_OWNERS,
    LIVE_WRITERS,
    QUARANTINED,
    QUEUE_CONSUMERS,
    REQUEUE_IDLE,
    SHOW_TRIGGER,
    STATUS_CONSUMERS,
    STATUS_OVERDUE,
    STATUS_QUEUES,
    UNQUARANTINE_SAFE,
    Database,
)
from triggerflow.rabbitmq import Broker, Topology
from triggerflow.rabbitmq_admin import BrokerQueue, ManagementClient, ManagementUnavailable, vhost_of
from triggerflow.settings import Settings

log = logging.getLogger(__name__)

EXIT_ATTENTION = 3

_USERINFO = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<user>[^:/@\s]*):[^@\s]*@", re.I)


class Redactor:
    """Removes the passwords of the configured URLs (and of any URL) from text."""

    def __init__(self, settings: Settings) -> None:
        self.secrets: list[str] = []
        for url in (settings.amqp_url.get_secret_value(), settings.database_url.get_secret_value(),
                    settings.management_dsn()):
            password = urlsplit(url).password
            if password:
                self.secrets += {password, unquote(password)}
        if settings.kwargs_key is not None:
            self.secrets.append(settings.kwargs_key.get_secret_value())

    def __call__(self, text: str) -> str:
        text = _USERINFO.sub(r"\g<scheme>\g<user>:***@", text)
        for secret in self.secrets:
            if len(secret) >= 3:  # a one-letter password would mangle every line
                text = text.replace(secret, "***")
        return text


async def _connect_db(settings: Settings) -> Database:
    return await Database.connect(settings.database_dsn(), max_size=1,
                                  pgbouncer=settings.pgbouncer)


def _broker(settings: Settings, name: str) -> Broker:
    return Broker(settings.amqp_dsn(), Topology(settings.namespace), name=name)


async def shell_defer(settings: Settings, queue: str, classpath: str, kwargs: dict[str, Any],
                      count: int, trigger_timeout: float | None, dag_id: str,
                      batch: int) -> list[int]:
    from triggerflow.loader import KwargsCodec, TriggerLoader
    from triggerflow.sdk import Deferral, TriggerflowClient

    trigger = TriggerLoader(settings.allowed_modules, KwargsCodec()).resolve(classpath)(**kwargs)
    run_id = f"cli-{uuid.uuid4().hex[:12]}"
    ids: list[int] = []
    async with TriggerflowClient(settings) as client:
        for start in range(0, count, batch):
            ids += await client.defer_many([
                Deferral(TaskKey(dag_id, "deferred", run_id, i), trigger, queue,
                         timeout=trigger_timeout)
                for i in range(start, min(count, start + batch))
            ])
    return ids


async def collect_status(settings: Settings) -> dict[str, Any]:
    """Queues, processes, overdue and quarantined triggers, and the problems among them."""
    redact = Redactor(settings)
    db = await _connect_db(settings)
    try:
        process_rows: list[Any] = await db.fetch(STATUS_CONSUMERS)
        queue_rows: list[Any] = await db.fetch(STATUS_QUEUES)
        overdue = await db.fetchval(STATUS_OVERDUE)
        quarantine_rows: list[Any] = await db.fetch(QUARANTINED)
    finally:
        await db.close()
    consumers = [dict(r) for r in process_rows]
    queues = {r["queue"]: dict(r) for r in queue_rows}
    quarantined = [dict(r) for r in quarantine_rows]
    names = set(queues) | set(settings.queues)
    for c in consumers:
        names.update(c["queues"])
    listed, management_error = await broker_team_queues(settings)
    names.update(listed)
    broker_info: dict[str, tuple[int, int] | None] = {}
    broker_error = None
    try:
        broker = _broker(settings, "triggerflow-status")
        await broker.connect()
        try:
            for name in sorted(names):
                broker_info[name] = await broker.queue_info(name)
        finally:
            await broker.close()
    except Exception as exc:
        broker_error = redact(str(exc) or type(exc).__name__)
    report_queues = []
    problems: list[str] = []
    for name in sorted(names):
        live = [c for c in consumers if c["alive"] and c["kind"] == "consumer"
                and name in c["queues"]]
        row = queues.get(name, {})
        info = broker_info.get(name)
        entry = {
            "queue": name,
            "depth": info[0] if info else None,
            "broker_consumers": info[1] if info else None,
            "consumers": len(live),
            "running": row.get("owned", 0) - row.get("dead_owner", 0),
            "triggers": row.get("triggers", 0),
            "unclaimed": row.get("unclaimed", 0),
            "quarantined": row.get("quarantined", 0),
            "dead_owner": row.get("dead_owner", 0),
            **broker_columns(listed.get(name), management_error),
        }
        report_queues.append(entry)
        if not live and (entry["triggers"] or name in settings.queues or name in listed):
            problems.append(f"queue {name} has no live consumer")
        if entry["dead_owner"]:
            problems.append(f"queue {name}: {entry['dead_owner']} triggers held by dead owners")
        if info is None and not broker_error:
            problems.append(f"queue {name} does not exist on the broker")
    if quarantined:
        problems.append(f"{len(quarantined)} quarantined trigger(s)")
    if overdue:
        problems.append(f"{overdue} deferred task(s) past their timeout")
    problems += _access_problems(broker_error, management_error, redact)
    for q in quarantined:
        q["last_error"] = redact(q["last_error"]) if q["last_error"] else q["last_error"]
    return {"queues": report_queues, "consumers": consumers, "overdue_tasks": overdue,
            "quarantined": quarantined, "problems": problems}


async def broker_team_queues(settings: Settings) -> tuple[dict[str, BrokerQueue], str | None]:
    """Every team queue the broker has (management API), or why it could not be listed."""
    try:
        async with ManagementClient(settings.management_dsn()) as api:
            found = await api.team_queues(vhost_of(settings.amqp_dsn()),
                                          Topology(settings.namespace).deferrals)
    except ManagementUnavailable as exc:
        return {}, str(exc)
    return found, None


def _access_problems(broker_error: str | None, management_error: str | None,
                     redact: Redactor) -> list[str]:
    problems = []
    if broker_error:
        problems.append(f"broker unreachable: {broker_error}")
    if management_error:
        problems.append(f"broker queue list unavailable: {redact(management_error)}")
    return problems


def broker_columns(queue: BrokerQueue | None, error: str | None) -> dict[str, Any]:
    """The broker's own numbers for one queue; None when they could not be read."""
    return {
        "in_broker": None if error else queue is not None,
        "broker_ready": queue.ready if queue else None,
        "broker_unacked": queue.unacked if queue else None,
        "broker_listed_consumers": queue.consumers if queue else None,
    }


def _render_status(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    # Piped into a file or a pod log, do not fold queue names at 80 columns.
    console = Console(width=None if sys.stdout.isatty() else 200)
    t = Table(title="Queues")
    for col in ("queue", "depth", "unacked", "broker consumers", "consumers", "running",
                "triggers", "unclaimed", "quarantined", "dead owner"):
        t.add_column(col, justify="left" if col == "queue" else "right", no_wrap=True)
    for q in report["queues"]:
        t.add_row(q["queue"], "-" if q["depth"] is None else str(q["depth"]),
                  _dash(q.get("broker_unacked")), _dash(q.get("broker_listed_consumers")),
                  str(q["consumers"]),
                  str(q["running"]), str(q["triggers"]), str(q["unclaimed"]),
                  str(q["quarantined"]), str(q["dead_owner"]))
    console.print(t)
    c = Table(title="Processes")
    for col in ("id", "kind", "host", "pid", "queues", "running", "capacity", "last renewal",
                "alive"):
        c.add_column(col, no_wrap=col != "queues")
    for p in report["consumers"]:
        c.add_row(str(p["id"]), p["kind"], p["host"], str(p["pid"]), ",".join(p["queues"]),
                  str(p["running"]), str(p["capacity"]),
                  p["renewed_at"].strftime("%H:%M:%S.%f")[:-3], "yes" if p["alive"] else "NO")
    console.print(c)
    if report["quarantined"]:
        qt = Table(title="Quarantined triggers")
        for col in ("id", "queue", "class", "failures", "last error"):
            qt.add_column(col)
        for r in report["quarantined"]:
            qt.add_row(str(r["id"]), r["queue"], r["classpath"], str(r["failures"]),
                       r["last_error"] or "")
        console.print(qt)
    console.print(f"Deferred tasks past their timeout: {report['overdue_tasks']}")
    for p in report["problems"]:
        console.print(f"[bold red]attention:[/] {p}", markup=True, highlight=False)
    if not report["problems"]:
        console.print("[green]all queues served[/]")


def _dash(value: Any) -> str:
    return "-" if value is None else str(value)


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


async def check_health(settings: Settings, host: str, kind: str,
                       pid: int | None) -> tuple[bool, str]:
    """(healthy, one-line reason) for the newest matching process row on ``host``."""
    db = await _connect_db(settings)
    try:
        rows: list[Any] = await db.fetch(HEALTH, host, kind, pid)
    finally:
        await db.close()
    what = "triggerflow process" if kind == "any" else kind
    if pid is not None:
        what += f" with pid {pid}"
    alive = [r for r in rows if r["alive"]]
    if alive:
        r = alive[0]
        return True, f"ok: {r['kind']} {r['id']} (pid {r['pid']}) renewed {r['age']:.1f}s ago"
    if rows:
        r = rows[0]
        return False, (f"stalled: {r['kind']} {r['id']} (pid {r['pid']}) last renewed "
                       f"{r['age']:.1f}s ago; its lease has expired")
    return False, f"dead: no live {what} on {host}"


# ----------------------------------------------------------------------------- admin actions


async def fetch_trigger(settings: Settings, trigger_id: int) -> dict[str, Any] | None:
    db = await _connect_db(settings)
    try:
        row = await db.fetchrow(SHOW_TRIGGER, trigger_id)
        return dict(row) if row else None
    finally:
        await db.close()


async def _wake(settings: Settings, rows: list[Any], verb: str) -> None:
    by_queue: dict[str, list[int]] = defaultdict(list)
    for r in rows:
        if r["queue"] is not None:
            by_queue[r["queue"]].append(r["id"])
    if by_queue:
        broker = _broker(settings, f"triggerflow-{verb}")
        await broker.connect()
        try:
            await broker.publish_wakeups(by_queue)
        finally:
            await broker.close()


async def requeue_triggers(settings: Settings, ids: list[int],
                           force: bool) -> tuple[list[Any], list[Any]]:
    """(re-sent rows, rows left with a live owner)."""
    db = await _connect_db(settings)
    try:
        rows = await db.fetch(REQUEUE_IDLE, ids, force)
        held = [] if force else await db.fetch(LIVE_OWNERS, ids)
        await _wake(settings, rows, "requeue")
        return rows, held
    finally:
        await db.close()


async def unquarantine_triggers(settings: Settings, ids: list[int]) -> list[Any]:
    db = await _connect_db(settings)
    try:
        rows: list[Any] = await db.fetch(UNQUARANTINE_SAFE, ids)
        await _wake(settings, [r for r in rows if r["resent"]], "unquarantine")
        return rows
    finally:
        await db.close()


# ----------------------------------------------------------------------------- queue gauges


class QueueGauges:
    """Exports ``triggerflow.queue.depth`` / ``.consumers`` / ``.subscribers`` per queue.

    A daemon thread with its own event loop, one database connection and one AMQP connection
    polls every ``interval`` seconds (two statements and a passive declare per queue), so the
    numbers keep coming while the process's own loop is blocked. A consumer reports its
    queues; a writer reports every queue (those consumers declare and those with triggers
    waiting) plus the events queue (``consumers`` there = live writers) and the dead-letter
    queue. Each process reports the same queues, so aggregate with ``max by (queue)``.
    """

    def __init__(self, settings: Settings, interval: float | None = None) -> None:
        from triggerflow import telemetry

        self.settings = settings
        self.interval = interval or min(5.0, settings.reaper_interval)
        self.topology = Topology(settings.namespace)
        self.redact = Redactor(settings)
        self.snapshot: dict[str, tuple[int | None, int | None, int | None]] = {}
        self.updated = 0.0  # monotonic time of the last good poll
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="queue-gauges", daemon=True)
        m = telemetry.get_metrics()
        m.gauge(telemetry.QUEUE_DEPTH, "Wake-up (or event) messages ready in the broker queue",
                lambda: self._observe(0))
        m.gauge(telemetry.QUEUE_CONSUMERS,
                "Live consumers (by lease) serving the queue; live writers for the events queue",
                lambda: self._observe(2))
        m.gauge(telemetry.QUEUE_SUBSCRIBERS,
                "Consumers the broker delivers the queue to (0 while paused at capacity)",
                lambda: self._observe(1))

    def start(self) -> QueueGauges:
        self._thread.start()
        atexit.register(self.stop)
        return self

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _observe(self, index: int) -> list[tuple[float, dict[str, Any]]]:
        if time.monotonic() - self.updated > 3 * self.interval + 5:
            return []  # stale: report nothing rather than old numbers
        out: list[tuple[float, dict[str, Any]]] = []
        for queue, values in sorted(self.snapshot.items()):
            value = values[index]
            if value is not None:
                out.append((float(value), {"queue": queue}))
        return out

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        db: Database | None = None
        broker: Broker | None = None
        failing = False
        while not self._stop.is_set():
            try:
                if db is None:
                    db = await _connect_db(self.settings)
                if broker is None or not broker.is_open:
                    if broker is not None:
                        await broker.close()
                    broker = _broker(self.settings, "triggerflow-queue-gauges")
                    await broker.connect()
                self.snapshot = await self.poll(db, broker)
                self.updated = time.monotonic()
                failing = False
            except Exception as exc:
                if not failing:
                    log.warning("queue gauges: poll failed (%s); retrying",
                                self.redact(repr(exc)))
                failing = True
                if db is not None:
                    with contextlib.suppress(Exception):
                        await db.close()
                    db = None
            await asyncio.to_thread(self._stop.wait, self.interval)
        for closer in (broker.close() if broker else None, db.close() if db else None):
            if closer is not None:
                with contextlib.suppress(Exception):
                    await closer

    async def poll(
        self, db: Database, broker: Broker
    ) -> dict[str, tuple[int | None, int | None, int | None]]:
        """{queue: (depth, subscribers, live consumers)}; None where the broker has no queue."""
        queues = list(self.settings.queues)
        serves_all = not queues
        if serves_all:
            scope: list[Any] = await db.fetch(ALL_QUEUES)
            queues = [r["queue"] for r in scope]
        counts: list[Any] = await db.fetch(QUEUE_CONSUMERS, queues)
        live = {r["q"]: int(r["consumers"]) for r in counts}
        snapshot: dict[str, tuple[int | None, int | None, int | None]] = {}
        for queue in queues:
            info = await broker.queue_info(queue)
            snapshot[queue] = (info[0] if info else None, info[1] if info else None,
                               live.get(queue, 0))
        if serves_all:
            writers = int(await db.fetchval(LIVE_WRITERS))
            for queue, consumers in ((self.topology.events_queue, writers),
                                     (self.topology.dead_queue, None)):
                found = await broker.queue_info(queue)
                snapshot[queue] = (found[0] if found else None, found[1] if found else None,
                                   consumers)
        return snapshot


_queue_gauges: QueueGauges | None = None


def start_queue_gauges(settings: Settings, *, all_queues: bool = False) -> QueueGauges:
    """Start the per-queue gauges of this process (once; later calls return the first).

    A consumer reports ``settings.queues``; a writer (``all_queues``) reports every queue.
    """
    global _queue_gauges
    if _queue_gauges is None:
        if all_queues:
            settings = settings.model_copy(update={"queues": []})
        _queue_gauges = QueueGauges(settings).start()
    return _queue_gauges


# ----------------------------------------------------------------------------- commands


Command = Callable[..., None]
Options = Callable[..., Callable[[Command], Command]]
Build = Callable[[dict[str, Any]], Settings]


def register(main: click.Group, settings_options: Options, build_settings: Build,
             connection: tuple[str, ...]) -> None:
    """Add the operator commands to ``main`` (cli.py passes its option and settings helpers)."""
    _register_probes(main, settings_options, build_settings, connection)
    _register_admin(main, settings_options, build_settings, connection)
    _register_tools(main, settings_options, build_settings, connection)


def _register_probes(main: click.Group, settings_options: Options, build_settings: Build,
                     connection: tuple[str, ...]) -> None:
    @main.command()
    @settings_options(*connection, "queues", "management_url")
    @click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
    def status(as_json: bool, **values: Any) -> None:
        """Queues (depth, unacked, consumers, running), processes, overdue and quarantined
        triggers. Team queues are listed from the broker (management API) and the database.

        Exit 3 when something needs attention: a team queue in the broker, a queue with
        triggers, or one named by --queue, with no live consumer; triggers held by dead
        owners; quarantined triggers; deferred tasks past their timeout; an unreachable
        broker or management API."""
        settings = build_settings(values)
        redact = Redactor(settings)
        try:
            report = asyncio.run(collect_status(settings))
        except Exception as exc:
            click.echo(redact(f"error: {exc}"), err=True)
            sys.exit(1)
        if as_json:
            click.echo(redact(json.dumps(report, default=_json_default, indent=2)))
        else:
            _render_status(report)
        sys.exit(EXIT_ATTENTION if report["problems"] else 0)

    @main.command()
    @settings_options(*connection)
    @click.option("--kind", type=click.Choice(["any", "consumer", "writer"]), default="any",
                  show_default=True, help="Which process must be alive on this host.")
    @click.option("--pid", type=int, default=None, help="Only the process with this pid.")
    def health(kind: str, pid: int | None, **values: Any) -> None:
        """Liveness probe: exit 0 when this host's consumer/writer is alive and renewing its
        lease, 1 otherwise (stalled: lease expired; dead: no process), with a one-line reason."""
        settings = build_settings(values)
        try:
            ok, line = asyncio.run(asyncio.wait_for(
                check_health(settings, socket.gethostname(), kind, pid), timeout=10))
        except Exception as exc:
            ok, line = False, f"unhealthy: cannot check ({type(exc).__name__}: {exc})"
        click.echo(Redactor(settings)(line))
        sys.exit(0 if ok else 1)


def _register_admin(main: click.Group, settings_options: Options, build_settings: Build,
                    connection: tuple[str, ...]) -> None:
    @main.group()
    def trigger() -> None:
        """Inspect triggers."""

    @trigger.command("show")
    @settings_options(*connection)
    @click.argument("trigger_id", type=int)
    @click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
    def trigger_show(trigger_id: int, as_json: bool, **values: Any) -> None:
        """Row, owner, attempts and last error of one trigger (exit 1 when there is none)."""
        settings = build_settings(values)
        redact = Redactor(settings)

        try:
            row = asyncio.run(fetch_trigger(settings, trigger_id))
        except Exception as exc:
            click.echo(redact(f"error: {exc}"), err=True)
            sys.exit(1)
        if row is None:
            click.echo(f"no trigger {trigger_id} (finished, cancelled or never created)", err=True)
            sys.exit(1)
        if as_json:
            click.echo(redact(json.dumps(row, default=_json_default, indent=2)))
            return
        width = max(len(k) for k in row)
        for key, value in row.items():
            text = "-" if value is None else _json_default(value)
            click.echo(redact(f"{key:<{width}}  {text}"))

    @main.command()
    @settings_options(*connection)
    @click.argument("trigger_ids", nargs=-1, type=int, required=True)
    @click.option("--force", is_flag=True,
                  help="Also take triggers from the live consumer running them (its copy is "
                       "fenced: its event is ignored).")
    def requeue(trigger_ids: tuple[int, ...], force: bool, **values: Any) -> None:
        """Re-send triggers no live consumer runs (unclaimed, refused by every consumer, or
        owned by a dead one) to their queue. Idempotent: a trigger a live consumer has
        claimed is left alone. Quarantined triggers need unquarantine."""
        settings = build_settings(values)
        ids = sorted(set(trigger_ids))

        try:
            rows, held = asyncio.run(requeue_triggers(settings, ids, force))
        except Exception as exc:
            click.echo(Redactor(settings)(f"error: {exc}"), err=True)
            sys.exit(1)
        click.echo(f"requeued {len(rows)} trigger(s); {len(ids) - len(rows)} needed nothing")
        for r in held:
            click.echo(f"  trigger {r['id']} runs on live consumer {r['owner_id']} "
                       f"({r['host']} pid {r['pid']}); --force takes it from there")

    @main.command()
    @settings_options(*connection)
    @click.argument("trigger_ids", nargs=-1, type=int, required=True)
    def unquarantine(trigger_ids: tuple[int, ...], **values: Any) -> None:
        """Clear a quarantine: defer again the task it failed and re-send the trigger (or drop
        the trigger when that task has moved on). Idempotent."""
        settings = build_settings(values)
        ids = sorted(set(trigger_ids))

        try:
            rows = asyncio.run(unquarantine_triggers(settings, ids))
        except Exception as exc:
            click.echo(Redactor(settings)(f"error: {exc}"), err=True)
            sys.exit(1)
        resent = sum(1 for r in rows if r["resent"])
        dropped = len(rows) - resent
        click.echo(f"unquarantined {resent} trigger(s); dropped {dropped} whose task had moved "
                   f"on; {len(ids) - len(rows)} needed nothing")


def _register_tools(main: click.Group, settings_options: Options, build_settings: Build,
                    connection: tuple[str, ...]) -> None:
    @main.command()
    @click.option("--tasks", type=int, default=24, show_default=True,
                  help="Timer tasks per team (plus one task of each other kind).")
    @click.option("--keep-running", is_flag=True, help="Leave the processes up at the end.")
    @settings_options(*connection)
    def demo(tasks: int, keep_running: bool, **values: Any) -> None:
        """Set up, start a writer, two team consumers and a resumer, defer a mix, show results."""
        from triggerflow.demo import run_demo

        sys.exit(run_demo(build_settings(values), tasks, keep_running))

    @main.command()
    @click.argument("scenarios", nargs=-1)
    @click.option("--quick", is_flag=True, help="Tiny sizes (smoke test).")
    @settings_options(*connection)
    def bench(scenarios: tuple[str, ...], quick: bool, **values: Any) -> None:
        """Benchmark against the real broker and database; prints a table per scenario."""
        from triggerflow.bench import run_bench

        sys.exit(run_bench(build_settings(values), list(scenarios), quick))

    @main.group()
    def docs() -> None:
        """Generated documentation."""

    @docs.command("config")
    @click.option("--output", type=click.Path(dir_okay=False), default="-",
                  help="File to write (default stdout).")
    def docs_config(output: str) -> None:
        """Print the configuration reference generated from the settings model."""
        from triggerflow.docgen import configuration_reference

        text = configuration_reference()
        if output == "-":
            click.echo(text, nl=False)
        else:
            with open(output, "w") as fh:
                fh.write(text)
