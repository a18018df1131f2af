"""Failover on the broker's word (``consumer/presence.py``): a killed consumer's connection
closes, RabbitMQ deletes its presence queue, and a peer takes its triggers over at once; a
frozen one keeps its socket, and only its lease decides.

Real processes, broker and database. The lease here is 30 s, far longer than each test
waits, so only the presence signal can explain a take-over before the dead one's row expires:
the tests assert that ordering in the database, not a duration.
"""

from __future__ import annotations

import asyncio
import signal
from datetime import datetime

from tests.conftest import Processes, consumer_id, wait_until
from tests.test_faults import all_owned_by, timers
from triggerflow.sdk import TriggerflowClient
from triggerflow.settings import Settings
from triggerflow.store.postgres import Database

LONG_LEASE = 30.0
PRESENCE_LINE = "closed its broker connection (presence queue"


async def expires_at(db: Database, consumer: int) -> datetime:
    return await db.fetchval(  # type: ignore[no-any-return]
        "SELECT expires_at FROM consumer WHERE id = $1", consumer)




async def presence_named(db: Database, consumer: int) -> None:
    """Wait until ``consumer`` named its presence queue: it hears deletions from then on."""
    await wait_until(lambda: db.fetchval(
        "SELECT presence IS NOT NULL FROM consumer WHERE id = $1", consumer), 15,
        message=f"consumer {consumer} named its presence queue")


async def test_a_killed_consumer_is_taken_over_before_its_lease_expires(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str],
) -> None:
    victim = procs.consume(teams[0], lease_ttl=LONG_LEASE)
    victim_id = await consumer_id(db, victim)
    await client.defer_many(timers(300, 60, teams[0]))
    await wait_until(lambda: all_owned_by(db, victim_id, 300), 15, message="victim holds all")
    peer = procs.consume(teams[0], lease_ttl=LONG_LEASE)
    peer_id = await consumer_id(db, peer)
    await presence_named(db, peer_id)
    lease_end = await expires_at(db, victim_id)  # its later renewals only push this out
    victim.send_signal(signal.SIGKILL)
    await wait_until(lambda: all_owned_by(db, peer_id, 300), 15, interval=0.05,
                     message="the peer took over on the broker's word")
    # the witness: taken over before the dead one's lease ran out, and the peer says why
    last_claim = await db.fetchval("SELECT max(claimed_at) FROM trigger")
    assert last_claim < lease_end, (last_claim, lease_end)
    # the reaper logs after its claim commits: the line may land just after the rows
    await wait_until(lambda: asyncio.sleep(0, "from 1 dead consumer(s)" in procs.log(peer)),
                     5, message="the peer's take-over line")
    log = procs.log(peer)
    assert f"consumer {victim_id} {PRESENCE_LINE}" in log, log[-3000:]
    # judged as a lease expiry is: one ungraceful loss counted, each at the next attempt
    assert await db.fetchval(
        "SELECT min(failures) = 1 AND max(failures) = 1 AND min(attempt) = 2 "
        "AND max(attempt) = 2 FROM trigger")


async def test_a_frozen_consumer_keeps_its_socket_and_is_left_to_its_lease(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str],
    settings: Settings,
) -> None:
    from testbed.spy import spy_on_events

    procs.writer()
    # Both up and hearing deletions before the timers exist: whichever claims them is frozen.
    started = [procs.consume(teams[0]), procs.consume(teams[0])]
    by_id = {await consumer_id(db, proc): proc for proc in started}
    for consumer in by_id:
        await presence_named(db, consumer)
    await client.defer_many(timers(200, 12, teams[0]))
    await wait_until(lambda: db.fetchval(
        "SELECT count(*) = 200 FROM trigger WHERE owner_id IS NOT NULL"), 15,
        message="the timers are claimed")
    sleeper_id = int(await db.fetchval(
        "SELECT owner_id FROM trigger GROUP BY 1 ORDER BY count(*) DESC LIMIT 1"))
    sleeper = by_id[sleeper_id]
    (peer_id,) = set(by_id) - {sleeper_id}
    peer = by_id[peer_id]
    held = {r["id"] for r in await db.fetch(
        "SELECT id FROM trigger WHERE owner_id = $1", sleeper_id)}
    async with spy_on_events(settings) as spy:
        sleeper.send_signal(signal.SIGSTOP)
        lease_end = await expires_at(db, sleeper_id)
        await wait_until(lambda: all_owned_by(db, peer_id, 200), 15, interval=0.05,
                         message="the peer took over after the lease")
        taken = await db.fetchval("SELECT max(claimed_at) FROM trigger")
        await wait_until(lambda: db.fetchval(
            "SELECT count(*) = 200 FROM task_instance WHERE state = 'scheduled'"), 30)
        applied = await db.fetchval("SELECT max(updated_at) FROM task_instance")
        sleeper.send_signal(signal.SIGCONT)
        await wait_until(lambda: asyncio.sleep(0, "lease lost" in procs.log(sleeper)), 10,
                         message="the woken consumer fenced itself")
        await wait_until(lambda: db.fetchval(
            "SELECT count(*) > 0 FROM consumer WHERE pid = $1 AND id > $2",
            sleeper.pid, sleeper_id), 10, message="the woken consumer registered anew")
    # the broker saw no close: the take-over came only once the frozen one's lease had run out
    assert held and taken >= lease_end, (held, taken, lease_end)
    assert PRESENCE_LINE not in procs.log(peer)
    # and the frozen attempt published nothing when it woke (its timers were overdue), the
    # peer fired them at the next attempt, and nothing changed after the peer's events
    assert spy.by_attempt(1) & held == set()
    assert held <= spy.by_attempt(2)
    assert await db.fetchval("SELECT max(updated_at) FROM task_instance") == applied
