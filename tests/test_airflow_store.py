"""AirflowStore on a real Airflow 3.3.2 schema: claim, renew, fencing, apply, reap, the
backstop, cancellation sweep, and the NOTIFY listener."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pendulum
import pytest

from tests import airflow_support as af
from tests.airflow_support import airflow_db, airflow_template
from tests.conftest import wait_until
from triggerflow.airflow import wakeups
from triggerflow.airflow.events import APPLY_FOR
from triggerflow.airflow.store import AirflowStore
from triggerflow.store import KwargsProblem, ProcessKind
from triggerflow.wire import Event

__all__ = ["airflow_db", "airflow_template"]

APPLY = APPLY_FOR[af.airflow_minor()]  # the statement this Airflow's store runs

DATETIME_TRIGGER = "airflow.providers.standard.triggers.temporal.DateTimeTrigger"
MOMENT = pendulum.datetime(2026, 11, 30, 12, tz="UTC")


@pytest.fixture
async def served(airflow_db: str) -> AsyncIterator[str]:
    """An Airflow database with triggerflow set up and one DAG run to defer tasks in."""
    dsn = af.dsn_of(airflow_db)
    await af.prepare(dsn)
    yield dsn


@contextlib.asynccontextmanager
async def opened(dsn: str, **options: Any) -> AsyncIterator[AirflowStore]:
    """An ``AirflowStore`` on ``dsn`` for the block, closed after it whatever happens."""
    store = await AirflowStore.connect(dsn, **options)
    try:
        yield store
    finally:
        await store.close()


async def defer(dsn: str, name: str, queue: str | None) -> int:
    from triggerflow.airflow.kwargs import encrypt_kwargs

    conn = await asyncpg.connect(dsn)
    try:
        kwargs = encrypt_kwargs({"moment": MOMENT, "end_from_trigger": False})
        return (await af.add_deferred_task(conn, name, DATETIME_TRIGGER, kwargs, queue=queue)).trigger_id
    finally:
        await conn.close()


def resume(trigger_id: int, attempt: int, queue: str) -> Event:
    from triggerflow.airflow.codec import resume_body

    return Event(trigger_id, attempt, queue, "resume", resume_body(MOMENT), time.time())


async def deferred_burst(dsn: str, n: int, first_index: int = 0) -> list[int]:
    """``n`` deferred task instances of queue team-a, one DateTimeTrigger row each (map
    indexes from ``first_index``); their trigger ids."""
    from triggerflow.airflow.kwargs import encrypt_kwargs

    conn = await asyncpg.connect(dsn)
    try:
        kwargs = encrypt_kwargs({"moment": MOMENT, "end_from_trigger": False})
        return [r["id"] for r in await conn.fetch(
            """WITH t AS (INSERT INTO "trigger" (classpath, kwargs, created_date, queue)
                          SELECT $1, $2, now(), 'team-a' FROM generate_series(1, $3) RETURNING id)
               INSERT INTO task_instance (id, task_id, dag_id, run_id, map_index, try_number,
                   max_tries, pool, pool_slots, queue, priority_weight, state, trigger_id,
                   next_method)
               SELECT gen_random_uuid(), 'burst', 'tf_golden', 'manual__golden',
                      $4 + row_number() OVER (ORDER BY t.id) - 1, 1, 0, 'default_pool', 1,
                      'team-a', 1, 'deferred', t.id, 'execute_complete' FROM t
               RETURNING trigger_id AS id""", DATETIME_TRIGGER, kwargs, n, first_index)]
    finally:
        await conn.close()


async def test_claim_decodes_airflow_rows_of_my_queues_only(served: str) -> None:
    mine = await defer(served, "mine", "team-a")
    other = await defer(served, "other", "team-b")
    no_queue = await defer(served, "no_queue", None)
    async with opened(served) as store:
        me = await store.register(ProcessKind.CONSUMER, "h", 1, ["team-a"], 100, "t", 30)
        result = await store.claim(me, [mine, other, no_queue], ["team-a"])
        assert [s.id for s in result.claimed] == [mine]
        spec = result.claimed[0]
        assert (spec.attempt, spec.queue, spec.classpath) == (1, "team-a", DATETIME_TRIGGER)
        assert spec.kwargs == {"moment": MOMENT, "end_from_trigger": False}
        assert spec.task == "tf_golden.mine@manual__golden"
        # Held by a live owner: nobody (not even I) claims it again.
        peer = await store.register(ProcessKind.CONSUMER, "h", 2, ["team-a"], 100, "t", 30)
        assert (await store.claim(peer, [mine], ["team-a"])).claimed == []

    # Rows without a queue are served only when a default queue is configured.
    async with opened(served, default_queue="fallback") as store:
        me = await store.register(ProcessKind.CONSUMER, "h", 3, ["fallback"], 100, "t", 30)
        claimed = (await store.claim(me, [no_queue, other], ["fallback"])).claimed
        assert [(s.id, s.queue) for s in claimed] == [(no_queue, "fallback")]


async def test_a_claim_holds_only_deferrals_younger_than_the_resume_delay(served: str) -> None:
    """The scheduler race's hold (docs/airflow-race.md): a claimed row's ``not_before`` is its
    deferral (``trigger.created_date``, the database's clock) plus the delay; an older
    deferral is not held."""
    young = await defer(served, "young", "team-a")
    old = await defer(served, "old", "team-a")
    await af.scalar(served, """UPDATE "trigger" SET created_date = now() - interval '1 minute'
                               WHERE id = $1""", old)
    async with opened(served, resume_delay=20.0) as store:
        me = await store.register(ProcessKind.CONSUMER, "h", 1, ["team-a"], 100, "t", 30)
        before = time.time()
        specs = {s.id: s for s in (await store.claim(me, [young, old], ["team-a"])).claimed}
        assert specs[old].not_before is None
        held = specs[young].not_before
        assert held is not None and before + 15 < held <= time.time() + 20


async def test_kwargs_under_another_key_are_unreadable_here_not_invalid(served: str) -> None:
    from cryptography.fernet import Fernet

    foreign = Fernet(Fernet.generate_key()).encrypt(b'{"a": 1}').decode()
    conn = await asyncpg.connect(served)
    try:
        trigger_id = (await af.add_deferred_task(conn, "foreign", DATETIME_TRIGGER, foreign,
                                              queue="team-a")).trigger_id
    finally:
        await conn.close()
    async with opened(served) as store:
        me = await store.register(ProcessKind.CONSUMER, "h", 1, ["team-a"], 100, "t", 30)
        [spec] = (await store.claim(me, [trigger_id], ["team-a"])).claimed
        assert spec.kwargs is None
        assert spec.kwargs_error is not None
        assert spec.kwargs_error.problem is KwargsProblem.UNREADABLE_HERE


@pytest.mark.serial  # timing bound (applied within 5 s): runs alone, after the parallel part
async def test_dead_owner_is_reaped_and_its_stale_events_change_nothing(served: str) -> None:
    trigger_id = await defer(served, "t1", "team-a")
    async with opened(served) as store:
        first = await store.register(ProcessKind.CONSUMER, "h", 1, ["team-a"], 100, "t", 2.0)
        assert [s.attempt for s in (await store.claim(first, [trigger_id], ["team-a"])).claimed] == [1]
        renewal = await store.renew(first, 2.0, 1, ["team-a"])
        assert renewal is not None and renewal.live_peers == 1
        # A peer on the same lease renews across first's expiry: the database took writes, so
        # the death is first's own (an outage that expires every lease blames no trigger).
        witness = await store.register(ProcessKind.CONSUMER, "h", 9, ["team-a"], 100, "t", 2.0)
        for _ in range(5):
            await asyncio.sleep(0.5)
            assert await store.renew(witness, 2.0, 0, ["team-a"]) is not None
        assert await store.renew(first, 2.0, 1, ["team-a"]) is None  # fenced: lease expired

        reaped = await store.reap_dead(["team-a"], max_failures=5)
        assert reaped.dead_owners == 1
        assert [(f.id, f.queue, f.failures, f.quarantined) for f in reaped.freed] == [
            (trigger_id, "team-a", 1, False)]

        second = await store.register(ProcessKind.CONSUMER, "h", 2, ["team-a"], 100, "t", 30)
        [spec] = (await store.claim(second, [trigger_id], ["team-a"])).claimed
        assert spec.attempt == 2
        # The dead owner's event (attempt 1), or one for the wrong queue: nothing moves.
        assert await store.apply_events([resume(trigger_id, 1, "team-a")]) == []
        assert await store.apply_events([resume(trigger_id, 2, "team-b")]) == []
        assert await af.scalar(served, "SELECT state FROM task_instance WHERE task_id = 't1'") == "deferred"

        applied = await store.apply_events([resume(trigger_id, 2, "team-a")] * 2)  # duplicate
        assert [(a.kind, a.queue) for a in applied] == [("resume", "team-a")]
        assert 0 <= applied[0].latency < 5
        assert await store.apply_events([resume(trigger_id, 2, "team-a")]) == []  # redelivered
        assert await af.scalar(served, "SELECT state FROM task_instance WHERE task_id = 't1'") == "scheduled"
        # Airflow's trigger row and triggerflow's bookkeeping go, as clean_unused would: not
        # in the apply's transaction but once no batch has come for a moment (unused.py).
        assert len(store.unused) == 1  # waiting for the clean
        await wait_until(lambda: af.scalar(served, 'SELECT count(*) = 0 FROM "trigger"'), 10,
                         message="the applied trigger's row deleted after the batch")
        assert await af.scalar(served, "SELECT count(*) FROM triggerflow.trigger_state") == 0


async def test_backstop_resends_rows_never_published_and_skips_published(served: str) -> None:
    unseen = await defer(served, "unseen", "team-a")
    published = await defer(served, "published", "team-a")
    no_queue = await defer(served, "no_queue", None)
    async with opened(served) as store:
        await store.mark_published([published])
        assert await store.resend_unclaimed(None, grace=0.5, limit=100) == []  # within grace
        await asyncio.sleep(0.7)
        assert await store.waiting_queues(0.5) == ["team-a"]
        refs = await store.resend_unclaimed(None, grace=0.5, limit=100)
        assert sorted((r.id, r.queue) for r in refs) == sorted([(unseen, "team-a"),
                                                                 (published, "team-a")])
        assert await store.resend_unclaimed(None, grace=0.5, limit=100) == []  # marked now
        assert no_queue not in [r.id for r in refs]  # no default queue: Airflow's triggerer's


async def test_sweep_and_clean_unused_after_a_task_is_marked_in_airflow(served: str) -> None:
    trigger_id = await defer(served, "cleared", "team-a")
    async with opened(served) as store:
        me = await store.register(ProcessKind.CONSUMER, "h", 1, ["team-a"], 100, "t", 30)
        await store.claim(me, [trigger_id], ["team-a"])
        assert await store.sweep_cancelled(me) == []
        await af.scalar(served, "UPDATE task_instance SET state = 'success' WHERE task_id = 'cleared'")
        # The writer's clean-up first: the trigger row and the bookkeeping go ...
        assert await store.clean_unused() == 1
        assert await af.scalar(served, 'SELECT count(*) FROM "trigger"') == 0
        assert await af.scalar(served, "SELECT count(*) FROM triggerflow.trigger_state") == 0
        assert await af.scalar(
            served, "SELECT trigger_id FROM task_instance WHERE task_id = 'cleared'") is None
        # ... and the consumer's sweep still finds the trigger it runs (issue 18: it did not).
        assert await store.sweep_cancelled(me) == [trigger_id]


async def test_cancel_log_records_airflow_moves_not_triggerflows_and_notifies(
        served: str) -> None:
    from triggerflow.airflow.cancels import Kills

    marked, timed_out, deleted, applied = [await defer(served, name, "team-a") for name in (
        "marked", "timed_out", "deleted", "applied")]
    await af.scalar(served, "UPDATE task_instance SET trigger_timeout = now() - interval '1 s' "
                            "WHERE task_id = 'timed_out'")
    store = await AirflowStore.connect(served)
    store.cancel_log.kills = kills = Kills()
    listener = await asyncpg.connect(served)
    notified: list[str] = []
    await listener.add_listener("triggerflow_airflow_cancel", lambda *a: notified.append(a[3]))
    try:
        # triggerflow's own sessions (the writer applying an event) are not logged ...
        async with store.pool.acquire() as conn:
            await conn.execute("UPDATE task_instance SET state = 'scheduled', trigger_id = NULL "
                               "WHERE task_id = 'applied'")
        assert await store.sweep_cancelled(1) == []
        # ... Airflow's are: one transaction marking two, and a deleted task instance
        await af.scalar(served, "UPDATE task_instance SET state = 'failed' "
                                "WHERE task_id IN ('marked', 'timed_out')")
        await af.scalar(served, "DELETE FROM task_instance WHERE task_id = 'deleted'")
        assert sorted(await store.sweep_cancelled(1)) == sorted([marked, timed_out, deleted])
        await wait_until(lambda: asyncio.sleep(0, len(notified) == 2), 5,
                         message="one notification per transaction")
        # on_kill() where Airflow calls it: not for a trigger whose timeout had passed
        assert [kills.take(i) for i in (marked, timed_out, deleted, applied)] == [
            True, False, True, False]
        assert kills.take(marked) is False  # read once
    finally:
        await listener.close()
        await store.close()


async def test_an_entry_committed_after_a_read_is_seen_by_the_next(served: str) -> None:
    """An entry is stamped when its row trigger runs (``clock_timestamp()``), and committed
    later: a read between the two cannot see it, and the next read only finds it because
    it reaches ``OVERLAP`` back past the previous read's instant."""
    trigger_id = await defer(served, "slow", "team-a")
    clearing = await asyncpg.connect(served)  # Airflow's session, clearing the task slowly
    try:
        async with opened(served) as store:
            assert await store.sweep_cancelled(1) == []
            async with clearing.transaction():
                await clearing.execute("UPDATE task_instance SET state = 'failed' "
                                       "WHERE task_id = 'slow'")
                assert await store.sweep_cancelled(1) == []  # logged, not yet committed
            assert await store.sweep_cancelled(1) == [trigger_id]
    finally:
        await clearing.close()


async def test_listener_delivers_new_trigger_rows(served: str) -> None:
    got: asyncio.Queue[tuple[str | None, list[int]]] = asyncio.Queue()
    connected = asyncio.Event()
    stop = asyncio.Event()

    async def deliver(queue: str | None, ids: list[int]) -> None:
        got.put_nowait((queue, ids))

    task = asyncio.create_task(wakeups.listen(served, deliver, stop, on_connected=connected.set))
    try:
        await asyncio.wait_for(connected.wait(), 5)
        trigger_id = await defer(served, "new", "team-a")
        assert await asyncio.wait_for(got.get(), 5) == ("team-a", [trigger_id])
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)


