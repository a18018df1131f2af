"""Bad input loses nothing and stops nobody: garbage, wrong versions, bad classes, poison
payloads, forged events, killers. Each case asserts its outcome and that the consumer keeps
serving valid triggers."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import aio_pika
import pytest

from tests.conftest import Processes, wait_until
from tests.triggers import BadPayload, EventAfter, Killer
from triggerflow.model import TaskKey
from triggerflow.sdk import Deferral, DeferralError, TriggerflowClient
from triggerflow.settings import Settings
from triggerflow.store.postgres import Database
from triggerflow.transport.rabbitmq import RabbitTransport, Topology
from triggerflow.triggers import DateTimeTrigger
from triggerflow.wire import HEADER_REASON, Event, encode_events


async def dead_letters(settings: Settings, expect: int, timeout: float = 10) -> list[tuple[bytes, str]]:
    """Read ``expect`` messages off the namespace's dead-letter queue."""
    conn = await aio_pika.connect(settings.amqp_dsn())
    got: list[tuple[bytes, str]] = []
    try:
        ch = await conn.channel()
        q = await ch.declare_queue(Topology(settings.namespace).dead_queue, passive=True)
        deadline = time.monotonic() + timeout
        while len(got) < expect and time.monotonic() < deadline:
            msg = await q.get(fail=False)
            if msg is None:
                await asyncio.sleep(0.1)
                continue
            await msg.ack()
            got.append((msg.body, str((msg.headers or {}).get(HEADER_REASON, ""))))
    finally:
        await conn.close()
    return got


async def insert_trigger(db: Database, classpath: str, kwargs: str, queue: str, n: int) -> int:
    """Write a trigger row as a buggy or hostile client might (bypassing SDK checks)."""
    tid = await db.fetchval(
        "INSERT INTO trigger (classpath, kwargs, queue) VALUES ($1, $2, $3) RETURNING id",
        classpath, kwargs, queue)
    await db.execute(
        "INSERT INTO task_instance (dag_id, task_id, run_id, state, queue, next_method, "
        "trigger_id) VALUES ('bad', $1, 'r', 'deferred', $2, 'execute_complete', $3)",
        f"t{n}", queue, tid)
    return int(tid)


async def test_garbage_wrong_version_unknown_and_disallowed_classes(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str],
    settings: Settings,
) -> None:
    procs.writer()
    consumer = procs.consume(teams[0])
    q = teams[0]
    unknown = await insert_trigger(db, "tests.triggers.DoesNotExist", "{}", q, 1)
    disallowed = await insert_trigger(db, "os.system", '{"command": "true"}', q, 2)
    not_trigger = await insert_trigger(db, "tests.triggers.NotATrigger", "{}", q, 3)
    bad_kwargs = await insert_trigger(db, "tests.triggers.EventAfter", '[1, 2]', q, 4)
    broker = RabbitTransport(settings.amqp_dsn(), Topology(settings.namespace))
    await broker.connect()
    ex = broker.topology.deferrals_of(q)
    await broker.publish(ex, q, b"\x00\xffnot json at all")
    await broker.publish(ex, q, json.dumps({"v": 99, "ids": [1]}).encode())
    await broker.publish(ex, q, json.dumps({"v": 2, "ids": [unknown, disallowed]}).encode())
    await broker.publish(ex, q, json.dumps({"v": 1, "id": not_trigger}).encode())  # previous version
    await broker.publish(ex, q, json.dumps({"v": 2, "ids": [bad_kwargs]}).encode())
    await broker.close()
    # ...and a valid trigger behind all of it still runs.
    await client.defer(TaskKey("good", "t", "r"), EventAfter(payload="fine"), queue=q)
    await wait_until(lambda: db.fetchval(
        "SELECT count(*) = 5 FROM task_instance WHERE state = 'scheduled'"), 20)
    rows = {r["task_id"]: json.loads(r["nk"]) for r in await db.fetch(
        "SELECT task_id, next_kwargs::text AS nk FROM task_instance WHERE dag_id = 'bad'")}
    assert rows["t1"]["error"] == "Trigger could not be loaded"
    assert "tests.triggers.DoesNotExist" in rows["t1"]["message"]
    assert rows["t2"]["error"] == "Trigger class not allowed" and "'os.system'" in rows["t2"]["message"]
    assert "NotATrigger" in rows["t3"]["message"] and "not a BaseTrigger" in rows["t3"]["message"]
    assert "EventAfter" in rows["t4"]["message"] and "consumer" in rows["t4"]["message"]
    good = await db.fetchval("SELECT next_kwargs->>'event' FROM task_instance WHERE dag_id = 'good'")
    assert good == "fine"
    letters = await dead_letters(settings, 2)
    reasons = sorted(r for _, r in letters)
    assert len(letters) == 2
    assert any("undecodable" in r for r in reasons)
    assert any("unsupported schema version 99" in r for r in reasons)
    assert consumer.poll() is None


