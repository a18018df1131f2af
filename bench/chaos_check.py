"""The checker of ``triggerflow bench chaos``: reads a recorded history (every operation,
every fault, every change of a task row, the final database and broker) and judges each
deferral against the rules the docs promise.

Rules, per deferral that reached the database:

- it ends exactly once: by an event of its own trigger (a resume or a task-end), by a
  cancel, by a newer deferral of the same task (a re-deferral supersedes it), or by a
  documented failure (``__fail__``: a timeout, a quarantine, an unloadable class);
- no ending at all after the drain is ``lost``; a second ending, or an event applied to a
  task that was no longer deferred on it, is ``twice``;
- an applied event must be this deferral's own: the timer's moment or the coroutine
  trigger's token, on the deferral's queue; anything else (an older deferral's event, a
  stale attempt's) is ``stale``;
- applied at most ``BASE_LATE`` seconds after it was due, or, when a fault overlapped its
  wait, at most ``BOUND[kind]`` seconds after that fault ended (``late_over`` otherwise);
- nothing applied before the moment it was due (``early``: a clock trusted while off);
- after the drain no trigger row and no message is left behind.

Bad input (``chaos_bad.py``) is recorded apart, so the counts above are about innocent work;
each piece must end as docs/security.md says (dead-lettered with its reason, refused by the
broker, ignored, or its task failed with its reason, a loop blocker quarantined), and its
dead letters and the quarantined blockers' rows are not "left behind".

``python -m bench.chaos_check HISTORY.json`` checks a saved history again (the bench writes
one per run under ``bench-results/``).
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

BASE_LATE = 5.0  # seconds past due with no fault in the way (a loaded 2-core machine)
# Seconds after a fault of each kind ended within which every affected task is applied,
# with the shipped defaults (lease_ttl 3 s, renew_interval 1 s, unclaimed_grace 15 s,
# reaper_interval 10 s). A fault's end: the replacement started (kill, term), SIGCONT
# (stop), the server accepting connections again (pg_restart).
BOUND: dict[str, float] = {
    "consumer_kill": 10.0,  # a peer takes over on the presence queue's deletion or the lease
    "consumer_term": 5.0,  # handed over on the way out
    "consumer_stop": 10.0,  # taken over after the lease, or resumed after SIGCONT
    "writer_kill": 10.0,  # its unacked events go back to the queue for the other writer
    "writer_term": 10.0,
    "writer_stop": 10.0,  # its unacked events wait for SIGCONT
    "pg_restart": 30.0,  # reconnect; a wake-up lost meanwhile is re-sent after the grace
    "pg_terminate": 30.0,  # a claim whose reply was cut off is re-sent after the grace
    "replay": 5.0,  # duplicates change nothing
    "consumer_skew": 10.0,  # the skewed one runs nothing and hands its triggers to peers
    "bad_message": 5.0,  # refused unread, or matches no row it may change
    # after the last of its bad triggers ended: a loop blocker stalls its consumer 1.6 s per
    # run (three runs to quarantine), whichever consumer takes it over in turn
    "bad_trigger": 15.0,
    # --topology cluster; the end: the old primary back as a synchronous standby, the node
    # back among the cluster's running nodes. A claim or an event cut off by the lost server
    # is re-sent after the grace (processes reach the new primary through the multi-host
    # URL, another broker node through the forwarder).
    "pg_promote": 30.0,
    "rabbit_node_stop": 30.0,
}
EARLY = 0.1  # seconds: an event applied this much before its moment fired early


@dataclass
class Outcome:
    d: str
    endings: list[str] = field(default_factory=list)  # applied / cancelled / superseded / failed
    late: float | None = None
    deadline: float | None = None
    problems: list[str] = field(default_factory=list)


@dataclass
class Report:
    seed: int
    faults: int
    faults_by_kind: dict[str, int]
    deferred: int
    applied: int
    cancelled: int
    superseded: int
    failed: int
    lost: int
    twice: int
    stale: int
    late_max: float
    late_over: int
    left_triggers: int
    left_messages: int
    problems: list[str]
    exits: int = 0  # processes that exited with no fault of the nemesis (restarted)
    early: int = 0  # applied before the moment it was due (a clock trusted when off)
    bad_sent: int = 0  # bad inputs that reached the broker or the database
    bad_refused: int = 0  # ... and were refused, dead-lettered or quarantined as documented
    bad_by_variant: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not (self.lost or self.twice or self.stale or self.left_triggers
                    or self.left_messages or self.early or self.bad_sent != self.bad_refused)

    def lines(self) -> list[str]:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(self.faults_by_kind.items())) or "none"
        out = [f"faults by kind: {kinds}; {self.exits} processes exited by themselves",
               f"outcomes: {self.applied} applied, {self.cancelled} cancelled, "
               f"{self.superseded} superseded by a re-deferral, {self.failed} failed "
               f"(documented), {self.lost} lost",
               f"left after the drain: {self.left_triggers} trigger rows, "
               f"{self.left_messages} messages; {self.late_over} applied later than their "
               f"bound (base {BASE_LATE:g} s), {self.early} earlier than due"]
        if self.bad_sent:
            variants = ", ".join(f"{k} {n}" for k, n in sorted(self.bad_by_variant.items()))
            out.insert(1, f"bad input: {self.bad_sent} sent, {self.bad_refused} refused, "
                          f"dead-lettered or quarantined as documented ({variants})")
        out += [f"  {p}" for p in self.problems[:30]]
        if len(self.problems) > 30:
            out.append(f"  ... and {len(self.problems) - 30} more")
        out.append(f"chaos seed={self.seed} faults={self.faults} deferred={self.deferred} "
                   f"applied={self.applied} lost={self.lost} twice={self.twice} "
                   f"stale={self.stale} late_max={self.late_max * 1000:.0f}ms")
        return out


def _moment(value: Any) -> float | None:
    try:
        return datetime.fromisoformat(str(value)).timestamp()
    except ValueError:
        return None


def _own_event(dfr: dict[str, Any], row: dict[str, Any]) -> bool:
    """Is the event applied in ``row`` the one ``dfr``'s trigger fires?"""
    if dfr["kind"] == "timer":
        moment = _moment(row.get("event"))
        return moment is not None and abs(moment - dfr["due"]) < 1e-3
    if dfr["kind"] == "end":
        return row.get("new_state") == "success" and row.get("result") == {"d": dfr["d"]}
    return row.get("event") == {"d": dfr["d"]}


