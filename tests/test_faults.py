"""Faults caused for real: SIGKILL, SIGTERM, SIGSTOP, broker and database restarts,
queues deleted under a consumer, tasks cleared by hand. Every wait is bounded."""

from __future__ import annotations

import asyncio
import re
import signal
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from tests.conftest import FAST, Processes, SuiteServices, consumer_id, states, wait_until
from tests.triggers import WaitsForever
from triggerflow.model import TaskKey
from triggerflow.sdk import Deferral, TriggerflowClient
from triggerflow.settings import Settings
from triggerflow.store.postgres import Database
from triggerflow.transport.rabbitmq import RabbitTransport, Topology
from triggerflow.triggers import DateTimeTrigger

FAILOVER_BOUND = FAST["lease_ttl"] + FAST["renew_interval"] + 1.5  # ttl + one renewal + claim


def timers(n: int, seconds: float, queue: str, dag: str = "dag") -> list[Deferral]:
    moment = datetime.now(UTC) + timedelta(seconds=seconds)
    return [Deferral(TaskKey(dag, f"t{i}", "r"), DateTimeTrigger(moment), queue) for i in range(n)]


async def owners(db: Database) -> dict[int | None, int]:
    rows = await db.fetch("SELECT owner_id, count(*) AS n FROM trigger GROUP BY 1")
    return {r["owner_id"]: r["n"] for r in rows}




async def all_owned_by(db: Database, owner: int, n: int) -> bool:
    return await db.fetchval(  # type: ignore[no-any-return]
        "SELECT count(*) = $2 FROM trigger WHERE owner_id = $1", owner, n)


@pytest.mark.serial  # timing bound (a failover bound): runs alone, after the parallel part
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
async def test_consumer_loss_fails_over_to_peer(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str],
    sig: signal.Signals,
) -> None:
    procs.writer()
    first = procs.consume(teams[0])
    first_id = await consumer_id(db, first)
    await client.defer_many(timers(500, 25, teams[0]))
    await wait_until(lambda: all_owned_by(db, first_id, 500), 15, message="first holds all")
    second = procs.consume(teams[0])
    second_id = await consumer_id(db, second)
    await asyncio.sleep(0.3)
    started = time.monotonic()
    first.send_signal(sig)
    await wait_until(lambda: all_owned_by(db, second_id, 500), 15, interval=0.05,
                     message="peer holds all")
    took = time.monotonic() - started
    bound = 1.5 if sig == signal.SIGTERM else FAILOVER_BOUND
    assert took < bound, f"failover after {sig.name} took {took:.2f}s (bound {bound}s)"
    if sig == signal.SIGTERM:
        assert first.wait(timeout=10) == 0
        assert "handed back" in procs.log(first)
        # A graceful hand-over is not counted against the triggers.
        assert await db.fetchval("SELECT max(failures) FROM trigger") == 0
    else:
        # One ungraceful loss is counted (no more), and does not slow the failover.
        assert await db.fetchval("SELECT max(failures) FROM trigger") == 1


async def test_sigkill_of_a_big_holder_is_reaped_in_batches(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str],
) -> None:
    # reap_batch 150 of 500 held: four reaper statements take the dead consumer's triggers
    # over, each batch started by the peer before the next is rewritten; every trigger blamed
    # once. No writer: its reaper would free batches for the peer to claim (two rewrites).
    first = procs.consume(teams[0], reap_batch=150)
    first_id = await consumer_id(db, first)
    await client.defer_many(timers(500, 25, teams[0]))
    await wait_until(lambda: all_owned_by(db, first_id, 500), 15, message="first holds all")
    second = procs.consume(teams[0], reap_batch=150)
    second_id = await consumer_id(db, second)
    await asyncio.sleep(0.3)
    first.send_signal(signal.SIGKILL)
    await wait_until(lambda: all_owned_by(db, second_id, 500), 15, interval=0.05,
                     message="peer holds all")
    # the last batch's line is logged once its triggers are started, after the commit
    await wait_until(lambda: asyncio.sleep(0, "from 1 dead consumer(s)" in procs.log(second)),
                     10, message="the reaper logged its last batch")
    log = procs.log(second)
    assert log.count("(a batch; more follow)") == 3, log[-3000:]  # the witness: 3 + the last
    assert log.count("reclaimed 50 triggers (50 taken over here) from 1 dead consumer(s)") == 1
    taken = [int(n) for n in re.findall(r"\((\d+) taken over here\)", log)]
    assert taken == [150, 150, 150, 50], log[-3000:]  # in the reaping rewrite, none re-sent
    # one rewrite each: claimed once by the first (attempt 1), taken over once (attempt 2)
    assert await db.fetchval(
        "SELECT min(attempt) = 2 AND max(attempt) = 2 AND min(failures) = 1 "
        "AND max(failures) = 1 FROM trigger")
    # the dead row went with its last trigger, so no renewal reports a dead peer any more
    assert await db.fetchval("SELECT count(*) FROM consumer WHERE id = $1", first_id) == 0
    # and the peer runs them: the timers are its own now
    await wait_until(lambda: db.fetchval(
        "SELECT running = 500 FROM consumer WHERE id = $1", second_id), 10,
        message="the peer's renewal reports all 500 running")


