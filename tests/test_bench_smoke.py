"""`triggerflow bench` runs end to end with tiny sizes (the benchmark itself is not a test).

Gives the bench a database and namespace of its own (it derives ``<db>_bench`` and
``<namespace>-bench`` from them) and drops the database afterwards.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

from tests.conftest import ROOT, admin_sql, drop_database_sql


def _drop(pg_server: str, database: str) -> None:
    asyncio.run(admin_sql(pg_server, drop_database_sql(database)))


def _run_quick(tmp_path: Path, pg_server: str, amqp_server: str,
               scenarios: list[str]) -> tuple[str, dict]:
    tag = uuid.uuid4().hex[:10]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRIGGERFLOW_")}
    env.update({
        "TRIGGERFLOW_DATABASE_URL": f"{pg_server}/tf_smoke_{tag}",
        "TRIGGERFLOW_AMQP_URL": amqp_server,
        "TRIGGERFLOW_NAMESPACE": f"tfs{tag}",
        "PYTHONPATH": str(ROOT),
        "COLUMNS": "160",
    })
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "triggerflow", "bench", *scenarios, "--quick"],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180,
        )
    finally:
        _drop(pg_server, f"tf_smoke_{tag}_bench")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    results = list((tmp_path / "bench-results").glob("bench-*-quick.json"))
    assert len(results) == 1
    return out, json.loads(results[0].read_text())


def test_bench_quick_prints_tables(tmp_path: Path, pg_server: str, amqp_server: str) -> None:
    out, data = _run_quick(tmp_path, pg_server, amqp_server, ["burst", "defer"])
    for title in ("Burst: N DateTimeTriggers", "Deferral through the SDK", "Summary"):
        assert title in out, out[-4000:]
    burst = data["burst"]["sizes"]["200"]
    assert burst["runs"][0]["applied"] == 200
    assert burst["reference_all_applied"] > 0 and burst["ratio"] > 0
    assert data["defer"]["single"]["n"] > 0


def test_bench_quick_reference_held_fire_periodic(tmp_path: Path, pg_server: str,
                                                  amqp_server: str) -> None:
    out, data = _run_quick(tmp_path, pg_server, amqp_server,
                           ["reference", "held", "fire", "periodic"])
    for title in ("Reference: the bare burst path", "also holding 500 waiting timers",
                  "Fire path alone: 200 timers due", "Periodic database work",
                  "Idle consumers, one queue each"):
        assert title in out, out[-4000:]
    assert data["reference"]["sizes"]["200"]["runs"][0]["applied"] == 200
    held = data["held"]["sizes"]["200"]
    assert held["runs"][0]["applied"] == 200 and held["runs"][0]["held"] == 500
    fire = data["fire"]
    assert (fire["due"], len(fire["runs"])) == (200, 5) and fire["all_fired"] > 0
    assert [r["held"] for r in data["periodic"]["held"]] == [200, 1_000]
    assert all(r["stmts_per_s"]["consumer"] > 0 for r in data["periodic"]["held"])
    assert data["periodic"]["idle"][0]["stmts_per_s_per_process"] > 0


def test_bench_quick_million(tmp_path: Path, pg_server: str, amqp_server: str) -> None:
    out, data = _run_quick(tmp_path, pg_server, amqp_server, ["million"])
    assert "Million: one consumer holding 20,000 waiting timers" in out, out[-4000:]
    m = data["million"]
    assert [lv["held"] for lv in m["levels"]] == [2_000, 20_000]
    assert m["claim_s"] > 0 and m["bytes_per_timer"] > 0
    assert m["steady"]["applied"] == 200 and m["reference"]["applied"] == 200
    fo = m["failover"]
    assert fo["complete"] and fo["peer_owned"] == fo["total"] == 20_000


def test_bench_quick_wide(tmp_path: Path, pg_server: str, amqp_server: str) -> None:
    out, data = _run_quick(tmp_path, pg_server, amqp_server, ["wide"])
    assert "Wide burst: N DateTimeTriggers at one instant over 2 consumers and 2 writers" in out, \
        out[-4000:]
    wide = data["wide"]["sizes"]["400"]
    assert wide["runs"][0]["applied"] == 400
    assert wide["reference_all_applied"] > 0 and wide["ratio"] > 0
    # the broker saw two consumers on the team queue and two writers on the events queue
    assert data["wide"]["broker_consumers"] == {"team": 2, "events": 2}