async def test_a_dead_letter_the_broker_cannot_take_is_filed_later_not_lost(
    db: Database, procs: Processes, teams: list[str], settings: Settings,
) -> None:
    """The dead-letter exchange is gone while the writer refuses a message: the message is
    held unacked (not acked with its reason lost) and filed once the exchange is back, and
    the writer applies valid events meanwhile."""
    writer = procs.writer()
    q = teams[0]
    broker = RabbitTransport(settings.amqp_dsn(), Topology(settings.namespace))
    await broker.connect()
    try:
        conn = await aio_pika.connect(settings.amqp_dsn())
        async with conn:
            await (await conn.channel()).exchange_delete(broker.topology.dead)
        await broker.publish(broker.topology.events, q, b"\x00\xffnot an event batch")
        async def refused() -> bool:  # the writer read it, and refused it
            return "undecodable" in procs.log(writer)

        await wait_until(refused, 20)
        good = await insert_trigger(db, "tests.triggers.EventAfter", "{}", q, 300)
        await broker.publish_events(q, [Event(good, 0, q, "resume", '{"ok": 1}', time.time())])
        await wait_until(lambda: db.fetchval(
            "SELECT state = 'scheduled' FROM task_instance WHERE task_id = 't300'"), 15)
        assert await dead_letters(settings, 1, timeout=1) == []
        await broker.declare(teams)  # `triggerflow topology apply`: the exchange is back
    finally:
        await broker.close()
    letters = await dead_letters(settings, 1, timeout=60)
    assert letters and "undecodable" in letters[0][1], letters
    assert b"not an event batch" in letters[0][0]
    assert "could not be filed" in procs.log(writer)  # the fault was met, not missed
    assert writer.poll() is None


async def test_sdk_refuses_bad_deferrals_before_writing(
    client: TriggerflowClient, db: Database, teams: list[str], settings: Settings
) -> None:
    from triggerflow.transport import Unroutable

    with pytest.raises(DeferralError, match="exceed"):
        await client.defer(TaskKey("d", "big", "r"), EventAfter(blob="x" * 70_000), queue=teams[0])
    with pytest.raises(DeferralError, match="not JSON-serializable"):
        await client.defer(TaskKey("d", "obj", "r"), EventAfter(x=object()), queue=teams[0])
    with pytest.raises(Unroutable, match="does not exist"):
        await client.defer(TaskKey("d", "q", "r"), EventAfter(), queue="no-such-team-queue")
    assert await db.fetchval("SELECT count(*) FROM trigger") == 0
    assert await db.fetchval("SELECT count(*) FROM task_instance") == 0


async def test_poison_event_payloads(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str],
    settings: Settings,
) -> None:
    """The consumer turns an unstorable payload into a readable failure; an event that still
    reaches the writer with a NUL is dead-lettered and the rest of its batch applied."""
    procs.writer()
    procs.consume(teams[0])
    await client.defer(TaskKey("p", "nul", "r"), BadPayload(), queue=teams[0])
    await client.defer(TaskKey("p", "obj", "r"), BadPayload(mode="object"), queue=teams[0])
    await wait_until(lambda: db.fetchval(
        "SELECT count(*) = 2 FROM task_instance WHERE next_method = '__fail__'"), 15)
    msgs = [r["m"] for r in await db.fetch(
        "SELECT next_kwargs->>'message' AS m FROM task_instance ORDER BY task_id")]
    assert "NUL" in msgs[0] and "not JSON-serializable" in msgs[1]
    # Now straight onto the events exchange, as a buggy consumer would.
    good_ids = [await insert_trigger(db, "tests.triggers.EventAfter", "{}", teams[0], 100 + i)
                for i in range(3)]
    bad_id = await insert_trigger(db, "tests.triggers.EventAfter", "{}", teams[0], 200)
    now = time.time()
    events = [Event(t, 0, teams[0], "resume", json.dumps({"ok": t}), now) for t in good_ids]
    events.insert(1, Event(bad_id, 0, teams[0], "resume", '{"bad": "a\\u0000b"}', now))
    broker = RabbitTransport(settings.amqp_dsn(), Topology(settings.namespace))
    await broker.connect()
    await broker.publish(broker.topology.events, teams[0], encode_events(events))
    await broker.close()
    await wait_until(lambda: db.fetchval(
        "SELECT count(*) = 3 FROM task_instance WHERE trigger_id IS NULL AND task_id IN "
        "('t100', 't101', 't102') AND state = 'scheduled'"), 15)
    # The refused event's task is not left deferred forever: it fails readably.
    await wait_until(lambda: db.fetchval(
        "SELECT next_kwargs->>'message' LIKE 'event dead-lettered%' FROM task_instance "
        "WHERE task_id = 't200'"), 10)
    letters = await dead_letters(settings, 1)
    assert letters and "database refused event" in letters[0][1]
    assert b"t200" not in letters[0][0] and str(bad_id).encode() in letters[0][0]