async def test_paused_consumer_is_fenced_and_reregisters(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str]
) -> None:
    procs.writer()
    sleeper = procs.consume(teams[0])
    sleeper_id = await consumer_id(db, sleeper)
    await client.defer_many(timers(200, 8, teams[0]))
    await wait_until(lambda: all_owned_by(db, sleeper_id, 200), 15)
    from testbed.spy import spy_on_events  # it imports this module's helpers

    # A spy on the events exchange sees what each consumer publishes, whatever the writer's
    # fencing makes of it: the peer's 200 events at attempt 2, and nothing of the woken
    # sleeper's attempt 1 (its timers are overdue when it wakes; it must emit none of them).
    async with spy_on_events(client.settings) as spy:
        sleeper.send_signal(signal.SIGSTOP)
        peer = procs.consume(teams[0])
        peer_id = await consumer_id(db, peer)
        await wait_until(lambda: all_owned_by(db, peer_id, 200), 15, message="peer took over")
        await wait_until(lambda: db.fetchval(
            "SELECT count(*) = 200 FROM task_instance WHERE state = 'scheduled'"), 15)
        applied = await db.fetchval("SELECT max(updated_at) FROM task_instance")
        sleeper.send_signal(signal.SIGCONT)
        new_id = await wait_until(lambda: db.fetchval(
            "SELECT id FROM consumer WHERE pid = $1 AND id > $2 AND expires_at > now()",
            sleeper.pid, sleeper_id), 10, message="woken consumer re-registered")
        assert new_id > sleeper_id
        await asyncio.sleep(1.5)
    assert len(spy.by_attempt(2)) == 200
    assert spy.by_attempt(1) == set(), "the fenced consumer published its stale attempt"
    assert await db.fetchval("SELECT max(updated_at) FROM task_instance") == applied
    assert "lease lost" in procs.log(sleeper)


async def test_task_cleared_by_hand_cancels_trigger_on_owner(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str], tmp_path: Path
) -> None:
    procs.consume(teams[0])
    tid = await client.defer(TaskKey("d", "t", "r"), WaitsForever(marker_dir=str(tmp_path)),
                             queue=teams[0])
    await wait_until(lambda: asyncio.sleep(0, (tmp_path / f"started-{tid}").exists()), 10)
    # "Clear" the task the way a UI would: straight in the database, no control message.
    await db.execute("UPDATE task_instance SET state = NULL, trigger_id = NULL")
    started = time.monotonic()
    await wait_until(lambda: asyncio.sleep(0, (tmp_path / f"cleanup-{tid}").exists()), 10)
    assert time.monotonic() - started < FAST["cancel_sweep_interval"] * 3 + 1
    assert await db.fetchval("SELECT count(*) FROM trigger") == 0


async def test_queue_deleted_and_redeclared_under_consumer(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str],
    settings: Settings,
) -> None:
    procs.writer()
    # A long re-send grace: only a healed subscription can serve the deferrals in time.
    consumer = procs.consume(teams[0], unclaimed_grace=60)
    await consumer_id(db, consumer)
    await asyncio.sleep(1.0)
    broker = RabbitTransport(settings.amqp_dsn(), Topology(settings.namespace), name="test-admin")
    await broker.connect()
    assert broker.channel is not None
    await broker.channel.queue_delete(teams[0])
    await broker.declare(teams)
    await broker.close()
    # At the first check past a renewal interval the consumer's subscription is renewed;
    # later deferrals flow. (Wake-ups the ghost swallowed before that are re-sent by the reaper.)
    await asyncio.sleep(FAST["subscription_renew_interval"]
                        + FAST["subscription_check_interval"] * 2 + 0.5)
    await client.defer_many(timers(50, 0.5, teams[0]))
    await wait_until(lambda: db.fetchval(
        "SELECT count(*) = 50 FROM task_instance WHERE state = 'scheduled'"),
        FAST["subscription_check_interval"] * 3 + 2, message="deferrals after re-declare served")


