"""Operations against the real services: metrics match the database, one trace from defer to
write, blocking triggers named, status / health / admin commands, the configuration page,
no secrets in output. Every wait is bounded."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ROOT, START_WAIT, Processes, consumer_id, settings_env, wait_until
from tests.triggers import BlocksLoop, EventAfter, Killer, Raises, Spins, WaitsForever
from triggerflow.model import TaskKey
from triggerflow.sdk import Deferral, TriggerflowClient
from triggerflow.settings import Settings
from triggerflow.store.postgres import Database
from triggerflow.triggers import DateTimeTrigger

# ----------------------------------------------------------------------------- helpers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def key(i: int, dag: str = "ops") -> TaskKey:
    return TaskKey(dag, f"task{i}", "run1")


Samples = dict[str, list[tuple[dict[str, str], float]]]


async def scrape(port: int) -> Samples:
    """Every sample of a Prometheus endpoint, by sample name (``otel_scope_*`` labels dropped)."""
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"http://127.0.0.1:{port}/metrics", timeout=5)).text
    out: Samples = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if not k.startswith("otel_scope")}
            out[s.name].append((labels, s.value))
    return out


async def scrape_when_up(port: int) -> Samples:
    async def attempt() -> Samples | None:
        try:
            return await scrape(port)
        except httpx.HTTPError:
            return None

    return await wait_until(attempt, 20, message=f"metrics on port {port}")  # type: ignore[no-any-return]


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    return sum(v for lab, v in samples.get(name, [])
               if all(lab.get(k) == want for k, want in labels.items()))


async def cli(settings: Settings, *args: str, **overrides: Any) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "triggerflow", *args],
        env=settings_env(settings, **overrides), cwd=ROOT, capture_output=True, text=True,
        timeout=60,
    )




async def writer_up(db: Database, proc: subprocess.Popen[bytes]) -> None:
    await wait_until(lambda: db.fetchval(
        "SELECT count(*) = 1 FROM consumer WHERE pid = $1 AND kind = 'writer'", proc.pid),
        START_WAIT, message="writer registered")


# ----------------------------------------------------------------------------- metrics


async def test_metrics_endpoint_serves_named_metrics_matching_the_database(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str]
) -> None:
    wport, cport = free_port(), free_port()
    writer = procs.writer(metrics_port=wport)
    consumer = procs.consume(teams[0], metrics_port=cport)
    await writer_up(db, writer)
    await consumer_id(db, consumer)
    soon = datetime.now(UTC) + timedelta(seconds=1)
    q = teams[0]
    deferrals = (
        [Deferral(key(i), DateTimeTrigger(soon), q) for i in range(4)]
        + [Deferral(key(10 + i), EventAfter(kind="success", delay=0.1, payload=i), q)
           for i in range(3)]
        + [Deferral(key(20 + i), EventAfter(delay=0.1, payload={"n": i}), q) for i in range(2)]
        + [Deferral(key(30 + i), Raises(delay=0.1), q) for i in range(2)]
    )
    await client.defer_many(deferrals)
    await wait_until(lambda: db.fetchval(
        "SELECT count(*) = 0 FROM task_instance WHERE state = 'deferred'"), 20,
        message="all resolved")

    # What the database says happened.
    by_kind = {r["kind"]: r["n"] for r in await db.fetch(
        "SELECT CASE WHEN state = 'scheduled' AND next_method = '__fail__' THEN 'fail' "
        "            WHEN state = 'scheduled' THEN 'resume' ELSE state END AS kind, "
        "       count(*) AS n FROM task_instance WHERE event_applied_at IS NOT NULL GROUP BY 1")}
    assert by_kind == {"resume": 6, "success": 3, "fail": 2}
    deferred = await db.fetchval("SELECT count(*) FROM task_instance")
    assert deferred == len(deferrals)

    async def consumer_counts_settled() -> Samples | None:
        s = await scrape(cport)
        return s if total(s, "triggerflow_events_emitted_total") == deferred else None

    c = await wait_until(consumer_counts_settled, 10, message="consumer counters")
    w = await scrape_when_up(wport)

    # Consumer: claims, starts and emitted events by kind equal the database.
    assert total(c, "triggerflow_triggers_claimed_total") == deferred
    assert total(c, "triggerflow_triggers_started_total") == deferred
    for kind, n in by_kind.items():
        assert total(c, "triggerflow_events_emitted_total", kind=kind, queue=q) == n, kind
    assert total(c, "triggerflow_triggers_failed_total", queue=q) == by_kind["fail"]
    assert total(c, "triggerflow_triggers_succeeded_total", queue=q) == deferred - by_kind["fail"]
    assert c["triggerflow_triggers_running"] == [({"queue": q}, 0.0)]
    assert c["triggerflow_capacity_left"] == [({}, float(Settings().capacity))]
    assert total(c, "triggerflow_loop_lag_seconds_count") > 0
    assert "triggerflow_loop_lag_seconds_bucket" in c
    assert total(c, "triggerflow_lease_renewals_total") >= 1

    # Writer: events applied by kind equal the task instances moved; one latency sample each.
    for kind, n in by_kind.items():
        assert total(w, "triggerflow_writer_events_applied_total", kind=kind, queue=q) == n, kind
    assert total(w, "triggerflow_event_latency_seconds_count", queue=q) == deferred
    assert 0 < total(w, "triggerflow_event_latency_seconds_sum") < 5 * deferred
    assert total(w, "triggerflow_writer_batch_size_sum") == deferred
    batches = total(w, "triggerflow_writer_batch_size_count")
    assert 1 <= batches <= deferred
    assert total(w, "triggerflow_writer_commit_time_seconds_count") == batches
    assert total(w, "triggerflow_writer_events_ignored_total") == 0


async def test_failures_are_counted_by_reason(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str], tmp_path: Path
) -> None:
    port = free_port()
    procs.writer()
    procs.consume(teams[0], metrics_port=port)
    await client.defer_many([Deferral(key(1), Raises(), teams[0]),
                             Deferral(key(2), WaitsForever(marker_dir=str(tmp_path)), teams[0],
                                      timeout=0.5)])
    await wait_until(lambda: db.fetchval(
        "SELECT count(*) = 2 FROM task_instance WHERE next_method = '__fail__'"), 20)

    async def counted() -> Samples | None:
        s = await scrape(port)
        return s if total(s, "triggerflow_triggers_failed_total") == 2 else None

    s = await wait_until(counted, 10)
    assert total(s, "triggerflow_triggers_failed_total", reason="Trigger failure") == 1
    assert total(s, "triggerflow_triggers_failed_total", reason="Trigger timeout") == 1


async def test_queue_depth_and_consumer_count_per_queue(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str],
    settings: Settings,
) -> None:
    served, unserved = teams
    wport, cport = free_port(), free_port()
    writer = procs.writer(metrics_port=wport)
    consumer = procs.consume(served, metrics_port=cport)
    await writer_up(db, writer)
    await consumer_id(db, consumer)
    far = datetime.now(UTC) + timedelta(hours=1)
    await client.defer_many([Deferral(key(i), DateTimeTrigger(far), served) for i in range(3)])
    await client.defer_many([Deferral(key(10 + i), DateTimeTrigger(far), unserved)
                             for i in range(3)])  # one wake-up message, nobody to take it
    events_queue = f"{settings.namespace}.events"

    async def writer_view() -> Samples | None:
        s = await scrape(wport)
        ok = (total(s, "triggerflow_queue_depth", queue=unserved) == 1
              and total(s, "triggerflow_queue_consumers", queue=unserved) == 0
              and total(s, "triggerflow_queue_consumers", queue=served) == 1
              and total(s, "triggerflow_queue_consumers", queue=events_queue) == 1)
        return s if ok else None

    w = await wait_until(writer_view, 15, message="writer's queue gauges")
    assert ({"queue": unserved}, 0.0) in w["triggerflow_queue_subscribers"]
    assert ({"queue": served}, 1.0) in w["triggerflow_queue_subscribers"]
    assert total(w, "triggerflow_queue_depth", queue=served) == 0

    async def consumer_view() -> Samples | None:
        s = await scrape(cport)
        return s if sorted(s.get("triggerflow_queue_consumers", []), key=str) == [
            ({"queue": served}, 1.0), ({"queue": events_queue}, 1.0)] else None

    c = await wait_until(consumer_view, 15, message="consumer's queue gauges")
    # its own queues only, and the shared ones (so a vanished writer still shows as 0)
    assert sorted(c["triggerflow_queue_depth"], key=str) == [
        ({"queue": served}, 0.0), ({"queue": f"{settings.namespace}.dead"}, 0.0),
        ({"queue": events_queue}, 0.0)]


# ----------------------------------------------------------------------------- traces


def read_spans(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def trace_to(path: Path) -> None:
    """Spans of this test process go to ``path`` (the SDK's defer span)."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from triggerflow import telemetry

    if not telemetry._configured:
        telemetry.setup(service="test-sdk", trace_file=str(path))
        return
    provider = trace.get_tracer_provider()  # set up earlier in this pytest process
    assert isinstance(provider, TracerProvider), "telemetry set up without tracing"
    provider.add_span_processor(SimpleSpanProcessor(telemetry.JsonLinesSpanExporter(str(path))))


async def test_one_trace_from_defer_through_fire_to_write(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str], tmp_path: Path
) -> None:
    from opentelemetry import trace

    sdk_file, consumer_file, writer_file = (tmp_path / f"{n}.jsonl"
                                            for n in ("sdk", "consumer", "writer"))
    trace_to(sdk_file)
    procs.writer(trace_file=str(writer_file))
    procs.consume(teams[0], trace_file=str(consumer_file))
    tid = await client.defer(key(1), EventAfter(delay=0.2, payload={"ok": 1}), queue=teams[0])
    trace.get_tracer_provider().force_flush()  # type: ignore[attr-defined]
    await wait_until(lambda: db.fetchval(
        "SELECT state = 'scheduled' FROM task_instance WHERE trigger_id IS NULL"), 20)

    def named(path: Path, name: str) -> list[dict[str, Any]]:
        return [s for s in read_spans(path) if s["name"] == name
                and s["attributes"].get("triggerflow.trigger_id", tid) == tid]

    async def all_spans() -> tuple[dict[str, Any], ...] | None:
        d, f, w = (named(sdk_file, "triggerflow.defer"),
                   named(consumer_file, "triggerflow.fire"),
                   named(writer_file, "triggerflow.write"))
        return (d[-1], f[-1], w[-1]) if d and f and w else None

    defer, fire, write = await wait_until(all_spans, 15, message="spans of all three processes")
    assert defer["service"] == "test-sdk"
    assert fire["service"] == "triggerflow-consumer"
    assert write["service"] == "triggerflow-writer"
    assert defer["trace_id"] == fire["trace_id"] == write["trace_id"]
    assert fire["parent_id"] == defer["span_id"]
    assert write["parent_id"] == fire["span_id"]
    assert fire["attributes"]["triggerflow.event"] == "resume"
    assert fire["attributes"]["triggerflow.queue"] == teams[0]
    # The waiting trigger held only the trace context, stored with its row.
    assert defer["start"] <= fire["start"] <= write["start"]