async def test_a_burst_of_10000_events_is_two_statements(served: str) -> None:
    """Timing is printed, not asserted (benchmarks measure; tests check behaviour)."""
    n = 10_000
    ids = await deferred_burst(served, n)
    async with opened(served) as store:
        me = await store.register(ProcessKind.CONSUMER, "h", 1, ["team-a"], n, "t", 30)
        started = time.perf_counter()
        claimed = (await store.claim(me, ids, ["team-a"])).claimed
        claim_s = time.perf_counter() - started
        assert len(claimed) == n
        started = time.perf_counter()
        applied = await store.apply_events([resume(i, 1, "team-a") for i in ids])
        apply_s = time.perf_counter() - started
        started = time.perf_counter()
        await store.unused.flush()  # what the writer runs once the burst is over
        clean_s = time.perf_counter() - started
        from triggerflow.airflow.kwargs import decode_kwargs, encrypt_kwargs

        kwargs = encrypt_kwargs({"moment": MOMENT, "end_from_trigger": False})
        started = time.perf_counter()
        for _ in range(1000):
            decode_kwargs(kwargs)
        decode_ms = time.perf_counter() - started  # 1000 rows: seconds == ms per row
        print(f"\nairflow store: claim {n} in {claim_s:.3f}s (kwargs decoding "
              f"{decode_ms:.3f} ms/row), apply {n} in {apply_s:.3f}s (1 statement), then "
              f"clean_unused in {clean_s:.3f}s (1 statement)")
        assert len(applied) == n
        assert await af.scalar(
            served, "SELECT count(*) FROM task_instance WHERE state = 'scheduled'") == n
        assert await af.scalar(served, 'SELECT count(*) FROM "trigger"') == 0


