"""Set-up (``db upgrade``, ``topology apply``), the services (``consume``, ``writer``) and what
the SDK does from the shell (``defer``, ``cancel``).

Each command: parse -> settings -> build -> run one function -> exit code. What they need
beyond click is imported when they run.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import TYPE_CHECKING, Any

import click

from triggerflow.cli import failures
from triggerflow.cli.options import (
    CONNECTION,
    CONSUMER,
    SDK,
    TELEMETRY,
    WRITER,
    build_settings,
    run_async,
    settings_options,
    stop_on_signals,
)
from triggerflow.errors import SettingRefused

if TYPE_CHECKING:
    from triggerflow.settings import Settings


def _setup_process(settings: Settings, service: str) -> None:
    from triggerflow import logs, telemetry

    logs.setup(settings.log_level, settings.log_format)
    telemetry.setup(service=service, metrics_port=settings.metrics_port,
                    otlp_endpoint=settings.otlp_endpoint, trace_file=settings.trace_file)
    if settings.metrics_port or settings.otlp_endpoint:
        from triggerflow.queue_gauges import start_queue_gauges

        start_queue_gauges(settings, all_queues=service == "triggerflow-writer")


def register(main: click.Group) -> None:
    """Add the set-up, service and SDK commands to ``main``."""
    for command in (db, topology, consume, writer, defer, cancel):
        main.add_command(command)


# -- set-up


@click.group()
def db() -> None:
    """Database schema."""


@db.command("upgrade")
@settings_options("database_url", "log_level")
@click.option("--revision", default="head", show_default=True, help="Target revision.")
def db_upgrade(revision: str, **values: Any) -> None:
    """Create the database if missing and apply migrations."""

    from triggerflow.store.postgres import database_name, ensure_database, upgrade_schema

    settings = build_settings(values)
    dsn = settings.database_dsn()
    created = asyncio.run(ensure_database(dsn))
    upgrade_schema(dsn, revision)
    click.echo(f"database {database_name(dsn)}: {'created and ' if created else ''}at {revision}")


@db.command("downgrade")
@settings_options("database_url", "log_level")
@click.argument("revision")
def db_downgrade(revision: str, **values: Any) -> None:
    """Run migrations' downgrade() down to REVISION (after rolling the code back)."""

    from triggerflow.store.postgres import (
        current_revision,
        database_name,
        downgrade_schema,
        revisions,
    )

    settings = build_settings(values)
    dsn = settings.database_dsn()
    known = [r for r, _ in revisions()]
    span = f"{known[0]}..{known[-1]}"
    if revision not in known:
        # "base" too: below the oldest revision every table goes, with the task rows in it.
        raise failures.ConfigError(f"unknown revision {revision!r}: downgrade to one of {span} "
                                   f"(below {known[0]} would drop every table)")
    current = asyncio.run(current_revision(dsn))
    if current is None or current not in known:
        # A newer release's revision: its own downgrade() is in that release, not here.
        raise failures.ConfigError(f"database {database_name(dsn)} is at revision {current}, "
                                   f"not one of {span}: run db downgrade with the release "
                                   "that upgraded it")
    if known.index(revision) > known.index(current):
        raise failures.ConfigError(f"database {database_name(dsn)} is at {current}, below "
                                   f"{revision}: use `triggerflow db upgrade --revision {revision}`")
    downgrade_schema(dsn, revision)
    click.echo(f"database {database_name(dsn)}: at {revision} (was {current})")


@db.command("current")
@settings_options("database_url", "log_level")
def db_current(**values: Any) -> None:
    """Print the database's revision and the newest this release ships."""

    from triggerflow.store.postgres import current_revision, database_name, revisions

    settings = build_settings(values)
    dsn = settings.database_dsn()
    current = asyncio.run(current_revision(dsn))
    head = revisions()[-1][0]
    state = "head" if current == head else f"head is {head}"
    click.echo(f"database {database_name(dsn)}: at {current or 'no revision'} ({state})")


@db.command("history")
def db_history() -> None:
    """List the revisions this release ships, oldest first."""

    from triggerflow.store.postgres import revisions

    for revision, doc in revisions():
        click.echo(f"{revision}  {doc}")


@click.group()
def topology() -> None:
    """Broker exchanges and queues."""


@topology.command("apply")
@settings_options("amqp_url", "namespace", "queues", "heartbeat")
@click.option("--delivery-limit", type=int, default=5, show_default=True,
              envvar="TRIGGERFLOW_DELIVERY_LIMIT", show_envvar=True,
              help="Quorum-queue delivery limit before dead-lettering.")
