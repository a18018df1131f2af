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

import dataclasses
import inspect
import re
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import asyncpg
import pytest
from _pytest.runner import runtestprotocol

from tools import mutate_policies
from tools.sql_mutants import Mutant, mutants

NATIVE = "triggerflow.store.postgres.statements."
AIRFLOW = "triggerflow.airflow.statements."
LEASE_FIELDS = ("renew", "unregister", "announce_presence", "presence_gone", "writer_gone")


@dataclass(frozen=True)
class Target:
    """Where a store reads a statement at run time: a module constant (``CLAIM``), a field
    of a frozen dataclass of statements (``NATIVE.renew``, read when a store is built), or
    an entry of a dict of them (``APPLY_FOR[3.3]``, what ``apply_events`` runs); ``store``:
    the pytest id part of that store's cases; ``label``: its name in the report."""

    module: str
    path: str
    store: str
    label: str = ""

    @property
    def name(self) -> str:
        return self.label or re.split(r"[.\[]", self.path)[-1]

    def get(self) -> str:
        constant, field, key = _parts(self.path)
        value = getattr(_load(self.module), constant)
        return str(value[key] if key else getattr(value, field) if field else value)

    def mutants(self, original: str) -> list[Mutant]:
        return mutants(original, before=SCOPE.get((self.store, self.name)))

    def set(self, text: str) -> None:
        module = _load(self.module)
        constant, field, key = _parts(self.path)
        value = getattr(module, constant)
        if key:
            value[key] = text
        elif field:
            setattr(module, constant, dataclasses.replace(value, **{field: text}))
        else:
            setattr(module, constant, text)


@dataclass(frozen=True)
class PolicyTarget:
    """A row-security policy (``tools/mutate_policies.py``), put in place in the session's
    template database: ``server`` and ``template`` as the suite's fixtures made them."""

    table: str
    policy: str
    text: str
    server: str
    template: str
    store: str = "postgres"

    @property
    def name(self) -> str:
        return f"{self.table}_{self.policy}"

    @classmethod
    def all(cls, config: pytest.Config) -> list[PolicyTarget]:
        made = config.stash.get(_FIXTURES, {})
        if "pg_server" not in made or "template_db" not in made:
            return []  # no policy case ran in the baseline
        return [cls(table, policy, text, made["pg_server"], made["template_db"])
                for (table, policy), text in mutate_policies.policies().items()]

    def get(self) -> str:
        return self.text

    def mutants(self, original: str) -> list[Mutant]:
        return mutate_policies.policy_mutants(original)

    def set(self, text: str) -> None:
        mutate_policies.put(self.server, self.template, self.table, self.policy, text)


@dataclass(frozen=True)
class TemplateTarget:
    """An ownership statement both SQL stores render from one template
    (``store.postgres.statements.ownership``): each mutant of the template is rendered for
    both and put in place in both stores' statement modules, and the cases of both stores
    that call it run against it."""

    name: str
    store: str = "shared"

    @property
    def template(self) -> Any:
        return _load(OWNERSHIP).TEMPLATES[self.name]

    def get(self) -> str:
        return str(self.template.sql)

    def mutants(self, original: str) -> list[Mutant]:
        return mutants(original)

    def changes(self, store: str, text: str) -> bool:
        """Whether mutant ``text`` renders differently for ``store``: dropping a hook native
        mode renders ``true`` (the Airflow team filter) leaves its statement as it was."""
        book = _load(RENDERED[store][1])

        def plain(sql: str) -> str:
            return re.sub(r"\s+", " ", re.sub(r"\s(AND true|true AND)\b", " ", sql)).strip()
        return plain(book.render(self.template.mutated(text))) != plain(book.render(self.template))

    def set(self, text: str) -> None:
        template = self.template.mutated(text)
        for store, (modules, book) in RENDERED.items():
            rendered = _load(book).render(template)  # a mangled template: KeyError, ValueError
            for module in modules:
                if hasattr(_load(module), self.name):
                    setattr(_load(module), self.name, rendered)
                    break
            else:
                raise AssertionError(f"no {store} statement module has {self.name}")