# ----------------------------------------------------------------------------- blocked loop


@pytest.mark.serial  # timing bound (a 0.2-0.8 s window): runs alone, after the parallel part
async def test_sleeping_trigger_is_named_in_a_warning_and_a_metric(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str]
) -> None:
    port = free_port()
    procs.writer()
    consumer = procs.consume(teams[0], metrics_port=port)
    await consumer_id(db, consumer)
    tid = await client.defer(key(1), BlocksLoop(delay=0.2, seconds=0.8), queue=teams[0])
    await wait_until(lambda: db.fetchval(
        "SELECT state = 'scheduled' FROM task_instance"), 20, message="BlocksLoop resumed")
    culprit = f"by trigger tests.triggers.BlocksLoop (id {tid})"
    lines = [line for line in procs.log(consumer).splitlines() if culprit in line]
    assert lines, procs.log(consumer)
    assert "WARNING" in lines[0]
    # Reported while still blocking: the first report comes before the 0.8 s sleep ends.
    first = float(lines[0].split("blocked for ")[1].split("s ")[0])
    assert 0.2 <= first < 0.8
    s = await scrape_when_up(port)
    assert total(s, "triggerflow_triggers_blocked_main_thread_total",
                 trigger_class="tests.triggers.BlocksLoop") >= 1
    # A block shorter than the lease costs nothing else.
    assert "lease lost" not in procs.log(consumer)


