"""``triggerflow bench airflow``: N deferred DateTimeSensorAsync task instances firing at one
instant in a real Airflow 3.3.2 metadata database; all-applied latency as in DESIGN.md (from
the instant until every task instance is ``scheduled``; no scheduler runs).

Per N: a fresh AirflowStack (metadata database, API server; no scheduler, no dag-processor),
the bench DAG stored by ``airflow dags reserialize``, Airflow's own ``airflow triggerer`` on
the queue started and healthy, then the N rows made by ``airflow_seed`` (Airflow's code) with
an instant ``lead`` seconds after they exist: the native burst's rule (2.5 s + N/2,500 s from
the start of the deferral) plus what deferring them takes here. Airflow's own code writes
the deferral (``airflow_seed``), 5-20 s for 10,000 on this machine, against about 1 s for
native mode's SDK, so the lead also holds 1.5x the previous run's deferral time (N/1,000 s
for the first): without it the instant passed before the rows were deferred, and the bench
measured its own seeding. Both servers get the same rule.
Latency per task instance is Airflow's own ``scheduled_dttm`` minus the instant; a run that
is not all ``scheduled`` within ``limit`` seconds of the instant reports how many were.

Also measured: the triggerer's memory (RSS of its process tree: the job and its trigger
runner) before the rows and at the instant, the triggers it held at the instant, and
statements per applied event from ``pg_stat_statements`` for this database (the bench's own
polling subtracted).

Each size runs twice on identical rows (same seed, same instant rule), each time on a fresh
stack: served by Airflow's own triggerer (``serve_with_airflow_triggerer``), then by
triggerflow's ``writer --airflow`` and ``consume --airflow`` (``serve_with_triggerflow``; the
memory is the consumer's, the process holding the waiting triggers). The table prints both
and the ratio of all-applied times.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.airflow_floor import row_change, writer_db_time
from bench.airflow_seed import bench_dag
from bench.airflow_serve import (
    QUEUE,
    TRIGGERFLOW,
    Served,
    serve_with_airflow_triggerer,
    serve_with_triggerflow,
)
from bench.airflow_waiting import PROCESS_ROLES, waiting
from bench.common import dist, median_of, with_checkout
from testbed.airflow_stack import AirflowStack

if TYPE_CHECKING:
    from triggerflow.settings import Settings

__all__ = ["QUEUE", "TRIGGERFLOW", "measure", "run_airflow_bench", "seed_rows"]


@dataclass(frozen=True)
class AirflowSizes:
    counts: tuple[int, ...] = (1_000, 10_000)
    limit: float = 300.0  # seconds after the instant before a run is cut off
    repeats: int = 3  # bursts per N served by triggerflow (and native), medians printed
    waiting: int = 10_000  # triggers held while statements/s and RSS are measured
    window: float = 30.0  # seconds statements are counted while they wait
    runtime_requests: int = 100  # requests of each kind per LatencyTrigger (airflow_runtime)


FULL = AirflowSizes()
QUICK = AirflowSizes(counts=(100,), limit=60.0, repeats=1, waiting=100, window=3.0,
                     runtime_requests=20)


def _tree_rss(pgid: int) -> int:
    """Resident memory of every process in the group ``pgid`` (bytes)."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid:  # field 5: process group
                continue
            status = (stat.parent / "status").read_text()
        except (OSError, IndexError, ValueError):
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total