async def test_forged_events_from_another_team_user_are_dead_lettered(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str],
    settings: Settings,
) -> None:
    """team_users says only user X may publish events of the queue; guest's are refused."""
    procs.writer(team_users={teams[0]: "someone-else"})
    tid = await insert_trigger(db, "tests.triggers.EventAfter", "{}", teams[0], 1)
    broker = RabbitTransport(settings.amqp_dsn(), Topology(settings.namespace))
    await broker.connect()
    ev = Event(tid, 0, teams[0], "success", json.dumps({"forged": True}), time.time())
    await broker.publish(broker.topology.events, teams[0], encode_events([ev]), user_id="guest")
    await broker.close()
    letters = await dead_letters(settings, 1)
    assert letters and "forged" in letters[0][1]
    assert await db.fetchval("SELECT state FROM task_instance") == "deferred"


async def test_events_from_the_teams_own_user_are_applied(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str]
) -> None:
    """With team_users set, a consumer's events carry its AMQP user and pass the check."""
    procs.writer(team_users={teams[0]: "guest"})
    procs.consume(teams[0])
    await client.defer(TaskKey("own", "t", "r"), EventAfter(payload="mine"), queue=teams[0])
    await wait_until(lambda: db.fetchval(
        "SELECT next_kwargs->>'event' = 'mine' FROM task_instance"), 15)


async def test_kwargs_encrypted_at_rest(
    db: Database, procs: Processes, teams: list[str], settings: Settings, topology: Topology
) -> None:
    from cryptography.fernet import Fernet

    key = Fernet.generate_key().decode()
    secure = Settings(**{**settings.model_dump(), "kwargs_key": key})
    procs.writer()
    procs.consume(teams[0], kwargs_key=key)
    async with TriggerflowClient(secure) as c:
        await c.defer(TaskKey("s", "t", "r"), EventAfter(delay=1, payload="secret-ok",
                                                          password="hunter2"), queue=teams[0])
    stored = await db.fetchval("SELECT kwargs FROM trigger")
    assert stored.startswith("fernet:") and "hunter2" not in stored
    await wait_until(lambda: db.fetchval(
        "SELECT next_kwargs->>'event' = 'secret-ok' FROM task_instance"), 15)


async def test_mixed_code_versions_hand_over_then_fail(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str], tmp_path: Path,
    settings: Settings,
) -> None:
    """A consumer without the class hands it to one that has it; with nobody able to load
    it, the task fails naming the class."""
    newcode = tmp_path / "newcode"
    newcode.mkdir()
    (newcode / "__init__.py").write_text("")
    (newcode / "triggers.py").write_text(
        "from tests.triggers import EventAfter\n\nclass Fresh(EventAfter):\n    pass\n")
    allowed = [*settings.allowed_modules, "newcode"]
    procs.writer()
    old = procs.consume(teams[0], allowed_modules=allowed)
    old_id = await wait_until(lambda: db.fetchval(
        "SELECT id FROM consumer WHERE pid = $1", old.pid), 10)
    q = teams[0]
    lonely = await insert_trigger(db, "newcode.triggers.Fresh", '{"payload": "x"}', q, 1)
    broker = RabbitTransport(settings.amqp_dsn(), Topology(settings.namespace))
    await broker.connect()
    await broker.publish_wakeups({q: [lonely]})
    await wait_until(lambda: db.fetchval(
        "SELECT next_method = '__fail__' FROM task_instance WHERE trigger_id IS NULL "
        "AND task_id = 't1'"), 15, message="task failed: nobody can load it")
    msg = await db.fetchval("SELECT next_kwargs->>'message' FROM task_instance WHERE task_id = 't1'")
    assert "newcode.triggers.Fresh" in msg and "no consumer" in msg
    # Now a consumer with the newer code joins: the old one hands over, the new one runs it.
    newer = procs.start("consume", "--queue", q, allowed_modules=allowed,
                        extra_pythonpath=str(tmp_path))
    await wait_until(lambda: db.fetchval(
        "SELECT count(*) = 2 FROM consumer WHERE expires_at > now() AND kind = 'consumer'"), 10)
    handed = await insert_trigger(db, "newcode.triggers.Fresh", '{"payload": "ran"}', q, 2)
    await broker.publish_wakeups({q: [handed]})
    await broker.close()
    await wait_until(lambda: db.fetchval(
        "SELECT next_kwargs->>'event' = 'ran' FROM task_instance WHERE task_id = 't2'"), 15)
    assert newer.poll() is None and old.poll() is None
    # Whoever took it first: if it was the old consumer, it refused it on the record.
    refused = await db.fetchval("SELECT count(*) FROM trigger WHERE $1 = ANY(rejected_by)", old_id)
    assert refused == 0  # finished triggers are deleted; nothing is left refused


