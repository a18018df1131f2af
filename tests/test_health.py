"""Health that means working, on real processes: ``/readyz`` and ``/livez`` served by the
process itself, a consumer the broker refuses is not ready, not counted and exits, a blocked
loop fails liveness while blocked, a lost database fails readiness naming it. Every wait is
bounded; nothing is timed."""

from __future__ import annotations

import asyncio
import json
import re
import signal
from typing import Any

import httpx
from yarl import URL

from testbed.netproxy import tcp_proxy
from tests.conftest import Processes, consumer_id, wait_until
from tests.test_ops import cli, free_port, key, scrape_when_up, total, writer_up
from tests.triggers import BlocksLoop, WaitsForever
from triggerflow.refusals import ACCESS_ATTEMPTS
from triggerflow.sdk import Deferral, TriggerflowClient
from triggerflow.settings import Settings
from triggerflow.store.postgres import Database
from triggerflow.store.postgres.admin import QUEUE_GAUGES
from triggerflow.store.postgres.statements.reaper import QUEUE_CONSUMERS

Probe = tuple[int, dict[str, Any]]


async def probe(port: int, path: str) -> Probe | None:
    """(status, JSON body) of ``path``, or None while nothing answers."""
    try:
        async with httpx.AsyncClient() as http:
            response = await http.get(f"http://127.0.0.1:{port}{path}", timeout=5)
    except httpx.HTTPError:
        return None
    return response.status_code, response.json()


async def probe_until(port: int, path: str, status: int, timeout: float = 30,
                      containing: str = "") -> dict[str, Any]:
    """Poll ``path`` until it answers ``status`` (with ``containing`` in its body)."""
    async def check() -> dict[str, Any] | None:
        got = await probe(port, path)
        if got and got[0] == status and containing in json.dumps(got[1]):
            return got[1]
        return None

    body: dict[str, Any] = await wait_until(
        check, timeout, interval=0.2, message=f"{path} on {port} answering {status} {containing}")
    return body


async def test_working_consumer_and_writer_are_ready_and_live(
    db: Database, procs: Processes, teams: list[str], settings: Settings
) -> None:
    wport, cport = free_port(), free_port()
    writer = procs.writer(metrics_port=wport)
    consumer = procs.consume(teams[0], metrics_port=cport)
    await writer_up(db, writer)
    cid = await consumer_id(db, consumer)

    checks = {"loop": "ok", "lease": "ok", "database": "ok", "broker": "ok"}
    for port, own in ((wport, {}), (cport, {"clock": "ok"})):  # a consumer checks its clock
        ready = await probe_until(port, "/readyz", 200)
        assert ready == {"status": "ok", "checks": {**checks, **own}}, ready
        assert await probe(port, "/livez") == (200, {"status": "ok", "checks": {"loop": "ok"}})
        metrics = await scrape_when_up(port)  # /metrics still served on the same port
        assert any(name.startswith("triggerflow_") for name in metrics)
    # Counted as capacity once subscribed: the renewal records it.
    await wait_until(lambda: db.fetchval(
        "SELECT subscribed FROM consumer WHERE id = $1", cid), 10, message="subscribed")

    # The CLI probe asks the endpoint: no database connection needed (a wrong URL proves it).
    ok = await cli(settings, "health", metrics_port=cport,
                   database_url="postgresql://nobody@127.0.0.1:1/none")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.strip() == "ok: broker ok, clock ok, database ok, lease ok, loop ok"
    live = await cli(settings, "health", "--live", metrics_port=cport)
    assert (live.returncode, live.stdout.strip()) == (0, "ok: loop ok")

    consumer.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(consumer.wait, 20) == 0
    gone = await cli(settings, "health", metrics_port=cport)
    assert gone.returncode == 1
    assert gone.stdout.startswith(f"dead: nothing answers on http://127.0.0.1:{cport}/readyz")


async def test_consumer_refused_by_the_broker_is_not_ready_not_counted_and_exits(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str],
    settings: Settings, tmp_path: Any,
) -> None:
    queue = teams[0]
    good_port, bad_port = free_port(), free_port()
    procs.writer()
    good = procs.consume(queue, metrics_port=good_port)
    good_id = await consumer_id(db, good)
    held = 200
    await client.defer_many([
        Deferral(key(i, "refused"), WaitsForever(marker_dir=str(tmp_path)), queue=queue)
        for i in range(held)])
    await wait_until(lambda: db.fetchval(
        "SELECT count(*) = $2 FROM trigger WHERE owner_id = $1", good_id, held), 30,
        message="the healthy consumer holds every trigger")

    wrong = str(URL(settings.amqp_dsn()).with_password("not-the-password"))
    bad = procs.consume(queue, metrics_port=bad_port, amqp_url=wrong)
    bad_id = await consumer_id(db, bad)  # it holds a live lease row...

    # ...but is not ready, and says why.
    body = await probe_until(bad_port, "/readyz", 503, containing="ACCESS_REFUSED")
    assert body["checks"]["lease"] == "ok" and body["checks"]["database"] == "ok"
    assert body["checks"]["broker"].startswith("not connected (AccessRefused: ")
    assert (await probe(bad_port, "/livez")) == (200, {"status": "ok", "checks": {"loop": "ok"}})

    # Not counted: its row says so, `status` counts one consumer and the queue gauge too.
    row = await db.fetchrow("SELECT expires_at > now() AS alive, subscribed FROM consumer "
                            "WHERE id = $1", bad_id)
    assert row is not None and row["alive"] and not row["subscribed"]
    status = await cli(settings, "status", "--json")
    report = json.loads(status.stdout)
    served = next(q for q in report["queues"] if q["queue"] == queue)
    assert served["consumers"] == 1, served
    assert {c["id"] for c in report["consumers"] if c["alive"]} >= {good_id, bad_id}
    # The per-queue consumer count that triggerflow_queue_consumers (and KEDA) reads.
    counted = await db.fetch(QUEUE_CONSUMERS, [queue])  # the reaper's
    assert [(r["q"], r["consumers"]) for r in counted] == [(queue, 1)]
    gauges = await db.fetch(QUEUE_GAUGES, [queue], 0.0)  # triggerflow_queue_consumers's
    assert [(r["queue"], r["consumers"], r["expected"]) for r in gauges] == [(queue, 1, 2)]

    # It keeps trying, a bounded number of times, each logged, then exits with one line.
    assert await asyncio.to_thread(bad.wait, 120) != 0
    log = procs.log(bad)
    retries = re.findall(r"the broker refused our credentials \(attempt (\d) of (\d)\)", log)
    assert [int(n) for n, _ in retries] == list(range(1, ACCESS_ATTEMPTS)), log
    exits = [line for line in log.splitlines() if "exiting:" in line]
    assert len(exits) == 1, log
    assert (f"exiting: the broker refused our credentials {ACCESS_ATTEMPTS} times in a row"
            in exits[0])
    assert "Traceback" not in log

    # Throughout, the healthy peer shed nothing to it: no rebalance, all still held there.
    metrics = await scrape_when_up(good_port)
    assert total(metrics, "triggerflow_triggers_released_total", cause="rebalance") == 0
    assert "rebalanced" not in procs.log(good)
    assert await db.fetchval("SELECT count(*) FROM trigger WHERE owner_id = $1", good_id) == held