_FIXTURES = pytest.StashKey[dict[str, str]]()


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef[Any],
                         request: pytest.FixtureRequest) -> Any:
    """Keep the PostgreSQL server's URL and the template database's name for the policies."""
    value = yield
    if fixturedef.argname in ("pg_server", "template_db"):
        request.config.stash.setdefault(_FIXTURES, {})[fixturedef.argname] = value
    return value


def _parts(path: str) -> tuple[str, str, str]:
    m = re.fullmatch(r"(\w+)(?:\.(\w+)|\[([\w.]+)\])?", path)
    assert m, path
    return m.group(1), m.group(2) or "", m.group(3) or ""


OWNERSHIP = NATIVE + "ownership"
# Where each store's renderings of the ownership templates live, and its bookkeeping.
RENDERED = {"postgres": (tuple(NATIVE + m for m in ("claims", "reaper", "writer")),
                         NATIVE + "bookkeeping:NATIVE"),
            "airflow": (tuple(AIRFLOW + m for m in ("claims", "reaper", "writer")),
                        AIRFLOW + "bookkeeping:AIRFLOW")}
# The ownership templates that decide fencing and leases (the rest: no-op hand-backs).
SHARED = ("CLAIM_PROBATION", "REAP_DEAD", "RELEASE", "RELEASE_LOST", "STRIKE", "TAKEN_SINCE",
          "FAIL_UNLOADABLE")

TARGETS: list[Target | TemplateTarget] = [
    *(Target(NATIVE + module, name, "postgres") for module, name in (
        ("claims", "CLAIM"), ("writer", "APPLY_EVENTS"), ("claims", "SWEEP_CANCELLED"),
        ("reaper", "TIMEOUT_ORPHANS"), ("deferral", "CANCEL"))),
    Target(AIRFLOW + "claims", "CLAIM", "airflow"),
    *(TemplateTarget(name) for name in SHARED),
    # The lease and presence statements: the native store reads them from its statements
    # module, the Airflow store from its own namespace (it imports LEASE by name).
    *(Target(NATIVE + "lease", f"NATIVE.{f}", "postgres") for f in LEASE_FIELDS),
    *(Target("triggerflow.airflow.store", f"LEASE.{f}", "airflow") for f in LEASE_FIELDS),
    Target("triggerflow.airflow.events", "APPLY_FOR[3.3]", "airflow", "APPLY"),
    Target("triggerflow.airflow.cancels", "READ", "airflow"),
    Target("triggerflow.airflow.cancels", "CREATE", "airflow"),
    Target("triggerflow.airflow.liveness", "BEAT_IF_SERVED", "airflow"),
]
# Statements no store method runs: their cases are a test module's, all of it.
OWN_CASES = {"CREATE": "tests/test_airflow_cancel_log.py",
             "BEAT_IF_SERVED": "tests/test_airflow_liveness.py"}
# Cases outside the contract suite that can kill a statement's mutants, run after the
# contract cases that call it (node id prefixes).
EXTRA_CASES = {
    ("postgres", "SWEEP_CANCELLED"): ["tests/test_cancel_log.py::"],  # the log's housekeeping
    ("airflow", "APPLY"): ["tests/test_airflow_golden.py::"],  # what Airflow's code writes
    ("airflow", "READ"): ["tests/test_airflow_store.py::test_an_entry_committed_after",
                          "tests/test_airflow_store.py::test_cancel_log_records",
                          "tests/test_airflow_store.py::test_sweep_and_clean_unused"],
    # the Airflow team filter (teams.py): consumers of two teams and one of none
    **{("airflow", name): ["tests/test_airflow_teams.py::test_each_consumer_"]
       for name in ("CLAIM_PROBATION", "REAP_DEAD", "register", "renew")},
    # and the hand-on of another team's rows to a consumer of that team sharing the queue
    ("airflow", "CLAIM"): ["tests/test_airflow_teams.py::test_each_consumer_",
                           "tests/test_airflow_teams.py::test_another_teams_row_"],
}
# The row-security policies' cases: the attacks of team roles on other teams' rows, and the
# processes on the documented unlisted roles (which the policies must leave alone).
POLICY_CASES = ["tests/test_isolation.py::test_team_", "tests/test_isolation.py::test_a_team_",
                "tests/test_trigger_ids.py::test_a_team_", "tests/test_task_keys.py::test_a_team_",
                "tests/test_documented_roles.py::test_per_team_",
                "tests/test_isolation.py::test_unlisted_roles_",
                "tests/test_documented_roles.py::test_every_component_"]
