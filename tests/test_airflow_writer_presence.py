"""Airflow mode's writers are seen dead at once too: ``triggerflow writer --airflow`` keeps its
lease row in triggerflow's schema beside Airflow's tables, and a SIGKILLed one is named by
``status --airflow`` (and ``health --kind writer``) on the broker's word, long before its
lease would run out. The lease here is 30 s, far longer than the test waits, so only the
presence signal can explain the order the test asserts in the database."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
from datetime import datetime
from typing import Any

from tests.airflow_support import airflow_db, airflow_template
from tests.conftest import SuiteServices, wait_until
from tests.test_airflow_faults import Served, served
from tests.test_status_broker import cli
from tests.test_writer_presence import LONG_LEASE, PRESENCE_LINE, WAIT

__all__ = ["airflow_db", "airflow_template", "served"]


async def writer_row(served: Served, proc: subprocess.Popen[bytes]) -> int:
    async def found() -> object:
        return await served.scalar(
            "SELECT max(id) FROM triggerflow.consumer WHERE pid = $1 AND kind = 'writer' "
            "AND expires_at > now() AND presence IS NOT NULL", proc.pid)

    return int(await wait_until(found, 30, message=f"writer {proc.pid} registered"))  # type: ignore[call-overload]


async def lease_end(served: Served, row: int) -> datetime:
    return await served.scalar(  # type: ignore[return-value]
        "SELECT expires_at FROM triggerflow.consumer WHERE id = $1", row)


async def dead_in_status(served: Served, management: str,
                         row: int) -> tuple[int, dict[str, Any]]:
    async def dead() -> tuple[int, dict[str, Any]] | None:
        out = await cli(served.procs.settings, "status", "--json", "--queue", served.queue,
                        management_url=management)
        assert out.returncode in (0, 3), out.stdout + out.stderr
        report = json.loads(out.stdout)
        alive = [w["alive"] for w in report["writers"] if w["id"] == row]
        return (out.returncode, report) if alive == [False] else None

    found: tuple[int, dict[str, Any]] = await wait_until(
        dead, WAIT, interval=0.2, message=f"status --airflow shows writer {row} dead")
    return found


async def test_killed_airflow_writers_are_named_before_their_lease_runs_out(
        served: Served, services: SuiteServices) -> None:
    consumer = served.procs.consume(served.queue)
    await served.consumer_id(consumer)
    victim = served.procs.writer(lease_ttl=LONG_LEASE)
    survivor = served.procs.writer(lease_ttl=LONG_LEASE)
    victim_id, survivor_id = await writer_row(served, victim), await writer_row(served, survivor)

    end = await lease_end(served, victim_id)
    victim.send_signal(signal.SIGKILL)
    code, report = await dead_in_status(served, services.management, victim_id)
    assert await lease_end(served, victim_id) < end  # ended on the broker's word
    assert code == 0, report["problems"]  # the survivor still applies events
    assert [w["alive"] for w in report["writers"] if w["id"] == survivor_id] == [True]
    health = await cli(served.procs.settings, "health", "--kind", "writer",
                       "--pid", str(victim.pid))
    assert health.returncode == 1 and f"writer {victim_id} (pid {victim.pid})" in health.stdout, \
        health.stdout
    line = f"writer {victim_id} {PRESENCE_LINE}"  # logged after the commit: may come later
    await wait_until(lambda: asyncio.sleep(0, any(line in served.procs.log(p)
                                                  for p in (survivor, consumer))), 5,
                     message="the line of whoever ended its lease")

    end = await lease_end(served, survivor_id)
    survivor.send_signal(signal.SIGKILL)
    code, report = await dead_in_status(served, services.management, survivor_id)
    assert await lease_end(served, survivor_id) < end
    assert code == 3
    assert any(p.startswith("no live writer") and f"writer {survivor_id} " in p
               for p in report["problems"]), report["problems"]
