"""`triggerflow bench chaos`: a short seeded run loses, doubles and misapplies nothing while
the faults really happen, and its checker finds what a doctored history hides.

The run starts a PostgreSQL cluster of its own (the nemesis restarts it) and uses the
suite's broker with a namespace of its own. Seed 3670 draws, within 45 s, eight fault kinds,
among them consumers with their clocks 146 s and 148 s ahead (and one 79 s behind), a
PostgreSQL restart and every kind of bad input (``bench/chaos_plan.py``; the schedule comes from the seed alone)."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from bench.chaos_check import check
from bench.chaos_plan import BAD_MESSAGES, BAD_TRIGGERS, make_plan
from tests.conftest import ROOT

SEED = 3670
SECONDS = 45
LAST = re.compile(r"^chaos seed=(\d+) faults=(\d+) deferred=(\d+) applied=(\d+) lost=(\d+) "
                  r"twice=(\d+) stale=(\d+) late_max=(\d+)ms$")


def run_chaos(cwd: Path, pg_server: str, amqp_server: str, args: list[str],
              timeout: float) -> str:
    """``triggerflow bench chaos ARGS`` in a subprocess from ``cwd``; its standard output,
    once it exited 0. The suite's services only fill the settings the run replaces with its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRIGGERFLOW_")}
    env.update({
        "TRIGGERFLOW_DATABASE_URL": f"{pg_server}/unused",
        "TRIGGERFLOW_AMQP_URL": amqp_server,
        "TRIGGERFLOW_NAMESPACE": f"tfc{uuid.uuid4().hex[:8]}",
        "PYTHONPATH": str(ROOT),
        "COLUMNS": "160",
    })
    proc = subprocess.run([sys.executable, "-m", "triggerflow", "bench", "chaos", *args],
                          env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return proc.stdout


@pytest.fixture(scope="module")
def chaos_run(tmp_path_factory: pytest.TempPathFactory, pg_server: str,
              amqp_server: str) -> tuple[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("chaos")
    out = run_chaos(tmp, pg_server, amqp_server, ["--seed", str(SEED), "--minutes",
                                                  str(SECONDS / 60)], timeout=300)
    [path] = (tmp / "bench-results").glob(f"chaos-{SEED}-*.json")
    return out, json.loads(path.read_text())


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
    assert history["schedule"] == make_plan(SEED, SECONDS).digest()
    # nothing left but the quarantined loop blocker (kept for `unquarantine`)
    assert history["drained"] and all(t["quarantined"] for t in history["final"]["triggers"])
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


@pytest.mark.slow
def test_skewed_clocks_and_bad_input_happened_and_hurt_nobody_else(
        chaos_run: tuple[str, dict[str, Any]]) -> None:
    out, history = chaos_run
    real = [f for f in history["faults"] if f["happened"]]
    # a consumer ran with its clock minutes ahead, measured by its own renewals, and stayed
    # up refusing work: nothing was applied before its moment
    skews = [f["witness"] for f in real if f["kind"] == "consumer_skew"]
    assert any(w["skew"] > 0 for w in skews), history["faults"]
    for w in skews:
        assert abs(w["clock_skew"] - w["skew"]) < 2 and w["alive_while_skewed"], w
    report = check(history)
    assert report.early == 0 and report.ok
    # every kind of bad input was sent, and each refused, dead-lettered or quarantined as
    # docs/security.md says (an unexplained dead letter would be a message left behind)
    assert set(report.bad_by_variant) == {*BAD_MESSAGES, *BAD_TRIGGERS}, report.bad_by_variant
    assert report.bad_sent == report.bad_refused >= len(BAD_MESSAGES) + len(BAD_TRIGGERS)
    assert f"bad input: {report.bad_sent} sent, {report.bad_sent} refused" in out
    dead = history["final"]["dead_letters"]
    for reason in ("undecodable wake-up", "oversized wake-up", "undecodable event batch",
                   "forged: routing key"):
        assert any(reason in x["reason"] for x in dead), (reason, dead)
    # the loop blocker was quarantined: its row stays for `unquarantine`, its task failed
    blocked = {i["trigger_id"] for f in real if f["kind"] == "bad_trigger"
               for i in f["inputs"] if i["variant"] == "block"}
    assert any(t["id"] in blocked and t["quarantined"] for t in history["final"]["triggers"])
    # bad input was recorded apart: the counts on the last line are innocent work only
    tokens = {i["token"] for f in history["faults"] if f["kind"].startswith("bad_")
              for i in f.get("inputs", [])}
    assert not tokens & {d["d"] for d in history["deferrals"]}


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

    # A quarantined row stays for `unquarantine` when its task failed as documented (the
    # nemesis killed its consumers often enough); not when its task did anything else.
    kept = copy.deepcopy(history)
    [tid] = [x["trigger_id"] for x in kept["deferrals"] if x["d"] == first["old_d"]]
    row = next(r for r in kept["audit"] if r["seq"] == first["seq"])
    row.update(new_state="scheduled", next_method="__fail__")
    kept["final"]["triggers"] = [{"id": tid, "queue": "q", "owner_id": None, "attempt": 1,
                                  "quarantined": True}]
    assert check(kept).ok, check(kept).problems
    [second_tid] = [x["trigger_id"] for x in kept["deferrals"] if x["d"] == second["old_d"]]
    kept["final"]["triggers"][0]["id"] = second_tid  # its task resumed: the row is left over
    assert not check(kept).ok

    early = copy.deepcopy(history)  # a timer fired on a clock that ran ahead
    row = next(r for r in early["audit"] if r["seq"] == first["seq"])
    row["applied"] -= 30
    report = check(early)
    assert (report.early, report.ok) == (1, False)
    assert any(first["old_d"] in p and "early" in p for p in report.problems)


@pytest.mark.slow
def test_the_checker_reports_bad_input_that_was_not_refused(
        chaos_run: tuple[str, dict[str, Any]]) -> None:
    _, history = chaos_run

    def doctored(change: Any) -> Any:
        h = copy.deepcopy(history)
        change(h)
        return check(h)

    def drop_forged_letter(h: dict[str, Any]) -> None:  # as if the writer had applied it
        letters = h["final"]["dead_letters"]
        body = next(x["body"] for x in letters if "forged" in x["reason"])
        kept = [x for x in letters if x["body"] != body]
        h["final"]["dead_letters"] = kept
        gone = len(letters) - len(kept)
        h["final"]["messages"] = {k: v - gone * k.endswith(".dead")
                                  for k, v in h["final"]["messages"].items()}

    def blocker_not_quarantined(h: dict[str, Any]) -> None:
        blocked = {i["token"] for f in h["faults"] if f["kind"] == "bad_trigger"
                   for i in f["inputs"] if i["variant"] == "block"}
        for r in h["audit"]:
            if r.get("old_d") in blocked and r.get("error"):
                r["error"] = "Trigger failure"

    def stray_letter(h: dict[str, Any]) -> None:  # a dead letter no bad input explains
        h["final"]["dead_letters"].append({"reason": "undecodable wake-up", "body": "x"})
        h["final"]["messages"] = {k: v + k.endswith(".dead") for k, v in h["final"]["messages"].items()}

    for change, says in ((drop_forged_letter, "event_forged"),
                         (blocker_not_quarantined, "Trigger quarantined")):
        report = doctored(change)
        assert report.bad_refused < report.bad_sent and not report.ok
        assert any(says in p for p in report.problems), report.problems
    report = doctored(stray_letter)
    assert report.left_messages == 1 and not report.ok


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


def test_airflow_mode_audit_maps_to_the_checkers_history() -> None:
    """Without services: Airflow mode's audit rows (``bench/chaos_airflow_audit.py``) as the
    checker reads them. A timer resumed with Airflow's serde of its moment; a re-deferral
    (cleared, then deferred on its next try, in one transaction) superseding the older one,
    whose task then ends by a task-end event with its XCom; a task marked failed (a cancel)
    whose trigger triggerflow lets go of later (no apply); a second event applied to a
    resumed task (twice)."""
    from bench.chaos_airflow_audit import native_audit

    def ti(seq: int, tx: int, task: str, old: tuple[str | None, str | None],
           new: tuple[str | None, str | None], **kw: Any) -> dict[str, Any]:
        return {"seq": seq, "op": "U", "tx": tx, "origin": None, "task": task, "queue": "q",
                "at": 100.0 + seq, "old_state": old[0], "old_d": old[1], "new_state": new[0],
                "new_d": new[1], "old_trigger": None, "new_trigger": None,
                "next_method": "execute_complete", "event": None, "try_number": 1,
                "applied": None, "old_applied": None, "xkey": None, "xvalue": None, **kw}

    moment = {"__classname__": "pendulum.datetime.DateTime", "__version__": 2,
              "__data__": {"timestamp": 105.0, "tz": "UTC"}}
    tf = {"origin": "triggerflow"}
    rows = [
        ti(1, 1, "wait_a:0", (None, None), ("deferred", "d0")),
        ti(2, 2, "wait_a:1", (None, None), ("deferred", "d1")),
        ti(3, 3, "wait_b:0", (None, None), ("deferred", "d3")),
        ti(4, 4, "wait_a:0", ("deferred", "d0"), ("scheduled", "d0"), event=moment,
           applied=105.5, **tf),
        ti(5, 5, "wait_a:1", ("deferred", "d1"), (None, None)),  # cleared ...
        ti(6, 5, "wait_a:1", (None, None), ("deferred", "d2"), try_number=2),  # ... next try
        ti(7, 6, "wait_b:0", ("deferred", "d3"), ("failed", "d3")),  # marked failed
        ti(8, 7, "wait_b:0", ("failed", "d3"), ("failed", "d3"), applied=107.0,
           old_applied=107.0, **tf),  # its trigger let go of: dates kept, no apply
        {**ti(9, 8, "wait_a:1", (None, None), (None, None)), "op": "X", "xkey": "d",
         "xvalue": "d2"},
        ti(10, 8, "wait_a:1", ("deferred", "d2"), ("success", "d2"), applied=110.2,
           try_number=2, **tf),
        ti(11, 9, "wait_a:0", ("scheduled", "d0"), ("scheduled", "d0"), event=moment,
           applied=111.0, old_applied=105.5, **tf),
    ]
    audit = native_audit(rows)
    assert [r["seq"] for r in audit] == [1, 2, 3, 4, 5, 7, 8, 10, 11]  # 5 and 6 merged
    assert audit[4]["old_state"] == "deferred" and audit[4]["new_d"] == "d2"
    assert audit[3]["event"] == "1970-01-01T00:01:45+00:00"
    assert audit[7]["result"] == {"d": "d2"}

    def dfr(d: str, kind: str, due: float) -> dict[str, Any]:
        return {"d": d, "task": d, "queue": "q", "kind": kind, "due": due, "ok": True}

    history = {
        "seed": 1, "faults": [], "final": {"triggers": [], "messages": {}},
        "cancels": [{"d": "d3", "ok": True, "moved": True}],
        "deferrals": [dfr("d0", "timer", 105.0), dfr("d1", "timer", 120.0),
                      dfr("d2", "end", 110.0), dfr("d3", "coroutine", 130.0)],
        "audit": audit,
    }
    report = check(history)
    assert (report.applied, report.superseded, report.cancelled) == (2, 1, 1)
    assert (report.lost, report.twice, report.stale) == (0, 1, 0)
    assert any(p.startswith("d0 ") and "twice" in p for p in report.problems)


def test_the_schedule_is_the_seeds() -> None:
    assert make_plan(SEED, SECONDS) == make_plan(SEED, SECONDS)
    assert make_plan(SEED, SECONDS).digest() != make_plan(SEED + 1, SECONDS).digest()


@pytest.mark.parametrize(("args", "says"), [
    (["chaos", "burst"], "bench chaos runs alone"),
])
def test_what_chaos_refuses_is_refused_in_one_line(args: list[str], says: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRIGGERFLOW_")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-m", "triggerflow", "bench", *args], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert says in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
