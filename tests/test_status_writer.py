"""Failures that must show in `triggerflow status` (exit 3, named) and fire their alert, on
real processes: no writer while timers fire, a queue whose consumer is gone after its
triggers timed out, a consumer leased but not subscribed. The alerts are evaluated by
``promtool test rules`` on series built from what the test scraped from those processes (or
from their absence), held for longer than the rule's ``for:``."""

from __future__ import annotations

import json
import re
import signal
import socket
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from testbed.services import free_port
from tests.conftest import Processes, states, wait_until
from tests.test_dashboards import alert_rules, alert_test, promtool, run_rule_tests
from tests.test_ops import Samples, scrape
from tests.test_status_broker import cli
from triggerflow.model import TaskKey
from triggerflow.sdk import Deferral, TriggerflowClient
from triggerflow.settings import Settings
from triggerflow.store.postgres import Database
from triggerflow.transport.rabbitmq import Topology
from triggerflow.triggers import DateTimeTrigger


def series_from(samples: Samples, instance: str, prefix: str = "triggerflow_queue_",
                minutes: int = 6) -> dict[str, str]:
    """promtool input: every scraped ``prefix`` sample held at its value for ``minutes``."""
    out = {}
    for name, found in samples.items():
        if name.startswith(prefix):
            for labels, value in found:
                matchers = ",".join(f'{k}="{v}"' for k, v in {**labels,
                                                              "instance": instance}.items())
                out[f"{name}{{{matchers}}}"] = f"{value:g}x{minutes}"
    return out


def fired(tmp_path: Path, alert: str, series: dict[str, str], at: str,
          labels: list[dict[str, str]]) -> str:
    """promtool's complaint if ``alert`` does not fire with exactly ``labels`` at ``at``."""
    tool = promtool()
    if tool is None:
        pytest.skip("promtool not found (.ci/tools fetches it)")
    rules, severity = alert_rules()
    expected = [{**x, "severity": severity[alert]} for x in labels]
    out = run_rule_tests(tool, tmp_path, [alert_test(alert, series, at, expected)], rules)
    return "" if out.returncode == 0 else out.stdout + out.stderr


async def status_json(settings: Settings, *args: str) -> tuple[int, dict[str, Any]]:
    out = await cli(settings, "status", "--json", *args)
    assert out.returncode in (0, 3), out.stdout + out.stderr
    return out.returncode, json.loads(out.stdout)


