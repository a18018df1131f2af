"""What Airflow's schema makes each applied event cost, measured in ``triggerflow bench
airflow`` beside the bursts it bounds.

Every server of Airflow's triggers (Airflow's ``handle_event_submit``, triggerflow's
``APPLY``) moves each task instance from ``deferred`` on its trigger to ``scheduled``:
``state``, ``trigger_id``, ``next_kwargs``, ``scheduled_dttm``, ``updated_at``. ``state`` and
``trigger_id`` are indexed, so each moved row is a non-HOT update: a new row version and an
entry in every index of ``task_instance``. ``row_change`` times that bare ``UPDATE`` (no
fence, no lock pass, nothing returned) of N waiting task instances, split over as many
connections running at once as the writer applies on, in sessions marked as the writer's
are (so the cancel log's row triggers skip them, as they skip ``APPLY``), and rolls it
back: the database time no statement that writes Airflow's rows can go under.
``writer_db_time`` reads what the writer's own statements took during a burst
(``pg_stat_statements``, the writer's role).
"""

from __future__ import annotations

import threading
import time
from typing import Any

BARE_ROW_CHANGE = """
UPDATE task_instance SET state = 'scheduled', trigger_id = NULL,
       next_kwargs = coalesce(next_kwargs, '{}'::jsonb) || '{"event": null}'::jsonb,
       scheduled_dttm = clock_timestamp(), updated_at = clock_timestamp()
WHERE id = ANY(%s::uuid[]) AND state = 'deferred'
"""


def row_change(database_url: str, run_id: str, lanes: int) -> dict[str, Any]:
    """Wall time of the bare row change of every deferred task instance of ``run_id``, in
    ``lanes`` transactions at once (rolled back), and database time per row."""
    import psycopg2  # type: ignore[import-untyped]

    conns = [psycopg2.connect(database_url) for _ in range(lanes)]
    try:
        with conns[0].cursor() as cur:
            cur.execute("SELECT id::text FROM task_instance WHERE run_id = %s "
                        "AND state = 'deferred' ORDER BY trigger_id", (run_id,))
            ids = [r[0] for r in cur.fetchall()]
        conns[0].rollback()
        share = -(-len(ids) // lanes)
        parts = [ids[i * share:(i + 1) * share] for i in range(lanes)]
        start = threading.Barrier(lanes)
        spans: list[tuple[float, float, int]] = []

        def lane(conn: Any, part: list[str]) -> None:
            with conn.cursor() as cur:
                # as the writer's sessions are: the cancel log's row triggers skip our moves
                cur.execute("SET LOCAL triggerflow.origin = 'triggerflow'")
                start.wait()
                t0 = time.perf_counter()
                cur.execute(BARE_ROW_CHANGE, (part,))
                spans.append((t0, time.perf_counter(), cur.rowcount))
            conn.rollback()

        threads = [threading.Thread(target=lane, args=(c, p)) for c, p in zip(conns, parts, strict=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for c in conns:
            c.close()
    rows = sum(n for _, _, n in spans)
    wall = max(e for _, e, _ in spans) - min(s for s, _, _ in spans)
    busy = sum(e - s for s, e, _ in spans)
    return {"rows": rows, "lanes": lanes, "wall_s": wall,
            "us_per_row": busy / rows * 1e6 if rows else None}


def writer_db_time(db: Any, role: str) -> float:
    """Milliseconds of database time the statements of ``role`` took in this database so far
    (``pg_stat_statements``); ``db`` is the bench's connection (``airflow._Db``)."""
    return float(db.one(
        "SELECT coalesce(sum(s.total_exec_time), 0) FROM pg_stat_statements s "
        "JOIN pg_roles r ON r.oid = s.userid JOIN pg_database d ON d.oid = s.dbid "
        "WHERE d.datname = current_database() AND r.rolname = %s", role))
