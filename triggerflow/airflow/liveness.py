"""What the writer's ``TriggererJob`` heartbeat vouches for: every trigger row with work is
served, by a live consumer or by a live Airflow triggerer.

Airflow's health checks (``airflow jobs check --job-type TriggererJob``, the API server's
``/api/v2/monitor/health``) read a triggerer as healthy while its job row's heartbeat is
recent. Under ``airflow triggerer`` that row is the process that runs the triggers; under
triggerflow the writer holds it, and a writer alone runs nothing. So the writer stamps the row
only while no row with work (a deferred task, an asset watcher, a callback) is unserved
(``statements.unserved``: no queue and no default queue, a queue with no live subscribed
consumer, a class every live consumer of its queue refused; rows a live Airflow triggerer
holds are served). A writer given ``--queue`` vouches only for those queues: rows of others,
and rows with no queue, are then Airflow's own triggerer's. Otherwise it skips the stamp and
names the queues, and once the heartbeat is older than ``[triggerer]
triggerer_health_check_threshold`` Airflow reports the triggerer unhealthy: what it reports
when no triggerer runs, which is the truth for those rows. (Airflow itself has no notion of
an unserved row: ``airflow triggerer --queues a`` heart-beats while a queue-less asset
watcher waits forever.) The same statement counts every unserved row, in scope or not, for
the ``triggerflow_unserved_triggers`` gauge. The check and the stamp are one statement
(``BEAT_IF_SERVED``): an idle writer's statements per second are what its database pays for
it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg

from triggerflow.airflow.statements.unserved import UNSERVED_ROWS, rendered
from triggerflow.telemetry import UNSERVED_TRIGGERS, get_metrics

log = logging.getLogger(__name__)

# One statement counts the unserved rows by queue and reason and stamps the heartbeat only
# when none is in the writer's scope. $1 the default queue (rows without one), $2 the
# writer's queues (empty: every queue, and rows with no queue), $3 the job row (NULL: read
# only). One row per (queue, team, reason), or one with a NULL queue. No array in the result:
# asyncpg would look its type up once on every pooled connection (two more statements each
# time).
BEAT_IF_SERVED = f"""
WITH unserved AS ({UNSERVED_ROWS}
), counted AS (
    SELECT queue, team, reason, count(*) AS triggers,
           cardinality($2::text[]) = 0 OR queue = ANY($2::text[]) AS vouched
    FROM unserved GROUP BY queue, team, reason
), beat AS (
    UPDATE job SET latest_heartbeat = now()
    WHERE id = $3 AND state = 'running' AND NOT EXISTS (SELECT 1 FROM counted WHERE vouched)
    RETURNING id
)
SELECT c.queue, c.team, c.reason, c.triggers, c.vouched, EXISTS (SELECT 1 FROM beat) AS beaten
FROM (VALUES (1)) AS one (x) LEFT JOIN counted c ON true
ORDER BY c.queue, c.team NULLS FIRST, c.reason
"""


@dataclass(frozen=True)
class Unserved:
    """Rows of one queue (``NO_QUEUE`` for none) and Airflow team (None: none) unserved for
    one reason (``statements.unserved.REASONS``); ``vouched``: in the writer's scope."""

    queue: str
    reason: str
    triggers: int
    vouched: bool
    team: str | None = None

    def label(self) -> str:
        where = self.queue if self.team is None else f"{self.queue} (Airflow team {self.team})"
        return where if self.reason == "no-consumer" else f"{where} ({self.reason})"


async def beat_if_served(conn: asyncpg.Connection, default_queue: str | None,
                         queues: Sequence[str], job_id: int | None,
                         ) -> tuple[list[Unserved], bool]:
    """The unserved rows by queue and reason, and whether job ``job_id``'s heartbeat was
    stamped (only when none is in scope; never for None)."""
    rows = await conn.fetch(rendered(BEAT_IF_SERVED), default_queue, list(queues), job_id)
    found = [Unserved(r["queue"], r["reason"], int(r["triggers"]), bool(r["vouched"]), r["team"])
             for r in rows if r["queue"] is not None]
    return found, bool(rows[0]["beaten"])


async def unserved_queues(
    conn: asyncpg.Connection, default_queue: str | None, queues: Sequence[str] = ()
) -> list[str]:
    """Queues (``NO_QUEUE`` for rows with none) with an unserved row in scope."""
    unserved, _ = await beat_if_served(conn, default_queue, queues, None)
    return sorted({u.queue for u in unserved if u.vouched})


def served_beat(
    default_queue: str | None, queues: Sequence[str] = (), stale_after: float = 60.0,
) -> Callable[[asyncpg.Connection, int], Awaitable[bool]]:
    """The heartbeat (``heartbeat.triggerer_job``'s ``beat``): stamps the job row only when
    no row in scope is unserved, in one statement; logs the unserved queues when that changes
    (not every interval) and exports every unserved row's count as the
    ``triggerflow_unserved_triggers`` gauge (by queue, reason and, for rows of an Airflow
    team, ``team``: as bounded as Airflow's team table; a series seen once stays, at 0, so it
    ends low rather than vanishing; nothing once no beat has read them for ``stale_after``
    seconds). Returns whether the row was stamped."""
    last: list[str] = []
    counts: dict[tuple[str, str, str | None], int] = {}
    read_at = [float("-inf")]

    def observe() -> list[tuple[float, dict[str, Any]]]:
        if time.monotonic() - read_at[0] > stale_after:
            return []
        return [(float(n), {"queue": q, "reason": r, **({"team": t} if t else {})})
                for (q, r, t), n in sorted(counts.items(), key=lambda kv: str(kv[0]))]

    get_metrics().gauge(UNSERVED_TRIGGERS, "Trigger rows with work that no live consumer and "
                        "no live Airflow triggerer serves (Airflow mode's writer)", observe)

    async def beat(conn: asyncpg.Connection, job_id: int) -> bool:
        nonlocal last
        unserved, beaten = await beat_if_served(conn, default_queue, queues, job_id)
        counts.update(dict.fromkeys(counts, 0))
        counts.update({(u.queue, u.reason, u.team): u.triggers for u in unserved})
        read_at[0] = time.monotonic()
        withheld = [u.label() for u in unserved if u.vouched]
        if withheld != last:
            if withheld:
                log.warning(
                    "triggerer heartbeat withheld: deferred work and no live consumer on %s",
                    ", ".join(withheld),
                )
            else:
                log.info("triggerer heartbeat resumed: every queue with deferred work has a consumer")
            last = withheld
        return beaten

    return beat
