"""A trigger that blocks the event loop (issue 19, attack 9) is stopped and struck each time
it overruns ``block_limit``, and quarantined at ``max_blocks`` blocked runs; the innocent
triggers on the same consumer keep firing. On the real services: one consumer, with a block
shorter than the lease and one that outlasts it (the consumer is fenced when the loop
resumes, and records the strike all the same); fleets of two and four consumers at the
default settings, where every block outlasts the lease and a peer takes the blocker over
before its strike lands (issue 35); and in one process, on the in-memory store and broker,
that the stopped trigger's own event is never sent."""

from __future__ import annotations

from datetime import timedelta

import pytest

from tests.conftest import Processes, consumer_id, wait_until
from tests.test_loops import QUEUE, fast_settings, running, until
from tests.test_ops import free_port, key, scrape_when_up, total
from tests.test_stuck import _sent
from tests.triggers import BlocksLoop, EventAfter
from triggerflow.consumer import Consumer
from triggerflow.model import TaskKey
from triggerflow.sdk import TriggerflowClient
from triggerflow.settings import Settings
from triggerflow.store import MAX_BLOCKS
from triggerflow.store.postgres import Database
from triggerflow.store.postgres.admin import QUARANTINED
from triggerflow.testing import InMemory
from triggerflow.triggers import TimeDeltaTrigger

STRIKES = 3  # max_blocks
BLOCKER = "tests.triggers.BlocksLoop"


@pytest.mark.parametrize("seconds", [0.8, 2.5], ids=["within-the-lease", "past-the-lease"])
async def test_a_trigger_that_blocks_the_loop_is_quarantined_after_max_blocks_strikes(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str],
    settings: Settings, seconds: float,
) -> None:
    q = teams[0]
    port = free_port()
    procs.writer()
    # One consumer: nobody witnesses its lease expire, so no loss is blamed on anyone and
    # every failure counted is a strike.
    consumer = procs.consume(q, max_blocks=STRIKES, block_limit=0.5, metrics_port=port)
    await consumer_id(db, consumer)
    timer = await client.defer(key(1), TimeDeltaTrigger(timedelta(seconds=2)), queue=q)
    waiter = await client.defer(key(2), EventAfter(delay=3, payload="innocent"), queue=q)
    blocker = await client.defer(key(3), BlocksLoop(delay=0.2, seconds=seconds), queue=q)

    await wait_until(lambda: db.fetchval(
        "SELECT quarantined_at IS NOT NULL FROM trigger WHERE id = $1", blocker), 25,
        interval=0.2, message="blocker quarantined")
    task = await db.fetchrow(
        "SELECT state, next_method, next_kwargs->>'error' AS error, "
        "next_kwargs->>'message' AS message FROM task_instance WHERE trigger_id = $1", blocker)
    assert task is not None
    assert (task["state"], task["next_method"], task["error"]) == (
        "scheduled", "__fail__", "Trigger quarantined")
    assert task["message"].startswith(
        f"trigger {blocker} ({BLOCKER}) was quarantined after it blocked the event loop for ")
    assert task["message"].endswith(f" s ({STRIKES} runs blocked)")
    # It ran exactly max_failures times, each stopped as its block passed the limit.
    log = procs.log(consumer)
    stopped = [line for line in log.splitlines()
               if f"stopped trigger {BLOCKER} (id {blocker})" in line]
    assert len(stopped) == STRIKES, log
    assert "charging a strike" in stopped[0]
    assert f"quarantined trigger {blocker} ({BLOCKER}) after it blocked the event loop" in log
    if seconds > settings.lease_ttl.total_seconds():  # fenced, struck all the same
        assert "lease lost" in log

    # The innocents on the same consumer fired as they would have.
    await wait_until(lambda: db.fetchval(
        "SELECT count(*) = 2 FROM task_instance WHERE dag_id = 'ops' AND state = 'scheduled' "
        "AND next_method = 'execute_complete'"), 15, message="innocents fired")
    assert await db.fetchval("SELECT count(*) FROM trigger WHERE id = ANY($1::bigint[])",
                             [timer, waiter]) == 0

    # The block was seen, and the quarantine shows where a killer's does.
    samples = await scrape_when_up(port)
    assert total(samples, "triggerflow_triggers_blocked_main_thread_total",
                 trigger_class=BLOCKER) >= STRIKES
    assert total(samples, "triggerflow_reaper_quarantined_total", queue=q) == 1
    [listed] = await db.fetch(QUARANTINED)  # what `triggerflow status` lists
    assert listed["id"] == blocker and "blocked the event loop" in listed["last_error"]
    assert consumer.poll() is None