class _Db:
    """The bench's one autocommit connection to the metadata database; counts its statements."""

    def __init__(self, url: str) -> None:
        import psycopg2  # type: ignore[import-untyped]

        self.conn = psycopg2.connect(url)
        self.conn.autocommit = True
        self.own = 0

    def one(self, sql: str, *args: Any) -> Any:
        with self.conn.cursor() as cur:
            cur.execute(sql, args)
            self.own += 1
            row = cur.fetchone() if cur.description else None
        return None if row is None else row[0]

    def all(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        with self.conn.cursor() as cur:
            cur.execute(sql, args)
            self.own += 1
            return list(cur.fetchall())

    def statements(self) -> int | None:
        """Statements run in this database so far (pg_stat_statements), or None without it."""
        try:
            return int(self.one(
                "SELECT coalesce(sum(calls), 0) FROM pg_stat_statements s JOIN pg_database d "
                "ON d.oid = s.dbid WHERE d.datname = current_database()"))
        except Exception:
            return None

    def close(self) -> None:
        self.conn.close()


def measure(server_url: str, n: int, limit: float, log: Any = print,
            serve: Callable[[AirflowStack], Served] = serve_with_airflow_triggerer,
            repeats: int = 1, window: float | None = None) -> dict[str, Any]:
    """``repeats`` bursts of ``n`` on one fresh stack (medians; each run under "runs"), and
    with a ``window`` then what ``n`` waiting triggers cost over it (``airflow_waiting``)."""
    dags = Path(tempfile.mkdtemp(prefix="tf-bench-airflow-dags-"))
    (dags / "tf_bench_airflow.py").write_text(bench_dag(n, QUEUE))
    stack = AirflowStack(server_url, dags)
    db: _Db | None = None
    try:
        migrate_s = stack.migrate()
        stack.start(services=("api-server",))
        db = _Db(stack.database_url)
        db.one("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        stack.run_cli("dags", "reserialize", timeout=300)
        served = serve(stack)
        time.sleep(3.0)  # let the triggerer settle before its empty RSS is read
        pgid = stack.processes[served.process].popen.pid if served.process in stack.processes else 0
        rss_empty = _tree_rss(pgid) if pgid else 0
        log(f"airflow bench N={n:,} ({served.name}): migrated in {migrate_s:.1f}s")
        waited = None
        if window is not None:  # first: a consumer whose memory no burst has touched yet
            from triggerflow.settings import Settings

            lanes = Settings.model_fields["writer_concurrency"].default
            waited = waiting(db, n, window, lambda k, lead: seed_rows(stack, k, lead),
                             lambda: _tree_rss(pgid), log,
                             floor=lambda run_id: row_change(stack.database_url, run_id, lanes))
        runs: list[dict[str, Any]] = []
        for i in range(repeats):
            allowance = 1.5 * runs[-1]["defer_s"] if runs else n / 1000
            runs.append(_burst(stack, db, served, n, limit, pgid, rss_empty, log, allowance))
            log(f"airflow bench N={n:,} ({served.name}) run {i + 1}/{repeats}: "
                f"{runs[-1]['applied']:,}/{n:,} scheduled"
                + (f", all in {runs[-1]['all_applied_s']:.3f}s" if runs[-1]["all_applied_s"]
                   else f" within {limit:.0f}s"))
        middle = sorted(runs, key=lambda r: r["all_applied_s"] or float("inf"))[len(runs) // 2]
        return {**middle, "runs": runs, "repeats": repeats, "waiting": waited,
                "all_applied_s": median_of(runs, "all_applied_s")
                if all(r["all_applied_s"] is not None for r in runs) else None,
                "migrate_s": migrate_s}
    finally:
        if db is not None:
            db.close()
        stack.stop()
        shutil.rmtree(dags, ignore_errors=True)


def _burst(stack: AirflowStack, db: _Db, served: Served, n: int, limit: float, pgid: int,
           rss_empty: int, log: Any, allowance: float) -> dict[str, Any]:
    """One burst of ``n`` rows seeded now, firing ``2.5 + n/2,500 + allowance`` s after they
    exist (``allowance``: the time deferring them is expected to take, see the module doc)."""
    lead = 2.5 + n / 2500 + allowance
    seeded = seed_rows(stack, n, lead)
    instant = datetime.fromisoformat(seeded["instant"])
    log(f"airflow bench N={n:,}: run with {n:,} task instances made in "
        f"{seeded['create_s']:.1f}s, deferred in {seeded['defer_s']:.1f}s; lead {lead:.1f}s")
    before = db.statements()
    own_before = db.own
    writer_role = PROCESS_ROLES["tf-writer"] if served.name == TRIGGERFLOW.name else None
    writer_before = writer_db_time(db, writer_role) if writer_role else 0.0
    # Held and RSS just before the instant: a fast burst has let go of its triggers by
    # the first poll after it.
    while (instant - datetime.now(UTC)).total_seconds() > 0.15:
        time.sleep(0.02)
    held = db.one(served.held_sql)
    rss_at = _tree_rss(pgid) if pgid else 0
    while datetime.now(UTC) < instant:
        time.sleep(0.01)
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        stack.check_alive()
        if not db.one("SELECT count(*) FROM task_instance WHERE run_id = %s AND state = 'deferred'",
                      seeded["run_id"]):
            break
        time.sleep(0.1)
    after = db.statements()
    lat = [float(r[0]) for r in db.all(
        "SELECT extract(epoch FROM scheduled_dttm - %s) FROM task_instance "
        "WHERE run_id = %s AND state = 'scheduled'", instant, seeded["run_id"])]
    applied = len(lat)
    statements = None if before is None or after is None else after - before - (db.own - own_before)
    writer_ms = writer_db_time(db, writer_role) - writer_before if writer_role else None
    return {
        "served_by": served.name, "n": n, "applied": applied, "limit_s": limit, "lead_s": lead,
        "create_s": seeded["create_s"], "defer_s": seeded["defer_s"],
        "latency": dist(lat), "all_applied_s": max(lat) if applied == n else None,
        "deferred_before_instant": seeded["defer_s"] < lead,
        "held_at_instant": held, "rss_empty": rss_empty, "rss_at_instant": rss_at,
        "bytes_per_held_trigger": (rss_at - rss_empty) / held if held else None,
        "statements": statements,
        "statements_per_event": statements / applied if statements and applied else None,
        "writer_us_per_event": writer_ms * 1000 / applied if writer_ms and applied else None,
    }


def seed_rows(stack: AirflowStack, n: int, lead: float, instant: str | None = None,
              ) -> dict[str, Any]:
    """Run ``airflow_seed`` in the stack's environment (see its doc); returns its report."""
    done = subprocess.run([sys.executable, "-m", "bench.airflow_seed", str(n),
                           str(lead), QUEUE, *([instant] if instant else [])],
                          env=with_checkout(stack.env), capture_output=True, text=True,
                          timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"seeding {n} rows failed:\n{done.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def run_airflow_bench(settings: Settings, quick: bool) -> int:
    """``triggerflow bench airflow [--quick]``: native mode's bursts (``airflow_native``), then
    each size served by Airflow's own triggerer and by triggerflow, on the PostgreSQL server
    of the settings' database (a database of its own per stack) and their broker; prints the
    tables and saves the raw results under bench-results/."""
    from urllib.parse import urlsplit, urlunsplit

    from rich.console import Console

    from bench.airflow_native import native_bursts
    from bench.airflow_report import table_airflow, table_runtime, table_targets
    from bench.airflow_runtime import measure_runtime

    console = Console(log_path=False, width=None if sys.stdout.isatty() else 150)
    server_url = urlunsplit(urlsplit(settings.database_dsn())._replace(path="", query=""))
    amqp_url = settings.amqp_dsn()
    sizes = QUICK if quick else FULL
    out = Path("bench-results")
    out.mkdir(exist_ok=True)
    stamp = f"{datetime.now():%Y%m%d-%H%M%S}{'-quick' if quick else ''}"
    native = native_bursts(settings, sizes.counts, sizes.repeats, quick, console,
                           out / f"logs-airflow-{stamp}")
    rows: list[dict[str, Any]] = []
    for n in sizes.counts:
        theirs = measure(server_url, n, sizes.limit, console.log)
        ours = measure(server_url, n, sizes.limit, console.log,
                       serve=lambda stack: serve_with_triggerflow(stack, amqp_url),
                       repeats=sizes.repeats, window=sizes.window if n == sizes.waiting else None)
        rows += [theirs, ours]
    runtime = measure_runtime(server_url, amqp_url, console.log, sizes.runtime_requests)
    tables = [table_airflow(rows, native), table_targets(rows, native, sizes.waiting),
              table_runtime(runtime, sizes.runtime_requests)]
    for table in tables:
        console.print(table)
    if not quick:  # only a full run replaces the record (bench/results.json)
        from bench.results import record

        record("airflow", tables)
    path = out / f"bench-airflow-{stamp}.json"
    path.write_text(json.dumps({"command": "triggerflow bench airflow" + (" --quick" if quick else ""),
                                "sizes": sizes.__dict__, "queue": QUEUE, "runs": rows,
                                "native": native, "runtime": runtime}, indent=1, default=str))
    console.print(f"raw results: {path}")
    ours_ok = all(r["applied"] == r["n"] for r in rows if r["served_by"] == TRIGGERFLOW.name)
    return 0 if ours_ok else 1