def _removed_by_join_filters(plan: dict[str, Any]) -> int:
    return int(plan.get("Rows Removed by Join Filter", 0)) + sum(
        _removed_by_join_filters(p) for p in plan.get("Plans", []))


async def _burst_after_emptied_statistics(served: str, store: AirflowStore,
                                          conn: asyncpg.Connection, me: int, n: int) -> list[int]:
    """A burst of ``n`` claimed, applied and cleaned up, ANALYZE recording the trigger tables
    empty, then a new burst of ``n`` deferred: its trigger ids."""
    first = await deferred_burst(served, n)
    await store.claim(me, first, ["team-a"])
    assert len(await store.apply_events([resume(i, 1, "team-a") for i in first])) == n
    await store.unused.flush()
    await conn.execute('ANALYZE "trigger", triggerflow.trigger_state')
    return await deferred_burst(served, n, first_index=n)


async def test_apply_plan_survives_statistics_of_emptied_trigger_tables(served: str) -> None:
    """After a burst's clean-up, ANALYZE (autovacuum's) records trigger and trigger_state as
    empty while their pages remain: the next burst's rows were then estimated at one, and
    APPLY's joins rescanned the batch once per row (n x n comparisons; 33-38 s for 5,000
    events in ``bench airflow``). Now each event finds its rows by index lookups."""
    n = 1000
    async with opened(served) as store:
        me = await store.register(ProcessKind.CONSUMER, "h", 1, ["team-a"], 2 * n, "t", 30)
        conn = await asyncpg.connect(served)
        try:
            second = await _burst_after_emptied_statistics(served, store, conn, me, n)
            assert len((await store.claim(me, second, ["team-a"])).claimed) == n
            events = [resume(i, 1, "team-a") for i in second]
            rollback = conn.transaction()  # the plan, measured, then nothing kept
            await rollback.start()
            try:
                plan = json.loads(await conn.fetchval(
                    "EXPLAIN (ANALYZE, FORMAT JSON) " + APPLY,
                    [e.trigger_id for e in events], [e.attempt for e in events],
                    [e.queue for e in events], [e.kind for e in events],
                    [e.payload for e in events], [e.fired_at for e in events], None))
            finally:
                await rollback.rollback()
            assert _removed_by_join_filters(plan[0]["Plan"]) < n
        finally:
            await conn.close()
        assert len(await store.apply_events(events)) == n


