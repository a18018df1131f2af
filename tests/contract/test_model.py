"""Model-based test of the store contract: random sequences of deferrals, claims by
consumers of one queue and of another, renewals, lease expiry (time moved on), reaping with
and without a take-over, strikes up to quarantine, fenced events (stale attempts, other
queues, duplicates, bad content), cancellations, releases and the reaper's other calls, run
against the in-memory store (the model) and a SQL store (the system: native PostgreSQL, or
Airflow mode's store, ``model_airflow``) side by side. Every answer is compared, and so are
the trigger and task rows after every step; a divergence fails with the shortest sequence
Hypothesis finds. A rule the system's store roles let differ does not run against it
(``System.differences`` says why).

Ids differ between stores, so both sides' ids are mapped to the order in which the machine
made them (trigger 0, consumer 1, ...), also inside failure messages. Durations are chosen
so that no comparison a store makes lands within five seconds of a tie: a step moves time by
a multiple of 10 s, and every lease, grace, window and timeout (plus the orphan slack) ends
at 5 mod 10 s; on a tie the two clocks could legitimately disagree (see ``model_systems``).

The budget is fixed (``EXAMPLES`` x ``STEPS``) and derandomized, so ``make test`` runs the
same sequences each time; ``TRIGGERFLOW_TEST_MODEL_SEED`` draws others (docs/testing.md).
"""

from __future__ import annotations

import asyncio
import os
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, seed, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    get_state_machine_test,
    invariant,
    precondition,
    rule,
)

from tests.conftest import admin_sql, drop_database_sql
from tests.contract.model_systems import MemorySystem, PostgresSystem, System
from triggerflow.store import (
    Cancelled,
    ClaimResult,
    ProcessKind,
    Reaped,
    Store,
    Struck,
    Taker,
    TriggerRef,
    TriggerSpec,
)
from triggerflow.store.interface import ORPHAN_SLACK
from triggerflow.wire import Event

EXAMPLES = 50
STEPS = 40
SEED_VARIABLE = "TRIGGERFLOW_TEST_MODEL_SEED"

A, B, C = "team-a", "team-b", "team-c"
QUEUE_SETS = [(A,), (A,), (B,), (A, B)]  # most consumers share queue A: claims race there
TTLS = [25.0, 45.0]  # a 30 s step ends a 25 s lease; a 45 s one outlives it once renewed
TRAVELS = [10.0, 30.0]
GRACES = [15.0, 35.0]  # resend_unclaimed, waiting_queues, taken_since
TIMEOUTS = [53.0, 3603.0]  # with the orphan slack: 5 mod 10
MAX_DEFERRAL = 95.0
KINDS = ["resume", "fail", "success", "failed", "skipped", "scheduled"]  # the last: unknown
PAYLOADS = ['{"fired": 1}', "null", "{not json", '"\\u0000"']  # the last two: refused
# Drawn for events: mostly good content and the trigger's own queue, so that batches move
# tasks often (one refused event refuses its whole batch).
EVENT_PAYLOADS = st.sampled_from(PAYLOADS[:2] * 3 + PAYLOADS[2:])
ELSEWHERE = st.sampled_from([False, False, False, True])
GHOST = 10**9  # an id no store has
assert all((t + ORPHAN_SLACK) % 10 == 5 for t in TIMEOUTS)

pick = st.integers(min_value=0, max_value=15)  # index into what exists, modulo its length
GHOSTS_FROM = 12  # a pick of a trigger from here on names one no store has
picks = st.lists(pick, max_size=4)


@dataclass
class Consumer:
    model: int
    system: int
    queues: tuple[str, ...]


@dataclass
class Trigger:
    model: int
    system: int
    queue: str


Outcome = tuple[str, Any]  # ("ok", normalised answer) or ("raised", exception class name)


