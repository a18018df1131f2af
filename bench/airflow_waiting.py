"""What N waiting Airflow triggers cost triggerflow's processes in ``triggerflow bench
airflow``: statements per second per process and resident memory per waiting trigger.

Statements are told apart by database role, as in native mode's ``periodic`` scenario
(``pg_stat_statements`` has no pid): ``roles`` creates one login role per triggerflow process
in the Airflow database (``tfaf_writer``, ``tfaf_consumer``) with what a deployment's user
needs, and ``serve_with_triggerflow`` starts each process as its own role. ``waiting`` then
seeds N rows an hour ahead (Airflow's code, as the bursts'), waits until the consumer holds
them all, lets it settle, and counts each role's statements over a window; the consumer's
RSS growth while N more are claimed, divided by N, is the memory per waiting trigger (the
first N paid the one-time costs: Airflow's trigger modules, the Fernet key). It runs before
the bursts, so no memory they freed is reused. Afterwards the N tasks are marked
``skipped`` (as by hand in Airflow's UI) and the consumer's cancel sweep lets go of them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from bench.common import _with_user

PROCESS_ROLES = {"tf-writer": "tfaf_writer", "tf-consume": "tfaf_consumer"}
HELD_SQL = "SELECT count(*) FROM triggerflow.trigger_state WHERE owner_id IS NOT NULL"


def roles(database_url: str) -> dict[str, str]:
    """Create (idempotently) the processes' roles with a deployment's rights on this
    database; returns process name -> database URL logging in as its role."""
    import psycopg2  # type: ignore[import-untyped]

    conn = psycopg2.connect(database_url)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            for role in PROCESS_ROLES.values():
                cur.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,))
                if cur.fetchone() is None:
                    cur.execute(f"CREATE ROLE {role} LOGIN")
                cur.execute(f"GRANT USAGE ON SCHEMA public, triggerflow TO {role}; "
                            f"GRANT ALL ON ALL TABLES IN SCHEMA public, triggerflow TO {role}; "
                            f"GRANT ALL ON ALL SEQUENCES IN SCHEMA public, triggerflow TO {role}")
    finally:
        conn.close()
    return {name: _with_user(database_url, role) for name, role in PROCESS_ROLES.items()}


def _per_role(db: Any) -> tuple[dict[str, int], list[dict[str, Any]]]:
    """Calls per process, and per statement (role, calls, the statement's start)."""
    rows = db.all(
        "SELECT r.rolname, s.calls, left(regexp_replace(s.query, '\\s+', ' ', 'g'), 90) "
        "FROM pg_stat_statements s "
        "JOIN pg_roles r ON r.oid = s.userid JOIN pg_database d ON d.oid = s.dbid "
        "WHERE d.datname = current_database() AND r.rolname = ANY(%s) AND s.calls > 0 "
        "ORDER BY s.calls DESC", list(PROCESS_ROLES.values()))
    calls = {name: sum(int(c) for r, c, _ in rows if r == role)
             for name, role in PROCESS_ROLES.items()}
    return calls, [{"role": r, "calls": int(c), "statement": q} for r, c, q in rows]


def held_within(db: Any, total: int, limit: float, log: Callable[[str], None] | None = None,
                what: str = "waiting triggers") -> float:
    """Seconds until the consumer holds ``total`` rows (``log``: progress every 10 s); raises
    after ``limit`` seconds."""
    t0 = shown = time.monotonic()
    while True:
        held = int(db.one(HELD_SQL))
        if held >= total:
            return time.monotonic() - t0
        elapsed = time.monotonic() - t0
        if elapsed > limit:
            raise RuntimeError(f"the consumer held {held:,} of {total:,} {what} after {limit:.0f} s")
        if log is not None and time.monotonic() - shown >= 10:
            shown = time.monotonic()
            log(f"{held:,} of {total:,} {what} held after {elapsed:.0f}s")
        time.sleep(0.5)


def _hold(db: Any, total: int) -> None:
    held_within(db, total, 300.0)
    time.sleep(3.0)  # claims and their allocations are over


def waiting(db: Any, n: int, window: float, seed: Callable[[int, float], dict[str, Any]],
            rss: Callable[[], int], log: Callable[[str], None],
            floor: Callable[[str], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Seed ``n`` rows an hour ahead; once held, statements/s per process over ``window``
    seconds; then ``n`` more, and the RSS growth over those is the memory per waiting trigger
    (the first ``n`` paid the one-time costs: Airflow's trigger modules, the Fernet key).
    ``db`` is the bench's connection (``airflow._Db``), ``seed(n, lead)`` seeds rows (the
    bench DAG maps exactly ``n``), ``rss()`` reads the consumer's resident memory; ``floor``,
    given the first ``n`` rows' run id while they wait, measures on them what is rolled back
    (``airflow_floor.row_change``)."""
    first = seed(n, 3600.0)
    _hold(db, n)
    db.one("ANALYZE")  # as autovacuum would have by now
    db.one("SELECT pg_stat_statements_reset(0, (SELECT oid FROM pg_database "
           "WHERE datname = current_database()), 0)")
    started = time.monotonic()
    time.sleep(window)
    calls, by_statement = _per_role(db)
    elapsed = time.monotonic() - started
    rss_before = rss()
    second = seed(n, 3600.0)
    _hold(db, 2 * n)
    rss_held = rss()
    log(f"airflow bench: {n:,} waiting: "
        + ", ".join(f"{name} {c / elapsed:.2f} statements/s" for name, c in calls.items())
        + f"; {(rss_held - rss_before) / n:.0f} B RSS per waiting trigger")
    floored = floor(first["run_id"]) if floor is not None else None
    if floored is not None and floored["rows"]:
        log(f"airflow bench: the bare row change of {floored['rows']:,} waiting task instances "
            f"on {floored['lanes']} connections took {floored['wall_s'] * 1000:.1f} ms "
            f"({floored['us_per_row']:.1f} µs of database time per row, rolled back)")
    db.one("UPDATE task_instance SET state = 'skipped' WHERE run_id = ANY(%s)",
           [first["run_id"], second["run_id"]])
    deadline = time.monotonic() + 120
    while int(db.one(HELD_SQL)) and time.monotonic() < deadline:
        time.sleep(0.5)  # the cancel sweep lets go of them before the bursts start
    return {"n": n, "window_s": elapsed, "rss_before": rss_before, "rss_held": rss_held,
            "bytes_per_waiting_trigger": (rss_held - rss_before) / n,
            "statements_per_s": {name: c / elapsed for name, c in calls.items()},
            "by_statement": by_statement, "floor": floored}
