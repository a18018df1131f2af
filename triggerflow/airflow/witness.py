"""The scheduler race's witness: when a held resume may go (docs/airflow-race.md).

An event that puts a task back to ``scheduled`` must wait until Airflow's scheduler has
handled the exit of the worker that deferred it. Each scheduler loop stamps every running
dag run it examines (``dag_run.last_scheduling_decision = utcnow()``, committed before it
queues tasks), then reads its workers' exits (``executor.heartbeat()``) and handles them
(``process_executor_events``). So once a dag run shows a stamp later than the exit, that
loop reads the exit; a second, later stamp proves that loop finished, the exit handled while
the task was still ``deferred``. With more than one live scheduler the stamps may be another
scheduler's, and the exit lives in the memory of the one that ran the task: the witness is
then that scheduler's job heartbeat (written at the end of a loop, after its executor
events), two beats past the exit.

The exit is not in the database: it is taken as the deferral (``trigger.created_date``) plus
``airflow_exit_grace``. The hold's ceiling (``not_before``, from ``airflow_resume_delay``)
releases an event whose witness never comes (a stalled or absent scheduler).

One poller per consumer reads the witness of every held event in one statement, every
``POLL`` seconds, only while some event is held. Importing this module imports nothing from
Airflow.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import asyncpg

from triggerflow.telemetry import get_metrics

log = logging.getLogger(__name__)

POLL = 0.2  # seconds between reads while an event is held
# A scheduler counts as live while its heartbeat is this recent: Airflow's
# [scheduler] scheduler_health_check_threshold default.
LIVE_SCHEDULER = 30.0

# Per held trigger: its deferral, its dag run's stamp, the scheduler that queued its task and
# that scheduler's heartbeat; and how many schedulers are live. A trigger whose row, deferred
# task or dag run is gone returns no row. Index lookups only (trigger id, ti.trigger_id,
# dag_run's (dag_id, run_id), job id, job's (job_type, latest_heartbeat)).
READ = """
SELECT t.id, t.created_date, dr.id AS run, dr.last_scheduling_decision AS stamp,
       ti.queued_by_job_id AS job, j.latest_heartbeat AS beat,
       (SELECT count(*) FROM job s
        WHERE s.job_type = 'SchedulerJob' AND s.state = 'running'
          AND s.latest_heartbeat > clock_timestamp() - make_interval(secs => $2)) AS schedulers