async def test_blocked_loop_fails_liveness_while_blocked(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str]
) -> None:
    port = free_port()
    procs.writer()
    consumer = procs.consume(teams[0], metrics_port=port)
    await consumer_id(db, consumer)
    await probe_until(port, "/livez", 200)
    await client.defer(key(1, "blocked"), BlocksLoop(delay=0.5, seconds=20), queue=teams[0])

    body = await probe_until(port, "/livez", 503, containing="event loop unresponsive")
    assert set(body["checks"]) == {"loop"}
    ready = await probe(port, "/readyz")
    assert ready is not None and ready[0] == 503
    assert ready[1]["checks"]["loop"].startswith("event loop unresponsive for ")
    assert consumer.poll() is None  # blocked, not dead: the server answered from its thread

    # The block ends, the loop ticks again, and the process is live (and then ready) again.
    await probe_until(port, "/livez", 200, timeout=60)
    await probe_until(port, "/readyz", 200, timeout=60)


async def test_lost_database_fails_readiness_naming_it(
    db: Database, procs: Processes, teams: list[str], settings: Settings
) -> None:
    port, db_port = free_port(), free_port()
    real = URL(settings.database_dsn())
    through_proxy = str(real.with_port(db_port))
    target = (real.host or "127.0.0.1", real.port or 5432)
    async with tcp_proxy(db_port, target):
        consumer = procs.consume(teams[0], metrics_port=port, database_url=through_proxy)
        await consumer_id(db, consumer)
        await probe_until(port, "/readyz", 200)
    # The database is unreachable now (the proxy is gone, its connections cut).
    body = await probe_until(port, "/readyz", 503, containing="StoreUnavailable")
    assert body["checks"]["database"].startswith("StoreUnavailable: "), body
    assert body["checks"]["broker"] == "ok" and body["checks"]["loop"] == "ok"
    assert (await probe(port, "/livez")) == (200, {"status": "ok", "checks": {"loop": "ok"}})
    async with tcp_proxy(db_port, target):  # reachable again: ready again
        await probe_until(port, "/readyz", 200, timeout=60)
        assert consumer.poll() is None


async def test_database_refusing_the_role_is_retried_then_exits_with_one_line(
    procs: Processes, teams: list[str], settings: Settings
) -> None:
    port = free_port()
    unknown = str(URL(settings.database_dsn()).with_user("no_such_role"))
    consumer = procs.consume(teams[0], metrics_port=port, database_url=unknown)
    body = await probe_until(port, "/readyz", 503, containing="no_such_role")
    assert body["checks"]["database"].startswith("connecting (StoreAccessRefused: "), body
    assert await asyncio.to_thread(consumer.wait, 120) == 1
    log = procs.log(consumer)
    retries = re.findall(r"the database refused our credentials \(attempt (\d) of", log)
    assert [int(n) for n in retries] == list(range(1, ACCESS_ATTEMPTS)), log
    exits = [line for line in log.splitlines() if "exiting:" in line]
    assert len(exits) == 1, log
    assert f"exiting: the database refused our credentials {ACCESS_ATTEMPTS} times" in exits[0]
    assert "Traceback" not in log


async def test_a_refused_virtual_host_is_named_and_ends_the_consumer(
    procs: Processes, teams: list[str], settings: Settings
) -> None:
    port = free_port()
    elsewhere = str(URL(settings.amqp_dsn()).with_path("/tf-no-such-vhost"))
    consumer = procs.consume(teams[0], metrics_port=port, amqp_url=elsewhere)
    body = await probe_until(port, "/readyz", 503, containing="tf-no-such-vhost")
    assert body["checks"]["broker"] == (
        "not connected (AccessRefused: the broker refused to open virtual host "
        "'tf-no-such-vhost' for user 'guest')")
    assert await asyncio.to_thread(consumer.wait, 120) == 1
    exits = [line for line in procs.log(consumer).splitlines() if "exiting:" in line]
    assert len(exits) == 1 and "virtual host 'tf-no-such-vhost'" in exits[0], exits
