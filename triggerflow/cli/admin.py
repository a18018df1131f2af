"""Operator actions: ``trigger show``, ``requeue``, ``unquarantine``, and the shell ``defer``."""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import click

from triggerflow.cli.options import CONNECTION, build_settings, settings_options

if TYPE_CHECKING:
    from triggerflow.settings import Settings


async def shell_defer(settings: Settings, queue: str, classpath: str, kwargs: dict[str, Any],
                      count: int, trigger_timeout: float | None, dag_id: str,
                      batch: int) -> list[int]:
    from triggerflow.loader import TriggerLoader
    from triggerflow.model import TaskKey
    from triggerflow.sdk import Deferral, TriggerflowClient

    trigger = TriggerLoader(settings.allowed_modules).resolve(classpath)(**kwargs)
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


async def _wake(settings: Settings, rows: list[Any], verb: str) -> None:
    from triggerflow.wiring import rabbit_transport

    by_queue: dict[str, list[int]] = defaultdict(list)
    for r in rows:
        if r["queue"] is not None:
            by_queue[r["queue"]].append(r["id"])
    if by_queue:
        broker = rabbit_transport(settings, name=f"triggerflow-{verb}")
        await broker.connect()
        try:
            await broker.publish_wakeups(by_queue)
        finally:
            await broker.close()


async def requeue_triggers(settings: Settings, ids: list[int],
                           force: bool) -> tuple[list[Any], list[Any]]:
    """(re-sent rows, rows left with a live owner)."""
    from triggerflow.store.postgres.admin import LIVE_OWNERS, REQUEUE_IDLE
    from triggerflow.wiring import admin_database

    db = await admin_database(settings)
    try:
        rows = await db.fetch(REQUEUE_IDLE, ids, force)
        held = [] if force else await db.fetch(LIVE_OWNERS, ids)
        await _wake(settings, rows, "requeue")
        return rows, held
    finally:
        await db.close()


async def unquarantine_triggers(settings: Settings, ids: list[int]) -> list[Any]:
    from triggerflow.store.postgres.admin import UNQUARANTINE_SAFE
    from triggerflow.wiring import admin_database

    db = await admin_database(settings)
    try:
        rows: list[Any] = await db.fetch(UNQUARANTINE_SAFE, ids)
        await _wake(settings, [r for r in rows if r["resent"]], "unquarantine")
        return rows
    finally:
        await db.close()


def register(main: click.Group) -> None:
    """Add ``trigger show``, ``requeue`` and ``unquarantine`` to ``main``."""
    connection = CONNECTION

    @main.group()
    def trigger() -> None:
        """Inspect triggers."""

    @trigger.command("show")
    @settings_options(*connection)
    @click.argument("trigger_id", type=int)
    @click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
    def trigger_show(trigger_id: int, as_json: bool, **values: Any) -> None:
        """Row, owner, attempts and last error of one trigger (exit 1 when there is none)."""

        from triggerflow.cli.status import fetch_trigger, json_default
        from triggerflow.redact import Redactor

        settings = build_settings(values)
        redact = Redactor(settings)
        row = asyncio.run(fetch_trigger(settings, trigger_id))
        if row is None:
            click.echo(f"no trigger {trigger_id} (finished, cancelled or never created)", err=True)
            sys.exit(1)
        if as_json:
            click.echo(redact(json.dumps(row, default=json_default, indent=2)))
            return
        width = max(len(k) for k in row)
        for key, value in row.items():
            text = "-" if value is None else json_default(value)
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
        rows, held = asyncio.run(requeue_triggers(settings, ids, force))
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
        rows = asyncio.run(unquarantine_triggers(settings, ids))
        resent = sum(1 for r in rows if r["resent"])
        dropped = len(rows) - resent
        click.echo(f"unquarantined {resent} trigger(s); dropped {dropped} whose task had moved "
                   f"on; {len(ids) - len(rows)} needed nothing")