async def test_killer_among_many_is_quarantined_alone(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str]
) -> None:
    """One trigger that kills its consumer (os._exit) among 300 innocents: consumers keep
    being restarted; probation groups halve until the killer runs alone and is quarantined."""
    q = teams[0]
    overrides: dict[str, int] = {}
    moment = datetime.now(UTC) + timedelta(seconds=45)
    innocents = [Deferral(TaskKey("inn", f"t{i}", "r"), DateTimeTrigger(moment), q)
                 for i in range(300)]
    await client.defer_many(innocents)
    killer_id = await client.defer(TaskKey("kill", "k", "r"), Killer(delay=0.3), queue=q)
    procs.writer()
    consumers = [procs.consume(q, **overrides) for _ in range(2)]
    deadline = time.monotonic() + 150
    restarts = 0
    while time.monotonic() < deadline:
        if await db.fetchval("SELECT quarantined_at IS NOT NULL FROM trigger WHERE id = $1",
                             killer_id):
            break
        for i, c in enumerate(consumers):
            if c.poll() is not None:
                consumers[i] = procs.consume(q, **overrides)
                restarts += 1
        await asyncio.sleep(0.2)
    else:
        raise AssertionError(f"killer not quarantined after {restarts} restarts")
    row = await db.fetchrow("SELECT state, next_method, next_kwargs->>'message' AS m "
                            "FROM task_instance WHERE dag_id = 'kill'")
    assert row["next_method"] == "__fail__" and "tests.triggers.Killer" in row["m"]
    assert await db.fetchval("SELECT count(*) FROM trigger WHERE quarantined_at IS NOT NULL") == 1
    # The innocents all fire on time afterwards.
    await wait_until(lambda: db.fetchval(
        "SELECT count(*) = 300 FROM task_instance WHERE dag_id = 'inn' AND state = 'scheduled'"),
        90, interval=0.5, message="all innocents fired")
    assert restarts >= 2


@pytest.mark.slow
async def test_soak_20k_two_consumers_two_writers_with_a_kill(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str]
) -> None:
    q = teams[0]
    procs.writer()
    procs.writer()
    a = procs.consume(q)
    procs.consume(q)
    now = datetime.now(UTC)
    kinds = ["resume", "success", "failed", "skipped"]
    deferrals: list[Deferral] = []
    for i in range(20_000):
        if i % 10 == 0:
            trig = EventAfter(delay=2 + (i % 7), kind=kinds[(i // 10) % 4], payload={"i": i})
        else:
            trig = DateTimeTrigger(now + timedelta(seconds=4 + (i % 800) / 100))
        deferrals.append(Deferral(TaskKey("soak", f"t{i}", "r"), trig, q))
    for start in range(0, 20_000, 5000):
        await client.defer_many(deferrals[start:start + 5000])
    await asyncio.sleep(5)
    a.kill()  # SIGKILL midway through the firing window
    a.wait()
    procs.consume(q)
    await wait_until(lambda: db.fetchval(
        "SELECT count(*) = 20000 FROM task_instance WHERE state <> 'deferred'"), 120,
        interval=0.5, message="every task resolved")
    counts = {r["state"]: r["n"] for r in await db.fetch(
        "SELECT state, count(*) AS n FROM task_instance GROUP BY 1")}
    assert counts == {"scheduled": 18_000 + 500, "success": 500, "failed": 500, "skipped": 500}
    assert await db.fetchval("SELECT count(*) FROM trigger") == 0
