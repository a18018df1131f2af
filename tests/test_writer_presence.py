"""A killed writer is seen dead at once (``triggerflow/presence.py``): its kernel closes its
broker connection, RabbitMQ deletes its presence queue, and a peer writer or a consumer that
hears it ends its lease, so ``status`` and ``health --kind writer`` say so. Where nobody may
end it, ``status`` reads the events queue's consumer count from the broker.

Real processes, broker and database. The writers' lease here is 30 s, far longer than each
test waits: only the presence signal (or the broker's count) can explain what ``status``
reports before the dead one's lease runs out, and the tests assert that ordering in the
database, not a duration.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
from datetime import datetime
from typing import Any

from testbed.services import free_port
from tests.conftest import Processes, wait_until
from tests.test_ops import Samples, scrape_when_up
from tests.test_status_broker import cli
from triggerflow.settings import Settings
from triggerflow.store.postgres import Database

LONG_LEASE = 30.0  # the writers' lease: max(lease_ttl, 10 s)
WAIT = 20.0  # shorter than LONG_LEASE: a lease running out cannot pass these tests
PRESENCE_LINE = "closed its broker connection (presence queue"


async def writer_id(db: Database, proc: subprocess.Popen[bytes]) -> int:
    """The id of a started writer, once it has named its presence queue on its row (it hears
    deletions from then on, and its own deletion is heard)."""
    return await wait_until(lambda: db.fetchval(  # type: ignore[no-any-return]
        "SELECT max(id) FROM consumer WHERE pid = $1 AND kind = 'writer' "
        "AND expires_at > now() AND presence IS NOT NULL", proc.pid), 30,
        message=f"writer pid {proc.pid} registered with its presence queue named")


async def lease_end(db: Database, row: int) -> datetime:
    return await db.fetchval(  # type: ignore[no-any-return]
        "SELECT expires_at FROM consumer WHERE id = $1", row)


async def status(settings: Settings) -> tuple[int, dict[str, Any]]:
    out = await cli(settings, "status", "--json")
    assert out.returncode in (0, 3), out.stdout + out.stderr
    return out.returncode, json.loads(out.stdout)


async def writer_dead_in_status(settings: Settings, row: int) -> tuple[int, dict[str, Any]]:
    async def dead() -> tuple[int, dict[str, Any]] | None:
        code, report = await status(settings)
        return (code, report) if [w["alive"] for w in report["writers"]
                                  if w["id"] == row] == [False] else None

    found: tuple[int, dict[str, Any]] = await wait_until(
        dead, WAIT, interval=0.2, message=f"status shows writer {row} dead")
    return found


def presence_lost(samples: Samples) -> float:
    return sum(v for labels, v in samples.get("triggerflow_reaper_presence_lost_total", [])
               if labels.get("kind") == "writer")


async def test_killed_writers_are_named_by_status_and_health_before_their_lease_runs_out(
    db: Database, procs: Processes, teams: list[str], settings: Settings,
) -> None:
    ports = [free_port(), free_port()]
    consumer = procs.consume(*teams, metrics_port=ports[0])
    victim, survivor = procs.writer(lease_ttl=LONG_LEASE), procs.writer(
        lease_ttl=LONG_LEASE, metrics_port=ports[1])
    victim_id, survivor_id = await writer_id(db, victim), await writer_id(db, survivor)
    await wait_until(lambda: db.fetchval(
        "SELECT presence IS NOT NULL FROM consumer WHERE pid = $1 AND kind = 'consumer' "
        "AND expires_at > now()", consumer.pid), 30, message="the consumer named its presence")
    health = await cli(settings, "health", "--kind", "writer", "--pid", str(victim.pid))
    assert health.returncode == 0 and health.stdout.startswith("ok: writer"), health.stdout

    # One of the two killed: the fleet still applies events, status names the dead one.
    end = await lease_end(db, victim_id)
    victim.send_signal(signal.SIGKILL)
    code, report = await writer_dead_in_status(settings, victim_id)
    ended = await lease_end(db, victim_id)
    assert ended < end, (ended, end)  # ended on the broker's word, not run out
    assert code == 0, report["problems"]
    dead = next(w for w in report["writers"] if w["id"] == victim_id)
    assert dead["pid"] == victim.pid
    assert [w["alive"] for w in report["writers"] if w["id"] == survivor_id] == [True]
    health = await cli(settings, "health", "--kind", "writer", "--pid", str(victim.pid))
    assert health.returncode == 1 and f"writer {victim_id} (pid {victim.pid})" in health.stdout, \
        health.stdout
    # whoever heard it first says so, once: the peer writer or the consumer (it logs after
    # the statement commits, so the line may land just after status read the row)
    line = f"writer {victim_id} {PRESENCE_LINE}"
    heard = await wait_until(lambda: asyncio.sleep(0, [
        proc for proc in (survivor, consumer) if line in procs.log(proc)]), 5,
        message="the line of whoever ended its lease")
    assert len(heard) == 1, [procs.log(p)[-2000:] for p in (survivor, consumer)]
    counted = [presence_lost(await scrape_when_up(port)) for port in ports]
    assert sum(counted) == 1, counted

    # Both killed: nothing applies events, status exits 3 naming the last one.
    end = await lease_end(db, survivor_id)
    survivor.send_signal(signal.SIGKILL)
    code, report = await writer_dead_in_status(settings, survivor_id)
    ended = await lease_end(db, survivor_id)
    assert ended < end, (ended, end)
    assert code == 3
    assert any(p.startswith("no live writer") and f"writer {survivor_id} " in p
               and f"(pid {survivor.pid})" in p for p in report["problems"]), report["problems"]
    health = await cli(settings, "health", "--kind", "writer")
    assert health.returncode == 1, health.stdout
    await wait_until(lambda: asyncio.sleep(0, f"writer {survivor_id} {PRESENCE_LINE}"
                                           in procs.log(consumer)), 5,
                     message="the consumer's line for the last writer")


async def test_a_killed_writer_nobody_heard_is_named_from_the_brokers_count(
    db: Database, procs: Processes, teams: list[str], settings: Settings,
) -> None:
    writer = procs.writer(lease_ttl=LONG_LEASE)
    row = await writer_id(db, writer)
    # registered longer than lease_ttl ago: past the grace a starting writer gets
    await wait_until(lambda: db.fetchval(
        "SELECT started_at < now() - make_interval(secs => $2) FROM consumer WHERE id = $1",
        row, settings.lease_ttl.total_seconds() + 0.5), 30, interval=0.2)
    _, report = await status(settings)
    assert not any("writer" in p for p in report["problems"]), report["problems"]

    end = await lease_end(db, row)
    writer.send_signal(signal.SIGKILL)
    writer.wait(10)

    async def named() -> tuple[int, dict[str, Any]] | None:
        code, report = await status(settings)
        return (code, report) if any("no writer consumes" in p for p in report["problems"]) \
            else None

    code, report = await wait_until(named, WAIT, interval=0.2,
                                    message="status names the writer the broker lost")
    # nobody ended its lease: the broker's count alone named it, within its lease
    assert await db.fetchval("SELECT now() < $1", end)
    assert [w["alive"] for w in report["writers"]] == [True]
    assert code == 3
    assert (f"no writer consumes {settings.namespace}.events on the broker, though writer "
            f"{row} on ") in " ".join(report["problems"])
    assert f"(pid {writer.pid}) hold(s) a lease" in " ".join(report["problems"])