def _is_apply(row: dict[str, Any]) -> bool:
    return row["op"] == "U" and row.get("applied") is not None \
        and row.get("applied") != row.get("old_applied")


def _deadline(dfr: dict[str, Any], applied: float, faults: list[dict[str, Any]]) -> float:
    """When ``dfr`` had to be applied by: ``BASE_LATE`` after it was due, or later when a
    fault overlapped its wait (started before the apply, recovery window past the due)."""
    deadline: float = dfr["due"] + BASE_LATE
    for f in faults:
        if not f.get("happened"):
            continue
        recovered = f["end"] + BOUND.get(f["kind"], BASE_LATE)
        if f["at"] <= applied and recovered >= dfr["due"]:
            deadline = max(deadline, recovered)
    return deadline


def _outcomes(deferrals: dict[str, dict[str, Any]],
              audit: list[dict[str, Any]]) -> dict[str, Outcome]:
    """The deferrals that reached the database (a failed call may still have committed)."""
    in_db = {r["new_d"] for r in audit if r.get("new_d")}
    outcomes: dict[str, Outcome] = {}
    for d, dfr in deferrals.items():
        if dfr["ok"] or d in in_db:
            outcomes[d] = Outcome(d)
            if d not in in_db:
                outcomes[d].problems.append("the SDK returned its trigger id, but no task "
                                            "row ever carried it")
    return outcomes


def _ending(row: dict[str, Any], old: str) -> str | None:
    """What ``row`` (a change of a task row deferred on ``old``) did to that deferral."""
    applied = _is_apply(row)
    ends = row["old_state"] == "deferred" and (
        row["new_state"] != "deferred" or row.get("new_d") != old)
    if not ends:
        return "applied to a task no longer deferred on it" if applied else None
    if row["new_state"] == "deferred":
        return "superseded"
    if row["new_state"] == "scheduled" and row.get("next_method") == "__fail__":
        return "failed"
    return "applied" if applied else "cancelled"