def topology_apply(delivery_limit: int, **values: Any) -> None:
    """Declare exchanges, team queues, events queue and dead letters (idempotent)."""

    from triggerflow.wiring import make_transport

    settings = build_settings(values)

    async def go() -> None:
        transport = make_transport(settings, name="topology")
        await transport.connect()
        try:
            await transport.declare(settings.queues, delivery_limit=delivery_limit)
        finally:
            await transport.close()

    asyncio.run(go())
    click.echo(f"topology {settings.namespace}: queues {', '.join(settings.queues) or '(none)'}")


# -- services


@click.command()
@settings_options(*CONNECTION, *TELEMETRY, *CONSUMER)
def consume(**values: Any) -> None:
    """Run triggers of one or more team queues (repeat --queue)."""
    from triggerflow.modes import mode_for

    settings = build_settings(values)
    if not settings.queues:
        raise click.UsageError("give at least one --queue (or TRIGGERFLOW_QUEUES)")
    # Only a mode whose store scopes consumers to a team takes one.
    if settings.airflow_team is not None and not mode_for(settings).capabilities.teams:
        raise failures.ConfigError("--team (TRIGGERFLOW_AIRFLOW_TEAM) names an Airflow team: "
                                   "it needs --airflow (TRIGGERFLOW_AIRFLOW)")
    _setup_process(settings, "triggerflow-consumer")

    async def go() -> int:
        from triggerflow.wiring import serve_consumer

        return await serve_consumer(settings, stop_on_signals())

    try:
        code = run_async(go())
    except SettingRefused as exc:  # e.g. a --team Airflow refuses: as a bad flag, exit 2
        raise failures.ConfigError(str(exc)) from None
    sys.exit(code)


@click.command()
@settings_options(*CONNECTION, *TELEMETRY, *WRITER)
def writer(**values: Any) -> None:
    """Apply events to task instances in batches."""
    from triggerflow.modes import mode_for

    settings = build_settings(values)
    if settings.queues and not mode_for(settings).writer_queues:
        # one environment shared by every process (compose, a ConfigMap) sets TRIGGERFLOW_QUEUES
        # for the writer too: a native writer serves every queue, so it is only named, not fatal
        click.echo("warning: a native writer serves every queue; --queue/TRIGGERFLOW_QUEUES "
                   "ignored", err=True)
    _setup_process(settings, "triggerflow-writer")

    async def go() -> int:
        from triggerflow.wiring import serve_writer

        return await serve_writer(settings, stop_on_signals())

    sys.exit(run_async(go()))


# -- what the SDK does, from the shell


@click.command()
@settings_options(*CONNECTION, *SDK)
@click.option("--queue", "queue", required=True, envvar="TRIGGERFLOW_DEFER_QUEUE",
              show_envvar=True, help="Team queue to defer to.")
@click.option("--trigger", "classpath", required=True, help="Trigger classpath.")
@click.option("--kwargs", "kwargs_json", default="{}", show_default=True,
              help="Trigger kwargs as JSON.")
@click.option("--count", type=click.IntRange(1), default=1, show_default=True,
              help="Task instances to create and defer.")
@click.option("--timeout", type=float, default=None, help="Trigger timeout in seconds.")
@click.option("--dag-id", default="cli", show_default=True, help="dag_id of the created tasks.")
@click.option("--batch", type=click.IntRange(1), default=1000, show_default=True,
              help="Deferrals per SDK batch.")
def defer(queue: str, classpath: str, kwargs_json: str, count: int, timeout: float | None,
          dag_id: str, batch: int, **values: Any) -> None:
    """Create COUNT task instances and defer them on a trigger (smoke tests, operators)."""

    from triggerflow.cli.admin import shell_defer

    settings = build_settings(values)
    try:
        kwargs = json.loads(kwargs_json)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="--kwargs") from None
    ids = asyncio.run(shell_defer(settings, queue, classpath, kwargs, count, timeout, dag_id,
                                  batch))
    click.echo(f"deferred {len(ids)} task(s) on {classpath} to {queue}: trigger ids "
               f"{ids[0]}..{ids[-1]}")


@click.command()
@settings_options(*CONNECTION)
@click.argument("trigger_ids", nargs=-1, type=int, required=True)
@click.option("--state", default="removed", show_default=True,
              type=click.Choice(["removed", "failed", "success", "skipped", "scheduled"],
                                 case_sensitive=False),
              help="State the task instance moves to.")
def cancel(trigger_ids: tuple[int, ...], state: str, **values: Any) -> None:
    """Take tasks out of 'deferred' and cancel their triggers on the owner (idempotent)."""

    from triggerflow.sdk import TriggerflowClient

    settings = build_settings(values)

    async def go() -> int:
        async with TriggerflowClient(settings) as client:
            return await client.cancel(list(trigger_ids), state=state)

    n = asyncio.run(go())
    click.echo(f"cancelled {n} task(s); {len(trigger_ids) - n} already not deferred")