def _rows_read(plan: dict[str, Any]) -> int:
    """Rows every node of an EXPLAIN ANALYZE plan produced or threw away, over all its loops:
    a per-row lookup reads about one per event and node, a rescan of the batch or of a table
    per event reads thousands."""
    own = (plan.get("Actual Rows", 0) + plan.get("Rows Removed by Filter", 0)
           + plan.get("Rows Removed by Join Filter", 0)) * plan.get("Actual Loops", 1)
    return int(own) + sum(_rows_read(p) for p in plan.get("Plans", []))


async def _explained(conn: asyncpg.Connection, statement: str, *args: Any) -> dict[str, Any]:
    """``statement``'s plan as it ran (with its "Execution Time"), its writes rolled back."""
    rollback = conn.transaction()
    await rollback.start()
    try:
        plan: dict[str, Any] = json.loads(await conn.fetchval(
            "EXPLAIN (ANALYZE, FORMAT JSON) " + statement, *args))[0]
    finally:
        await rollback.rollback()
    return plan


def _assert_read_by_lookups(what: str, n: int, **plans: dict[str, Any]) -> None:
    """Each statement's plan (from ``_explained``) read about what index lookups for ``n``
    rows read, not a table or the batch once per row; printed for the docs."""
    print(f"\nrows read for {what}: " + ", ".join(
        f"{name} {_rows_read(plan['Plan'])} in {plan['Execution Time']:.1f} ms"
        for name, plan in plans.items()))
    for plan in plans.values():
        assert _rows_read(plan["Plan"]) < 30 * n