def _endings(outcomes: dict[str, Outcome], deferrals: dict[str, dict[str, Any]],
             audit: list[dict[str, Any]], faults: list[dict[str, Any]]) -> int:
    """Each change of a task row as an ending of the deferral it carried; returns stale."""
    stale = 0
    for row in audit:
        old = row.get("old_d")
        if row["op"] != "U" or old is None or old not in outcomes:
            continue
        o, dfr = outcomes[old], deferrals[old]
        ending = _ending(row, old)
        if ending is None:
            continue
        if ending.startswith("applied to"):
            o.problems.append(f"an event {ending} (seq {row['seq']}, {row['old_state']})")
            o.endings.append("applied")
            continue
        o.endings.append(ending)
        if ending != "applied":
            continue
        if not _own_event(dfr, row) or row.get("queue") != dfr["queue"]:
            stale += 1
            o.problems.append(f"stale: applied event {row.get('event')!r} / result "
                              f"{row.get('result')!r} on queue {row.get('queue')} is not "
                              "this deferral's")
        o.late = row["applied"] - dfr["due"]
        o.deadline = _deadline(dfr, row["applied"], faults)
        if o.late < -EARLY:
            o.problems.append(f"early: applied {-o.late:.2f}s before its moment")
    return stale


def _cancels_contradicted(outcomes: dict[str, Outcome], cancels: list[dict[str, Any]]) -> int:
    """A cancel that said it moved the task, for a deferral that ended otherwise."""
    n = 0
    for c in cancels:
        o = outcomes.get(c["d"])
        if o is not None and c.get("ok") and c.get("moved") and "cancelled" not in o.endings:
            o.problems.append("the cancel said it moved the task, yet it ended "
                              f"{'/'.join(o.endings) or 'never'}")
            n += 1
    return n


def _bad_inputs(faults: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**i, "kind": f["kind"]} for f in faults if f["kind"].startswith("bad_")
            for i in f.get("inputs", [])]


