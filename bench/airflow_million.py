"""``triggerflow bench airflow-million``: one ``consume --airflow`` holding 1,000,000 waiting
Airflow ``DateTimeTrigger``s (issue 18: at most 0.5 KB each).

On a fresh Airflow 3.3.2 metadata database (API server only: no scheduler, so nothing else
touches the rows) served by ``writer --airflow`` and one ``consume --airflow``:

1. ``TEMPLATE`` deferred ``DateTimeSensorAsync`` task instances made by Airflow's own code
   (``airflow_seed``), firing hours ahead; the consumer claims them, which pays its one-time
   costs (Airflow's trigger modules, the Fernet key, the pools, the heap's first arrays);
2. its RSS and CPU time are read, then ``n - TEMPLATE`` more rows are cloned from one of
   them in SQL (``CLONE``: the same trigger row and task instance, a new trigger id and map
   index), in chunks, as fast as the database writes them, while the writer wakes the
   consumer and it claims them;
3. once it holds all ``n``: the claim's time, the RSS growth over the clones divided by
   their number (bytes per waiting trigger), the consumer's CPU over the claim, then
   statements per second per process over a window while the ``n`` wait.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.airflow import _Db, _tree_rss, seed_rows
from bench.airflow_seed import bench_dag
from bench.airflow_serve import QUEUE, TRIGGERFLOW, serve_with_triggerflow
from bench.airflow_waiting import HELD_SQL, _per_role, held_within
from testbed.airflow_stack import AirflowStack

if TYPE_CHECKING:
    from triggerflow.settings import Settings


@dataclass(frozen=True)
class MillionSizes:
    n: int = 1_000_000
    template: int = 1_000  # rows made by Airflow's code before the clones
    chunk: int = 50_000  # rows per cloning statement
    limit: float = 1800.0  # seconds the consumer gets to hold them all
    window: float = 30.0  # seconds statements are counted while they wait


FULL = MillionSizes()
QUICK = MillionSizes(n=5_000, template=500, chunk=1_000, limit=300.0, window=3.0)
TARGET_BYTES = 512  # issue 18: at most 0.5 KB per waiting trigger

# Clone the template task instance on trigger %(template)s into %(count)s more deferred task
# instances of the same run, each with a trigger row of its own copied from the template's
# (map indexes from %(base)s). Column lists are filled in from the live schema (see _clone_sql).
CLONE = """
WITH t AS (
    INSERT INTO "trigger" ({trigger_cols})
    SELECT {trigger_cols} FROM "trigger", generate_series(1, %(count)s) WHERE id = %(template)s
    RETURNING id
), numbered AS (
    SELECT id, %(base)s - 1 + row_number() OVER (ORDER BY id) AS i FROM t
)
INSERT INTO task_instance (id, map_index, trigger_id, {ti_cols})
SELECT gen_random_uuid(), n.i, n.id, {ti_prefixed}
FROM numbered n, task_instance ti WHERE ti.trigger_id = %(template)s
"""


def _columns(db: _Db, table: str, skip: set[str]) -> list[str]:
    return [c for (c,) in db.all(
        "SELECT column_name FROM information_schema.columns WHERE table_schema = 'public' "
        "AND table_name = %s ORDER BY ordinal_position", table) if c not in skip]


def _clone_sql(db: _Db) -> str:
    trigger_cols = _columns(db, "trigger", {"id", "triggerer_id"})
    ti_cols = _columns(db, "task_instance", {"id", "map_index", "trigger_id"})
    quoted = ", ".join(f'"{c}"' for c in trigger_cols)
    return CLONE.format(trigger_cols=quoted, ti_cols=", ".join(f'"{c}"' for c in ti_cols),
                        ti_prefixed=", ".join(f'ti."{c}"' for c in ti_cols))


def _tree_cpu(pgid: int) -> float:
    """CPU seconds (user + system) of every process in the group ``pgid``."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return total / os.sysconf("SC_CLK_TCK")