FROM "trigger" t
JOIN task_instance ti ON ti.trigger_id = t.id AND ti.state = 'deferred'
JOIN dag_run dr ON dr.dag_id = ti.dag_id AND dr.run_id = ti.run_id
LEFT JOIN job j ON j.id = ti.queued_by_job_id
WHERE t.id = ANY($1::int[])
"""


@dataclass
class _Held:
    ceiling: float  # epoch seconds: released then whatever the witness says
    released: asyncio.Future[str] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())


@dataclass
class _Stamps:
    """The last two distinct values a witness (a dag run's stamp, a scheduler's heartbeat)
    was seen with, in the order seen."""
    before: datetime | None = None
    last: datetime | None = None

    def see(self, value: datetime) -> None:
        if value != self.last:
            self.before, self.last = self.last, value

    def past(self, moment: datetime) -> bool:
        """Two values later than ``moment``: a whole scheduler loop ran after it."""
        return self.before is not None and self.before > moment


class Witness:
    """The consumer's holds (``hold``) and their one poller (``serving``)."""

    def __init__(self) -> None:
        self._dsn: str | None = None
        self._grace = timedelta(0)
        self._held: dict[int, list[_Held]] = {}
        self._stamps: dict[tuple[str, int], _Stamps] = {}
        self._poller: asyncio.Task[None] | None = None
        self._conn: asyncpg.Connection | None = None
        self._poll = POLL
        self.polls = 0  # reads done
        self._reading = asyncio.Lock()  # one statement at a time on the one connection

    @contextlib.asynccontextmanager
    async def serving(self, dsn: str, exit_grace: float,
                      poll: float = POLL) -> AsyncIterator[None]:
        """The consumer's lifetime: where to read the witness from, every ``poll`` seconds."""
        self._dsn, self._grace, self._poll = dsn, timedelta(seconds=exit_grace), poll
        try:
            yield
        finally:
            if self._poller is not None:
                self._poller.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._poller
            await self._disconnect()
            self._dsn, self._poller = None, None
            self._stamps.clear()

    async def hold(self, trigger_id: int | None, ceiling: float) -> str:
        """Return once the scheduler has handled the exit of the worker that deferred
        ``trigger_id``'s task, its row is gone, or at ``ceiling`` (epoch seconds), whichever
        comes first; returns which (``witness``, ``gone``, ``ceiling``). Outside ``serving``
        (no database), or with no trigger id to read by: at ``ceiling``."""
        start = time.time()
        if ceiling <= start:
            return "ceiling"
        if self._dsn is None or trigger_id is None:
            await asyncio.sleep(ceiling - start)
            return self._record(start, "ceiling")
        held = _Held(ceiling)
        self._held.setdefault(trigger_id, []).append(held)
        if self._poller is None or self._poller.done():
            self._poller = asyncio.create_task(self._poll_while_held(),
                                               name="airflow-resume-witness")
        try:
            done, _ = await asyncio.wait([held.released], timeout=ceiling - time.time())
            by = held.released.result() if done else "ceiling"
        finally:
            waiting = self._held.get(trigger_id, [])
            if held in waiting:
                waiting.remove(held)
            if not waiting:
                self._held.pop(trigger_id, None)
            held.released.cancel()  # no-op once set
        return self._record(start, by)

    @staticmethod
    def _record(start: float, by: str) -> str:
        get_metrics().resume_hold.record(time.time() - start, {"released_by": by})
        return by

    async def _poll_while_held(self) -> None:
        failing = False
        while self._held:
            try:
                await self.poll()
                failing = False
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
                # The ceiling still releases every held event; read again next time.
                if not failing:
                    log.warning("scheduler witness not read (held events go at their "
                                "ceiling until it is): %r", exc)
                failing = True
                await self._disconnect()
            await asyncio.sleep(self._poll)

    async def poll(self) -> None:
        """One read for every held event; release those whose witness is complete."""
        async with self._reading:
            ids = list(self._held)
            if not ids:
                return
            if self._conn is None or self._conn.is_closed():
                self._conn = await asyncpg.connect(self._dsn, server_settings={
                    "application_name": "triggerflow-airflow-witness"})
            rows = await self._conn.fetch(READ, ids, LIVE_SCHEDULER)
            self.polls += 1
            self._judge(ids, rows)

    def _judge(self, ids: list[int], rows: list[Any]) -> None:
        found: set[int] = set()
        watched: set[tuple[str, int]] = set()
        for row in rows:
            found.add(row["id"])
            key, value = _witness_of(row)
            if key is None or value is None:
                continue  # no witness to read (no scheduler queued it): the ceiling
            watched.add(key)
            stamps = self._stamps.setdefault(key, _Stamps())
            stamps.see(value)
            if stamps.past(row["created_date"] + self._grace):
                self._release(row["id"], "witness")
        for trigger_id in set(ids) - found:
            self._release(trigger_id, "gone")  # the writer finds such an event stale
        # Keep only the witnesses some held event still reads.
        for key in set(self._stamps) - watched:
            del self._stamps[key]

    def _release(self, trigger_id: int, by: str) -> None:
        for held in self._held.get(trigger_id, ()):
            if not held.released.done():
                held.released.set_result(by)

    async def _disconnect(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and not conn.is_closed():
            with contextlib.suppress(Exception):
                await conn.close(timeout=5)


def _witness_of(row: Any) -> tuple[tuple[str, int] | None, datetime | None]:
    """One scheduler: its stamp on the task's dag run (every loop). More: the heartbeat of
    the scheduler that queued the task, whose executor reads the worker's exit."""
    if row["schedulers"] > 1:
        job = row["job"]
        return (None, None) if job is None else (("job", job), row["beat"])
    return ("run", row["run"]), row["stamp"]


WITNESS = Witness()