def _bad_endings(audit: list[dict[str, Any]], tokens: set[str]) -> dict[str, list[dict[str, Any]]]:
    """The changes of task rows that ended each bad deferral (by its token)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for row in audit:
        old = row.get("old_d")
        if row["op"] == "U" and old in tokens and _ending(row, old) is not None:
            out.setdefault(old, []).append(row)
    return out


def _end_bad_faults(faults: list[dict[str, Any]], ended: dict[str, list[dict[str, Any]]]
                    ) -> list[dict[str, Any]]:
    """A ``bad_trigger`` fault lasts until the last of its triggers ended (a loop blocker
    stalls consumers until it is quarantined), not until its deferrals returned."""
    out = []
    for f in faults:
        if f["kind"] == "bad_trigger":
            ends = [r["at"] for i in f.get("inputs", [])
                    for r in ended.get(i["token"], [])]
            f = {**f, "end": max([f["end"], *ends])}
        out.append(f)
    return out


def _judge_bad(bad: list[dict[str, Any]], ended: dict[str, list[dict[str, Any]]],
               audit: list[dict[str, Any]], dead: list[dict[str, Any]],
               problems: list[str]) -> tuple[int, int, set[int]]:
    """Each bad input against what ``docs/security.md`` says becomes of it: (sent, refused
    as documented, indexes of the dead letters it explains)."""
    applied = {json.dumps(r.get("event"), sort_keys=True) for r in audit if _is_apply(r)}
    explained: set[int] = set()
    sent = refused = 0
    for i in bad:
        tok, expect = i["token"], i["expect"]
        rows = ended.get(tok, [])
        if not (i["sent"] or "refused" in i or rows):
            continue  # never left the bench (an SDK call failed under another fault)
        sent += 1
        letters = [n for n, x in enumerate(dead) if tok in x["body"]]
        explained.update(letters)
        if i["kind"] == "bad_trigger":
            got = [f"{r['new_state']}/{r.get('next_method')}/{r.get('error')}" for r in rows]
            good = len(rows) == 1 and rows[0]["next_method"] == "__fail__" \
                and rows[0].get("error") == expect
        elif json.dumps({"d": tok}, sort_keys=True) in applied:
            got, good = ["its event was applied to a task"], False
        elif expect == "ignored":
            got, good = [dead[n]["reason"] for n in letters], not letters
        elif expect == "broker":
            got = [i.get("refused", "published")] + [dead[n]["reason"] for n in letters]
            good = "max size" in i.get("refused", "") or any(
                "bytes, over the" in dead[n]["reason"] for n in letters)
        else:
            # at least once: a writer killed between its dead letter and its ack gets the
            # message again and files it again, with the same reason
            got = [dead[n]["reason"] for n in letters]
            good = bool(letters) and all(expect in dead[n]["reason"] for n in letters)
        if good:
            refused += 1
        else:
            problems.append(f"bad input {tok} ({i['variant']}, {i['queue']}): expected "
                            f"{expect!r}, got {got or 'nothing'}")
    return sent, refused, explained


def check(history: dict[str, Any]) -> Report:
    deferrals: dict[str, dict[str, Any]] = {x["d"]: x for x in history["deferrals"]}
    audit = sorted(history["audit"], key=lambda r: r["seq"])
    bad = _bad_inputs(history["faults"])
    ended = _bad_endings(audit, {i["token"] for i in bad})
    faults = _end_bad_faults(history["faults"], ended)
    outcomes = _outcomes(deferrals, audit)
    stale = _endings(outcomes, deferrals, audit, faults)
    twice = _cancels_contradicted(outcomes, history.get("cancels", []))
    counts: Counter[str] = Counter()
    lost = late_over = 0
    late_max = 0.0
    problems: list[str] = []
    early = 0
    for d, o in outcomes.items():
        early += any(p.startswith("early") for p in o.problems)
        if not o.endings:
            lost += 1
            o.problems.append("lost: never applied, cancelled, superseded or failed")
        elif len(o.endings) > 1:
            twice += 1
            o.problems.append(f"twice: ended {len(o.endings)} times ({', '.join(o.endings)})")
        if o.endings:
            counts[o.endings[0]] += 1
        if o.late is not None and o.deadline is not None:
            late_max = max(late_max, o.late)
            if o.late + deferrals[d]["due"] > o.deadline:
                late_over += 1
                o.problems.append(f"late: applied {o.late:.2f}s after due, past its bound "
                                  f"({o.deadline - deferrals[d]['due']:.1f}s)")
        problems += [f"{d} ({deferrals[d]['kind']}, {deferrals[d]['queue']}): {p}"
                     for p in o.problems]
    final = history.get("final", {})
    dead = final.get("dead_letters", [])
    bad_sent, bad_refused, explained = _judge_bad(bad, ended, audit, dead, problems)
    # a quarantined row stays for `unquarantine`: documented, not left over, for a loop
    # blocker and for a trigger whose task failed with it (the nemesis killed the consumers
    # running it often enough, or while it ran alone on probation: docs/failure-modes.md)
    quarantined = {i["trigger_id"] for i in bad if i["variant"] == "block"} | {
        deferrals[d].get("trigger_id") for d, o in outcomes.items() if o.endings == ["failed"]}
    left = [t for t in final.get("triggers", [])
            if not (t.get("quarantined") and t["id"] in quarantined)]
    left_triggers = len(left)
    left_messages = sum(final.get("messages", {}).values()) - len(explained)
    if left_triggers:
        problems.append(f"trigger rows left after the drain: {left[:10]}")
    if left_messages:
        problems.append(f"messages left after the drain: {final['messages']} "
                        f"({len(explained)} dead letters of bad input)")
    problems += [f"dead letter: {x}" for n, x in enumerate(dead) if n not in explained][:10]
    by_kind: Counter[str] = Counter(f["kind"] for f in faults if f.get("happened"))
    variants: Counter[str] = Counter(i["variant"] for i in bad if i["sent"] or "refused" in i)
    return Report(
        seed=history["seed"], faults=sum(by_kind.values()), faults_by_kind=dict(by_kind),
        deferred=len(outcomes), applied=counts["applied"], cancelled=counts["cancelled"],
        superseded=counts["superseded"], failed=counts["failed"], lost=lost, twice=twice,
        stale=stale, late_max=late_max, late_over=late_over, left_triggers=left_triggers,
        left_messages=left_messages, problems=problems, exits=len(history.get("exits", [])),
        early=early, bad_sent=bad_sent, bad_refused=bad_refused, bad_by_variant=dict(variants))


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m bench.chaos_check HISTORY.json", file=sys.stderr)
        return 2
    report = check(json.loads(Path(argv[0]).read_text()))
    print("\n".join(report.lines()))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
