"""SQL mutation testing: does the contract suite notice when a condition goes?

``make mutate`` (or ``python -m tools.mutate_sql``) runs pytest on ``tests/contract`` with
this module as a plugin. After a clean baseline it replaces one statement constant at a time
(in-process, by assignment: no file is edited) with each of its mutants (``sql_mutants``),
runs the cases of that store that call the statement, stops at the first failure, and
restores the constant. A mutant is *killed* when a case fails, *survived* when all pass,
*invalid* when PostgreSQL rejects the mutated text itself. The table goes to stdout and to
``--mutate-report`` (markdown).
"""

from __future__ import annotations

import inspect
import re
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, cast

import pytest
from _pytest.runner import runtestprotocol

from tools.sql_mutants import mutants

# (module, constant, the pytest id part of that store's cases): the statements by role
NATIVE = "triggerflow.store.postgres.statements."
AIRFLOW = "triggerflow.airflow.statements."
TARGETS: list[tuple[str, str, str]] = [
    *((NATIVE + module, name, "postgres") for module, name in (
        ("claims", "CLAIM"), ("claims", "CLAIM_PROBATION"), ("writer", "APPLY_EVENTS"),
        ("reaper", "REAP_DEAD"), ("claims", "RELEASE"), ("claims", "RELEASE_LOST"),
        ("claims", "SWEEP_CANCELLED"), ("reaper", "TIMEOUT_ORPHANS"), ("deferral", "CANCEL"),
        ("claims", "STRIKE"), ("claims", "TAKEN_SINCE"))),
    *((AIRFLOW + module, name, "airflow") for module, name in (
        ("claims", "CLAIM"), ("claims", "CLAIM_PROBATION"), ("reaper", "REAP_DEAD"),
        ("claims", "RELEASE"), ("claims", "RELEASE_LOST"), ("claims", "STRIKE"),
        ("claims", "TAKEN_SINCE"))),
    ("triggerflow.airflow.events", "APPLY", "airflow"),
    ("triggerflow.airflow.cancels", "CREATE", "airflow"),
    ("triggerflow.airflow.liveness", "BEAT_IF_SERVED", "airflow"),
]
# Statements no store method runs: their cases are a test module's, all of it.
OWN_CASES = {"CREATE": "tests/test_airflow_cancel_log.py",
             "BEAT_IF_SERVED": "tests/test_airflow_liveness.py"}
# Store classes, and which of their methods run which constant (read from their source).
STORES = {"postgres": "triggerflow.store.postgres.store:PostgresStore",
          "airflow": "triggerflow.airflow.store:AirflowStore"}
INDIRECT = {("airflow", "APPLY"): "apply_events"}  # through events.apply_events
# Mutated only up to this text: what follows in Airflow's APPLY (callback requests, XComs)
# is Airflow's bookkeeping, checked by tests/test_airflow_golden.py, not a Store contract.
SCOPE = {("airflow", "APPLY"): "), detached AS ("}
_LINE = re.compile(r"^(killed|survived|invalid)\s+(\w+)\.(\w+) (L\d+: .*?) ?(test_\S+|\w+Error)?$")
_INVALID = re.compile(r"PostgresSyntaxError|UndefinedColumnError|UndefinedTableError|"
                      r"AmbiguousColumnError|DatatypeMismatchError|GroupingError|"
                      r"UndefinedFunctionError|InvalidColumnReferenceError")


@dataclass
class Result:
    store: str
    statement: str
    mutant: str
    outcome: str  # killed | survived | invalid
    by: str = ""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--mutate", action="store_true", help="run SQL mutation testing")
    parser.addoption("--mutate-only", default="", help="comma-separated statement names")
    parser.addoption("--mutate-report", default=".tools/mutation-report.md")
    parser.addoption("--mutate-keep", default="", help="previous runs' progress lines "
                     "(comma-separated files): mutants killed there are not run again")
    parser.addoption("--mutate-verify", action="store_true", help="with --mutate-keep: "
                     "run carried-over kills again, their killer first")
    parser.addoption("--mutate-again", default="", help="with --mutate-keep: carry over "
                     "survivors too, except those matching this regex (run again)")


def _load(spec: str) -> Any:
    module, _, attr = spec.partition(":")
    mod = __import__(module, fromlist=["_"])
    return getattr(mod, attr) if attr else mod


def _methods_using(store: str, module: str, statement: str) -> set[str]:
    if (store, statement) in INDIRECT:
        return {INDIRECT[store, statement]}
    cls = _load(STORES[store])
    alias = module.rsplit(".", 1)[-1]  # the store imports each statement module by its name
    return {name for name, fn in vars(cls).items() if inspect.isfunction(fn)
            and re.search(rf"\b{alias}\.{statement}\b", inspect.getsource(fn))}


