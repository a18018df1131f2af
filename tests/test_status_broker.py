"""`triggerflow status` lists the team queues the broker has (management API of the suite's
own node), not only those the database knows, and says so plainly when it cannot."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import aio_pika
import pytest

from tests.conftest import ROOT, Processes, settings_env, wait_until
from triggerflow.settings import Settings
from triggerflow.store.postgres import Database
from triggerflow.transport.rabbitmq import RabbitTransport, Topology


async def cli(settings: Settings, *args: str, **overrides: Any) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "triggerflow", *args],
        env=settings_env(settings, **overrides), cwd=ROOT, capture_output=True, text=True,
        timeout=60)


@pytest.fixture
async def broker_only_queue(settings: Settings, topology: Topology) -> AsyncIterator[str]:
    """A team queue declared and bound in the broker, with one waiting message, that the
    database has never heard of."""
    name = f"{settings.namespace}-forgotten"
    broker = RabbitTransport(settings.amqp_dsn(), topology, name="test-admin")
    await broker.connect()
    await broker.declare([name])
    await broker.close()
    conn = await aio_pika.connect(settings.amqp_dsn())
    try:
        ch = await conn.channel()
        exchange = await ch.get_exchange(topology.deferrals_of(name))
        await exchange.publish(aio_pika.Message(b"{}"), routing_key=name)
        yield name
        await ch.queue_delete(name)
    finally:
        await conn.close()


async def test_status_json_names_a_queue_only_the_broker_has(
    settings: Settings, teams: list[str], broker_only_queue: str, procs: Processes,
    db: Database,
) -> None:
    for team in teams:
        procs.consume(team)
    procs.writer()
    await wait_until(lambda: db.fetchval(
        "SELECT count(*) = 3 FROM consumer WHERE expires_at > now()"), 20)

    async def broker_sees_both() -> dict[str, Any] | None:
        """The report, once the management API's statistics list both subscriptions."""
        out = await cli(settings, "status", "--json")
        assert out.returncode == 3, out.stdout + out.stderr
        report: dict[str, Any] = json.loads(out.stdout)
        listed = [q["broker_listed_consumers"] for q in report["queues"] if q["queue"] in teams]
        return report if listed == [1, 1] else None

    report = await wait_until(broker_sees_both, 20, interval=0.5,
                              message="management API lists the team consumers")
    queues = {q["queue"]: q for q in report["queues"]}
    forgotten = queues[broker_only_queue]
    assert forgotten["in_broker"] is True
    assert forgotten["triggers"] == 0 and forgotten["consumers"] == 0
    assert forgotten["broker_listed_consumers"] == 0
    assert forgotten["depth"] == 1  # exact, by AMQP; the management API's counts lag its
    assert forgotten["broker_unacked"] == 0  # statistics interval
    assert report["problems"] == [f"queue {broker_only_queue} has no live consumer"]
    for team in teams:
        assert queues[team]["in_broker"] is True and queues[team]["consumers"] == 1

    table = await cli(settings, "status")
    assert table.returncode == 3
    assert broker_only_queue in table.stdout and "has no live consumer" in table.stdout


async def test_status_says_when_the_management_api_is_unreachable(
    settings: Settings, topology: Topology,
) -> None:
    down = "http://guest:hunter2secret@127.0.0.1:1/"
    out = await cli(settings, "status", "--json", management_url=down)
    assert out.returncode == 3, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    problems = json.loads(out.stdout)["problems"]
    assert any(p.startswith("broker queue list unavailable: RabbitMQ management API at "
                            "http://127.0.0.1:1 unreachable") for p in problems), problems
    table = await cli(settings, "status", management_url=down)
    assert table.returncode == 3 and "management API" in table.stdout
    assert "hunter2secret" not in out.stdout + out.stderr + table.stdout + table.stderr


@pytest.mark.parametrize(("amqp", "management", "vhost"), [
    ("amqp://guest:guest@127.0.0.1:5672/", "http://guest:guest@127.0.0.1:15672/", "/"),
    ("amqp://team-ml:s%40cret@rabbit.svc:5672/prod?heartbeat=10",
     "http://team-ml:s%40cret@rabbit.svc:15672/", "prod"),
    ("amqp://rabbit", "http://rabbit:15672/", "/"),
])
def test_management_url_defaults_to_the_amqp_host_and_user(
    amqp: str, management: str, vhost: str,
) -> None:
    from triggerflow.transport.management import default_management_url, vhost_of

    assert default_management_url(amqp) == management
    assert vhost_of(amqp) == vhost
    settings = Settings(amqp_url=amqp)
    assert settings.management_dsn() == management
    assert Settings(amqp_url=amqp, management_url="http://x:1/").management_dsn() == "http://x:1/"
