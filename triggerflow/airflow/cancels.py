"""Airflow mode: a task's end stops its trigger promptly, whatever runs first.

Airflow's triggerer stops a trigger when its row leaves the triggerer's assignment: a task
cleared, marked success or failed, timed out by the scheduler, or its DAG run deleted, then
``Trigger.clean_unused`` deletes the row, and the next loop cancels the trigger
(``TriggerRunnerSupervisor.update_triggers`` -> ``TriggerRunner.cancel_triggers``, with the
"user action" message). ``run_trigger`` then awaits ``on_kill()`` unless the task instance's
``trigger_timeout`` has passed (a timeout kills, it does not cancel) and always
``cleanup()``. A triggerer shutting down or handing a trigger on calls only ``cleanup()``.

triggerflow's consumer used to learn this from its bookkeeping row (``trigger_state``,
owner = me, task no longer deferred). The writer's ``clean_unused`` deletes that row with
the trigger row, so when the writer ran first the consumer never found out and the trigger
ran on (issue 18). Now the fact is recorded where it happens:

- ``setup`` installs row triggers on Airflow's ``task_instance`` that log a trigger id to
  ``triggerflow.cancel_log`` when its task leaves ``deferred`` (or moves to another trigger,
  or is deleted with its DAG run), with the task's ``trigger_timeout``, and NOTIFY
  ``triggerflow_airflow_cancel`` (an empty payload: PostgreSQL sends one per transaction, so a
  bulk clear is one notification). triggerflow's own moves (events applied, failures it
  decides) are not logged: its sessions carry ``triggerflow.origin`` (``ORIGIN``), which the
  triggers' ``WHEN`` reads, so the writer's hot path pays one comparison per row and no call.
- The consumer LISTENs (``watch``) and on each notification, and every
  ``cancel_sweep_interval`` as the backstop for a notification missed while reconnecting,
  reads the entries logged since its last read (``CancelLog.read``, an index range scan):
  every trigger it runs among them is cancelled, whether or not the writer has deleted the
  bookkeeping yet. Reads overlap by ``OVERLAP`` seconds, so an entry whose transaction
  committed after a later one's is still seen.
- ``on_kill`` is decided as Airflow decides it: ``KILLS`` remembers which ids were cancelled
  by a task's end and whether the task's ``trigger_timeout`` had passed; ``loader.
  AirflowCoroutine`` reads it when its cancellation arrives. Any other cancellation
  (shutdown, hand-over, lost lease) calls only ``cleanup()``.

Consumers trim entries older than ``KEEP`` (every ``TRIM_EVERY``). Importing this module
imports nothing from Airflow.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime, timedelta
from typing import Any

from triggerflow.airflow.schema import SCHEMA

CHANNEL = "triggerflow_airflow_cancel"
ORIGIN = {"triggerflow.origin": "triggerflow"}  # startup parameter of triggerflow's sessions
OVERLAP = 60.0  # seconds each read reaches back: commits can land out of logged order
KEEP = 3600.0  # seconds an entry is kept
TRIM_EVERY = 600.0  # seconds between a consumer's trims

_NOT_OURS = "current_setting('triggerflow.origin', true) IS DISTINCT FROM 'triggerflow'"

CREATE = f"""
CREATE TABLE IF NOT EXISTS {SCHEMA}.cancel_log (
    trigger_id integer NOT NULL,
    timeout_at timestamptz,
    logged_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS cancel_log_logged ON {SCHEMA}.cancel_log (logged_at);

-- SECURITY DEFINER: the API server's and scheduler's role writes the entry without a grant
-- on triggerflow's schema; the search_path cannot be hijacked.
CREATE OR REPLACE FUNCTION {SCHEMA}.log_task_left_trigger() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    INSERT INTO {SCHEMA}.cancel_log (trigger_id, timeout_at)
    VALUES (OLD.trigger_id, OLD.trigger_timeout);
    PERFORM pg_notify('{CHANNEL}', '');
    RETURN NULL;
END
$$;

-- WHEN is evaluated without calling the function: rows that stay deferred, and every move
-- triggerflow's own sessions make, cost a comparison.
CREATE OR REPLACE TRIGGER triggerflow_task_left_deferred
AFTER UPDATE ON task_instance FOR EACH ROW
WHEN (OLD.state = 'deferred' AND OLD.trigger_id IS NOT NULL
      AND (NEW.state IS DISTINCT FROM 'deferred' OR NEW.trigger_id IS DISTINCT FROM OLD.trigger_id)
      AND {_NOT_OURS})
EXECUTE FUNCTION {SCHEMA}.log_task_left_trigger();

CREATE OR REPLACE TRIGGER triggerflow_deferred_task_deleted
AFTER DELETE ON task_instance FOR EACH ROW
WHEN (OLD.state = 'deferred' AND OLD.trigger_id IS NOT NULL AND {_NOT_OURS})
EXECUTE FUNCTION {SCHEMA}.log_task_left_trigger();
"""

DROP = """
DROP TRIGGER IF EXISTS triggerflow_task_left_deferred ON task_instance;
DROP TRIGGER IF EXISTS triggerflow_deferred_task_deleted ON task_instance;
"""

# Entries logged since $1 (NULL: the first read, OVERLAP back), the database's clock, and
# which of them had passed their trigger_timeout by now (Airflow's on_kill test).
READ = f"""
WITH since AS (SELECT coalesce($1, clock_timestamp() - make_interval(secs => $2)) AS t)
SELECT clock_timestamp() AS at,
       ARRAY(SELECT l.trigger_id FROM {SCHEMA}.cancel_log l, since
             WHERE l.logged_at > since.t) AS ids,
       ARRAY(SELECT l.trigger_id FROM {SCHEMA}.cancel_log l, since
             WHERE l.logged_at > since.t AND l.timeout_at < clock_timestamp()) AS timed_out
"""

TRIM = f"""
DELETE FROM {SCHEMA}.cancel_log WHERE logged_at < clock_timestamp() - make_interval(secs => $1)
"""

Fetch = Callable[..., Awaitable[list[Any]]]


class Kills:
    """Trigger ids cancelled because their task ended, read once by the cancelled trigger:
    True when Airflow would call ``on_kill()`` (its ``trigger_timeout`` had not passed).
    Entries of triggers this process does not run are dropped after ``OVERLAP`` seconds."""

    def __init__(self) -> None:
        self._kills: dict[int, tuple[bool, float]] = {}

    def record(self, ids: list[int], timed_out: set[int]) -> None:
        now = time.monotonic()
        if len(self._kills) > 1024:
            self._kills = {k: v for k, v in self._kills.items() if now - v[1] < OVERLAP}
        for trigger_id in ids:
            self._kills[trigger_id] = (trigger_id not in timed_out, now)

    def take(self, trigger_id: int | None) -> bool:
        """Whether this cancellation should call ``on_kill()`` (forgets the id)."""
        found = self._kills.pop(trigger_id, None) if trigger_id is not None else None
        return found is not None and found[0]


KILLS = Kills()  # one per process: the store records, the trigger's coroutine reads


class CancelLog:
    """A consumer's reader of ``cancel_log``: ``read`` returns the trigger ids whose task
    left them since the last read (with ``OVERLAP``)."""

    def __init__(self, kills: Kills = KILLS) -> None:
        self.kills = kills
        self._since: datetime | None = None
        self._trimmed = time.monotonic()

    async def read(self, fetch: Fetch) -> list[int]:
        rows = await fetch(READ, self._since, OVERLAP)
        row = rows[0]
        ids = [int(i) for i in row["ids"]]
        self.kills.record(ids, {int(i) for i in row["timed_out"]})
        self._since = row["at"] - timedelta(seconds=OVERLAP)
        if time.monotonic() - self._trimmed > TRIM_EVERY:
            self._trimmed = time.monotonic()
            await fetch(TRIM, KEEP)
        return ids


@contextlib.asynccontextmanager
async def watch(dsn: str, wake: Callable[[], None]) -> AsyncIterator[None]:
    """LISTEN on ``CHANNEL`` while inside: ``wake()`` on each notification and after each
    (re)connection (notifications sent while not connected are lost)."""
    from triggerflow.airflow.wakeups import listen_channel

    stop = asyncio.Event()

    async def handle(_payload: str) -> None:
        wake()

    task = asyncio.create_task(
        listen_channel(dsn, CHANNEL, handle, stop, on_connected=wake), name="airflow-cancel-listen"
    )
    try:
        yield
    finally:
        stop.set()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