# Store classes, and which of their methods run which constant (read from their source).
STORES = {"postgres": "triggerflow.store.postgres.store:PostgresStore",
          "airflow": "triggerflow.airflow.store:AirflowStore"}
INDIRECT = {("airflow", "APPLY"): "apply_events",  # through events.apply_events
            ("airflow", "READ"): "sweep_cancelled"}  # through cancels.CancelLog
# Mutated only up to this text: what follows in Airflow's APPLY (callback requests, XComs)
# is Airflow's bookkeeping, checked by tests/test_airflow_golden.py, not a Store contract.
SCOPE = {("airflow", "APPLY"): "), detached AS ("}
# A progress line; a policy's mutant names its clause, or is a clause made `true`.
_LINE = re.compile(r"^(killed|survived|invalid)\s+(\w+)\.(\w+) "
                   r"((?:L\d+:|USING:|WITH CHECK:|`).*?) ?(test_\S+|\w+Error)?$")
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


def _methods_using(target: Target, store: str) -> set[str]:
    if (store, target.name) in INDIRECT:
        return {INDIRECT[store, target.name]}
    cls = _load(STORES[store])
    constant, field, _ = _parts(target.path)
    # The store imports each statement module by its name; it keeps its lease statements
    # (a dataclass) as ``self._lease``, in methods of its base class.
    used = rf"\b_lease\.{field}\b" if field else \
        rf"\b{target.module.rsplit('.', 1)[-1]}\.{constant}\b"
    return {name for name, fn in inspect.getmembers(cls, inspect.isfunction)
            if re.search(used, inspect.getsource(fn))}


