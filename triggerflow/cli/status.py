"""``status`` and ``health``: what runs, what waits, what needs attention."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
from datetime import datetime
from typing import TYPE_CHECKING, Any

import click

from triggerflow.cli.options import CONNECTION, build_settings, settings_options

if TYPE_CHECKING:
    from triggerflow.settings import Settings

EXIT_ATTENTION = 3
# The states ``status --ids`` lists: the keys of store.postgres.admin.TRIGGER_IDS, named here
# so that --help imports no database code (tests/test_cli.py checks the two agree).
ID_STATES = ("dead-owner", "quarantined", "running", "unclaimed")


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
                "clock skew", "alive"):
        c.add_column(col, no_wrap=col != "queues")
    for p in report["consumers"]:
        skew = "-" if p["clock_skew"] is None else f"{p['clock_skew']:+.3f}s"
        # Airflow mode: the team a consumer serves (--team, under [core] multi_team)
        team = f" (Airflow team {p['airflow_team']})" if p.get("airflow_team") else ""
        c.add_row(str(p["id"]), p["kind"], p["host"], str(p["pid"]), ",".join(p["queues"]) + team,
                  str(p["running"]), str(p["capacity"]),
                  p["renewed_at"].strftime("%H:%M:%S.%f")[:-3], skew,
                  ("yes (warming up)" if p["warming"] else "yes") if p["alive"] else "NO")
    console.print(c)
    _render_writers(console, report)
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


def _render_writers(console: Any, report: dict[str, Any]) -> None:
    """Writers by lease, then the events and dead-letter queues they drain or fill."""
    from rich.table import Table

    if report["writers"]:
        w = Table(title="Writers")
        for col in ("id", "host", "pid", "last renewal", "renewed ago", "alive"):
            w.add_column(col, no_wrap=True)
        for p in report["writers"]:
            w.add_row(str(p["id"]), p["host"], str(p["pid"]),
                      p["renewed_at"].strftime("%H:%M:%S.%f")[:-3],
                      f"{p['renewed_ago']:.1f}s", "yes" if p["alive"] else "NO")
        console.print(w)
    else:
        console.print("Writers: none has registered")
    s = Table(title="Events and dead letters")
    for col in ("queue", "depth", "unacked", "broker consumers"):
        s.add_column(col, justify="left" if col == "queue" else "right", no_wrap=True)
    for q in (report["events"], report["dead_letters"]):
        s.add_row(q["queue"], _dash(q["depth"]), _dash(q.get("broker_unacked")),
                  _dash(q["broker_consumers"]))
    console.print(s)


def _dash(value: Any) -> str:
    return "-" if value is None else str(value)


def json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


async def check_health(settings: Settings, host: str, kind: str,
                       pid: int | None) -> tuple[bool, str]:
    """(healthy, one-line reason) for the newest matching process row on ``host``, in the
    mode's own lease table."""
    from triggerflow.modes import mode_for
    from triggerflow.wiring import admin_database

    sql = mode_for(settings).status_statements()
    db = await admin_database(settings)
    try:
        rows: list[Any] = await db.fetch(sql.health, host, kind, pid)
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
    from triggerflow.store.postgres.admin import SHOW_TRIGGER
    from triggerflow.wiring import admin_database

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
    @settings_options(*connection, "queues", "management_url", "lease_ttl", "max_clock_skew",
                      "airflow", "default_queue")
    @click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
    @click.option("--ids", "ids_in", type=click.Choice(ID_STATES), default=None,
                  help="Only list the ids of triggers in this state (of the --queue queues, "
                       "else every queue), one a line, for requeue or unquarantine.")
    def status(as_json: bool, ids_in: str | None, **values: Any) -> None:
        """Queues (depth, unacked, consumers, running), processes, writers, the events and
        dead-letter queues, overdue and quarantined triggers. Team queues are listed from
        the broker (management API) and the database.

        Exit 3 when something needs attention: a team queue in the broker, a queue with
        triggers, or one named by --queue, with no live consumer; no live writer; a live
        consumer well below capacity that is not subscribed on the broker (one warming up,
        waiting for its trigger runtime beside a peer, is listed as such instead); dead letters;
        triggers held by dead owners; quarantined triggers; deferred tasks past their
        timeout; a live consumer whose clock is off the database's by more than
        --max-clock-skew (it runs nothing); an unreachable broker or management API.

        With --airflow: the same of triggerflow's part of an Airflow deployment (its leases
        and bookkeeping beside Airflow's rows; queues Airflow's own triggerer serves are not
        listed), and exit 3 naming any trigger row one lease period old that nothing serves
        (no queue and no --default-queue, a queue with no live consumer, a class every live
        consumer refused; rows a live Airflow triggerer holds are served). --ids is native
        mode's (it feeds requeue and unquarantine)."""
        from triggerflow.cli.status_report import collect_status, trigger_ids
        from triggerflow.modes import mode_for
        from triggerflow.redact import Redactor

        settings = build_settings(values)
        redact = Redactor(settings)
        # A failure reading (database down, login refused) is the root handler's one line,
        # which names the setting to check.
        if ids_in is not None:
            ids_sql = mode_for(settings).status_statements().trigger_ids
            if ids_sql is None:
                raise click.UsageError("--ids lists native mode's triggers (for requeue and "
                                       "unquarantine, which Airflow mode does not have); "
                                       "drop --airflow, or --ids")
            rows = asyncio.run(trigger_ids(settings, ids_sql(ids_in), list(settings.queues)))
            if as_json:
                click.echo(json.dumps({"state": ids_in, "triggers": rows}, indent=2))
            elif rows:
                click.echo("\n".join(str(r["id"]) for r in rows))
            return
        report = asyncio.run(collect_status(settings))
        if as_json:
            click.echo(redact(json.dumps(report, default=json_default, indent=2)))
        else:
            _render_status(report)
        sys.exit(EXIT_ATTENTION if report["problems"] else 0)

    @main.command()
    @settings_options(*connection, "metrics_port")
    @click.option("--kind", type=click.Choice(["any", "consumer", "writer"], case_sensitive=False),
                  default="any",
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
        from triggerflow.redact import Redactor

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
