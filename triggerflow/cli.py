"""The CLI: parse -> settings -> build -> run one function -> exit code.

Every ``Settings`` field a command uses is an option whose env var (``TRIGGERFLOW_*``) is
shown in ``--help``. Exit codes: 0 ok, 1 failure, 2 usage error, 3 status needs attention.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import click
from pydantic import ValidationError

from triggerflow.settings import Settings

F = TypeVar("F", bound=Callable[..., Any])

CONNECTION = ("amqp_url", "database_url", "namespace", "heartbeat", "db_pool_size", "pgbouncer",
              "log_level", "log_format")
TELEMETRY = ("metrics_port", "otlp_endpoint", "trace_file")
CONSUMER = ("queues", "capacity", "allowed_modules", "lease_ttl", "renew_interval",
            "claim_batch", "prefetch", "reclaim_rate", "probation_seconds",
            "max_failures", "blocked_threshold", "subscription_check_interval", "event_batch",
            "event_linger", "max_event_bytes", "reaper_interval", "cancel_sweep_interval",
            "unclaimed_grace", "max_deferral", "kwargs_key")
WRITER = ("writer_batch", "writer_prefetch", "team_users", "lease_ttl", "renew_interval",
          "reaper_interval", "unclaimed_grace", "max_deferral", "reclaim_rate",
          "subscription_check_interval")
SDK = ("allowed_modules", "max_kwargs_bytes", "max_deferral", "kwargs_key")


def settings_options(*names: str) -> Callable[[F], F]:
    """Add one option per Settings field, named ``--field-name``, env ``TRIGGERFLOW_FIELD``."""

    def decorate(fn: F) -> F:
        for name in reversed(names):
            info = Settings.model_fields[name]
            flag = "--" + ("queue" if name == "queues" else name.replace("_", "-"))
            env = f"TRIGGERFLOW_{name.upper()}"
            annotation = str(info.annotation)
            kwargs: dict[str, Any] = {"help": info.description, "envvar": env,
                                      "show_envvar": True, "default": None}
            if "list" in annotation:
                # pydantic-settings reads the env var itself ("a,b" or JSON); click would
                # split it on whitespace.
                kwargs.update(multiple=True, default=(), envvar=None, show_envvar=False,
                              help=f"{info.description} Repeatable.  [env var: {env}]")
            elif info.annotation is bool:
                flag = f"{flag}/--no-{flag[2:]}"
            elif info.annotation is int:
                kwargs["type"] = int
            elif info.annotation is float:
                kwargs["type"] = float
            fn = click.option(flag, name, **kwargs)(fn)
        return fn

    return decorate


def build_settings(values: dict[str, Any]) -> Settings:
    given: dict[str, Any] = {}
    for key, value in values.items():
        if key not in Settings.model_fields or value is None or value == ():
            continue
        if isinstance(value, tuple):  # repeatable flags; an env var may hold "a,b" or JSON
            if len(value) == 1 and str(value[0]).lstrip().startswith("["):
                value = json.loads(value[0])
            else:
                value = [part for item in value
                         for part in str(item).replace(" ", ",").split(",") if part]
        elif key == "team_users" and isinstance(value, str):
            value = json.loads(value)
        given[key] = value
    try:
        return Settings(**given)
    except ValidationError as exc:
        raise click.UsageError(str(exc)) from None


def run_async(main: Coroutine[Any, Any, int | None]) -> int:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main) or 0
    return uvloop.run(main) or 0


def stop_on_signals() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


def _setup_process(settings: Settings, service: str) -> None:
    from triggerflow import logs, telemetry

    logs.setup(settings.log_level, settings.log_format)
    telemetry.setup(service=service, metrics_port=settings.metrics_port,
                    otlp_endpoint=settings.otlp_endpoint, trace_file=settings.trace_file)
    if settings.metrics_port or settings.otlp_endpoint:
        from triggerflow.cliops import start_queue_gauges

        start_queue_gauges(settings, all_queues=service == "triggerflow-writer")


def _fail(message: str) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(1)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="triggerflow")
def main() -> None:
    """triggerflow: deferrable triggers on RabbitMQ, with PostgreSQL as the durable record."""


# ----------------------------------------------------------------------------- set-up


@main.group()
def db() -> None:
    """Database schema."""


@db.command("upgrade")
@settings_options("database_url", "log_level")
@click.option("--revision", default="head", show_default=True, help="Target revision.")
def db_upgrade(revision: str, **values: Any) -> None:
    """Create the database if missing and apply migrations."""
    from triggerflow.postgres import database_name, ensure_database, upgrade_schema

    settings = build_settings(values)
    dsn = settings.database_dsn()
    try:
        created = asyncio.run(ensure_database(dsn))
        upgrade_schema(dsn, revision)
    except Exception as exc:
        _fail(f"database upgrade failed: {exc}")
    click.echo(f"database {database_name(dsn)}: {'created and ' if created else ''}at {revision}")


@main.group()
def topology() -> None:
    """Broker exchanges and queues."""


@topology.command("apply")
@settings_options("amqp_url", "namespace", "queues", "heartbeat")
@click.option("--delivery-limit", type=int, default=5, show_default=True,
              envvar="TRIGGERFLOW_DELIVERY_LIMIT", show_envvar=True,
              help="Quorum-queue delivery limit before dead-lettering.")
def topology_apply(delivery_limit: int, **values: Any) -> None:
    """Declare exchanges, team queues, events queue and dead letters (idempotent)."""
    from triggerflow.rabbitmq import Broker, Topology

    settings = build_settings(values)

    async def go() -> None:
        broker = Broker(settings.amqp_dsn(), Topology(settings.namespace), name="topology")
        await broker.connect()
        try:
            await broker.declare(settings.queues, delivery_limit=delivery_limit)
        finally:
            await broker.close()

    try:
        asyncio.run(go())
    except Exception as exc:
        _fail(f"topology apply failed: {exc}")
    click.echo(f"topology {settings.namespace}: queues {', '.join(settings.queues) or '(none)'}")


# ----------------------------------------------------------------------------- services


@main.command()
@settings_options(*CONNECTION, *TELEMETRY, *CONSUMER)
def consume(**values: Any) -> None:
    """Run triggers of one or more team queues (repeat --queue)."""
    settings = build_settings(values)
    if not settings.queues:
        raise click.UsageError("give at least one --queue (or TRIGGERFLOW_QUEUES)")
    _setup_process(settings, "triggerflow-consumer")

    async def go() -> int:
        from triggerflow.consumer import Consumer
        from triggerflow.postgres import Database
        from triggerflow.rabbitmq import Broker, Topology

        stop = stop_on_signals()
        db = await Database.connect(settings.database_dsn(), max_size=settings.db_pool_size,
                                    pgbouncer=settings.pgbouncer)
        broker = Broker(settings.amqp_dsn(), Topology(settings.namespace),
                        name=f"triggerflow-consumer:{','.join(settings.queues)}")
        try:
            return await Consumer(settings, db, broker).run(stop)
        finally:
            await db.close()

    sys.exit(run_async(go()))


@main.command()
@settings_options(*CONNECTION, *TELEMETRY, *WRITER)
def writer(**values: Any) -> None:
    """Apply events to task instances in batches."""
    settings = build_settings(values)
    _setup_process(settings, "triggerflow-writer")

    async def go() -> int:
        from triggerflow.postgres import Database
        from triggerflow.rabbitmq import Broker, Topology
        from triggerflow.writer import Writer

        stop = stop_on_signals()
        db = await Database.connect(settings.database_dsn(), max_size=settings.db_pool_size,
                                    pgbouncer=settings.pgbouncer)
        broker = Broker(settings.amqp_dsn(), Topology(settings.namespace), name="triggerflow-writer")
        try:
            return await Writer(settings, db, broker).run(stop)
        finally:
            await db.close()

    sys.exit(run_async(go()))


# ----------------------------------------------------------------------------- operators


@main.command()
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
    from triggerflow.cliops import shell_defer

    settings = build_settings(values)
    try:
        kwargs = json.loads(kwargs_json)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="--kwargs") from None
    try:
        ids = asyncio.run(shell_defer(settings, queue, classpath, kwargs, count, timeout,
                                      dag_id, batch))
    except Exception as exc:
        _fail(str(exc))
    click.echo(f"deferred {len(ids)} task(s) on {classpath} to {queue}: trigger ids "
               f"{ids[0]}..{ids[-1]}")


@main.command()
@settings_options(*CONNECTION)
@click.argument("trigger_ids", nargs=-1, type=int, required=True)
@click.option("--state", default="removed", show_default=True,
              type=click.Choice(["removed", "failed", "success", "skipped", "scheduled"]),
              help="State the task instance moves to.")
def cancel(trigger_ids: tuple[int, ...], state: str, **values: Any) -> None:
    """Take tasks out of 'deferred' and cancel their triggers on the owner (idempotent)."""
    from triggerflow.sdk import TriggerflowClient

    settings = build_settings(values)

    async def go() -> int:
        async with TriggerflowClient(settings) as client:
            return await client.cancel(list(trigger_ids), state=state)

    try:
        n = asyncio.run(go())
    except Exception as exc:
        _fail(str(exc))
    click.echo(f"cancelled {n} task(s); {len(trigger_ids) - n} already not deferred")


from triggerflow import cliops as _cliops  # noqa: E402 - admin commands register on main

_cliops.register(main, settings_options, build_settings, CONNECTION)
from triggerflow.airflow.cli import airflow_group as _airflow_group  # noqa: E402

main.add_command(_airflow_group)