async def test_no_writer_exits_3_naming_it_and_fires_the_alert(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str],
    settings: Settings, topology: Topology, tmp_path: Path,
) -> None:
    served = teams[0]
    port = free_port()
    consumer = procs.consume(*teams, metrics_port=port)
    await wait_until(lambda: db.fetchval(
        "SELECT count(*) = 1 FROM consumer WHERE expires_at > now()"), 20)
    soon = datetime.now(UTC) + timedelta(seconds=0.5)
    await client.defer_many([Deferral(TaskKey("nw", f"t{i}", "r"), DateTimeTrigger(soon), served)
                             for i in range(200)])

    async def events_waiting() -> tuple[int, dict[str, Any]] | None:
        code, report = await status_json(settings)
        return (code, report) if report["events"]["depth"] else None

    code, report = await wait_until(events_waiting, 30, interval=0.5,
                                    message="fired events waiting in the events queue")
    assert code == 3
    events = f"{settings.namespace}.events"
    depth = report["events"]["depth"]
    assert report["events"]["queue"] == events and report["writers"] == []
    assert (f"no live writer (none has registered): {depth} event message(s) waiting in "
            f"{events}") in report["problems"]
    assert report["not_subscribed"] == [] and report["dead_letters"]["depth"] == 0
    assert await states(db) == {"deferred": 200}  # fired, and nothing applied
    table = await cli(settings, "status")
    assert table.returncode == 3 and "no live writer" in table.stdout
    assert "Writers: none has registered" in table.stdout and events in table.stdout

    # What the consumer exports while no writer runs: 0 writers, the events waiting.
    async def consumer_sees_no_writer() -> Samples | None:
        s = await scrape(port)
        return s if ({"queue": events}, 0.0) in s.get("triggerflow_queue_consumers", []) \
            and ({"queue": events}, 0.0) in s.get("triggerflow_queue_subscribers", []) else None

    no_writer = await wait_until(consumer_sees_no_writer, 15, interval=0.5)
    assert any(v > 0 for labels, v in no_writer["triggerflow_queue_depth"]
               if labels == {"queue": events})

    writer = procs.writer()
    await wait_until(lambda: db.fetchval(
        "SELECT count(*) = 200 FROM task_instance WHERE state = 'scheduled'"), 30,
        message="the writer applies the backlog")

    async def writer_seen() -> Samples | None:
        s = await scrape(port)
        return s if ({"queue": events}, 1.0) in s.get("triggerflow_queue_consumers", []) \
            and ({"queue": events}, 1.0) in s.get("triggerflow_queue_subscribers", []) else None

    with_writer = await wait_until(writer_seen, 15, interval=0.5)
    _, report = await status_json(settings)
    assert not any("writer" in p for p in report["problems"]), report["problems"]
    assert [w["alive"] for w in report["writers"]] == [True]

    writer.send_signal(signal.SIGKILL)
    writer.wait(10)
    # The consumer hears the writer's presence queue go and ends its lease (presence.py);
    # tests/test_writer_presence.py checks that it is that, not the lease running out.
    await wait_until(lambda: db.fetchval(
        "SELECT count(*) = 0 FROM consumer WHERE kind = 'writer' AND expires_at > now()"), 30,
        message="the killed writer's lease expires")
    late = datetime.now(UTC) + timedelta(seconds=0.3)
    await client.defer(TaskKey("nw", "late", "r"), DateTimeTrigger(late), queue=served)
    code, report = await wait_until(events_waiting, 30, interval=0.5)
    assert code == 3
    problem = next(p for p in report["problems"] if "writer" in p)
    dead = report["writers"][0]
    assert re.fullmatch(
        rf"no live writer: 1 event message\(s\) waiting in {re.escape(events)}; the last, "
        rf"writer {dead['id']} on {re.escape(socket.gethostname())} \(pid {writer.pid}\), "
        r"renewed \d+s ago", problem), problem

    labels = [{"queue": events}]
    assert fired(tmp_path, "TriggerflowNoWriter", series_from(no_writer, "c"), "5m", labels) == ""
    # the scrape with a live writer is quiet (the check can fail)
    assert fired(tmp_path, "TriggerflowNoWriter", series_from(with_writer, "c"), "5m", labels)

    # Every process gone: no triggerflow series at all, only the scrape target's `up`.
    consumer.send_signal(signal.SIGKILL)
    consumer.wait(10)
    with pytest.raises(httpx.ConnectError):
        await scrape(port)
    assert fired(tmp_path, "TriggerflowNoWriter", {'up{job="triggerflow",instance="c"}': "0x6"},
                 "5m", [{"queue": "events"}]) == ""