class Recorder:
    """Which store methods each case calls (wrapped during the baseline run)."""

    def __init__(self) -> None:
        self.current = ""
        self.calls: dict[str, set[str]] = defaultdict(set)  # "store.method" -> nodeids
        self._saved: list[tuple[type, str, Any]] = []

    def install(self) -> None:
        for store, spec in STORES.items():
            cls = _load(spec)  # its own methods and its base class's, wrapped on it
            for name, fn in inspect.getmembers(cls, inspect.iscoroutinefunction):
                self._saved.append((cls, name, vars(cls).get(name)))
                setattr(cls, name, self._wrap(f"{store}.{name}", fn))

    def _wrap(self, key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        async def recorded(*args: Any, **kwargs: Any) -> Any:
            self.calls[key].add(self.current)
            return await fn(*args, **kwargs)
        return recorded

    def uninstall(self) -> None:
        for cls, name, fn in self._saved:
            if fn is None:  # inherited: the base class's shows through again
                delattr(cls, name)
            else:
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
    targets: list[Target | TemplateTarget | PolicyTarget] = [*TARGETS, *PolicyTarget.all(config)]
    for target in targets:
        name, store = target.name, target.store
        if only and name not in only:
            continue
        original = target.get()
        cases = _cases(items, recorder, target)
        kills: dict[str, int] = defaultdict(int)  # a case that killed a mutant goes first next
        for mutant in target.mutants(original):
            before = kept.get((store, name, mutant.description))
            if before is not None and not (verify and before.outcome == "killed"):
                results.append(before)
                continue
            # A case that killed this mutant before, then those that killed its siblings.
            cases.sort(key=lambda item: (not (before and item.nodeid.endswith(before.by)),
                                         -kills[item.nodeid]))
            result = _try(target, original, mutant, cases)
            if result.outcome == "killed":
                for by in result.by.split(" and "):
                    kills[next(i.nodeid for i in cases if i.nodeid.endswith("::" + by))] += 1
            results.append(result)
            config.get_terminal_writer().line(
                f"{result.outcome:8} {store}.{name} {mutant.description} {result.by}")
    _report(config, _table(results, time.monotonic() - started))
    return True


def _try(target: Target | TemplateTarget | PolicyTarget, original: str, mutant: Mutant,
         cases: list[pytest.Item]) -> Result:
    """Put ``mutant`` in place, run ``cases`` until one fails, put the original back."""
    result = Result(target.store, target.name, mutant.description, "survived")
    try:
        target.set(mutant.text)
    except (asyncpg.PostgresError, KeyError, ValueError) as exc:
        # a policy PostgreSQL refuses (rolled back), a template the mutant left unrenderable
        result.outcome, result.by = "invalid", type(exc).__name__
        return result
    try:
        # a template's mutant is killed only when a case of each store fails on it
        # (for a store the mutant leaves its statement as it was, it cannot be)
        groups = [[i for i in cases if _store_of(i) == store] for store in RENDERED
                  if target.changes(store, mutant.text)] \
            if isinstance(target, TemplateTarget) else [cases]
        if not groups:
            result.by = "(renders the same for both stores)"
            return result
        killers: list[str] = []
        for group in groups:
            for item, passed, text in _run(group):
                if not passed:
                    invalid = _INVALID.search(text)
                    if invalid:
                        result.outcome, result.by = "invalid", invalid.group()
                        return result
                    killers.append(item.nodeid.split("::")[-1])
                    break
            else:
                result.by = (f"none of {_store_of(group[0])}'s {len(group)} cases" if group
                             else "(no case calls it)")
                return result
        result.outcome, result.by = "killed", " and ".join(killers)
    finally:
        target.set(original)
    return result


def _store_of(item: pytest.Item) -> str:
    """The store a case runs against: its contract parameter, else Airflow mode's for the
    Airflow test modules ``EXTRA_CASES`` names."""
    for store in RENDERED:
        if f"[{store}" in item.nodeid:
            return store
    return "airflow" if item.nodeid.startswith("tests/test_airflow") else "postgres"


def _cases(items: list[pytest.Item], recorder: Recorder,
           target: Target | TemplateTarget | PolicyTarget) -> list[pytest.Item]:
    """The cases that run a statement: its own module's, else the store's cases that called
    a method using it in the baseline; then those of ``EXTRA_CASES``."""
    store, name = target.store, target.name
    if isinstance(target, PolicyTarget):
        return [i for i in items if i.nodeid.startswith(tuple(POLICY_CASES))]
    if name in OWN_CASES:
        return [i for i in items if i.nodeid.startswith(OWN_CASES[name] + "::")]
    stores = tuple(RENDERED) if isinstance(target, TemplateTarget) else (store,)
    cases: list[pytest.Item] = []
    for one in stores:  # a template's: the native store's cases, then Airflow mode's
        statement = target if isinstance(target, Target) else Target(
            next(m for m in RENDERED[one][0] if hasattr(_load(m), name)), name, one)
        callers = set().union(*(recorder.calls[f"{one}.{m}"]
                                for m in _methods_using(statement, one)))
        extra = tuple(EXTRA_CASES.get((one, name), ()))
        cases += [i for i in items if i.nodeid in callers and f"[{one}" in i.nodeid]
        cases += [i for i in items if extra and i.nodeid.startswith(extra) and i not in cases]
    return cases


def _wanted(item: pytest.Item) -> bool:
    """A contract case of a SQL store, or a case some statement or policy names."""
    if item.nodeid.startswith("tests/contract/"):
        return "[postgres" in item.nodeid or "[airflow" in item.nodeid
    prefixes = [*(p + "::" for p in OWN_CASES.values()), *POLICY_CASES,
                *(p for ps in EXTRA_CASES.values() for p in ps)]
    return item.nodeid.startswith(tuple(prefixes))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--mutate"):
        dropped = [i for i in items if not _wanted(i)]
        items[:] = [i for i in items if _wanted(i)]
        config.hook.pytest_deselected(items=dropped)


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
    """``python -m tools.mutate_sql [pytest args]``: the contract suite on both SQL stores,
    and the cases outside it that statements and policies name (``_wanted``)."""
    files = {p.split("::")[0] for p in [*OWN_CASES.values(), *POLICY_CASES,
                                        *(p for ps in EXTRA_CASES.values() for p in ps)]}
    return int(pytest.main(["-q", "-p", "tools.mutate_sql", "--mutate", "tests/contract",
                            *sorted(files), *sys.argv[1:]]))


if __name__ == "__main__":
    raise SystemExit(main())