async def test_spinning_trigger_is_named_costs_its_lease_and_its_triggers_move(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str],
    settings: Settings, tmp_path: Path,
) -> None:
    procs.writer()
    spinner = procs.consume(teams[0])
    spinner_id = await consumer_id(db, spinner)
    waits = await client.defer_many([
        Deferral(key(i), WaitsForever(marker_dir=str(tmp_path)), teams[0]) for i in range(3)])
    # Spins once: on the peer it moves to it waits, so the peer's health is not a race
    # against its 2 s delay.
    spin = await client.defer(key(9), Spins(delay=2.0, once=str(tmp_path / "spun")),
                              queue=teams[0])
    await wait_until(lambda: db.fetchval(
        "SELECT count(*) = 4 FROM trigger WHERE owner_id = $1", spinner_id), 15,
        message="the first consumer holds all four")
    await wait_until(lambda: asyncio.sleep(0, all(
        (tmp_path / f"started-{w}").exists() for w in waits)), 10)
    for w in waits:
        (tmp_path / f"started-{w}").unlink()
    peer = procs.consume(teams[0])
    peer_id = await consumer_id(db, peer)

    culprit = f"by trigger tests.triggers.Spins (id {spin})"
    await wait_until(lambda: asyncio.sleep(0, culprit in procs.log(spinner)), 15,
                     message="Spins named in the log")
    # The blocked loop cannot renew: the lease runs out and health fails for that pid.
    await wait_until(lambda: db.fetchval(
        "SELECT count(*) = 0 FROM consumer WHERE id = $1 AND expires_at > now()", spinner_id),
        10, message="spinner's lease expired")
    out = await cli(settings, "health", "--pid", str(spinner.pid))
    assert out.returncode == 1, out.stdout
    assert out.stdout.startswith(("stalled:", "dead:")), out.stdout
    assert len(out.stdout.strip().splitlines()) == 1
    assert spinner.poll() is None  # still running, still spinning: only the lease says so

    # Its other triggers move to the peer, which starts them again.
    await wait_until(lambda: db.fetchval(
        "SELECT count(*) = 3 FROM trigger WHERE owner_id = $1 AND id = ANY($2::bigint[]) "
        "AND attempt = 2", peer_id, waits), 15, message="other triggers on the peer")
    await wait_until(lambda: asyncio.sleep(0, all(
        (tmp_path / f"started-{w}").exists() for w in waits)), 10, message="restarted on peer")
    assert (await cli(settings, "health", "--pid", str(peer.pid))).returncode == 0
    lines = [line for line in procs.log(spinner).splitlines() if culprit in line]
    assert len(lines) >= 3  # reported again as the block keeps doubling (0.2, 0.4, 0.8 s...)