def close_connections(services: SuiteServices, client_name: str, reason: str) -> int:
    """Close, on the suite's own broker node, every connection whose client properties name
    ``client_name``; returns how many."""
    node = services.rabbit()
    closed = 0
    for line in node.ctl("list_connections", "pid", "client_properties").splitlines():
        if client_name in line:
            node.ctl("close_connection", line.split()[0], reason)
            closed += 1
    return closed


async def test_broker_connection_closed_and_app_restarted_lose_nothing(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str],
    services: SuiteServices,
) -> None:
    node = services.rabbit()
    procs.writer()
    procs.consume(teams[0])
    await client.defer_many(timers(300, 3, teams[0], dag="a"))
    await wait_until(lambda: db.fetchval(
        "SELECT count(*) = 300 FROM trigger WHERE owner_id IS NOT NULL"), 15)
    # Witness: the close lands while the 300 timers are held, not after they were applied.
    pending = await db.fetchval("SELECT count(*) FROM trigger WHERE queue = $1", teams[0])
    closed = sum(close_connections(services, name, "test: closing")
                 for name in ("triggerflow-consumer", "triggerflow-writer"))
    assert pending > 0 and closed >= 2, (pending, closed)
    await wait_until(lambda: db.fetchval(
        "SELECT count(*) = 300 FROM task_instance WHERE dag_id = 'a' AND state = 'scheduled'"),
        30, message="all applied after close_connection")
    await client.defer_many(timers(300, 8, teams[0], dag="b"))
    await asyncio.sleep(1)
    assert await db.fetchval(  # witness: the broker goes away with dag b's work still to do
        "SELECT count(*) FROM task_instance WHERE dag_id = 'b' AND state = 'deferred'") > 0
    await asyncio.to_thread(node.stop_app)
    try:
        await asyncio.sleep(3)
    finally:
        await asyncio.to_thread(node.start_app)
    await wait_until(lambda: db.fetchval(
        "SELECT count(*) = 300 FROM task_instance WHERE dag_id = 'b' AND state = 'scheduled'"),
        60, message="all applied after broker restart")
    assert await db.fetchval("SELECT count(*) FROM trigger") == 0


@pytest.mark.serial  # timing bound (the restart must land mid-burst): runs alone, after the parallel part
async def test_postgres_restart_mid_run_loses_no_event(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str],
    services: SuiteServices,
) -> None:
    services.owned("pg")  # skip before starting anything when PostgreSQL is not ours
    writer = procs.writer()
    procs.consume(teams[0])
    # Events fire over ~6 s so the restart lands while the writer is applying batches.
    deferrals = []
    now = datetime.now(UTC)
    for i in range(3000):
        moment = now + timedelta(seconds=3 + (i % 60) / 10)
        deferrals.append(Deferral(TaskKey("pg", f"t{i}", "r"), DateTimeTrigger(moment), teams[0]))
    await client.defer_many(deferrals)
    # Witness: the restart lands mid-burst, after the first events were applied and with
    # most still to come (they fire until +9 s).
    await wait_until(lambda: db.fetchval(
        "SELECT count(*) > 0 FROM task_instance WHERE state = 'scheduled'"), 15)
    applied_before = await db.fetchval(
        "SELECT count(*) FROM task_instance WHERE state = 'scheduled'")
    await asyncio.to_thread(services.restart_postgres)
    assert applied_before < 3000, applied_before
    try:
        await wait_until(lambda: db.fetchval(
            "SELECT count(*) = 3000 FROM task_instance WHERE state = 'scheduled'"), 60,
            interval=0.5, message="every event applied after the restart")
    except AssertionError as exc:
        left = await db.fetch("SELECT owner_id IS NOT NULL AS owned, attempt, count(*) "
                              "FROM trigger GROUP BY 1, 2")
        raise AssertionError(f"{exc}: tasks {await states(db)}, triggers left "
                             f"{[tuple(r) for r in left]}") from None
    await wait_until(lambda: db.fetchval("SELECT count(*) = 0 FROM trigger"), 15)
    # The writer met the outage with events in hand and kept them until it could commit.
    assert "retrying it" in procs.log(writer), procs.log(writer)[-2000:]


