"""`triggerflow bench chaos`: a short seeded run loses, doubles and misapplies nothing while
the faults really happen, and its checker finds what a doctored history hides.

The run starts a PostgreSQL cluster of its own (the nemesis restarts it) and uses the
suite's broker with a namespace of its own. Seed 286 draws every fault kind within 45 s
(``bench/chaos_plan.py``; the schedule comes from the seed alone)."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import uuid
from typing import Any

import pytest

from bench.chaos_check import check
from bench.chaos_plan import make_plan
from tests.conftest import ROOT

SEED = 286
LAST = re.compile(r"^chaos seed=(\d+) faults=(\d+) deferred=(\d+) applied=(\d+) lost=(\d+) "
                  r"twice=(\d+) stale=(\d+) late_max=(\d+)ms$")


@pytest.fixture(scope="module")
def chaos_run(tmp_path_factory: pytest.TempPathFactory, pg_server: str,
              amqp_server: str) -> tuple[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("chaos")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRIGGERFLOW_")}
    env.update({
        "TRIGGERFLOW_DATABASE_URL": f"{pg_server}/unused",  # the run starts its own cluster
        "TRIGGERFLOW_AMQP_URL": amqp_server,
        "TRIGGERFLOW_NAMESPACE": f"tfc{uuid.uuid4().hex[:8]}",
        "PYTHONPATH": str(ROOT),
        "COLUMNS": "160",
    })
    proc = subprocess.run(
        [sys.executable, "-m", "triggerflow", "bench", "chaos", "--seed", str(SEED),
         "--minutes", "0.75"], env=env, cwd=tmp, capture_output=True, text=True, timeout=270)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    [path] = (tmp / "bench-results").glob(f"chaos-{SEED}-*.json")
    return proc.stdout, json.loads(path.read_text())


@pytest.mark.slow
def test_a_short_seeded_run_loses_doubles_and_misapplies_nothing(
        chaos_run: tuple[str, dict[str, Any]]) -> None:
    out, history = chaos_run
    last = LAST.match(out.strip().splitlines()[-1])
    assert last, out[-3000:]
    seed, faults, deferred, applied, lost, twice, stale, _ = map(int, last.groups())
    assert (seed, lost, twice, stale) == (SEED, 0, 0, 0)
    assert deferred > 100 and applied > deferred / 2
    # the schedule is the seed's: the run followed the plan drawn from it
    assert history["schedule"] == make_plan(SEED, 45).digest()
    assert history["drained"] and history["final"]["triggers"] == []
    # the faults really happened, several kinds of them, each with its witness
    real = [f for f in history["faults"] if f["happened"]]
    kinds = {f["kind"] for f in real}
    assert faults == len(real) >= 6 and len(kinds) >= 4, history["faults"]
    for f in real:
        w = f["witness"]
        if f["kind"].endswith("_kill"):
            assert w["returncode"] == -9 and w["new_pid"] != w["pid"]
        if f["kind"] == "pg_restart":
            assert w["new_postmaster_pid"] != w["postmaster_pid"]
    killed = [f for f in real if f["kind"] in ("consumer_kill", "pg_restart")]
    assert killed, "no consumer SIGKILL or PostgreSQL restart in the run"
    # re-deferrals and cancels were part of it, and both kinds of trigger
    assert any(d["again"] for d in history["deferrals"])
    assert any(c["moved"] for c in history["cancels"])
    assert {d["kind"] for d in history["deferrals"]} == {"timer", "coroutine", "end"}


def _applies(history: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in history["audit"]
            if r["op"] == "U" and r["old_state"] == "deferred" and r["applied"] is not None
            and r["new_state"] == "scheduled" and r["next_method"] != "__fail__"]


@pytest.mark.slow
def test_the_checker_reports_a_lost_a_doubled_and_a_stale_task(
        chaos_run: tuple[str, dict[str, Any]]) -> None:
    _, history = chaos_run
    assert check(history).ok
    timers = {d["d"] for d in history["deferrals"] if d["kind"] == "timer"}
    applies = [r for r in _applies(history) if r["old_d"] in timers]
    first, second = applies[0], applies[1]

    lost = copy.deepcopy(history)  # the apply of one task never happened
    lost["audit"] = [r for r in lost["audit"] if r["seq"] != first["seq"]]
    report = check(lost)
    assert (report.lost, report.twice, report.stale, report.ok) == (1, 0, 0, False)
    assert any(first["old_d"] in p and "lost" in p for p in report.problems)

    stale = copy.deepcopy(history)  # one task resumed by another deferral's event
    row = next(r for r in stale["audit"] if r["seq"] == first["seq"])
    row["event"] = second["event"]
    report = check(stale)
    assert (report.lost, report.twice, report.stale) == (0, 0, 1)
    assert any(first["old_d"] in p and "stale" in p for p in report.problems)

    twice = copy.deepcopy(history)  # the same event applied again to the resumed task
    again = {**first, "seq": max(r["seq"] for r in history["audit"]) + 1,
             "old_state": "scheduled", "old_applied": first["applied"],
             "applied": first["applied"] + 0.5}
    twice["audit"].append(again)
    report = check(twice)
    assert (report.lost, report.twice, report.stale) == (0, 1, 0)

    left = copy.deepcopy(history)  # a trigger row left behind
    left["final"]["triggers"] = [{"id": 1, "queue": "q", "owner_id": None, "attempt": 0}]
    assert not check(left).ok


def test_the_checker_alone_on_a_hand_made_history() -> None:
    """Without services: a timer applied, one superseded by a re-deferral (whose old event
    must not apply), a coroutine trigger applied by a stale event, one never ended."""
    def dfr(d: str, task: str, kind: str, due: float) -> dict[str, Any]:
        return {"d": d, "task": task, "queue": "q", "kind": kind, "due": due, "ok": True}

    def row(seq: int, old_d: str, new_d: str | None, new_state: str,
            **kw: Any) -> dict[str, Any]:
        return {"seq": seq, "op": "U", "queue": "q", "old_state": "deferred", "old_d": old_d,
                "new_d": new_d, "new_state": new_state, "next_method": "resume",
                "event": None, "result": None, "applied": None, "old_applied": None, **kw}

    history = {
        "seed": 1, "faults": [], "cancels": [], "final": {"triggers": [], "messages": {}},
        "deferrals": [dfr("d0", "t0", "timer", 100.0), dfr("d1", "t1", "timer", 100.0),
                      dfr("d2", "t1", "timer", 110.0), dfr("d3", "t3", "coroutine", 100.0),
                      dfr("d4", "t4", "coroutine", 100.0)],
        "audit": [
            {"seq": 0, "op": "I", "new_d": d, "queue": "q", "new_state": "deferred"}
            for d in ("d0", "d1", "d3", "d4")] + [
            row(1, "d0", "d0", "scheduled", event="1970-01-01T00:01:40+00:00",
                applied=100.5),
            row(2, "d1", "d2", "deferred"),  # re-deferred: d1 superseded by d2
            row(3, "d2", "d2", "scheduled", event="1970-01-01T00:01:50+00:00", applied=111),
            row(4, "d3", "d3", "scheduled", event={"d": "d4"}, applied=101.0),
        ],
    }
    report = check(history)
    assert (report.deferred, report.applied, report.superseded) == (5, 3, 1)
    assert (report.lost, report.twice, report.stale) == (1, 0, 1)
    assert any(p.startswith("d4 ") and "lost" in p for p in report.problems)
    assert any(p.startswith("d3 ") and "stale" in p for p in report.problems)
    assert report.lines()[-1] == ("chaos seed=1 faults=0 deferred=5 applied=3 lost=1 twice=0 "
                                  "stale=1 late_max=1000ms")


def test_the_schedule_is_the_seeds() -> None:
    assert make_plan(SEED, 45) == make_plan(SEED, 45)
    assert make_plan(SEED, 45).digest() != make_plan(SEED + 1, 45).digest()


@pytest.mark.parametrize(("args", "says"), [
    (["chaos", "--mode", "airflow"], "only --mode native"),
    (["chaos", "burst"], "bench chaos runs alone"),
])
def test_what_chaos_refuses_is_refused_in_one_line(args: list[str], says: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRIGGERFLOW_")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-m", "triggerflow", "bench", *args], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert says in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
