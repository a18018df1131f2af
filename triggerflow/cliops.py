"""Admin and operator commands: status, health, trigger show, requeue, unquarantine, defer.

Kept apart from ``cli.py`` so that file stays the thin parse-and-dispatch layer.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import uuid
from collections import defaultdict
from collections.abc import Callable
from datetime import datetime
from typing import Any

import click

from triggerflow.model import TaskKey
from triggerflow.postgres import (
    QUARANTINED,
    REQUEUE,
    SHOW_TRIGGER,
    STATUS_CONSUMERS,
    STATUS_OVERDUE,
    STATUS_QUEUES,
    UNQUARANTINE,
    Database,
)
from triggerflow.rabbitmq import Broker, Topology
from triggerflow.settings import Settings

EXIT_ATTENTION = 3


async def shell_defer(settings: Settings, queue: str, classpath: str, kwargs: dict[str, Any],
                      count: int, timeout: float | None, dag_id: str, batch: int) -> list[int]:
    from triggerflow.loader import TriggerLoader
    from triggerflow.sdk import Deferral, TriggerflowClient

    from triggerflow.loader import KwargsCodec

    trigger = TriggerLoader(settings.allowed_modules, KwargsCodec()).resolve(classpath)(**kwargs)
    run_id = f"cli-{uuid.uuid4().hex[:12]}"
    ids: list[int] = []
    async with TriggerflowClient(settings) as client:
        for start in range(0, count, batch):
            ids += await client.defer_many([
                Deferral(TaskKey(dag_id, "deferred", run_id, i), trigger, queue, timeout=timeout)
                for i in range(start, min(count, start + batch))
            ])
    return ids


async def collect_status(settings: Settings) -> dict[str, Any]:
    db = await Database.connect(settings.database_dsn(), max_size=1, pgbouncer=settings.pgbouncer)
    try:
        consumers = [dict(r) for r in await db.fetch(STATUS_CONSUMERS)]
        queues = {r["queue"]: dict(r) for r in await db.fetch(STATUS_QUEUES)}
        overdue = await db.fetchval(STATUS_OVERDUE)
        quarantined = [dict(r) for r in await db.fetch(QUARANTINED)]
    finally:
        await db.close()
    names = set(queues) | set(settings.queues)
    for c in consumers:
        names.update(c["queues"])
    broker_info: dict[str, tuple[int, int] | None] = {}
    broker_error = None
    try:
        broker = Broker(settings.amqp_dsn(), Topology(settings.namespace), name="status")
        await broker.connect()
        try:
            for name in sorted(names):
                broker_info[name] = await broker.queue_info(name)
        finally:
            await broker.close()
    except Exception as exc:
        broker_error = str(exc).replace(settings.amqp_url.get_secret_value(), "<amqp_url>")
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
            "running": sum(c["running"] for c in live),
            "triggers": row.get("triggers", 0),
            "unclaimed": row.get("unclaimed", 0),
            "quarantined": row.get("quarantined", 0),
            "dead_owner": row.get("dead_owner", 0),
        }
        report_queues.append(entry)
        if not live and (entry["triggers"] or name in settings.queues):
            problems.append(f"queue {name} has no live consumer")
        if entry["dead_owner"]:
            problems.append(f"queue {name}: {entry['dead_owner']} triggers held by dead owners")
        if info is None and not broker_error:
            problems.append(f"queue {name} does not exist on the broker")
    if quarantined:
        problems.append(f"{len(quarantined)} quarantined trigger(s)")
    if overdue:
        problems.append(f"{overdue} deferred task(s) past their timeout")
    if broker_error:
        problems.append(f"broker unreachable: {broker_error}")
    return {"queues": report_queues, "consumers": consumers, "overdue_tasks": overdue,
            "quarantined": quarantined, "problems": problems}


def _render_status(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    t = Table(title="Queues")
    for col in ("queue", "depth", "consumers", "running", "triggers", "unclaimed",
                "quarantined", "dead owner"):
        t.add_column(col, justify="left" if col == "queue" else "right")
    for q in report["queues"]:
        t.add_row(q["queue"], "-" if q["depth"] is None else str(q["depth"]), str(q["consumers"]),
                  str(q["running"]), str(q["triggers"]), str(q["unclaimed"]),
                  str(q["quarantined"]), str(q["dead_owner"]))
    console.print(t)
    c = Table(title="Processes")
    for col in ("id", "kind", "host", "pid", "queues", "running", "capacity", "last renewal",
                "alive"):
        c.add_column(col)
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
        console.print(f"[bold red]attention:[/] {p}")
    if not report["problems"]:
        console.print("[green]all queues served[/]")


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


def register(main: click.Group, settings_options: Callable[..., Any],
             build_settings: Callable[[dict[str, Any]], Settings],
             connection: tuple[str, ...]) -> None:
    @main.command()
    @settings_options(*connection, "queues")
    @click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
    def status(as_json: bool, **values: Any) -> None:
        """Queues, consumers, overdue and quarantined triggers. Exit 3 when something needs
        attention (a queue with no consumer, dead owners, quarantined triggers)."""
        settings = build_settings(values)
        try:
            report = asyncio.run(collect_status(settings))
        except Exception as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(1)
        if as_json:
            click.echo(json.dumps(report, default=_json_default, indent=2))
        else:
            _render_status(report)
        sys.exit(EXIT_ATTENTION if report["problems"] else 0)

    @main.command()
    @settings_options(*connection)
    @click.option("--kind", type=click.Choice(["any", "consumer", "writer"]), default="any",
                  show_default=True, help="Which process must be alive on this host.")
    @click.option("--pid", type=int, default=None, help="Only the process with this pid.")
    def health(kind: str, pid: int | None, **values: Any) -> None:
        """Liveness probe: exit 0 when this host's consumer/writer is alive and renewing."""
        settings = build_settings(values)
        host = socket.gethostname()

        async def go() -> tuple[bool, str]:
            db = await Database.connect(settings.database_dsn(), max_size=1,
                                        pgbouncer=settings.pgbouncer)
            try:
                rows = await db.fetch(
                    "SELECT id, kind, pid, expires_at > now() AS alive, "
                    "extract(epoch FROM now() - renewed_at) AS age FROM consumer "
                    "WHERE host = $1 AND ($2 = 'any' OR kind = $2) AND ($3::int IS NULL OR pid = $3)"
                    " ORDER BY renewed_at DESC", host, kind, pid)
            finally:
                await db.close()
            alive = [r for r in rows if r["alive"]]
            if alive:
                r = alive[0]
                return True, f"ok: {r['kind']} {r['id']} (pid {r['pid']}) renewed {r['age']:.1f}s ago"
            if rows:
                r = rows[0]
                return False, (f"stalled: {r['kind']} {r['id']} (pid {r['pid']}) last renewed "
                               f"{r['age']:.1f}s ago")
            return False, f"dead: no {kind if kind != 'any' else 'triggerflow'} process on {host}"

        try:
            ok, line = asyncio.run(asyncio.wait_for(go(), timeout=10))
        except Exception as exc:
            ok, line = False, f"unhealthy: {type(exc).__name__}: {exc}"
        click.echo(line)
        sys.exit(0 if ok else 1)

    @main.group()
    def trigger() -> None:
        """Inspect triggers."""

    @trigger.command("show")
    @settings_options(*connection)
    @click.argument("trigger_id", type=int)
    def trigger_show(trigger_id: int, **values: Any) -> None:
        """Row, owner, attempts and last error of one trigger."""
        settings = build_settings(values)

        async def go() -> dict[str, Any] | None:
            db = await Database.connect(settings.database_dsn(), max_size=1)
            try:
                row = await db.fetchrow(SHOW_TRIGGER, trigger_id)
                return dict(row) if row else None
            finally:
                await db.close()

        row = asyncio.run(go())
        if row is None:
            click.echo(f"no trigger {trigger_id} (finished, cancelled or never created)", err=True)
            sys.exit(1)
        width = max(len(k) for k in row)
        for key, value in row.items():
            click.echo(f"{key:<{width}}  {_json_default(value) if value is not None else '-'}")

    def _resend_command(sql: str, verb: str) -> Callable[..., None]:
        def command(trigger_ids: tuple[int, ...], **values: Any) -> None:
            settings = build_settings(values)

            async def go() -> int:
                db = await Database.connect(settings.database_dsn(), max_size=1)
                try:
                    rows = await db.fetch(sql, list(trigger_ids))
                    by_queue: dict[str, list[int]] = defaultdict(list)
                    for r in rows:
                        by_queue[r["queue"]].append(r["id"])
                    if by_queue:
                        broker = Broker(settings.amqp_dsn(), Topology(settings.namespace),
                                        name=f"triggerflow-{verb}")
                        await broker.connect()
                        try:
                            await broker.publish_wakeups(by_queue)
                        finally:
                            await broker.close()
                    return len(rows)
                finally:
                    await db.close()

            try:
                n = asyncio.run(go())
            except Exception as exc:
                click.echo(f"error: {exc}", err=True)
                sys.exit(1)
            click.echo(f"{verb}d {n} trigger(s); {len(trigger_ids) - n} needed nothing")

        return command

    requeue_cmd = _resend_command(REQUEUE, "requeue")
    requeue_cmd.__doc__ = ("Release triggers from their owner and re-send them to their queue "
                           "(idempotent; quarantined ones need unquarantine).")
    main.command("requeue")(click.argument("trigger_ids", nargs=-1, type=int, required=True)(
        settings_options(*connection)(requeue_cmd)))
    unq_cmd = _resend_command(UNQUARANTINE, "unquarantine")
    unq_cmd.__doc__ = ("Clear a quarantine: re-defer the task it failed and re-send the trigger "
                       "(idempotent).")
    main.command("unquarantine")(click.argument("trigger_ids", nargs=-1, type=int, required=True)(
        settings_options(*connection)(unq_cmd)))

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

    _ = os  # (kept for future per-process health files)