async def test_rolling_restart_spreads_triggers(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str]
) -> None:
    q = teams[0]
    a, b = procs.consume(q), procs.consume(q)
    for started in (a, b):  # both up (signal handlers installed) before the rollout
        await consumer_id(db, started)
    await client.defer_many(timers(1000, 120, q))
    await wait_until(lambda: db.fetchval(
        "SELECT count(*) = 1000 FROM trigger WHERE owner_id IS NOT NULL"), 15)
    for old in (a, b):  # restart each in turn, as a rollout does
        old.send_signal(signal.SIGTERM)
        assert old.wait(timeout=15) == 0
        new = procs.consume(q)
        await consumer_id(db, new)
        await wait_until(lambda: db.fetchval(
            "SELECT count(*) = 1000 FROM trigger t JOIN consumer c ON c.id = t.owner_id "
            "WHERE c.expires_at > now()"), 15, message="all owned by live consumers")

    async def spread() -> bool:
        counts = list((await owners(db)).values())
        return len(counts) == 2 and min(counts) >= 300

    await wait_until(spread, 20, interval=0.5, message="triggers spread over both consumers")
    assert await db.fetchval("SELECT max(failures) FROM trigger") == 0


async def test_orphan_timeout_and_unconsumed_queue_reported(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str]
) -> None:
    """Nobody consumes the queue: the writer's reaper times the task out and says why."""
    writer = procs.writer(unclaimed_grace=0.5)
    await client.defer(TaskKey("o", "t", "r"), DateTimeTrigger(
        datetime.now(UTC) + timedelta(hours=1)), queue=teams[1], timeout=1)
    await wait_until(lambda: db.fetchval(
        "SELECT next_kwargs->>'error' = 'Trigger timeout' FROM task_instance"), 15,
        message="orphaned deferral timed out")
    assert await db.fetchval("SELECT count(*) FROM trigger") == 0
    await client.defer(TaskKey("o", "t2", "r"), DateTimeTrigger(
        datetime.now(UTC) + timedelta(hours=1)), queue=teams[1])
    await wait_until(lambda: asyncio.sleep(
        0, f"queue {teams[1]} has no live consumer" in procs.log(writer)), 15)


async def test_sdk_survives_broker_and_database_restarts(
    client: TriggerflowClient, db: Database, teams: list[str], services: SuiteServices,
) -> None:
    """The SDK's pooled connections die under it; the next defer still records and sends."""
    await client.defer(TaskKey("sdk", "before", "r"), DateTimeTrigger(
        datetime.now(UTC) + timedelta(hours=1)), queue=teams[0])
    closed = await asyncio.to_thread(close_connections, services, "triggerflow-sdk",
                                     "test: closing the SDK")
    assert closed >= 1
    await asyncio.to_thread(services.restart_postgres)
    await client.defer(TaskKey("sdk", "after", "r"), DateTimeTrigger(
        datetime.now(UTC) + timedelta(hours=1)), queue=teams[0])
    await wait_until(lambda: db.fetchval(
        "SELECT count(*) = 2 FROM task_instance WHERE state = 'deferred'"), 15)


async def test_a_short_postgres_outage_dead_letters_no_healthy_wakeup(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str],
    services: SuiteServices, settings: Settings, topology: Topology,
) -> None:
    """Consumers whose leases ran out while PostgreSQL was down hold the wake-ups they are
    given until the lease is back (one lease period at most) instead of handing them back at
    once: each hand-back counts towards the queue's delivery limit (5), and handing them back
    every 0.1 s dead-lettered healthy wake-ups within a second (found by ``triggerflow bench
    chaos``). Here the wake-ups arrive while both leases are lost, as a re-send does."""
    postgres = services.owned("pg").postgres
    q = teams[0]
    consumers = [procs.consume(q), procs.consume(q)]
    for started in consumers:
        await consumer_id(db, started)
    await client.defer_many(timers(50, 120, q))
    ids = await wait_until(lambda: db.fetch(
        "SELECT id FROM trigger WHERE owner_id IS NOT NULL"), 15, message="all claimed")
    assert len(ids) == 50
    broker = RabbitTransport(settings.amqp_dsn(), topology, name="test-dead-letters")
    await broker.connect()
    try:
        await asyncio.to_thread(postgres.pause)
        try:
            await wait_until(lambda: asyncio.sleep(0, all(
                "lease lost" in procs.log(c) for c in consumers)), 20,
                message="both consumers' leases lost")
            await broker.publish_wakeups({q: [r["id"] for r in ids]})
            await asyncio.sleep(FAST["lease_ttl"])  # handed around while the leases are lost
        finally:
            await asyncio.to_thread(postgres.resume)
        await wait_until(lambda: db.fetchval(
            "SELECT count(*) = 2 FROM consumer WHERE kind = 'consumer' AND expires_at > now()"),
            30, interval=0.5, message="both consumers registered again")
        await asyncio.sleep(2 * FAST["lease_ttl"])  # what they held is claimed, then acked
        info = await broker.queue_info(q)
        dead = await broker.queue_info(topology.dead_queue)
    finally:
        await broker.close()
    assert info.ready == 0 and dead.ready == 0, (info, dead)