async def test_claim_and_held_plans_survive_statistics_of_emptied_trigger_tables(
        served: str) -> None:
    """As APPLY's above: CLAIM (a consumer's every claim) and HELD_ELSEWHERE (the writer's
    lock pass) right after ANALYZE recorded the trigger tables empty, with a new burst in
    them. Each delivered id, and each event, finds its rows by its own index lookups."""
    from triggerflow.airflow.statements.claims import CLAIM
    from triggerflow.airflow.statements.writer import HELD_ELSEWHERE
    from triggerflow.airflow.teams import installed_has_teams, render

    n = 1000
    async with opened(served) as store:
        me = await store.register(ProcessKind.CONSUMER, "h", 1, ["team-a"], 2 * n, "t", 30)
        conn = await asyncpg.connect(served)
        try:
            second = await _burst_after_emptied_statistics(served, store, conn, me, n)
            # as a consumer of no Airflow team runs it under [core] multi_team (teams.py);
            # 3.2 has no teams (no trigger.team_name)
            teams = installed_has_teams()
            claim = await _explained(conn, render(CLAIM, scoped=teams, has_teams=teams), me,
                                     second, ["team-a"], None, None)
            assert len((await store.claim(me, second, ["team-a"])).claimed) == n
            held = await _explained(conn, HELD_ELSEWHERE, second, [1] * n, ["team-a"] * n, None)
        finally:
            await conn.close()
        _assert_read_by_lookups(f"{n}", n, CLAIM=claim, HELD_ELSEWHERE=held)