# ----------------------------------------------------------------------------- status


async def test_status_json_flags_a_queue_without_consumer_then_passes(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str],
    settings: Settings,
) -> None:
    served, unserved = teams
    writer = procs.writer()
    first = procs.consume(served)
    await writer_up(db, writer)
    first_id = await consumer_id(db, first)
    far = datetime.now(UTC) + timedelta(hours=1)
    await client.defer_many([Deferral(key(i), DateTimeTrigger(far), served) for i in range(2)])
    await client.defer_many([Deferral(key(10 + i), DateTimeTrigger(far), unserved)
                             for i in range(3)])
    await wait_until(lambda: db.fetchval(
        "SELECT count(*) = 2 FROM trigger WHERE owner_id = $1", first_id), 15)
    # status reads what the consumer's renewals wrote (running, subscribed on the broker): a
    # claim can land before the first renewal after subscribing (a CI run read 0 consumers)
    await wait_until(lambda: db.fetchval(
        "SELECT running = 2 AND subscribed FROM consumer WHERE id = $1", first_id), 10)

    out = await cli(settings, "status", "--json")
    assert out.returncode == 3, out.stdout + out.stderr
    report = json.loads(out.stdout)
    queues = {q["queue"]: q for q in report["queues"]}
    assert queues[unserved]["consumers"] == 0
    assert queues[unserved]["triggers"] == 3 and queues[unserved]["unclaimed"] == 3
    assert queues[unserved]["depth"] == 1  # one wake-up message waits for a consumer
    assert queues[served]["consumers"] == 1 and queues[served]["running"] == 2
    assert f"queue {unserved} has no live consumer" in report["problems"]
    consumer = next(c for c in report["consumers"] if c["id"] == first_id)
    assert consumer["queues"] == [served] and consumer["host"] == socket.gethostname()
    assert consumer["alive"] and consumer["capacity"] == Settings().capacity

    second = procs.consume(unserved)
    second_id = await consumer_id(db, second)
    await wait_until(lambda: db.fetchval(
        "SELECT count(*) = 3 FROM trigger WHERE owner_id = $1", second_id), 15)
    await wait_until(lambda: db.fetchval(
        "SELECT running = 3 AND subscribed FROM consumer WHERE id = $1", second_id), 10)
    out = await cli(settings, "status", "--json")
    assert out.returncode == 0, out.stdout
    report = json.loads(out.stdout)
    assert report["problems"] == []
    queues = {q["queue"]: q for q in report["queues"]}
    assert queues[unserved]["consumers"] == 1 and queues[unserved]["running"] == 3
    assert queues[unserved]["depth"] == 0
    table = await cli(settings, "status")
    assert table.returncode == 0
    assert "all queues served" in table.stdout and unserved in table.stdout