def measure_million(server_url: str, amqp_url: str, sizes: MillionSizes, log: Any = print,
                    ) -> dict[str, Any]:
    def progress(line: str) -> None:
        log(f"airflow-million: {line}")

    dags = Path(tempfile.mkdtemp(prefix="tf-bench-million-dags-"))
    (dags / "tf_bench_airflow.py").write_text(bench_dag(sizes.template, QUEUE))
    stack = AirflowStack(server_url, dags)
    db: _Db | None = None
    try:
        stack.migrate()
        stack.start(services=("api-server",))
        db = _Db(stack.database_url)
        db.one("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        stack.run_cli("dags", "reserialize", timeout=300)
        # room for all of them and a margin (the shipped capacity is 200,000 per consumer)
        serve_with_triggerflow(stack, amqp_url, capacity=int(sizes.n * 1.2))
        pgid = stack.processes[TRIGGERFLOW.process].popen.pid
        rss_empty = _tree_rss(pgid)
        seeded = seed_rows(stack, sizes.template, 6 * 3600.0)
        held_within(db, sizes.template, sizes.limit, progress, "template rows")
        time.sleep(3.0)  # the claims' allocations are over
        rss_warm, cpu_warm = _tree_rss(pgid), _tree_cpu(pgid)
        template = int(db.one("SELECT min(trigger_id) FROM task_instance WHERE run_id = %s",
                              seeded["run_id"]))
        clone = _clone_sql(db)
        log(f"airflow-million: {sizes.template:,} rows made by Airflow's code and held; "
            f"consumer RSS {rss_warm / 2**20:.0f} MiB; cloning {sizes.n - sizes.template:,}")
        t0 = time.monotonic()
        base = sizes.template
        with db.conn.cursor() as cur:
            while base < sizes.n:
                count = min(sizes.chunk, sizes.n - base)
                cur.execute(clone, {"count": count, "template": template, "base": base})
                base += count
                held = int(db.one(HELD_SQL))
                log(f"airflow-million: {base:,} rows written in {time.monotonic() - t0:.0f}s, "
                    f"{held:,} held")
        written_s = time.monotonic() - t0
        held_within(db, sizes.n, sizes.limit, progress, "rows")
        claim_s = time.monotonic() - t0
        cpu_claim = _tree_cpu(pgid) - cpu_warm
        time.sleep(3.0)
        rss_held = _tree_rss(pgid)
        db.one("ANALYZE")  # as autovacuum would have by now
        db.one("SELECT pg_stat_statements_reset(0, (SELECT oid FROM pg_database "
               "WHERE datname = current_database()), 0)")
        started = time.monotonic()
        time.sleep(sizes.window)
        calls, by_statement = _per_role(db)
        window = time.monotonic() - started
        cloned = sizes.n - sizes.template
        result = {
            "n": sizes.n, "template": sizes.template, "written_s": written_s,
            "claim_s": claim_s, "claimed_per_s": cloned / claim_s,
            "rss_empty": rss_empty, "rss_warm": rss_warm, "rss_held": rss_held,
            "bytes_per_waiting_trigger": (rss_held - rss_warm) / cloned,
            "bytes_per_trigger_from_empty": (rss_held - rss_empty) / sizes.n,
            "cpu_claim_s": cpu_claim, "cpu_us_per_claim": 1e6 * cpu_claim / cloned,
            "statements_per_s": {name: c / window for name, c in calls.items()},
            "by_statement": by_statement,
        }
        log(f"airflow-million: {sizes.n:,} held; {result['bytes_per_waiting_trigger']:.0f} B "
            f"per waiting trigger; claimed in {claim_s:.1f}s")
        return result
    finally:
        if db is not None:
            db.close()
        stack.stop()
        shutil.rmtree(dags, ignore_errors=True)


def table_million(r: dict[str, Any]) -> Any:
    from rich.table import Table

    t = Table(title=f"{r['n']:,} waiting Airflow DateTimeTriggers in one consume --airflow")
    for col in ("measure", "value", "target", "met"):
        t.add_column(col, justify="right")
    per = r["bytes_per_waiting_trigger"]
    t.add_row("RSS per waiting trigger (growth over the cloned rows)", f"{per:.0f} B",
              f"≤ {TARGET_BYTES} B", "met" if per <= TARGET_BYTES else "MISSED")
    t.add_row("RSS per trigger from the empty consumer (one-time costs included)",
              f"{r['bytes_per_trigger_from_empty']:.0f} B", "", "")
    t.add_row("consumer RSS: empty / template held / all held",
              " / ".join(f"{r[k] / 2**20:.0f} MiB" for k in ("rss_empty", "rss_warm", "rss_held")),
              "", "")
    t.add_row(f"rows written by the bench ({r['n'] - r['template']:,} cloned in SQL)",
              f"{r['written_s']:.1f} s", "", "")
    t.add_row("from the first clone until all held", f"{r['claim_s']:.1f} s "
              f"({r['claimed_per_s']:,.0f}/s)", "", "")
    t.add_row("consumer CPU per claimed trigger", f"{r['cpu_us_per_claim']:.0f} µs", "", "")
    for name, rate in r["statements_per_s"].items():
        t.add_row(f"statements/s, {name}, while all wait", f"{rate:.2f}", "≤ 2",
                  "met" if rate <= 2 else "MISSED")
    return t


def run_airflow_million(settings: Settings, quick: bool) -> int:
    """``triggerflow bench airflow-million [--quick]``: prints the table, saves the raw result."""
    from urllib.parse import urlsplit, urlunsplit

    from rich.console import Console

    console = Console(log_path=False, width=None if sys.stdout.isatty() else 150)
    server_url = urlunsplit(urlsplit(settings.database_dsn())._replace(path="", query=""))
    sizes = QUICK if quick else FULL
    result = measure_million(server_url, settings.amqp_dsn(), sizes, console.log)
    table = table_million(result)
    console.print(table)
    if not quick:  # only a full run replaces the record (bench/results.json)
        from bench.results import record

        record("airflow-million", [table])
    out = Path("bench-results")
    out.mkdir(exist_ok=True)
    path = out / f"bench-airflow-million-{datetime.now():%Y%m%d-%H%M%S}{'-quick' if quick else ''}.json"
    path.write_text(json.dumps({"command": "triggerflow bench airflow-million"
                                + (" --quick" if quick else ""), "sizes": sizes.__dict__,
                                "result": result}, indent=1, default=str))
    console.print(f"raw results: {path}")
    return 0  # all held (measure_million raises otherwise); the table says met or missed
