"""``triggerflow bench airflow-waits``: how late a task resumes after a short wait, under
Airflow's own triggerer and under triggerflow's shipped hold (docs/airflow-race.md).

One real Airflow 3.3.2 stack (scheduler, API server, dag-processor, LocalExecutor with 8
workers, as ``tests/test_airflow_race.py``) and the race DAG file
(``tests/airflow_dags/triggerflow_race.py``) with ``TF_RACE_GROUPS``: per wait W one DAG,
``tf_race_wait_W``, of mapped ``DateTimeSensorAsync`` whose triggers fire W seconds after
their deferral. Each group runs once served by ``airflow triggerer`` and once by
triggerflow's ``writer --airflow`` and ``consume --airflow`` with shipped defaults (the hold
``airflow_resume_delay`` and its witness), the two sides in turn (ABBA over the groups, so a
slower stretch of the machine does not fall on one side only). Only one side runs at a time.

Per task, from the database (row triggers the bench adds to ``trigger`` and
``task_instance``, stamped with ``clock_timestamp()``): the deferral (its first trigger's
``created_date``), the fire (deferral + W), the resume (when it first left ``deferred``) and
its final state; per run, the ``log`` table's ``state mismatch`` rows (the race). Lateness is
resume - fire.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.airflow_serve import serve_with_triggerflow
from bench.common import CHECKOUT, ms, pct
from testbed.airflow_stack import AirflowStack, AirflowStackError

if TYPE_CHECKING:
    from rich.table import Table

    from triggerflow.settings import Settings

QUEUE = "default"  # the race DAG's tasks' queue
AIRFLOW, TRIGGERFLOW = "airflow triggerer", "triggerflow"
DAG_FILE = CHECKOUT / "tests" / "airflow_dags" / "triggerflow_race.py"


@dataclass(frozen=True)
class WaitSizes:
    groups: tuple[tuple[int, int], ...]  # (W seconds, tasks)
    limit: float  # seconds a group's run may take before it is cut off


FULL = WaitSizes(groups=((0, 200), (1, 50), (2, 50), (5, 50), (10, 50), (15, 50)), limit=900.0)
QUICK = WaitSizes(groups=((0, 20), (5, 10)), limit=300.0)

# Deferrals and resumes, stamped by the database as they are written; both sides pay the
# same two inserts per task. SECURITY DEFINER: triggerflow's processes log in as roles that
# may not write the bench's tables.
AUDIT = """
CREATE TABLE tf_bench_trigger (id integer, created_date timestamptz);
CREATE TABLE tf_bench_ti (ti_id uuid, dag_id text, run_id text, map_index integer,
    old_state text, new_state text, trigger_id integer, at timestamptz);
CREATE FUNCTION tf_bench_trigger_row() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN INSERT INTO tf_bench_trigger VALUES (NEW.id, NEW.created_date); RETURN NULL; END $$;
CREATE FUNCTION tf_bench_ti_row() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
  IF NEW.state IS DISTINCT FROM OLD.state AND 'deferred' IN (NEW.state, OLD.state) THEN
    INSERT INTO tf_bench_ti VALUES (NEW.id, NEW.dag_id, NEW.run_id, NEW.map_index, OLD.state,
        NEW.state, coalesce(NEW.trigger_id, OLD.trigger_id), clock_timestamp());
  END IF;
  RETURN NULL;
END $$;
CREATE TRIGGER tf_bench_trigger AFTER INSERT ON trigger
    FOR EACH ROW EXECUTE FUNCTION tf_bench_trigger_row();
CREATE TRIGGER tf_bench_ti AFTER UPDATE OF state ON task_instance
    FOR EACH ROW EXECUTE FUNCTION tf_bench_ti_row();
"""

# Per task instance of one run: its first deferral (trigger.created_date), when that
# deferral ended (the first row leaving 'deferred' after it), and its state now.
PER_TASK = """
SELECT ti.map_index, ti.state,
       extract(epoch FROM d.deferred_at)::float8, extract(epoch FROM r.resumed_at)::float8
FROM task_instance ti
LEFT JOIN LATERAL (
    SELECT coalesce(t.created_date, a.at) AS deferred_at, a.at FROM tf_bench_ti a
    LEFT JOIN tf_bench_trigger t ON t.id = a.trigger_id
    WHERE a.ti_id = ti.id AND a.new_state = 'deferred' ORDER BY a.at LIMIT 1) d ON true
LEFT JOIN LATERAL (
    SELECT min(b.at) AS resumed_at FROM tf_bench_ti b
    WHERE b.ti_id = ti.id AND b.old_state = 'deferred' AND b.at >= d.at) r ON true