class StoreMachine(RuleBasedStateMachine):
    """The model (``self.model``) and the system (``self.system``) receive the same calls."""

    runner: ClassVar[asyncio.Runner]
    system_under_test: ClassVar[System]

    def __init__(self) -> None:
        super().__init__()
        self.model: System = MemorySystem()
        self.system = self.system_under_test
        self.run(self.system.reset())
        self.triggers: list[Trigger] = []
        self.consumers: list[Consumer] = []

    def run(self, coro: Awaitable[Any]) -> Any:
        async def wrapped() -> Any:
            return await coro
        return self.runner.run(wrapped())

    # -- mapping each side's ids to the machine's names --------------------------------

    def t_name(self, side: int, trigger_id: int | None) -> str | None:
        if trigger_id is None:
            return None
        for i, t in enumerate(self.triggers):
            if (t.model, t.system)[side] == trigger_id:
                return f"t{i}"
        return f"t?{trigger_id}"

    def c_name(self, side: int, consumer_id: int | None) -> str | None:
        if consumer_id is None:
            return None
        for i, c in enumerate(self.consumers):
            if (c.model, c.system)[side] == consumer_id:
                return f"c{i}"
        return f"c?{consumer_id}"

    def text(self, side: int, value: Any) -> Any:
        """``value`` with the ids inside its texts named (failure messages name both)."""
        if isinstance(value, str):
            value = re.sub(r"\btrigger (\d+)",
                           lambda m: f"trigger {self.t_name(side, int(m[1]))}", value)
            return re.sub(r"\bconsumer (\d+)",
                          lambda m: f"consumer {self.c_name(side, int(m[1]))}", value)
        if isinstance(value, dict):
            return {k: self.text(side, v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.text(side, v) for v in value]
        return value

    def runs(self, rule: str) -> bool:
        """Whether the system runs ``rule``: a store the roles let differ there does not
        (``System.differences`` says why)."""
        return rule not in self.system.differences

    def content(self, side: int, classpath: str, kwargs: Any = None,
                task: str | None = None) -> tuple[Any, Any, Any]:
        """A trigger's class, kwargs and task in the model's terms (the system maps its own)."""
        return (classpath, kwargs, task) if side == 0 else \
            self.system.content(classpath, kwargs, task)

    def spec(self, side: int, s: TriggerSpec) -> tuple[Any, ...]:
        problem = s.kwargs_error.problem if s.kwargs_error else None
        classpath, kwargs, task = self.content(side, s.classpath, s.kwargs, s.task)
        return (self.t_name(side, s.id), s.attempt, s.queue, classpath, kwargs, problem, task)

    def refs(self, side: int, refs: Sequence[TriggerRef]) -> list[tuple[Any, ...]]:
        return sorted((str(self.t_name(side, r.id)), r.queue) for r in refs)

    # -- one call on both sides ------------------------------------------------------------

    def both(self, call: Callable[[int, Store], Awaitable[Any]],
             normalise: Callable[[int, Any], Any] = lambda side, x: x) -> tuple[Any, Any]:
        """Run ``call`` on the model (side 0) then the system (side 1); their outcomes must
        be equal once normalised. Returns the raw answers (None where one raised)."""
        outcomes: list[Outcome] = []
        raw: list[Any] = []
        for side, target in enumerate((self.model, self.system)):
            try:
                answer = self.run(call(side, target.store))
            except Exception as exc:  # the store's error, or a crash: both must agree
                outcomes.append(("raised", type(exc).__name__))
                raw.append(None)
            else:
                outcomes.append(("ok", normalise(side, answer)))
                raw.append(answer)
        assert outcomes[1] == outcomes[0], f"{self.system.name} answered {outcomes[1]}, " \
                                          f"the model {outcomes[0]}"
        return raw[0], raw[1]

    def index(self, i: int) -> int | None:
        """The trigger a pick names (modulo how many there are), None for a ghost: most picks
        name a trigger that exists, so claims and events find work in short sequences."""
        if i >= GHOSTS_FROM or not self.triggers:
            return None
        return i % len(self.triggers)

    def ids(self, side: int, chosen: Sequence[int]) -> list[int]:
        """The triggers ``chosen`` picks, as ``side`` names them (a ghost id no store has)."""
        out = []
        for i in chosen:
            n = self.index(i)
            out.append(GHOST + i if n is None else self.trigger_id(side, n))
        return out

    def trigger_id(self, side: int, n: int) -> int:
        """Trigger ``n`` (the machine's name), as ``side`` names it."""
        t = self.triggers[n]
        return t.model if side == 0 else t.system

    def consumer(self, i: int) -> Consumer:
        return self.consumers[i % len(self.consumers)]

    @staticmethod
    def me(side: int, c: Consumer) -> int:
        return c.model if side == 0 else c.system

    # -- seeding and time ------------------------------------------------------------------

    @rule(queue=st.sampled_from([A, A, B]), timeout=st.sampled_from(TIMEOUTS))
    def defer(self, queue: str, timeout: float) -> None:
        name = f"task{len(self.triggers)}"
        ids = [self.run(s.defer(name, queue, timeout)) for s in (self.model, self.system)]
        self.triggers.append(Trigger(ids[0], ids[1], queue))

    @rule(queues=st.sampled_from(QUEUE_SETS), ttl=st.sampled_from(TTLS))
    def register(self, queues: tuple[str, ...], ttl: float) -> None:
        async def call(side: int, store: Store) -> int:
            me = await store.register(ProcessKind.CONSUMER, "model", 1, queues, 100, "t", ttl)
            await store.renew(me, ttl, 0, queues, subscribed=True)  # subscribed, as serving
            return me

        model, system = self.both(call, lambda side, me: None)
        self.consumers.append(Consumer(model, system, queues))

    @rule(seconds=st.sampled_from(TRAVELS))
    def travel(self, seconds: float) -> None:
        for s in (self.model, self.system):
            self.run(s.travel(seconds))

    @precondition(lambda self: self.triggers and self.runs("end_task_by_hand"))
    @rule(i=pick, state=st.sampled_from(["success", "failed"]))
    def end_task_by_hand(self, i: int, state: str) -> None:
        name = f"task{i % len(self.triggers)}"
        for s in (self.model, self.system):
            self.run(s.end_task(name, state))

    # -- leases ----------------------------------------------------------------------------

    @precondition(lambda self: self.consumers)
    @rule(c=pick, ttl=st.sampled_from(TTLS))
    def renew(self, c: int, ttl: float) -> None:
        who = self.consumer(c)
        self.both(lambda side, store: store.renew(self.me(side, who), ttl, 0, who.queues),
                  lambda side, renewal: renewal is None)  # the counts are read now and then

    @precondition(lambda self: self.consumers)
    @rule(c=pick)
    def unregister(self, c: int) -> None:
        who = self.consumer(c)
        self.both(lambda side, store: store.unregister(self.me(side, who)))

    # -- claims ----------------------------------------------------------------------------

    def claim_result(self, side: int, r: ClaimResult) -> tuple[Any, ...]:
        return (sorted(self.spec(side, s) for s in r.claimed),
                sorted(str(self.t_name(side, i)) for i in r.suspects), self.refs(side, r.refused))

    @precondition(lambda self: self.consumers)
    @rule(c=pick, chosen=picks)
    def claim(self, c: int, chosen: list[int]) -> None:
        who = self.consumer(c)
        self.both(lambda side, store: store.claim(self.me(side, who), self.ids(side, chosen),
                                                  who.queues), self.claim_result)

    @precondition(lambda self: self.consumers)
    @rule(c=pick, limit=st.sampled_from([None, 1, 2]))
    def claim_probation(self, c: int, limit: int | None) -> None:
        who = self.consumer(c)
        self.both(lambda side, store: store.claim_probation(self.me(side, who), who.queues, limit),
                  lambda side, specs: sorted(self.spec(side, s) for s in specs))

    @precondition(lambda self: self.consumers)
    @rule(c=pick, chosen=picks)
    def clear_probation(self, c: int, chosen: list[int]) -> None:
        who = self.consumer(c)
        self.both(lambda side, store: store.clear_probation(self.me(side, who),
                                                            self.ids(side, chosen)))

    @precondition(lambda self: self.consumers)
    @rule(c=pick, chosen=st.none() | picks, cannot_load=st.booleans())
    def release(self, c: int, chosen: list[int] | None, cannot_load: bool) -> None:
        who = self.consumer(c)
        self.both(lambda side, store: store.release(
            self.me(side, who), None if chosen is None else self.ids(side, chosen),
            cannot_load=cannot_load, reason="cannot load" if cannot_load else None), self.refs)

    @precondition(lambda self: self.consumers and self.triggers)
    @rule(c=pick, chosen=picks, delta=st.sampled_from([0, 0, -1, 1]))
    def release_lost(self, c: int, chosen: list[int], delta: int) -> None:
        who = self.consumer(c)
        attempts = [self.fired(self.attempt(i) + delta) for i in chosen]
        self.both(lambda side, store: store.release_lost(self.me(side, who),
                                                         self.ids(side, chosen), attempts),
                  self.refs)

    @precondition(lambda self: self.consumers)
    @rule(c=pick, seconds=st.sampled_from(GRACES))
    def taken_since(self, c: int, seconds: float) -> None:
        who = self.consumer(c)
        self.both(lambda side, store: store.taken_since(self.me(side, who), seconds),
                  lambda side, found: sorted((str(self.t_name(side, i)), a) for i, a in found))

    @precondition(lambda self: self.consumers)
    @rule(c=pick, chosen=picks)
    def fail_unloadable(self, c: int, chosen: list[int]) -> None:
        who = self.consumer(c)
        self.both(lambda side, store: store.fail_unloadable(self.me(side, who),
                                                            self.ids(side, chosen)),
                  lambda side, ids: sorted(str(self.t_name(side, i)) for i in ids))

    @precondition(lambda self: self.consumers and self.triggers)
    @rule(c=pick, t=pick)
    def other_loaders(self, c: int, t: int) -> None:
        who = self.consumer(c)
        self.both(lambda side, store: store.other_loaders(
            self.trigger_id(side, t % len(self.triggers)), self.me(side, who)))

    @precondition(lambda self: self.consumers and self.runs("forget"))
    @rule(c=pick, chosen=picks)
    def forget(self, c: int, chosen: list[int]) -> None:
        who = self.consumer(c)
        self.both(lambda side, store: store.forget(self.me(side, who), self.ids(side, chosen)))

    @precondition(lambda self: self.consumers and self.runs("sweep_cancelled"))
    @rule(c=pick)
    def sweep_cancelled(self, c: int) -> None:
        who = self.consumer(c)
        self.both(lambda side, store: store.sweep_cancelled(self.me(side, who)),
                  lambda side, ids: sorted(str(self.t_name(side, i)) for i in ids))

    def attempt(self, i: int) -> int:
        """The model's attempt of the trigger pick ``i`` names now (1 once gone or a ghost:
        its events are stale)."""
        n = self.index(i)
        return 1 if n is None else self.attempt_of(n)

    def attempt_of(self, n: int) -> int:
        """The model's attempt of trigger ``n`` now (1 once gone)."""
        assert isinstance(self.model, MemorySystem)
        row = self.model.memory.triggers.get(self.triggers[n].model)
        return row.attempt if row else 1

    def fired(self, attempt: int) -> int:
        """The attempt an event or strike names. Never 0 where the system keeps no row for
        a trigger nobody claimed yet (no consumer ran it: no event can name it), as
        ``differences`` says."""
        return attempt if self.runs("attempt 0") else max(1, attempt)

    # -- strikes ---------------------------------------------------------------------------

    @precondition(lambda self: self.consumers and self.triggers)
    @rule(c=pick, t=pick, delta=st.sampled_from([0, 0, -1, 1]), blocked=st.sampled_from([1.24, 8.05]),
          max_blocks=st.sampled_from([1, 2, 3]))
    def strike(self, c: int, t: int, delta: int, blocked: float, max_blocks: int) -> None:
        who, i = self.consumer(c), t % len(self.triggers)
        attempt = self.fired(self.attempt_of(i) + delta)

        def struck(side: int, s: Struck | None) -> Any:
            return s and (self.t_name(side, s.id), s.queue, self.content(side, s.classpath)[0],
                          s.blocks, s.quarantined, s.freed)

        self.both(lambda side, store: store.strike(self.me(side, who), self.trigger_id(side, i),
                                                   attempt, blocked, max_blocks, who.queues),
                  struck)

    # -- the reaper ------------------------------------------------------------------------

    def reaped(self, side: int, r: Reaped) -> tuple[Any, ...]:
        # The SQL stores count the dead rows they delete only on the rows they return: a
        # dead consumer that held nothing is deleted (``rows_agree`` compares) but counted 0
        # there, 1 in the model. The reaper reads the count only when it freed something.
        dead = r.dead_owners if r.freed or r.taken else None
        return (sorted((str(self.t_name(side, f.id)), f.queue, self.content(side, f.classpath)[0],
                        f.failures, f.quarantined) for f in r.freed), dead,
                sorted(self.spec(side, s) for s in r.taken))

    @rule(queues=st.sampled_from([None, (A,), (B,), (A, B)]), max_failures=st.sampled_from([1, 2, 5]),
          max_blocks=st.sampled_from([1, 3]))
    def reap_dead(self, queues: tuple[str, ...] | None, max_failures: int, max_blocks: int) -> None:
        self.both(lambda side, store: store.reap_dead(queues, max_failures, max_blocks=max_blocks),
                  self.reaped)

    @precondition(lambda self: self.consumers)
    @rule(c=pick, room=st.sampled_from([1, 10]), max_failures=st.sampled_from([1, 2, 5]),
          max_blocks=st.sampled_from([1, 3]))
    def take_over(self, c: int, room: int, max_failures: int, max_blocks: int) -> None:
        """A reaping consumer: its own queues, taking over what it may run."""
        who = self.consumer(c)
        self.both(lambda side, store: store.reap_dead(
            who.queues, max_failures, taker=Taker(self.me(side, who), room),
            max_blocks=max_blocks), self.reaped)

    @rule(queues=st.sampled_from([None, (A,), (B,)]), grace=st.sampled_from(GRACES))
    def resend_unclaimed(self, queues: tuple[str, ...] | None, grace: float) -> None:
        self.both(lambda side, store: store.resend_unclaimed(queues, grace, 100), self.refs)

    @precondition(lambda self: self.runs("time_out_orphans"))
    @rule(queues=st.sampled_from([None, (A,), (B,)]))
    def time_out_orphans(self, queues: tuple[str, ...] | None) -> None:
        self.both(lambda side, store: store.time_out_orphans(queues, MAX_DEFERRAL), self.refs)

    @rule(grace=st.sampled_from(GRACES))
    def waiting_queues(self, grace: float) -> None:
        self.both(lambda side, store: store.waiting_queues(grace),
                  lambda side, queues: sorted(queues))

    @rule()
    def queue_consumers(self) -> None:
        self.both(lambda side, store: store.queue_consumers([A, B, C]))

    # -- events and cancellation -----------------------------------------------------------

    @precondition(lambda self: self.triggers)
    @rule(chosen=st.lists(st.tuples(pick, st.sampled_from([0, 0, 0, -1, 1]), ELSEWHERE,
                                    st.sampled_from(KINDS), EVENT_PAYLOADS),
                          min_size=1, max_size=4),
          unlocked=st.booleans())
    def apply(self, chosen: list[tuple[int, int, bool, str, str]], unlocked: bool) -> None:
        """A writer's batch: fenced by attempt and queue; stale attempts, other queues,
        repeats, unknown kinds and bad content included."""
        batch = []  # (index, attempt, queue, kind, payload)
        for t, delta, elsewhere, kind, payload in chosen:
            i = t % len(self.triggers)
            queue = self.triggers[i].queue
            if elsewhere:
                queue = B if queue == A else A
            batch.append((i, self.fired(self.attempt_of(i) + delta), queue, kind, payload))
        fired = time.time()

        async def call(side: int, store: Store) -> Any:
            events = [Event(self.trigger_id(side, i), attempt, queue, kind, payload, fired)
                      for i, attempt, queue, kind, payload in batch]
            if unlocked:
                applied, held = await store.apply_unlocked(events)
                assert held == []  # nobody else holds a row here
            else:
                applied = await store.apply_events(events)
            if side == 1:
                await self.system.settle()
            return applied

        self.both(call, lambda side, applied: sorted((a.kind, a.queue) for a in applied))

    @precondition(lambda self: self.triggers and self.runs("cancel"))
    @rule(chosen=picks, state=st.sampled_from(["removed", "success"]))
    def cancel(self, chosen: list[int], state: str) -> None:
        def cancelled(side: int, found: list[Cancelled]) -> Any:
            return sorted((str(self.t_name(side, c.id)), self.c_name(side, c.owner) or "",
                           c.moved, c.queue) for c in found)

        self.both(lambda side, store: store.cancel(self.ids(side, chosen), state), cancelled)

    # -- the rows behind the answers -------------------------------------------------------

    @invariant()
    def rows_agree(self) -> None:
        seen = []
        for side, s in enumerate((self.model, self.system)):
            rows = self.run(s.rows())
            triggers = {str(self.t_name(side, i)): (
                self.c_name(side, r.owner), r.attempt, r.failures, r.quarantined,
                r.blocked_attempts, sorted(str(self.c_name(side, c)) for c in r.rejected_by))
                for i, r in rows.triggers.items()}
            tasks = {name: tuple(self.text(side, v) for v in self.system.canonical_task(
                         t.state, t.next_method, t.next_kwargs))
                     for name, t in rows.tasks.items()}
            processes = sorted(str(self.c_name(side, c)) for c in rows.processes)
            seen.append((triggers, tasks, processes))
        assert seen[1] == seen[0], f"{self.system.name}'s rows differ from the model's"


def model_settings() -> settings:
    return settings(max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
                    database=None, derandomize=os.environ.get(SEED_VARIABLE) is None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
                    print_blob=False, report_multiple_bugs=False)


def run_machine(system: System, runner: asyncio.Runner) -> None:
    """Run the machine against ``system`` on the budget, seeded from the environment."""
    machine = type(f"{system.name.capitalize()}Machine", (StoreMachine,),
                   {"runner": runner, "system_under_test": system})
    test = get_state_machine_test(machine, settings=model_settings())
    if os.environ.get(SEED_VARIABLE):
        test = seed(int(os.environ[SEED_VARIABLE]))(test)
    test()


def test_the_postgres_store_answers_as_the_model(pg_server: str, template_db: str) -> None:
    database = f"tf_model_{uuid.uuid4().hex[:12]}"
    asyncio.run(admin_sql(pg_server, f'CREATE DATABASE "{database}" TEMPLATE "{template_db}"'))
    try:
        with asyncio.Runner() as runner:
            system = runner.run(PostgresSystem.open(f"{pg_server}/{database}"))
            try:
                run_machine(system, runner)
            finally:
                runner.run(system.close())
    finally:
        asyncio.run(admin_sql(pg_server, drop_database_sql(database)))


def test_the_airflow_store_answers_as_the_model(request: pytest.FixtureRequest) -> None:
    """The same machine against Airflow mode's store over a seeded Airflow metadata database;
    the rules Airflow mode lets differ do not run (``model_airflow.DIFFERENCES``)."""
    from tests import airflow_support as af  # skips without triggerflow[airflow]
    from tests.contract.model_airflow import AirflowSystem

    template: str = request.getfixturevalue("airflow_template")
    with asyncio.Runner() as runner:
        database = runner.run(af.copy_database(template))
        try:
            system = runner.run(AirflowSystem.open(database))
            try:
                run_machine(system, runner)
            finally:
                runner.run(system.close())
        finally:
            runner.run(af.drop_database(database))


def test_the_model_answers_as_itself() -> None:
    """The machine's own check: two memory stores never diverge (no clock or id slip in
    the machine itself), in-process and fast."""
    with asyncio.Runner() as runner:
        run_machine(MemorySystem(), runner)