# The blocker: time.sleep(8) in run(), past any lease. Default settings otherwise
# (lease_ttl, renew_interval, block_limit, max_blocks, max_failures), not the suite's fast ones.
FLEET_BLOCK = 8.0
DEFAULT_LEASE = {"lease_ttl": 3.0, "renew_interval": 1.0}
# Runs of the blocker before it is out, whatever the fleet: max_blocks runs, plus the run a
# peer may have started (taking it over during the last block) before that block counted.
RUN_BOUND = MAX_BLOCKS + 1
INNOCENTS = 8


def blocker_runs(logs: list[str], blocker: int) -> int:
    """Runs of the blocker that blocked a loop: each is stopped once, as its loop resumes."""
    return sum(f"stopped trigger {BLOCKER} (id {blocker})" in line
               for log in logs for line in log.splitlines())


@pytest.mark.parametrize("size", [2, 4], ids=["two-consumers", "four-consumers"])
async def test_a_loop_blocker_is_quarantined_in_a_fleet_whoever_takes_it_over(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str], size: int,
) -> None:
    """Issue 35: every block outlasts the lease, so a peer takes the blocker over (and is
    blocked in turn) before the blocked consumer can strike. The culprit is quarantined
    within RUN_BOUND runs of its own all the same, and the innocent timers that shared its
    consumers are applied, none quarantined."""
    q = teams[0]
    procs.writer()
    fleet = [procs.consume(q, **DEFAULT_LEASE) for _ in range(size)]
    for consumer in fleet:
        await consumer_id(db, consumer)
    timers = [await client.defer(key(i), TimeDeltaTrigger(timedelta(seconds=3 + 3 * i)), queue=q)
              for i in range(INNOCENTS)]
    blocker = await client.defer(key(INNOCENTS), BlocksLoop(delay=0.2, seconds=FLEET_BLOCK),
                                 queue=q)

    await wait_until(lambda: db.fetchval(
        "SELECT quarantined_at IS NOT NULL FROM trigger WHERE id = $1", blocker), 120,
        interval=0.2, message="blocker quarantined")
    task = await db.fetchrow(
        "SELECT state, next_method, next_kwargs->>'message' AS message FROM task_instance "
        "WHERE trigger_id = $1", blocker)
    assert task is not None
    assert (task["state"], task["next_method"]) == ("scheduled", "__fail__")
    assert f"trigger {blocker} ({BLOCKER}) was quarantined after it blocked the event loop" in \
        task["message"]

    # Every innocent timer is applied (none quarantined, none failed).
    await wait_until(lambda: db.fetchval(
        "SELECT count(*) = $1 FROM task_instance WHERE dag_id = 'ops' AND state = 'scheduled' "
        "AND next_method = 'execute_complete'", INNOCENTS), 60, message="innocents applied")
    assert await db.fetchval("SELECT count(*) FROM trigger WHERE id = ANY($1::bigint[])",
                             timers) == 0
    logs = [procs.log(p) for p in procs.procs]
    assert not [line for log in logs for line in log.splitlines()
                if "quarantined trigger" in line and BLOCKER not in line]
    runs = blocker_runs(logs, blocker)
    assert 1 <= runs <= RUN_BOUND, runs
    assert all(p.poll() is None for p in fleet)


async def test_the_stopped_blocker_sends_no_event_and_its_neighbours_do() -> None:
    """The stop runs as the loop resumes, before the blocker's own completion: the event it
    yielded right after its block is never published, its task ends quarantined."""
    mem = InMemory()
    mem.broker.declare(QUEUE)
    s = fast_settings(block_limit=0.3, max_blocks=2, lease_ttl=5.0)
    consumer = Consumer(s, mem.store, mem.transport())
    async with running(consumer), mem.client(s) as client:
        timer = await client.defer(TaskKey("d", "timer", "r"),
                                   TimeDeltaTrigger(timedelta(seconds=0.5)), queue=QUEUE)
        blocker = await client.defer(TaskKey("d", "blocker", "r"),
                                     BlocksLoop(delay=0.05, seconds=0.5), queue=QUEUE)
        await until(lambda: mem.store.triggers[blocker].quarantined)
        events: list[tuple[int, str]] = []
        await until(lambda: _sent(consumer, events) >= 1)
    assert [trigger_id for trigger_id, _ in events] == [timer]
    assert len(mem.store.triggers[blocker].blocked_attempts) == 2
    task = mem.store.task(TaskKey("d", "blocker", "r"))
    assert task.next_method == "__fail__"
    assert f"({BLOCKER}) was quarantined after it blocked the event loop for 0." in \
        task.next_kwargs["message"]
