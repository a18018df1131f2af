"""``status`` and ``health``: what runs, what waits, what needs attention."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
from datetime import datetime
from typing import Any

import click

from triggerflow.cli.options import CONNECTION, build_settings, settings_options
from triggerflow.redact import Redactor
from triggerflow.settings import Settings
from triggerflow.store.postgres.admin import (
    HEALTH,
    QUARANTINED,
    SHOW_TRIGGER,
    STATUS_CONSUMERS,
    STATUS_OVERDUE,
    STATUS_QUEUES,
)
from triggerflow.transport import QueueInfo
from triggerflow.transport.management import (
    BrokerQueue,
    ManagementClient,
    ManagementUnavailable,
    vhost_of,
)
from triggerflow.transport.rabbitmq import Topology
from triggerflow.wiring import admin_database, rabbit_transport

EXIT_ATTENTION = 3


async def collect_status(settings: Settings) -> dict[str, Any]:
    """Queues, processes, overdue and quarantined triggers, and the problems among them."""
    redact = Redactor(settings)
    db = await admin_database(settings)
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
    broker_info: dict[str, QueueInfo | None] = {}
    broker_error = None
    try:
        broker = rabbit_transport(settings, name="triggerflow-status")
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
        # counted only once subscribed on the broker (a refused one holds a lease, no queue)
        live = [c for c in consumers if c["alive"] and c["subscribed"]
                and c["kind"] == "consumer" and name in c["queues"]]
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


def json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


async def check_health(settings: Settings, host: str, kind: str,
                       pid: int | None) -> tuple[bool, str]:
    """(healthy, one-line reason) for the newest matching process row on ``host``."""
    db = await admin_database(settings)
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


def probe_endpoint(port: int, live: bool, timeout: float = 5.0) -> tuple[bool, str]:
    """(working, one-line reason) from this host's own ``/readyz`` (or ``/livez``): one HTTP
    request to the process, no database connection."""
    import urllib.error
    import urllib.request

    from triggerflow.health import LIVEZ, READYZ

    url = f"http://127.0.0.1:{port}{LIVEZ if live else READYZ}"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            status, body = response.status, response.read()
    except urllib.error.HTTPError as exc:  # 503 carries the report too
        status, body = exc.code, exc.read()
    except OSError as exc:
        return False, f"dead: nothing answers on {url} ({getattr(exc, 'reason', exc)})"
    try:
        checks: dict[str, str] = json.loads(body)["checks"]
    except (ValueError, KeyError, TypeError):
        return False, f"unhealthy: {url} answered {status} without a report"
    if status == 200:
        return True, f"ok: {', '.join(f'{name} ok' for name in checks)}"
    failing = "; ".join(f"{name}: {why}" for name, why in checks.items() if why != "ok")
    return False, f"{'not live' if live else 'not ready'}: {failing or f'status {status}'}"


async def fetch_trigger(settings: Settings, trigger_id: int) -> dict[str, Any] | None:
    db = await admin_database(settings)
    try:
        row = await db.fetchrow(SHOW_TRIGGER, trigger_id)
        return dict(row) if row else None
    finally:
        await db.close()


def register(main: click.Group) -> None:
    """Add ``status`` and ``health`` to ``main``."""
    connection = CONNECTION

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
            click.echo(redact(json.dumps(report, default=json_default, indent=2)))
        else:
            _render_status(report)
        sys.exit(EXIT_ATTENTION if report["problems"] else 0)

    @main.command()
    @settings_options(*connection, "metrics_port")
    @click.option("--kind", type=click.Choice(["any", "consumer", "writer"]), default="any",
                  show_default=True, help="Database check: which process must be alive here.")
    @click.option("--pid", type=int, default=None,
                  help="Database check: only the process with this pid.")
    @click.option("--live", is_flag=True,
                  help="Endpoint check: ask /livez (the event loop responds) instead of /readyz.")
    def health(kind: str, pid: int | None, live: bool, **values: Any) -> None:
        """Probe this host's consumer or writer; exit 0 when it works, 1 otherwise, with a
        one-line reason.

        With a metrics port (--metrics-port, TRIGGERFLOW_METRICS_PORT) it asks the process's
        own endpoint, /readyz (lease, broker subscriptions, database, event loop) or /livez
        with --live: no database connection. Without one it reads the lease rows in the
        database (stalled: lease expired; dead: no process)."""
        settings = build_settings(values)
        if settings.metrics_port:
            ok, line = probe_endpoint(settings.metrics_port, live)
            click.echo(line)
            sys.exit(0 if ok else 1)
        try:
            ok, line = asyncio.run(asyncio.wait_for(
                check_health(settings, socket.gethostname(), kind, pid), timeout=10))
        except Exception as exc:
            ok, line = False, f"unhealthy: cannot check ({type(exc).__name__}: {exc})"
        click.echo(Redactor(settings)(line))
        sys.exit(0 if ok else 1)
