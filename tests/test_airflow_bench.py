"""The Airflow bench's rows are Airflow's: the task instances and trigger rows that
``bench.airflow_seed`` writes in bulk equal, column for column, those a real
deferral writes when Airflow's scheduler runs the same DAG (worker, task runner, execution
API), for the same instant. Then ``bench airflow --quick`` resumes a small burst both ways."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from bench.airflow import QUEUE, QUICK, seed_rows
from bench.airflow_runtime import TRIGGERS
from bench.airflow_seed import DAG_ID, bench_dag
from testbed.airflow_stack import TEMPLATE_VARIABLE, AirflowStack
from tests.airflow_support import airflow_template

__all__ = ["airflow_template"]

# A real Airflow stack (scheduler, API server, DAG processor): `make test-airflow`'s stage.
pytestmark = pytest.mark.airflow_stack

N = 3
QUICK_N = QUICK.counts[0]
ROWS = """
SELECT ti.run_id, ti.map_index, ti.state, ti.try_number, ti.next_method, ti.next_kwargs::text,
       ti.trigger_timeout, t.classpath, t.kwargs, t.queue, t.team_name
FROM task_instance ti JOIN trigger t ON t.id = ti.trigger_id
WHERE ti.dag_id = %s ORDER BY ti.run_id, ti.map_index
"""


def test_seeded_rows_equal_a_real_airflow_deferral(
        tmp_path: Path, pg_server: str, airflow_template: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import psycopg2  # type: ignore[import-untyped]

    monkeypatch.setenv(TEMPLATE_VARIABLE, airflow_template)  # the session's migrated schema

    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "tf_bench_airflow.py").write_text(bench_dag(N, QUEUE))
    stack = AirflowStack(pg_server, dags)
    try:
        stack.migrate()
        stack.start()  # no triggerer: the deferred rows stay as written
        stack.wait_for_dags([DAG_ID])
        instant = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
        real_run = stack.trigger_dag(DAG_ID, {"instant": instant})
        conn = psycopg2.connect(stack.database_url)
        conn.autocommit = True
        with conn, conn.cursor() as cur:
            deadline = time.monotonic() + 150
            rows: list[tuple[object, ...]] = []
            while time.monotonic() < deadline and len(rows) < N:
                cur.execute(ROWS, (DAG_ID,))
                rows = cur.fetchall()
                time.sleep(0.5)
            assert len(rows) == N, f"the real run deferred {len(rows)} of {N}\n{stack.tail_logs()}"
            seeded = seed_rows(stack, N, 0.0, instant)
            cur.execute(ROWS, (DAG_ID,))
            by_run: dict[object, list[tuple[object, ...]]] = {}
            for row in cur.fetchall():
                by_run.setdefault(row[0], []).append(row[1:])
        conn.close()
        real, bench = by_run[real_run], by_run[seeded["run_id"]]
        assert len(bench) == N
        assert bench == real
        assert real[0][1] == "deferred" and real[0][8] == QUEUE  # state, trigger queue
    finally:
        stack.stop()
    assert stack.leftovers() == []


def run_bench(cwd: Path, pg_server: str, amqp_server: str, scenario: str, timeout: float,
              template: str) -> str:
    """``triggerflow bench SCENARIO --quick`` on the suite's services, from ``cwd`` (its
    bench-results/ go there), each stack's database copied from the session's migrated
    ``template``; its output, once it exited 0."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRIGGERFLOW_")}
    env.update({"TRIGGERFLOW_DATABASE_URL": f"{pg_server}/unused", "TRIGGERFLOW_AMQP_URL": amqp_server,
                "COLUMNS": "200", TEMPLATE_VARIABLE: template})
    proc = subprocess.run([sys.executable, "-m", "triggerflow", "bench", scenario, "--quick"],
                          env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


@pytest.mark.timeout(540)  # two Airflow stacks (migrate, API server) and a native bench
def test_bench_airflow_quick_serves_identical_rows_both_ways(
        tmp_path: Path, pg_server: str, amqp_server: str, airflow_template: str) -> None:
    """``triggerflow bench airflow --quick``: native mode's burst of 100, then 100 seeded rows
    served by Airflow's triggerer, then the same rows on a fresh stack by triggerflow (and
    what 100 waiting cost it), then the runtime's request latency under both; all applied,
    the tables printed."""
    out = run_bench(tmp_path, pg_server, amqp_server, "airflow", timeout=540,
                    template=airflow_template)
    assert "airflow triggerer" in out and "triggerflow" in out, out[-4000:]  # the table
    raw = json.loads(next((tmp_path / "bench-results").glob("bench-airflow-*-quick.json"))
                     .read_text())
    runs = raw["runs"]
    assert "Issue 9's targets" in out, out[-4000:]
    assert raw["native"][str(QUICK_N)]["applied"] == QUICK_N  # native burst, same run
    assert [(r["served_by"], r["applied"]) for r in runs] == [
        ("airflow triggerer", QUICK_N), ("triggerflow", QUICK_N)], runs
    ours = runs[1]
    assert ours["held_at_instant"] == QUICK_N, ours  # claimed through NOTIFY before the instant
    assert 0 <= ours["latency"]["p50"] <= ours["all_applied_s"] < QUICK.limit, ours
    waited = ours["waiting"]  # statements counted under each process's own role
    assert waited["n"] == QUICK_N and set(waited["statements_per_s"]) == {"tf-writer", "tf-consume"}
    assert all(rate > 0 for rate in waited["statements_per_s"].values()), waited  # renewals
    # The floor: the bare row change of the waiting rows, rolled back (they were then skipped).
    assert waited["floor"]["rows"] == QUICK_N and waited["floor"]["wall_s"] > 0, waited["floor"]
    assert ours["writer_us_per_event"] > 0, ours  # the writer's own database time
    assert raw["native"][str(QUICK_N)]["writer_us_per_event"] > 0, raw["native"]
    assert "bare row change" in out, out[-4000:]
    # The runtime table: every LatencyTrigger's requests timed under both servers.
    runtime = {(r["served_by"], r["request"]): r for r in raw["runtime"]}
    for server in ("airflow triggerer", "triggerflow"):
        reads = runtime[(server, "GetConnection (sync)")]
        assert reads["n"] == TRIGGERS * (QUICK.runtime_requests - 1), reads  # less each first
        assert 0 < reads["p50"] <= reads["p99"] <= reads["max"], reads
        assert runtime[(server, "GetVariable (sync_to_async)")]["n"] == TRIGGERS * QUICK.runtime_requests


@pytest.mark.timeout(420)  # an Airflow stack (migrate, API server), 5,000 rows claimed
def test_bench_airflow_million_quick_holds_every_cloned_row(
        tmp_path: Path, pg_server: str, amqp_server: str, airflow_template: str) -> None:
    """``triggerflow bench airflow-million --quick``: 500 rows made by Airflow's code, 4,500
    cloned from one of them in SQL, all held by one ``consume --airflow``; the table
    printed with the memory per waiting trigger."""
    from bench.airflow_million import QUICK as MILLION_QUICK

    out = run_bench(tmp_path, pg_server, amqp_server, "airflow-million", timeout=400,
                    template=airflow_template)
    assert "waiting Airflow DateTimeTriggers in one consume --airflow" in out, out[-4000:]
    raw = json.loads(next((tmp_path / "bench-results").glob("bench-airflow-million-*-quick.json"))
                     .read_text())
    result = raw["result"]
    assert result["n"] == MILLION_QUICK.n and result["template"] == MILLION_QUICK.template
    assert result["rss_held"] > result["rss_warm"] > 0 and result["bytes_per_waiting_trigger"] > 0
    assert set(result["statements_per_s"]) == {"tf-writer", "tf-consume"}, result