async def test_a_queue_whose_triggers_timed_out_stays_reported_and_its_alerts_fire(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str],
    settings: Settings, tmp_path: Path,
) -> None:
    served, orphaned = teams
    port = free_port()
    procs.writer(metrics_port=port)
    procs.consume(served)
    await wait_until(lambda: db.fetchval(
        "SELECT count(*) = 2 FROM consumer WHERE expires_at > now()"), 20)
    far = datetime.now(UTC) + timedelta(hours=1)
    running = await client.defer_many([Deferral(TaskKey("q", f"r{i}", "r"),
                                                DateTimeTrigger(far), served) for i in range(3)])
    await client.defer(TaskKey("q", "orphan", "r"), DateTimeTrigger(far), queue=orphaned,
                       timeout=1)
    await wait_until(lambda: db.fetchval(
        "SELECT state = 'scheduled' FROM task_instance WHERE task_id = 'orphan'"), 20,
        message="the orphan's deferral timed out")
    assert await db.fetchval("SELECT count(*) FROM trigger WHERE queue = $1", orphaned) == 0

    # Nothing in the database names the queue any more; every scrape still reports it.
    samples: list[Samples] = []

    async def reported_for_a_while() -> bool:
        s = await scrape(port)
        assert ({"queue": orphaned}, 0.0) in s["triggerflow_queue_consumers"], s
        samples.append(s)
        return len(samples) >= 6  # the gauges poll every second here

    await wait_until(reported_for_a_while, 20, interval=1)
    last = samples[-1]
    assert ({"queue": served}, 1.0) in last["triggerflow_queue_consumers"]
    assert ({"queue": orphaned}, 1.0) in last["triggerflow_reaper_timed_out_total"]

    series = series_from(last, "w")
    assert fired(tmp_path, "TriggerflowQueueWithoutConsumer", series, "3m",
                 [{"queue": orphaned}]) == ""
    # the timed-out counter is born at 1 on the first timeout: the rule still sees it
    series.update(series_from(last, "w", prefix="triggerflow_reaper_timed_out", minutes=3))
    series = {k: ("_ " + v if "timed_out" in k else v) for k, v in series.items()}
    assert fired(tmp_path, "TriggerflowOverdueDeferredTasks", series, "3m",
                 [{"queue": orphaned}]) == ""

    # status lists ids by state, for requeue
    await client.defer_many([Deferral(TaskKey("q", f"u{i}", "r"), DateTimeTrigger(far),
                                      orphaned) for i in range(2)])
    out = await cli(settings, "status", "--ids", "running", "--queue", served)
    assert out.returncode == 0 and out.stdout.split() == [str(i) for i in sorted(running)]
    out = await cli(settings, "status", "--ids", "unclaimed", "--json")
    listed = json.loads(out.stdout)
    assert listed["state"] == "unclaimed"
    assert [t["queue"] for t in listed["triggers"]] == [orphaned, orphaned]
    out = await cli(settings, "status", "--ids", "quarantined", "--queue", served)
    assert out.returncode == 0 and out.stdout == ""


async def test_a_lease_without_a_subscription_is_named(
    db: Database, procs: Processes, teams: list[str], settings: Settings, tmp_path: Path,
) -> None:
    served = teams[0]
    port = free_port()
    procs.writer(metrics_port=port)
    # Renewing its subscription every 2 s (the suite's setting), the real consumer was off the
    # management API's list for most of a minute in one CI run (each renewal drops it until
    # the broker's next statistics sample); here it keeps the one it made.
    subscribed = procs.consume(served, subscription_renew_interval=600)
    await wait_until(lambda: db.fetchval(
        "SELECT count(*) = 2 FROM consumer WHERE expires_at > now()"), 20)
    # A consumer row that renews its lease but never reached the broker (as one with a
    # wrong broker password does): registered a minute ago, well below capacity.
    ghost = await db.fetchval(
        "INSERT INTO consumer (kind, host, pid, queues, capacity, running, started_at, "
        "renewed_at, expires_at) VALUES ('consumer', 'ghost-host', 4242, $1, 100, 0, "
        "now() - interval '1 minute', now(), now() + interval '5 minutes') RETURNING id",
        [served])

    seen: list[Any] = []

    async def broker_listed() -> tuple[int, dict[str, Any]] | None:
        code, report = await status_json(settings)
        named = [u["consumer_id"] for u in report["not_subscribed"]]
        seen[:] = [report["not_subscribed"], report["consumers"]]
        return (code, report) if named == [ghost] else None

    try:
        code, report = await wait_until(broker_listed, 60, interval=1,
                                        message="the management API lists the real consumer")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last seen: {seen!r}") from None
    assert code == 3
    assert report["not_subscribed"] == [{
        "queue": served, "consumer_id": ghost, "host": "ghost-host", "pid": 4242,
        "problem": f"consumer {ghost} on ghost-host (pid 4242) holds a lease on {served} but "
                   "is not subscribed on the broker"}]
    real = await db.fetchval("SELECT id FROM consumer WHERE pid = $1", subscribed.pid)
    assert real != ghost  # the real, subscribed consumer is matched by its connection name

    async def gauge() -> Samples | None:
        s = await scrape(port)
        return s if ({"queue": served}, 1.0) in s.get("triggerflow_queue_unsubscribed", []) \
            else None

    seen = await wait_until(gauge, 15, interval=0.5)
    assert ({"queue": served}, 2.0) in seen["triggerflow_queue_consumers"]
    assert fired(tmp_path, "TriggerflowConsumerNotSubscribed", series_from(seen, "w"), "3m",
                 [{"queue": served}]) == ""

    await db.execute("DELETE FROM consumer WHERE id = $1", ghost)
    _, report = await status_json(settings)
    assert report["not_subscribed"] == []