async def test_apply_plans_survive_statistics_that_undercount_task_instance(served: str) -> None:
    """Statistics taken while task_instance was nearly empty (a new deployment, or right
    after ``airflow db clean``) undercount it once history grows back. The batch's APPLY and
    CLEAN_UNUSED then still find its rows by index lookups: the detach step's plain
    ``trigger_id = ANY($1)`` read the whole table once per batch (201,000 rows here)."""
    from triggerflow.airflow.events import CLEAN_UNUSED

    n = 1000
    async with opened(served) as store:
        me = await store.register(ProcessKind.CONSUMER, "h", 1, ["team-a"], n, "t", 30)
        conn = await asyncpg.connect(served)
        try:
            await conn.execute("ANALYZE task_instance")  # one DAG run, no task yet
            await conn.execute(
                """INSERT INTO task_instance (id, task_id, dag_id, run_id, map_index,
                       try_number, max_tries, pool, pool_slots, queue, priority_weight, state)
                   SELECT gen_random_uuid(), 'history', 'tf_golden', 'manual__golden', g, 1, 0,
                          'default_pool', 1, 'team-a', 1, 'success'
                   FROM generate_series(1, 200000) AS g""")
            ids = await deferred_burst(served, n)
            assert len((await store.claim(me, ids, ["team-a"])).claimed) == n
            events = [resume(i, 1, "team-a") for i in ids]
            columns = ([e.trigger_id for e in events], [e.attempt for e in events],
                       [e.queue for e in events], [e.kind for e in events],
                       [e.payload for e in events], [e.fired_at for e in events], None)
            apply = await _explained(conn, APPLY, *columns)
            clean = await _explained(conn, CLEAN_UNUSED, ids)
        finally:
            await conn.close()
        _assert_read_by_lookups(f"{n} beside 200,000", n, APPLY=apply, CLEAN_UNUSED=clean)
        assert len(await store.apply_events(events)) == n