# ----------------------------------------------------------------------------- admin


async def test_trigger_show_and_cancel_twice(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str],
    settings: Settings, tmp_path: Path,
) -> None:
    procs.writer()
    consumer = procs.consume(teams[0])
    cid = await consumer_id(db, consumer)
    tid = await client.defer(key(1), WaitsForever(marker_dir=str(tmp_path)), queue=teams[0])
    await wait_until(lambda: asyncio.sleep(0, (tmp_path / f"started-{tid}").exists()), 10)

    shown = await cli(settings, "trigger", "show", str(tid))
    assert shown.returncode == 0, shown.stderr
    fields = dict(line.split(None, 1) for line in shown.stdout.splitlines())
    assert fields["id"] == str(tid)
    assert fields["classpath"] == "tests.triggers.WaitsForever"
    assert fields["owner_id"] == str(cid) and fields["owner_alive"] == "True"
    assert fields["attempt"] == "1" and fields["task_state"] == "deferred"
    assert fields["task_id"] == "task1" and fields["last_error"] == "-"
    as_json = json.loads((await cli(settings, "trigger", "show", str(tid), "--json")).stdout)
    assert as_json["owner_id"] == cid

    out = await cli(settings, "cancel", str(tid))
    assert out.returncode == 0 and "cancelled 1 task(s)" in out.stdout, out.stdout + out.stderr
    await wait_until(lambda: asyncio.sleep(0, (tmp_path / f"cleanup-{tid}").exists()), 10,
                     message="cleanup ran on the owner")
    await wait_until(lambda: db.fetchval("SELECT count(*) = 0 FROM trigger"), 10)
    assert await db.fetchval("SELECT state FROM task_instance") == "removed"
    again = await cli(settings, "cancel", str(tid))
    assert again.returncode == 0 and "cancelled 0 task(s); 1 already" in again.stdout
    assert await db.fetchval("SELECT state FROM task_instance") == "removed"
    gone = await cli(settings, "trigger", "show", str(tid))
    assert gone.returncode == 1 and f"no trigger {tid}" in gone.stderr