WHERE ti.dag_id = %s AND ti.run_id = %s
"""


def group_stats(wait: float, rows: list[tuple[Any, ...]], mismatches: int) -> dict[str, Any]:
    """One group's numbers from ``PER_TASK`` rows ``(map_index, state, deferred, resumed)``
    (epoch seconds; None where not seen): lateness = resumed - (deferred + wait)."""
    late = sorted(float(resumed) - (float(deferred) + wait) for _, _, deferred, resumed in rows
                  if deferred is not None and resumed is not None)
    return {"tasks": len(rows), "succeeded": sum(1 for r in rows if r[1] == "success"),
            "deferred": sum(1 for r in rows if r[2] is not None), "resumed": len(late),
            "p50": pct(late, 50) if late else None, "max": late[-1] if late else None,
            "mismatches": mismatches, "lateness": [round(x, 4) for x in late]}


def ratio(ours: float | None, theirs: float | None) -> str:
    """triggerflow / airflow, or "-" where either is missing or Airflow's is not positive."""
    if ours is None or theirs is None or theirs <= 0:
        return "-"
    return f"{ours / theirs:.1f}x"


def table_waits(groups: list[dict[str, Any]]) -> Table:
    from rich.table import Table

    t = Table(title="Short waits: resume - fire per task, triggers firing W s after their "
              "deferral (Airflow 3.3.2 stack, LocalExecutor, 8 workers)")
    for col in ("W", "served by", "tasks", "succeeded", "state mismatch rows", "p50", "max",
                "p50 x airflow", "max x airflow"):
        t.add_column(col, justify="right")
    for g in groups:
        theirs, ours = g[AIRFLOW], g[TRIGGERFLOW]
        for name, r in ((AIRFLOW, theirs), (TRIGGERFLOW, ours)):
            mine = name == TRIGGERFLOW
            t.add_row(f"{g['wait']} s", name, str(r["tasks"]), str(r["succeeded"]),
                      str(r["mismatches"]), ms(r["p50"]), ms(r["max"]),
                      ratio(r["p50"], theirs["p50"]) if mine else "",
                      ratio(r["max"], theirs["max"]) if mine else "")
    t.caption = ("Deferral = the task's first trigger row's created_date; fire = deferral + W; "
                 "resume = when the task first left 'deferred' (database clock); p50/max of "
                 "resume - fire over the group's tasks. triggerflow: writer --airflow and "
                 "consume --airflow with shipped defaults (airflow_resume_delay and its "
                 "witness). State mismatch rows: Airflow's log table, the scheduler race.")
    return t