async def test_listener_reconnects_and_the_backstop_finds_what_it_missed(served: str) -> None:
    got: asyncio.Queue[tuple[str | None, list[int]]] = asyncio.Queue()
    connections = asyncio.Queue[None]()
    stop = asyncio.Event()

    async def deliver(queue: str | None, ids: list[int]) -> None:
        got.put_nowait((queue, ids))

    task = asyncio.create_task(wakeups.listen(
        served, deliver, stop, retry_interval=1.0,
        on_connected=lambda: connections.put_nowait(None)))
    store = await AirflowStore.connect(served)
    try:
        await asyncio.wait_for(connections.get(), 5)
        killed = await af.scalar(
            served, "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE application_name = 'triggerflow-airflow-listen' "
                    "AND datname = current_database()")
        assert killed == 1
        missed = await defer(served, "while_away", "team-a")  # no listener right now
        await asyncio.wait_for(connections.get(), 10)  # reconnected
        after = await defer(served, "after", "team-a")
        assert await asyncio.wait_for(got.get(), 5) == ("team-a", [after])
        await asyncio.sleep(0.6)
        await store.mark_published([after])  # what the writer does after publishing
        assert got.empty()  # the row inserted while away was never notified
        assert [r.id for r in await store.resend_unclaimed(["team-a"], 0.5, 100)] == [missed]
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
        await store.close()


async def test_release_refusal_and_probation_on_airflow_rows(served: str) -> None:
    trigger_id = await defer(served, "t", "team-a")
    async with opened(served) as store:
        me = await store.register(ProcessKind.CONSUMER, "h", 1, ["team-a"], 100, "t", 30)
        peer = await store.register(ProcessKind.CONSUMER, "h", 2, ["team-a"], 100, "t", 30)
        await store.claim(me, [trigger_id], ["team-a"])
        assert await store.other_loaders(trigger_id, me) == 1
        # I cannot load it: handed back, and my next claim passes it on instead of running it.
        refs = await store.release(me, [trigger_id], cannot_load=True, reason="no module")
        assert [(r.id, r.queue) for r in refs] == [(trigger_id, "team-a")]
        again = await store.claim(me, [trigger_id], ["team-a"])
        assert again.claimed == [] and [r.id for r in again.refused] == [trigger_id]
        assert await store.other_loaders(trigger_id, me) == 1
        [spec] = (await store.claim(peer, [trigger_id], ["team-a"])).claimed
        assert spec.attempt == 2

        # Lost ungracefully twice: a suspect, claimed only on probation, and cleared after.
        await af.scalar(served, "UPDATE triggerflow.trigger_state SET owner_id = NULL, failures = 2")
        assert (await store.claim(peer, [trigger_id], ["team-a"])).suspects == [trigger_id]
        [spec] = await store.claim_probation(peer, ["team-a"])
        assert (spec.id, spec.attempt) == (trigger_id, 3)
        await store.clear_probation(peer, [trigger_id])
        assert await af.scalar(served, "SELECT failures FROM triggerflow.trigger_state") == 0
        await store.unregister(peer)
        assert await af.scalar(served, "SELECT owner_id FROM triggerflow.trigger_state") is None
