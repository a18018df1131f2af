"""Clock skew (security.md, attack 11): a consumer whose clock is far off the database's
would fire timers early and fail timed tasks at once. Each renewal measures the skew; past
``max_clock_skew`` the consumer runs nothing, says so, and serves again once it is back.

The skew is faked without touching the machine's clock: in-process through the consumer's
``clock``, in a subprocess by a ``sitecustomize`` that shifts ``time.time`` there alone."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from tests.conftest import Processes, consumer_id, wait_until
from tests.test_loops import QUEUE, far, fast_settings, key, running, until
from tests.test_ops import free_port, scrape_when_up
from tests.triggers import WaitsForever
from triggerflow.cli.status import probe_endpoint
from triggerflow.cli.status_report import collect_status
from triggerflow.consumer import Consumer
from triggerflow.model import TaskKey
from triggerflow.sdk import Deferral, TriggerflowClient
from triggerflow.settings import Settings
from triggerflow.skew import ClockCheck
from triggerflow.store.postgres import Database
from triggerflow.testing import InMemory
from triggerflow.triggers import DateTimeTrigger

AHEAD = 300.0
SHIFT_TIME = f"""\
import time

_real = time.time
time.time = lambda: _real() + {AHEAD}  # this process's wall clock only: the machine's stays
"""


@pytest.mark.parametrize("off", [AHEAD, -AHEAD], ids=["ahead", "behind"])
async def test_a_skewed_consumer_hands_back_what_it_holds_and_resumes_when_fixed(
    off: float,
) -> None:
    """Either way: behind, it fires timers late and times tasks out late."""
    mem = InMemory()
    mem.broker.declare(QUEUE)
    offset = [0.0]
    consumer = Consumer(fast_settings(), mem.store, mem.transport(),
                        clock=lambda: time.time() + offset[0])
    async with running(consumer), mem.client(fast_settings()) as client:
        ids = await client.defer_many([Deferral(key(i), far(), QUEUE) for i in range(3)])
        await until(lambda: len(consumer.runner) == 3)
        offset[0] = off  # the host's clock jumps
        await until(lambda: not consumer.runner.running and all(
            mem.store.triggers[i].owner is None for i in ids))
        assert consumer.subscriptions.paused and not consumer.subscriptions.subscribed
        assert f"clock {off:+.1f}s off" in str(consumer.lease.clock_check.problem())
        await until(lambda: abs((mem.store.processes[consumer.me].clock_skew or 0) - off) < 1)
        assert all(mem.store.task(key(i)).state == "deferred" for i in range(3))
        offset[0] = 0.0  # fixed: the next renewal finds it back, and it takes them again
        await until(lambda: len(consumer.runner) == 3)
        assert consumer.lease.clock_check.problem() is None


async def test_a_consumer_300s_ahead_fires_nothing_early_and_a_peer_runs_on_time(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str],
    settings: Settings, tmp_path: Path,
) -> None:
    shifted = tmp_path / "ahead"
    shifted.mkdir()
    (shifted / "sitecustomize.py").write_text(SHIFT_TIME)
    port = free_port()
    procs.writer()
    skewed = procs.consume(teams[0], metrics_port=port, extra_pythonpath=str(shifted))
    skewed_id = await consumer_id(db, skewed)
    # The attack is in place: its renewals measured its clock 300 s ahead (on its row).
    await wait_until(lambda: db.fetchval(
        "SELECT clock_skew > $2 - 1 FROM consumer WHERE id = $1", skewed_id, AHEAD), 10,
        message="the skew recorded")
    moment = datetime.now(UTC) + timedelta(seconds=4)
    await client.defer_many([
        Deferral(TaskKey("skew", "timer", "r"), DateTimeTrigger(moment), teams[0]),
        Deferral(TaskKey("skew", "waits", "r"), WaitsForever(marker_dir=str(tmp_path)),
                 teams[0], timeout=120)])
    # It says so: a log line, its metric, /readyz and `status` (a problem: exit 3).
    assert "clock +300.0s off the database's, past max_clock_skew" in procs.log(skewed)
    metrics = await scrape_when_up(port)
    [(_, skew)] = metrics["triggerflow_clock_skew_seconds"]
    assert skew > AHEAD - 1
    ready, line = await asyncio.to_thread(probe_endpoint, port, False)
    assert not ready and "clock: clock +300" in line, line
    report = await collect_status(settings)
    assert any(f"consumer {skewed_id} on" in p and "clock +300" in p
               for p in report["problems"]), report["problems"]
    # A peer with a good clock runs both: the timer at its moment, not 4 s early ...
    peer_id = await consumer_id(db, procs.consume(teams[0]))
    applied = await wait_until(lambda: db.fetchval(
        "SELECT event_applied_at FROM task_instance WHERE task_id = 'timer' "
        "AND state = 'scheduled'"), 15, message="the timer's task resumed")
    assert applied >= moment, f"fired early: applied {applied}, due {moment}"
    # ... and the task with timeout=120 still waits, held by the peer, not failed.
    assert await db.fetchval(
        "SELECT ti.state = 'deferred' AND t.owner_id = $1 FROM task_instance ti "
        "JOIN trigger t ON t.id = ti.trigger_id WHERE ti.task_id = 'waits'", peer_id)


def test_the_skew_is_taken_at_the_round_trips_midpoint_and_a_slow_one_is_ignored() -> None:
    check = ClockCheck(bound=2.0)
    assert check.problem() == "clock not yet compared with the database's" and not check.ok
    check.measure(sent_wall=1000.0, round_trip=0.4, db_time=1000.1)  # answered mid-way
    assert check.skew is not None and abs(check.skew - 0.1) < 1e-9 and check.ok
    check.measure(sent_wall=1300.0, round_trip=0.2, db_time=1000.0)
    assert check.skew is not None and abs(check.skew - 300.1) < 1e-9 and not check.ok
    assert "clock +300.1s off the database's (max_clock_skew 2s)" in str(check.problem())
    check.measure(sent_wall=1000.0, round_trip=3.0, db_time=1001.5)  # +-1.5 s: says too little
    assert check.skew is not None and abs(check.skew - 300.1) < 1e-9
    check.measure(sent_wall=700.0, round_trip=0.2, db_time=1000.0)  # behind is off too
    assert check.skew is not None and abs(check.skew + 299.9) < 1e-9 and not check.ok
    assert "clock -299.9s off the database's" in str(check.problem())