class _Stack:
    """The stack, its bench connection, and which side serves it now."""

    def __init__(self, stack: AirflowStack, amqp_url: str, log: Callable[[str], Any]) -> None:
        import psycopg2  # type: ignore[import-untyped]

        self.stack, self.amqp_url, self.log = stack, amqp_url, log
        self.conn = psycopg2.connect(stack.database_url)
        self.conn.autocommit = True
        self.side: str | None = None

    def q(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        with self.conn.cursor() as cur:
            cur.execute(sql, args)
            return list(cur.fetchall()) if cur.description else []

    def serve(self, side: str) -> None:
        if self.side == side:
            return
        for name in ("triggerer", "tf-writer", "tf-consume"):
            self.stack.stop_process(name)
        job = self.q("SELECT coalesce(max(id), 0) FROM job")[0][0]
        t0 = time.monotonic()
        if side == AIRFLOW:
            self.stack.start_triggerer([QUEUE])
        else:
            consumer = self.q("SELECT coalesce(max(id), 0) FROM triggerflow.consumer")[0][0] \
                if self.q("SELECT to_regclass('triggerflow.consumer')")[0][0] else 0
            serve_with_triggerflow(self.stack, self.amqp_url, queue=QUEUE, scheduler=True)
            # The health endpoint may still count the stopped triggerer's heartbeat: wait for
            # this side's own consumer to subscribe.
            self._wait("SELECT count(*) FROM triggerflow.consumer WHERE kind = 'consumer' "
                       "AND id > %s AND subscribed AND expires_at > now()", consumer)
        self._wait("SELECT count(*) FROM job WHERE job_type = 'TriggererJob' AND id > %s "
                   "AND latest_heartbeat > now() - interval '10 seconds'", job)
        self.side = side
        self.log(f"airflow-waits: {side} serving after {time.monotonic() - t0:.1f}s")

    def _wait(self, sql: str, *args: Any, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.q(sql, *args)[0][0]:
            self.stack.check_alive()
            if time.monotonic() > deadline:
                raise AirflowStackError(f"not ready in {timeout:.0f}s: {sql}\n"
                                        + self.stack.tail_logs())
            time.sleep(0.5)

    def run_group(self, wait: int, limit: float) -> dict[str, Any]:
        dag_id = f"tf_race_wait_{wait}"
        run_id = self.stack.trigger_dag(dag_id)
        t0 = time.monotonic()
        state = ""
        while state not in ("success", "failed") and time.monotonic() - t0 < limit:
            self.stack.check_alive()
            time.sleep(1.0)
            state = self.q("SELECT state FROM dag_run WHERE dag_id = %s AND run_id = %s",
                           dag_id, run_id)[0][0]
        rows = self.q(PER_TASK, dag_id, run_id)
        mismatches = self.q("SELECT count(*) FROM log WHERE event = 'state mismatch' "
                            "AND dag_id = %s AND run_id = %s", dag_id, run_id)[0][0]
        return {**group_stats(wait, rows, mismatches), "run_state": state or "running",
                "run_s": time.monotonic() - t0}

    def close(self) -> None:
        self.conn.close()


def measure_waits(server_url: str, amqp_url: str, sizes: WaitSizes,
                  log: Callable[[str], Any] = print) -> list[dict[str, Any]]:
    """Every group under both sides on one stack; one dict per group (``wait``, ``tasks``
    and each side's ``group_stats`` under its name)."""
    dags = Path(tempfile.mkdtemp(prefix="tf-bench-waits-dags-"))
    (dags / DAG_FILE.name).symlink_to(DAG_FILE)
    spec = ",".join(f"{w}:{n}" for w, n in sizes.groups)
    # 8 workers, as the race test: 16 task starts at once time out on the one API server
    # worker of a small machine, which fails tasks for another reason than the race.
    stack = AirflowStack(server_url, dags, extra_env={"TF_RACE_GROUPS": spec,
                                                      "AIRFLOW__CORE__PARALLELISM": "8"})
    served: _Stack | None = None
    out: list[dict[str, Any]] = []
    try:
        log(f"airflow-waits: migrated in {stack.migrate():.1f}s")
        served = _Stack(stack, amqp_url, log)
        served.q(AUDIT)
        stack.start()
        stack.wait_for_dags([f"tf_race_wait_{w}" for w, _ in sizes.groups], timeout=300)
        for i, (wait, tasks) in enumerate(sizes.groups):
            group: dict[str, Any] = {"wait": wait, "tasks": tasks}
            for side in (AIRFLOW, TRIGGERFLOW) if i % 2 == 0 else (TRIGGERFLOW, AIRFLOW):
                served.serve(side)
                r = group[side] = served.run_group(wait, sizes.limit)
                log(f"airflow-waits: W={wait}s {side}: {r['succeeded']}/{tasks} success "
                    f"(run {r['run_state']} in {r['run_s']:.0f}s), resume - fire p50 "
                    f"{ms(r['p50'])} max {ms(r['max'])}, {r['mismatches']} mismatch rows")
            out.append(group)
    finally:
        if served is not None:
            served.close()
        stack.stop()
        shutil.rmtree(dags, ignore_errors=True)
    return out


def run_airflow_waits(settings: Settings, quick: bool) -> int:
    """``triggerflow bench airflow-waits [--quick]`` on the settings' PostgreSQL server (a
    database of its own) and broker: prints the table, saves the raw results under
    bench-results/; a full run replaces the record (bench/results.json)."""
    from urllib.parse import urlsplit, urlunsplit

    from rich.console import Console

    console = Console(log_path=False, width=None if sys.stdout.isatty() else 150)
    server_url = urlunsplit(urlsplit(settings.database_dsn())._replace(path="", query=""))
    sizes = QUICK if quick else FULL
    groups = measure_waits(server_url, settings.amqp_dsn(), sizes, console.log)
    table = table_waits(groups)
    console.print(table)
    if not quick:
        from bench.results import record

        record("airflow-waits", [table])
    out = Path("bench-results")
    out.mkdir(exist_ok=True)
    path = out / f"bench-airflow-waits-{datetime.now():%Y%m%d-%H%M%S}{'-quick' if quick else ''}.json"
    path.write_text(json.dumps({"command": "triggerflow bench airflow-waits"
                                + (" --quick" if quick else ""), "groups": groups,
                                "sizes": sizes.__dict__}, indent=1, default=str))
    console.print(f"raw results: {path}")
    # Tasks Airflow's own triggerer loses to the race are a result; triggerflow's would be a bug.
    return 0 if all(g[TRIGGERFLOW]["succeeded"] == g["tasks"] for g in groups) else 1