class Recorder:
    """Which store methods each case calls (wrapped during the baseline run)."""

    def __init__(self) -> None:
        self.current = ""
        self.calls: dict[str, set[str]] = defaultdict(set)  # "store.method" -> nodeids
        self._saved: list[tuple[type, str, Any]] = []

    def install(self) -> None:
        for store, spec in STORES.items():
            cls = _load(spec)
            for name, fn in list(vars(cls).items()):
                if inspect.iscoroutinefunction(fn):
                    self._saved.append((cls, name, fn))
                    setattr(cls, name, self._wrap(f"{store}.{name}", fn))

    def _wrap(self, key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        async def recorded(*args: Any, **kwargs: Any) -> Any:
            self.calls[key].add(self.current)
            return await fn(*args, **kwargs)
        return recorded

    def uninstall(self) -> None:
        for cls, name, fn in self._saved:
            setattr(cls, name, fn)


def _run(items: list[pytest.Item]) -> Iterator[tuple[pytest.Item, bool, str]]:
    """Run ``items`` one by one: (item, passed, failure text). Each is torn down to the
    session, so the session's fixtures (servers, templates) stay up for the next one."""
    for item in items:
        down_to = cast(pytest.Item, item.session)  # teardown reads only its listchain()
        reports = runtestprotocol(item, nextitem=down_to, log=False)
        failed = [r for r in reports if r.failed]
        yield item, not failed, "\n".join(str(r.longrepr) for r in failed)


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session) -> bool | None:
    config = session.config
    if not config.getoption("--mutate") or config.option.collectonly:
        return None
    items = list(session.items)
    recorder = Recorder()
    recorder.install()
    try:
        for item in items:
            recorder.current = item.nodeid
            for _, passed, text in _run([item]):
                if not passed:
                    _report(config, f"baseline fails: {item.nodeid}\n{text[-5000:]}")
                    session.testsfailed = 1
                    return True
    finally:
        recorder.uninstall()
    only = {s for s in config.getoption("--mutate-only").split(",") if s}
    kept = _kept(config.getoption("--mutate-keep"), config.getoption("--mutate-again"))
    verify = config.getoption("--mutate-verify")
    results: list[Result] = []
    started = time.monotonic()
    for module_name, name, store in TARGETS:
        if only and name not in only:
            continue
        module: ModuleType = _load(module_name)
        original = getattr(module, name)
        cases = _cases(items, recorder, store, module_name, name)
        kills: dict[str, int] = defaultdict(int)  # a case that killed a mutant goes first next
        for mutant in mutants(original, before=SCOPE.get((store, name))):
            before = kept.get((store, name, mutant.description))
            if before is not None and not (verify and before.outcome == "killed"):
                results.append(before)
                continue
            # A case that killed this mutant before, then those that killed its siblings.
            cases.sort(key=lambda item: (not (before and item.nodeid.endswith(before.by)),
                                         -kills[item.nodeid]))
            setattr(module, name, mutant.text)
            try:
                result = Result(store, name, mutant.description, "survived")
                for item, passed, text in _run(cases):
                    if not passed:
                        invalid = _INVALID.search(text)
                        result.outcome = "invalid" if invalid else "killed"
                        result.by = invalid.group() if invalid else item.nodeid.split("::")[-1]
                        kills[item.nodeid] += 1
                        break
                if not cases:
                    result.by = "(no case calls it)"
            finally:
                setattr(module, name, original)
            results.append(result)
            config.get_terminal_writer().line(
                f"{result.outcome:8} {store}.{name} {mutant.description} {result.by}")
    _report(config, _table(results, time.monotonic() - started))
    return True


def _cases(items: list[pytest.Item], recorder: Recorder, store: str, module: str,
           name: str) -> list[pytest.Item]:
    """The cases that run statement ``name``: its own module's, else the store's cases that
    called a method using it in the baseline."""
    if name in OWN_CASES:
        return [i for i in items if i.nodeid.startswith(OWN_CASES[name] + "::")]
    callers = set().union(*(recorder.calls[f"{store}.{m}"]
                            for m in _methods_using(store, module, name)))
    return [i for i in items if i.nodeid in callers and f"[{store}" in i.nodeid]


def _kept(path: str, again: str) -> dict[tuple[str, str, str], Result]:
    """Outcomes of a previous run to carry over: its kills, and (given ``again``) its
    survivors but those matching ``again``."""
    kept: dict[tuple[str, str, str], Result] = {}
    lines = [line for p in path.split(",") if p for line in Path(p).read_text().splitlines()]
    for line in lines:  # a later file's line wins
        m = _LINE.match(line.rstrip())
        if m is None:
            continue
        outcome, store, statement, mutant, by = m.groups()
        rerun = not again or re.search(again, f"{store}.{statement} {mutant}")
        if outcome == "killed" or not rerun:
            kept[store, statement, mutant] = Result(store, statement, mutant, outcome, by or "")
    return kept


def _report(config: pytest.Config, text: str) -> None:
    path = Path(config.getoption("--mutate-report"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    config.get_terminal_writer().write("\n" + text)


def _table(results: list[Result], seconds: float) -> str:
    counts: dict[str, int] = defaultdict(int)
    for r in results:
        counts[r.outcome] += 1
    valid = counts["killed"] + counts["survived"]
    score = 100.0 * counts["killed"] / valid if valid else 0.0
    lines = [
        f"{len(results)} mutants: {counts['killed']} killed, {counts['survived']} survived, "
        f"{counts['invalid']} invalid SQL (not counted); score {score:.1f}% "
        f"in {seconds / 60:.1f} min",
        "",
        "| store | statement | mutant | result | killed by |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        mutant = r.mutant.replace("|", "\\|")
        lines.append(f"| {r.store} | {r.statement} | {mutant} | {r.outcome} | {r.by} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    """``python -m tools.mutate_sql [pytest args]``: the contract suite on both SQL stores."""
    return int(pytest.main(["-q", "-p", "tools.mutate_sql", "--mutate",
                            "tests/contract", *OWN_CASES.values(),
                            "-k", "postgres or airflow or test_airflow_", *sys.argv[1:]]))


if __name__ == "__main__":
    raise SystemExit(main())
