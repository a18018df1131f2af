"""Airflow's own triggerer as the oracle (issue 18): how each task instance of some DAG runs
ended, read from Airflow's tables, in a form that two runs of the same DAGs compare equal
when they ended the same.

Every real-stack module runs its DAGs once under ``airflow triggerer`` and once under
triggerflow (no Airflow triggerer) and asserts ``conforms(oracle, candidate)``: per task
instance the final state, the try number, every XCom (key and value), the
``task_instance_history`` rows (try number and state) and whether the instance still points
at a trigger row. What differs between two honest runs is masked: run ids, timestamps, and
the values of XComs a module names (measured latencies). A try that one side's history skips
(a number below its own try number with no row: under load a worker can fail to start a try,
and Airflow fails that try while queued and records it nowhere) is not compared; every try
both sides recorded is. The trigger's own lifecycle
(started, cancelled, ``on_kill()``, ``cleanup()``) is compared by the modules whose triggers
leave markers (tests/test_airflow_cancel_e2e.py).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

TaskKey = tuple[str, str, int]  # dag_id, task_id, map_index

# ISO 8601 instants as Airflow and pendulum print them (a "T" or a space between date and time)
_INSTANT = re.compile(r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:?\d\d)?")
# Airflow's serde writes a datetime as {"__classname__": "datetime.datetime", "__data__": ...}
_INSTANT_CLASSES = {"datetime.datetime", "pendulum.datetime.DateTime"}

_INSTANCES = """
SELECT dag_id, task_id, map_index, run_id, state, try_number, trigger_id IS NOT NULL
FROM task_instance WHERE dag_id = ANY(%s) AND run_id = ANY(%s)
"""
_XCOMS = """
SELECT dag_id, task_id, map_index, run_id, key, value
FROM xcom WHERE dag_id = ANY(%s) AND run_id = ANY(%s)
"""
_HISTORY = """
SELECT dag_id, task_id, map_index, run_id, try_number, state
FROM task_instance_history WHERE dag_id = ANY(%s) AND run_id = ANY(%s)
ORDER BY try_number
"""


@dataclass(frozen=True)
class TaskEnd:
    """How one task instance ended, as Airflow's tables say."""

    state: str | None
    try_number: int
    xcoms: Mapping[str, Any]  # key -> value, masked
    history: tuple[tuple[int, str | None], ...]  # (try_number, state) of earlier tries
    on_trigger: bool  # the instance still points at a trigger row


def mask(value: Any, run_ids: Iterable[str]) -> Any:
    """``value`` with run ids and timestamps replaced by placeholders."""
    ids = sorted(run_ids, key=len, reverse=True)

    def walk(v: Any) -> Any:
        if isinstance(v, dict) and v.get("__classname__") in _INSTANT_CLASSES:
            return "<time>"
        if isinstance(v, dict):
            return {walk(k): walk(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [walk(x) for x in v]
        if isinstance(v, str):
            for run_id in ids:
                v = v.replace(run_id, "<run>")
            return _INSTANT.sub("<time>", v)
        return v

    return walk(value)


def ends(database_url: str, runs: Mapping[str, str], *,
         unstable_xcoms: Iterable[str] = ()) -> dict[TaskKey, TaskEnd]:
    """Every task instance of ``runs`` (dag_id -> run_id): how it ended. The values of the
    XComs of the tasks named in ``unstable_xcoms`` (measurements) are compared by key only."""
    import psycopg2  # type: ignore[import-untyped]

    dags, run_ids = list(runs), list(runs.values())
    unstable = set(unstable_xcoms)
    ours = {(dag, run) for dag, run in runs.items()}
    xcoms: dict[TaskKey, dict[str, Any]] = {}
    history: dict[TaskKey, list[tuple[int, str | None]]] = {}
    found: dict[TaskKey, TaskEnd] = {}
    with contextlib.closing(psycopg2.connect(database_url)) as conn, conn.cursor() as cur:
        cur.execute(_XCOMS, (dags, run_ids))
        for dag, task, index, run, key, value in cur.fetchall():
            if (dag, run) in ours:
                shown = "<measured>" if task in unstable else mask(value, run_ids)
                xcoms.setdefault((dag, task, index), {})[key] = shown
        cur.execute(_HISTORY, (dags, run_ids))
        for dag, task, index, run, try_number, state in cur.fetchall():
            if (dag, run) in ours:
                history.setdefault((dag, task, index), []).append((try_number, state))
        cur.execute(_INSTANCES, (dags, run_ids))
        for dag, task, index, run, state, try_number, on_trigger in cur.fetchall():
            if (dag, run) in ours:
                key = (dag, task, index)
                found[key] = TaskEnd(state, try_number, xcoms.get(key, {}),
                                     tuple(history.get(key, ())), on_trigger)
    return found


def differences(oracle: Mapping[TaskKey, TaskEnd],
                candidate: Mapping[TaskKey, TaskEnd]) -> list[str]:
    """One line per way ``candidate`` ended differently from ``oracle``."""
    lines = [f"{key}: only under Airflow's triggerer ({oracle[key]})"
             for key in sorted(set(oracle) - set(candidate))]
    lines += [f"{key}: only under triggerflow ({candidate[key]})"
              for key in sorted(set(candidate) - set(oracle))]
    for key in sorted(set(oracle) & set(candidate)):
        want, got = oracle[key], candidate[key]
        for column in ("state", "try_number", "xcoms", "history", "on_trigger"):
            if column == "history" and not _histories_differ(want, got):
                continue
            if getattr(want, column) != getattr(got, column):
                lines.append(f"{key} {column}: Airflow's triggerer {getattr(want, column)!r}, "
                             f"triggerflow {getattr(got, column)!r}")
    return lines


def _histories_differ(want: TaskEnd, got: TaskEnd) -> bool:
    """The recorded tries differ, leaving out a try one side skipped (see the docstring)."""
    theirs, ours = dict(want.history), dict(got.history)
    if len(theirs) != len(want.history) or len(ours) != len(got.history):
        return want.history != got.history  # a try recorded twice: compare as they are
    for number in theirs.keys() | ours.keys():
        if number in theirs and number in ours:
            if theirs[number] != ours[number]:
                return True
        elif number >= want.try_number or number >= got.try_number:
            return True  # past a side's last try: no skip
        # else: below both sides' try numbers, recorded by one only: the other skipped it
    return False


def assert_conforms(oracle: Mapping[TaskKey, TaskEnd], candidate: Mapping[TaskKey, TaskEnd],
                    where: str = "") -> None:
    """Fail, naming every difference, unless every task ended as under the oracle."""
    assert oracle, "the oracle ran no task"
    diff = differences(oracle, candidate)
    assert not diff, "ended differently than under `airflow triggerer`:\n" + "\n".join(diff) + where
