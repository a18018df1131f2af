"""How the writer applies a batch of events in Airflow mode (``AirflowStore.apply_events``).

Set-based first: ``events.APPLY`` moves every task it can in one statement, with Airflow's
semantics. What it cannot, Airflow's own code applies, one event each in a thread
(``orm``): failures of tasks that may retry, and the events of asset-watcher and callback
rows (``Trigger.submit_event``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

import asyncpg

from triggerflow.airflow.events import AirflowEvent, apply_events, needs_airflow
from triggerflow.airflow.nontask import NON_TASK_IDS
from triggerflow.airflow.statements import writer
from triggerflow.store import Applied, StoreError, StoreUnavailable
from triggerflow.wire import first_per_attempt


@dataclass
class Batch:
    """What one transaction of the batch did: ``rows`` applied by ``events.APPLY``, the
    ``firsts`` it was given (one event per attempt), the triggers whose task it ``moved``,
    the resumes of ``non_task`` rows for Airflow's code, and the events ``held`` by another
    transaction (skipped, to be retried)."""

    rows: list[asyncpg.Record] = field(default_factory=list)
    firsts: list[AirflowEvent] = field(default_factory=list)
    moved: set[int] = field(default_factory=set)
    non_task: list[AirflowEvent] = field(default_factory=list)
    held: set[int] = field(default_factory=set)


async def apply_batch(conn: asyncpg.Connection, events: list[AirflowEvent], *,
                      default_queue: str | None, release: str, skip_held: bool) -> Batch:
    """``events`` applied set-based on ``conn``; with ``skip_held``, those whose rows another
    transaction holds are skipped (locked first, SKIP LOCKED, as the native store does)."""
    done = Batch()
    # The hot path stays one transaction of its own; an outer one only when skipping.
    async with conn.transaction() if skip_held else contextlib.nullcontext():
        if skip_held:
            done.held = {r["id"] for r in await conn.fetch(
                writer.HELD_ELSEWHERE, [e.trigger_id for e in events],
                [e.attempt for e in events], [e.queue for e in events], default_queue)}
            events = [e for e in events if e.trigger_id not in done.held]
        # One event per attempt moves a task; every event of a non-task row counts.
        done.firsts = first_per_attempt(events)
        done.rows = await apply_events(conn, done.firsts, default_queue, clean=False,
                                       release=release)
        done.moved = {r["trigger_id"] for r in done.rows}
        # Resumes that moved no task: those of asset-watcher and callback rows go to
        # Airflow's own Trigger.submit_event (the rest were stale).
        unmoved = [e.trigger_id for e in done.firsts if e.kind == "resume"
                   and e.trigger_id not in done.moved]
        if unmoved:
            non_task = {r["id"] for r in await conn.fetch(NON_TASK_IDS, unmoved)}
            done.non_task = [e for e in events if e.kind == "resume" and e.trigger_id in non_task]
    return done


async def with_airflow(batch: Batch, dsn: str, default_queue: str | None) -> list[Applied]:
    """What Airflow's own code applies of ``batch`` (``orm``), one event each, in a thread:
    asset-watcher and callback events, then failures of tasks that may retry."""
    applied: list[Applied] = []
    for function, events in (("apply_watcher_events", batch.non_task),
                             ("apply_with_airflow", needs_airflow(batch.firsts, batch.moved))):
        if events:
            applied += await _in_thread(function, dsn, events, default_queue)
    return applied


async def _in_thread(function: str, dsn: str, events: list[AirflowEvent],
                     default_queue: str | None) -> list[Applied]:
    from sqlalchemy.exc import OperationalError, SQLAlchemyError

    from triggerflow.airflow import orm  # imports Airflow: only when an event needs it

    try:
        done = await asyncio.to_thread(getattr(orm, function), dsn, events, default_queue)
    except OperationalError as exc:
        raise StoreUnavailable(repr(exc)) from exc
    except SQLAlchemyError as exc:
        raise StoreError(repr(exc)) from exc
    return [Applied(e.kind, e.queue, time.time() - e.fired_at) for e in done]