async def test_requeue_frees_a_trigger_of_a_vanished_owner_once(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str],
    settings: Settings,
) -> None:
    procs.writer()
    consumer = procs.consume(teams[0])
    cid = await consumer_id(db, consumer)
    far = datetime.now(UTC) + timedelta(hours=1)
    tid = await client.defer(key(1), DateTimeTrigger(far), queue=teams[0])
    await wait_until(lambda: db.fetchval(
        "SELECT owner_id = $1 FROM trigger WHERE id = $2", cid, tid), 10)
    # An owner whose row is gone (unregistered after a failed hand-back): nothing re-sends it.
    await db.execute("UPDATE trigger SET owner_id = 424242 WHERE id = $1", tid)
    status = json.loads((await cli(settings, "status", "--json")).stdout)
    assert any(q["dead_owner"] == 1 for q in status["queues"])

    out = await cli(settings, "requeue", str(tid))
    assert out.returncode == 0 and "requeued 1 trigger(s)" in out.stdout, out.stdout + out.stderr
    await wait_until(lambda: db.fetchval(
        "SELECT owner_id = $1 AND attempt = 2 FROM trigger WHERE id = $2", cid, tid), 10,
        message="claimed again by the live consumer")

    again = await cli(settings, "requeue", str(tid))
    assert again.returncode == 0, again.stderr
    assert "requeued 0 trigger(s); 1 needed nothing" in again.stdout
    assert f"runs on live consumer {cid}" in again.stdout
    await asyncio.sleep(1)
    row = await db.fetchrow("SELECT owner_id, attempt FROM trigger WHERE id = $1", tid)
    assert (row["owner_id"], row["attempt"]) == (cid, 2)  # the second run changed nothing

    forced = await cli(settings, "requeue", "--force", str(tid))
    assert forced.returncode == 0 and "requeued 1 trigger(s)" in forced.stdout
    await wait_until(lambda: db.fetchval(
        "SELECT owner_id = $1 AND attempt = 3 FROM trigger WHERE id = $2", cid, tid), 10)


async def test_unquarantine_redefers_the_task_once(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str],
    settings: Settings,
) -> None:
    # The real path: a trigger kills each consumer that runs it; after max_failures such
    # losses a surviving peer's reaper quarantines it and fails its task.
    procs.writer()
    victims = [procs.consume(teams[1], max_failures=2) for _ in range(3)]
    for victim in victims:
        await consumer_id(db, victim)
    tid = await client.defer(key(1), Killer(delay=0.3), queue=teams[1], method_name="resume_me",
                             kwargs={"carry": 1}, timeout=3600)
    await wait_until(lambda: db.fetchval(
        "SELECT quarantined_at IS NOT NULL FROM trigger WHERE id = $1", tid), 30,
        message="Killer quarantined")
    await asyncio.sleep(0.5)
    assert sorted(v.poll() or 0 for v in victims) == [0, 137, 137]  # two died, one reaped
    for v in victims:  # stop the survivor: nobody should run the re-sent killer below
        if v.poll() is None:
            v.terminate()
            v.wait(10)
    task = await db.fetchrow("SELECT state, next_method, next_kwargs->>'error' AS error "
                             "FROM task_instance")
    assert dict(task) == {"state": "scheduled", "next_method": "__fail__",
                          "error": "Trigger quarantined"}
    status = await cli(settings, "status", "--json")
    assert status.returncode == 3
    assert [q["id"] for q in json.loads(status.stdout)["quarantined"]] == [tid]

    out = await cli(settings, "unquarantine", str(tid))
    assert out.returncode == 0 and "unquarantined 1 trigger(s)" in out.stdout, out.stdout
    row = await db.fetchrow(
        "SELECT ti.state, ti.next_method, ti.next_kwargs->>'carry' AS carry, "
        "       ti.trigger_timeout IS NOT NULL AS has_timeout, t.quarantined_at, t.failures, "
        "       t.owner_id FROM task_instance ti JOIN trigger t ON t.id = ti.trigger_id")
    assert dict(row) == {"state": "deferred", "next_method": "resume_me", "carry": "1",
                         "has_timeout": True, "quarantined_at": None, "failures": 0,
                         "owner_id": None}
    again = await cli(settings, "unquarantine", str(tid))
    assert again.returncode == 0
    assert "unquarantined 0 trigger(s); dropped 0" in again.stdout
    assert "1 needed nothing" in again.stdout
    assert await db.fetchval("SELECT state FROM task_instance") == "deferred"


# ----------------------------------------------------------------------------- health


async def test_health_alive_stalled_dead(
    db: Database, procs: Processes, teams: list[str], settings: Settings
) -> None:
    port = free_port()
    consumer = procs.consume(teams[0], metrics_port=port)  # no peer or writer: nobody reaps it
    cid = await consumer_id(db, consumer)
    pid = str(consumer.pid)

    alive = await cli(settings, "health", "--kind", "consumer", "--pid", pid)
    assert alive.returncode == 0, alive.stdout
    assert alive.stdout.startswith(f"ok: consumer {cid} (pid {pid}) renewed ")
    assert (await cli(settings, "health")).returncode == 0

    consumer.send_signal(signal.SIGSTOP)
    try:
        await wait_until(lambda: db.fetchval(
            "SELECT expires_at < now() FROM consumer WHERE id = $1", cid), 10)
        stalled = await cli(settings, "health", "--pid", pid)
        assert stalled.returncode == 1
        assert stalled.stdout.startswith(f"stalled: consumer {cid} (pid {pid}) last renewed")
        assert len(stalled.stdout.strip().splitlines()) == 1
    finally:
        consumer.send_signal(signal.SIGCONT)

    # Resumed, it finds its lease gone, counts it, and registers anew.
    new_id = await consumer_id(db, consumer)
    assert new_id != cid
    assert (await cli(settings, "health", "--pid", pid)).returncode == 0
    s = await scrape_when_up(port)
    assert total(s, "triggerflow_lease_lost_total") == 1

    consumer.send_signal(signal.SIGTERM)
    assert consumer.wait(15) == 0
    dead = await cli(settings, "health", "--pid", pid)
    assert dead.returncode == 1
    assert dead.stdout.strip() == (f"dead: no live triggerflow process with pid {pid} "
                                   f"on {socket.gethostname()}")


# ----------------------------------------------------------------------------- docs, secrets


def test_configuration_reference_is_up_to_date() -> None:
    from tools.docgen import configuration_reference
    from triggerflow.cli import main

    page = ROOT / "docs" / "configuration.md"
    assert page.read_text() == configuration_reference(main), (
        "regenerate: triggerflow docs config --output docs/configuration.md")


async def test_passwords_never_printed(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str],
    settings: Settings,
) -> None:
    assert "guest:guest" in settings.amqp_url.get_secret_value()
    procs.writer(log_level="DEBUG")
    consumer = procs.consume(teams[0], log_level="DEBUG", log_format="json")
    refused = procs.consume(teams[0], amqp_url=settings.amqp_url.get_secret_value().replace(
        "guest:guest@", "guest:hunter2secret@"))
    await consumer_id(db, consumer)
    await client.defer(key(1), Raises(), queue=teams[0])
    await wait_until(lambda: db.fetchval("SELECT state = 'scheduled' FROM task_instance"), 20)

    outputs = [await cli(settings, "status", "--json"), await cli(settings, "status"),
               await cli(settings, "health")]
    bad_broker = "amqp://guest:hunter2secret@127.0.0.1:1/"
    unreachable = await cli(settings, "status", "--json", amqp_url=bad_broker)
    assert unreachable.returncode == 3
    assert any(p.startswith("broker unreachable")
               for p in json.loads(unreachable.stdout)["problems"])
    outputs += [unreachable, await cli(settings, "status", amqp_url=bad_broker)]
    bad_db = "postgresql://postgres:pgsecretword@127.0.0.1:1/nowhere"
    outputs += [await cli(settings, "status", database_url=bad_db),
                await cli(settings, "health", database_url=bad_db),
                await cli(settings, "trigger", "show", "1", database_url=bad_db)]
    assert all(o.returncode != 0 for o in outputs[-3:])
    await wait_until(lambda: asyncio.sleep(0, "ACCESS_REFUSED" in procs.log(refused)), 15)
    texts = [o.stdout + o.stderr for o in outputs] + [procs.log(p) for p in procs.procs]
    for text in texts:
        for secret in ("guest:guest", "hunter2secret", "pgsecretword"):
            assert secret not in text, text
