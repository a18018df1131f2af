"""Isolation between teams on the real services: an event is applied only for a trigger of
the queue its routing key names, only with a kind the project defines; control messages
cancel only what the store confirms; refused deferrals leak nothing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aio_pika
import aiormq
import asyncpg
import pytest
from yarl import URL

from tests.conftest import ROOT, Processes, SuiteServices, wait_until
from tests.test_bad_input import dead_letters, insert_trigger
from tests.triggers import EventAfter, WaitsForever
from triggerflow.model import TaskKey
from triggerflow.sdk import Deferral, TriggerflowClient
from triggerflow.settings import Settings
from triggerflow.store import StoreError
from triggerflow.store.postgres import Database
from triggerflow.transport import Delivery, PublishRefused
from triggerflow.transport.rabbitmq import RabbitTransport, Topology
from triggerflow.triggers.file import FileTrigger
from triggerflow.wire import Event, encode_control, encode_events

DEFINITIONS = ROOT / "brokers" / "rabbitmq" / "definitions.json"


async def publish_raw(settings: Settings, routing_key: str, events: list[Event] | bytes) -> None:
    """Publish events as any team's user could, straight to the events exchange."""
    body = events if isinstance(events, bytes) else encode_events(events)
    broker = RabbitTransport(settings.amqp_dsn(), Topology(settings.namespace))
    await broker.connect()
    try:
        await broker.publish(broker.topology.events, routing_key, body, user_id="guest")
    finally:
        await broker.close()


async def test_event_naming_another_teams_trigger_is_dead_lettered_by_default(
    db: Database, procs: Processes, teams: list[str], settings: Settings,
) -> None:
    """No team_users: team A's routing key cannot carry an event for team B's trigger."""
    procs.writer()
    victim = await insert_trigger(db, "tests.triggers.EventAfter", "{}", teams[1], 1)
    forged = Event(victim, 0, teams[1], "success", json.dumps({"forged": True}), time.time())
    await publish_raw(settings, teams[0], [forged])
    letters = await dead_letters(settings, 1)
    assert letters and "routing key" in letters[0][1]
    assert await db.fetchval("SELECT state FROM task_instance") == "deferred"


@pytest.mark.parametrize("team_users", [False, True])
async def test_event_naming_its_own_queue_for_another_teams_trigger_changes_nothing(
    db: Database, procs: Processes, teams: list[str], settings: Settings, team_users: bool,
) -> None:
    """Team A's key, team A's queue in the event, team B's trigger id: the routing-key and
    user checks pass, so only the row's own queue (fenced in APPLY_EVENTS) stops it."""
    procs.writer(**({"team_users": {teams[0]: "guest", teams[1]: "guest"}} if team_users else {}))
    victim = await insert_trigger(db, "tests.triggers.EventAfter", "{}", teams[1], 1)
    own = await insert_trigger(db, "tests.triggers.EventAfter", "{}", teams[0], 2)
    await publish_raw(settings, teams[0], [
        Event(victim, 0, teams[0], "success", json.dumps({"stolen": True}), time.time()),
        Event(own, 0, teams[0], "resume", '"mine"', time.time())])
    # The second event of the same message applied: the first was seen and ignored.
    await wait_until(lambda: db.fetchval(
        "SELECT state = 'scheduled' FROM task_instance WHERE task_id = 't2'"), 10)
    assert await db.fetchval("SELECT state FROM task_instance WHERE task_id = 't1'") == "deferred"
    assert await db.fetchval("SELECT count(*) FROM trigger WHERE id = $1", victim) == 1


async def test_queue_missing_from_team_users_is_still_checked_against_the_routing_key(
    db: Database, procs: Processes, teams: list[str], settings: Settings,
) -> None:
    procs.writer(team_users={teams[0]: "guest"})
    victim = await insert_trigger(db, "tests.triggers.EventAfter", "{}", teams[1], 1)
    forged = Event(victim, 0, teams[1], "success", "1", time.time())
    await publish_raw(settings, teams[0], [forged])
    letters = await dead_letters(settings, 1)
    assert letters and "routing key" in letters[0][1]
    assert await db.fetchval("SELECT state FROM task_instance") == "deferred"


async def test_unknown_event_kind_is_dead_lettered_and_never_becomes_a_state(
    db: Database, procs: Processes, teams: list[str], settings: Settings,
) -> None:
    procs.writer()
    tid = await insert_trigger(db, "tests.triggers.EventAfter", "{}", teams[0], 1)
    body = json.dumps({"v": 2, "events": [[tid, 0, teams[0], "pwned", "1", time.time()]]})
    await publish_raw(settings, teams[0], body.encode())
    letters = await dead_letters(settings, 1)
    assert letters and "unknown event kind 'pwned'" in letters[0][1]
    assert await db.fetchval("SELECT state FROM task_instance") == "deferred"


async def test_event_nested_past_the_servers_limits_is_refused_and_other_teams_go_on(
    db: Database, procs: Processes, teams: list[str], settings: Settings,
) -> None:
    """Team A's own event with a payload nested 20,000 deep makes PostgreSQL raise "stack depth
    limit exceeded" (SQLSTATE 54001): a refused event, dead-lettered, not a retry that stops
    every writer while team B's events wait behind it."""
    procs.writer()
    own = await insert_trigger(db, "tests.triggers.EventAfter", "{}", teams[0], 1)
    other = await insert_trigger(db, "tests.triggers.EventAfter", "{}", teams[1], 2)
    deep = "[" * 20_000 + "]" * 20_000
    await publish_raw(settings, teams[0], [Event(own, 0, teams[0], "resume", deep, time.time())])
    await publish_raw(settings, teams[1], [Event(other, 0, teams[1], "resume", '{"ok": 1}', time.time())])
    letters = await dead_letters(settings, 1)
    assert letters and "stack depth" in letters[0][1]
    assert await wait_until(lambda: db.fetchval(
        "SELECT state = 'scheduled' FROM task_instance WHERE task_id = 't2'"), 10)
    # A's own task ends in __fail__ naming the refusal, as the writer does for any refused event.
    failed = await db.fetchrow("SELECT next_method, next_kwargs::text AS kw FROM task_instance "
                               "WHERE task_id = 't1'")
    assert failed["next_method"] == "__fail__" and "stack depth" in failed["kw"]


async def test_store_ignores_an_unknown_kind_even_when_asked_directly(
    db: Database, teams: list[str], dsn: str,
) -> None:
    from triggerflow.store.postgres.store import PostgresStore

    tid = await insert_trigger(db, "tests.triggers.EventAfter", "{}", teams[0], 1)
    store = await PostgresStore.connect(dsn)
    try:
        ev = Event(tid, 0, teams[0], "resume", "1", time.time())
        ev.kind = "pwned"  # past the wire's check, as a buggy caller of the store could
        applied = await store.apply_events([ev])
    finally:
        await store.close()
    assert applied == []
    assert await db.fetchval("SELECT state FROM task_instance") == "deferred"
    assert await db.fetchval("SELECT count(*) FROM trigger") == 1


async def test_non_utf8_file_name_ends_the_task_with_a_readable_failure(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str],
    tmp_path: Path,
) -> None:
    """glob returns the name with lone surrogates; the payload check turns it into __fail__."""
    (tmp_path / os.fsdecode(b"report-\xff.csv")).write_text("x")
    procs.writer()
    procs.consume(teams[0])
    await client.defer(TaskKey("files", "t", "r"),
                       FileTrigger(str(tmp_path / "*.csv"), poke_interval=0.1), queue=teams[0])
    await client.defer(TaskKey("files", "after", "r"), EventAfter(payload="still-serving"),
                       queue=teams[0])
    row = await wait_until(lambda: db.fetchrow(
        "SELECT next_method, next_kwargs->>'message' AS message FROM task_instance "
        "WHERE task_id = 't' "
        "AND state = 'scheduled'"), 15)
    assert row["next_method"] == "__fail__"
    message = row["message"]
    assert "FileTrigger" in message and "not valid UTF-8" in message
    await wait_until(lambda: db.fetchval(
        "SELECT next_kwargs->>'event' = 'still-serving' FROM task_instance "
        "WHERE task_id = 'after'"), 15)


@pytest.mark.serial  # timing bound (cancelled within 2 s): runs alone, after the parallel part
async def test_forged_cancel_is_ignored_and_squatted_control_names_change_nothing(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str],
    settings: Settings, tmp_path: Path,
) -> None:
    """With the sweep off: a team pre-declares the control queue names consumers used to
    take and publishes a cancel for a deferred task; the consumer still serves, ignores the
    forged cancel, and cancels at once through the real control path."""
    topo = Topology(settings.namespace)
    conn = await aio_pika.connect(settings.amqp_dsn())
    try:
        ch = await conn.channel()
        control = await ch.get_exchange(topo.control_of(teams[0]))
        for i in range(1, 6):  # the ids the first consumers of this database get
            squat = await ch.declare_queue(f"{topo.control}.{i}", durable=True)
            await squat.bind(control, str(i))
        procs.consume(teams[0], cancel_sweep_interval=3600)
        tid = await client.defer(TaskKey("c", "t", "r"), WaitsForever(marker_dir=str(tmp_path)),
                                 queue=teams[0])
        await wait_until(lambda: asyncio.sleep(0, (tmp_path / f"started-{tid}").exists()), 15,
                         message="trigger started despite the squatted names")
        owner = await db.fetchval("SELECT owner_id FROM trigger WHERE id = $1", tid)
        await control.publish(aio_pika.Message(encode_control("cancel", [tid])),
                              routing_key=str(owner))
        await asyncio.sleep(2)
        assert not (tmp_path / f"cleanup-{tid}").exists(), "a forged cancel stopped the trigger"
        assert await db.fetchval("SELECT state FROM task_instance") == "deferred"
        assert await db.fetchval("SELECT owner_id FROM trigger WHERE id = $1", tid) == owner
        started = time.monotonic()
        assert await client.cancel([tid]) == 1
        await wait_until(lambda: asyncio.sleep(0, (tmp_path / f"cleanup-{tid}").exists()), 5,
                         message="cleanup after the real cancel")
        assert time.monotonic() - started < 2, "cancelled by the control message, not a sweep"
        await wait_until(lambda: db.fetchval("SELECT count(*) = 0 FROM trigger"), 5)
    finally:
        with contextlib.suppress(Exception):
            ch = await conn.channel()
            for i in range(1, 6):
                await ch.queue_delete(f"{topo.control}.{i}")
        await conn.close()


async def test_shipped_team_permissions_let_a_consumer_take_only_a_server_named_control_queue(
    services: SuiteServices,
) -> None:
    """team-ml's permissions from definitions.json, on the suite's own node: a consumer gets
    its server-named control queue and its messages; the names a team could squat are refused."""
    node = services.rabbit()
    perms = next(p for p in json.loads(DEFINITIONS.read_text())["permissions"]
                 if p["user"] == "team-ml")
    tag = uuid.uuid4().hex[:8]
    vhost, user = f"tfiso-{tag}", f"tfiso-ml-{tag}"
    base = URL(services.amqp)
    node.ctl("add_vhost", vhost)
    node.ctl("add_user", user, user)
    try:
        node.ctl("set_permissions", "-p", vhost, user,
                 perms["configure"], perms["write"], perms["read"])
        node.ctl("set_permissions", "-p", vhost, base.user or "guest", ".*", ".*", ".*")
        topo = Topology()  # the shipped "triggerflow" names the permissions are written for
        admin = RabbitTransport(str(base.with_path("/" + vhost)), topo)
        team = RabbitTransport(str(base.with_path("/" + vhost).with_user(user)
                                   .with_password(user)), topo)
        await admin.connect()
        await admin.declare(["team-ml"])
        await team.connect()
        got: list[bytes] = []

        async def on_control(delivery: Delivery) -> None:
            got.append(delivery.body)
            await delivery.ack()

        await team.subscribe_control(7, on_control, prefetch=10, queues=["team-ml"])
        await admin.publish_control(7, "cancel", [1], queue="team-ml")
        await wait_until(lambda: asyncio.sleep(0, got), 5, message="control message received")
        for squat in ("triggerflow.control.8", "amq.gen-squat"):
            conn = await aio_pika.connect(str(base.with_path("/" + vhost).with_user(user)
                                              .with_password(user)))
            try:
                ch = await conn.channel()
                with pytest.raises(aiormq.exceptions.ChannelAccessRefused):
                    await ch.declare_queue(squat, durable=True)
            finally:
                await conn.close()
        await team.close()
        await admin.close()
    finally:
        node.ctl("delete_vhost", vhost)
        node.ctl("delete_user", user)


@contextlib.contextmanager
def team_user(services: SuiteServices, namespace: str, queue: str) -> Iterator[str]:
    """A user on the suite's node that may defer only into ``queue`` (write on its deferral
    exchange only); yields its AMQP URL."""
    node = services.rabbit()
    user = f"tfiso-{uuid.uuid4().hex[:8]}"
    node.ctl("add_user", user, user)
    try:
        node.ctl("set_permissions", user, ".*",
                 rf"^({namespace}\.deferrals\.{queue}|{namespace}\.(events|dead|control\..*))$", ".*")
        yield str(URL(services.amqp).with_user(user).with_password(user))
    finally:
        node.ctl("delete_user", user)


def connections_of(services: SuiteServices, user: str) -> int:
    return sum(1 for line in services.rabbit().ctl("list_connections", "user").splitlines()
               if line.strip() == user)


async def test_refused_multi_queue_deferral_keeps_what_was_published_and_leaks_nothing(
    db: Database, teams: list[str], settings: Settings, topology: Topology,
    services: SuiteServices,
) -> None:
    with team_user(services, settings.namespace, teams[0]) as url:
        user = URL(url).user
        mine = Settings(**{**settings.model_dump(), "amqp_url": url})
        async with TriggerflowClient(mine) as c:
            with pytest.raises(PublishRefused):
                await c.defer_many([
                    Deferral(TaskKey("m", "mine", "r"), WaitsForever(marker_dir="/"), teams[0]),
                    Deferral(TaskKey("m", "theirs", "r"), WaitsForever(marker_dir="/"), teams[1]),
                ])
            rows = dict(await db.fetch("SELECT task_id, state FROM task_instance"))
            # The wake-up for teams[0] went out: that task stays deferred and will run.
            assert rows == {"mine": "deferred", "theirs": "failed"}
            for i in range(5):
                with pytest.raises(PublishRefused):
                    await c.defer(TaskKey("m", f"again{i}", "r"), WaitsForever(marker_dir="/"),
                                  queue=teams[1])
            await asyncio.sleep(1)  # let the broker list what is still open
            assert connections_of(services, user) <= 1
            await c.defer(TaskKey("m", "after", "r"), WaitsForever(marker_dir="/"), queue=teams[0])
            assert connections_of(services, user) == 1


SDK_GRANTS = """
GRANT SELECT, INSERT, DELETE ON trigger TO {r};
GRANT SELECT, INSERT, UPDATE ON task_instance TO {r};
GRANT SELECT ON consumer TO {r};
GRANT USAGE ON SEQUENCE trigger_id_seq TO {r};
"""


@contextlib.asynccontextmanager
async def team_role(db: Database, dsn: str, queue: str) -> AsyncIterator[str]:
    """A login role with the documented SDK grants, listed in team_queue for ``queue``."""
    role = f"tfiso_{uuid.uuid4().hex[:10]}"
    await db.execute(f'CREATE ROLE "{role}" LOGIN')
    try:
        await db.execute(SDK_GRANTS.format(r=f'"{role}"'))
        await db.execute("INSERT INTO team_queue (role, queue) VALUES ($1, $2)", role, queue)
        yield str(URL(dsn).with_user(role))
    finally:
        await db.execute(f'DROP OWNED BY "{role}"')
        await db.execute(f'DROP ROLE "{role}"')


async def test_team_database_role_reaches_only_its_own_queues_rows(
    db: Database, dsn: str, teams: list[str], settings: Settings, topology: Topology,
) -> None:
    theirs = await insert_trigger(db, "tests.triggers.EventAfter", "{}", teams[1], 1)
    # B listed too, as every team is: A's rows are checked against A's queues, not anyone's.
    async with team_role(db, dsn, teams[0]) as dsn_a, team_role(db, dsn, teams[1]):
        team_a = Settings(**{**settings.model_dump(), "database_url": dsn_a})
        async with TriggerflowClient(team_a) as c:
            mine = await c.defer(TaskKey("a", "mine", "r"), EventAfter(), queue=teams[0])
            with pytest.raises(StoreError, match="row-level security"):
                await c.defer(TaskKey("a", "theirs", "r"), EventAfter(), queue=teams[1])
            # B's task key, in A's own queue: a task of A's own (0008), B's row untouched
            await c.defer(TaskKey("bad", "t1", "r"), EventAfter(), queue=teams[0])
            assert await c.cancel([theirs]) == 0
        conn = await asyncpg.connect(dsn_a)
        try:
            seen = [r["id"] for r in await conn.fetch("SELECT id FROM trigger")]
            assert mine in seen and theirs not in seen and len(seen) == 2  # its own two only
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute("INSERT INTO trigger (classpath, kwargs, queue) "
                                   "VALUES ('tests.triggers.EventAfter', '{}', $1)", teams[1])
            with pytest.raises(asyncpg.InsufficientPrivilegeError, match="row-level security"):
                await conn.execute("INSERT INTO task_instance (dag_id, task_id, run_id, state, "
                                   "queue) VALUES ('a', 'planted', 'r', 'scheduled', $1)", teams[1])
            assert await conn.execute("DELETE FROM trigger WHERE id = $1", theirs) == "DELETE 0"
        finally:
            await conn.close()
    rows = {tuple(r) for r in await db.fetch(
        "SELECT task_id, queue, trigger_id = $1 FROM task_instance", theirs)}
    assert rows == {("t1", teams[1], True), ("t1", teams[0], False), ("mine", teams[0], False)}
    assert await db.fetchval("SELECT count(*) FROM trigger") == 3


async def test_team_cannot_point_its_tasks_at_another_teams_trigger(
    db: Database, dsn: str, procs: Processes, teams: list[str], settings: Settings,
    topology: Topology,
) -> None:
    """Trigger ids share one sequence: team A's SDK role, row security and all, inserted task
    rows in its own queue that named team B's trigger, read B's result when the writer applied
    B's event, and had the reaper delete B's trigger through a past timeout. The database now
    refuses any task row whose trigger is of another queue, inserted or updated."""
    theirs = await insert_trigger(db, "tests.triggers.EventAfter", "{}", teams[1], 1)
    async with team_role(db, dsn, teams[0]) as dsn_a:
        team_a = Settings(**{**settings.model_dump(), "database_url": dsn_a})
        async with TriggerflowClient(team_a) as c:
            mine = await c.defer(TaskKey("a", "mine", "r"), EventAfter(), queue=teams[0])
        conn = await asyncpg.connect(dsn_a)
        try:
            with pytest.raises(asyncpg.ForeignKeyViolationError, match="its own queue"):
                await conn.execute(
                    "INSERT INTO task_instance (dag_id, task_id, run_id, state, queue, "
                    "next_method, trigger_id, trigger_timeout) VALUES ('a', 'spy', 'r', "
                    "'deferred', $1, 'execute_complete', $2, now() - interval '1 hour')",
                    teams[0], theirs)
            with pytest.raises(asyncpg.ForeignKeyViolationError, match="its own queue"):
                await conn.execute("UPDATE task_instance SET trigger_id = $1 WHERE trigger_id = $2",
                                   theirs, mine)
        finally:
            await conn.close()
    # Not a team matter only: no role, the owner included, can link across queues.
    with pytest.raises(Exception, match="its own queue"):
        await db.execute("UPDATE task_instance SET queue = $1 WHERE task_id = 'mine'", teams[1])
    procs.writer()
    await publish_raw(settings, teams[1], [Event(theirs, 0, teams[1], "resume", '{"secret": 1}',
                                                 time.time())])
    await wait_until(lambda: db.fetchval(
        "SELECT state = 'scheduled' FROM task_instance WHERE task_id = 't1'"), 10)
    rows = dict(await db.fetch("SELECT task_id, state FROM task_instance"))
    assert rows == {"t1": "scheduled", "mine": "deferred"}


CONSUMER_GRANTS = """
GRANT SELECT, INSERT, UPDATE, DELETE ON consumer TO {r};
GRANT SELECT, UPDATE, DELETE ON trigger_cancel_log TO {r};
"""
REGISTER = ("INSERT INTO consumer (kind, host, pid, queues, capacity, version, expires_at) "
            "VALUES ($2, 'x', 1, $1::text[], 10, 'x', now() + interval '1 minute') "
            "RETURNING id")


async def test_a_team_consumer_role_keeps_its_lease_rows_to_its_own_queues(
    db: Database, dsn: str, teams: list[str],
) -> None:
    """Team A's consumer role (its trigger code can read the credentials) registers, renews
    and leaves rows of its own queues only. Re-pointing its own row at B's queue would plant
    an idle "peer" for B's consumers to shed their triggers to: the UPDATE policy's
    ``WITH CHECK`` refuses the new row (migration 0006). The same for its cancel-log entries."""
    a, b = teams
    theirs = await db.fetchval(REGISTER, [b], "consumer")
    writer = await db.fetchval(REGISTER, [], "writer")
    shared = await db.fetchval(REGISTER, [a, b], "consumer")  # sees it, may not touch it
    everything = await db.fetchval(REGISTER, [], "consumer")  # no queue list: all of them
    await db.execute("INSERT INTO trigger_cancel_log (trigger_id, queue) VALUES (1, $1), (2, $2)",
                     a, b)
    async with team_role(db, dsn, a) as dsn_a, team_role(db, dsn, b):  # B listed, as it is
        await db.execute(CONSUMER_GRANTS.format(r=f'"{URL(dsn_a).user}"'))
        conn = await asyncpg.connect(dsn_a)
        try:
            mine = await conn.fetchval(REGISTER, [a], "consumer")
            for queues, kind in (([b], "consumer"), ([], "consumer"), ([a], "writer")):
                with pytest.raises(asyncpg.InsufficientPrivilegeError, match="row-level security"):
                    await conn.fetchval(REGISTER, queues, kind)
            for queues in ([b], [a, b], []):
                with pytest.raises(asyncpg.InsufficientPrivilegeError, match="row-level security"):
                    await conn.execute("UPDATE consumer SET queues = $2::text[] WHERE id = $1",
                                       mine, queues)
            with pytest.raises(asyncpg.InsufficientPrivilegeError, match="row-level security"):
                await conn.execute("UPDATE consumer SET kind = 'writer' WHERE id = $1", mine)
            # Its own lease it renews; B's it neither sees nor ends; the writer it sees only.
            assert await conn.execute("UPDATE consumer SET expires_at = now() + interval "
                                      "'2 minutes' WHERE id = $1", mine) == "UPDATE 1"
            seen = {r["id"] for r in await conn.fetch("SELECT id FROM consumer")}
            assert seen == {mine, writer, shared, everything}
            assert await conn.execute("UPDATE consumer SET expires_at = now() WHERE id <> $1",
                                      mine) == "UPDATE 0"
            assert await conn.execute("DELETE FROM consumer WHERE id <> $1", mine) == "DELETE 0"
            assert await conn.execute("DELETE FROM consumer WHERE id = $1", mine) == "DELETE 1"
            # Its own entry only: no entry moved to B's queue, B's neither read nor deleted.
            assert [r["queue"] for r in await conn.fetch("SELECT queue FROM trigger_cancel_log")] == [a]
            assert await conn.execute("UPDATE trigger_cancel_log SET logged_at = now()") == "UPDATE 1"
            with pytest.raises(asyncpg.InsufficientPrivilegeError, match="row-level security"):
                await conn.execute("UPDATE trigger_cancel_log SET queue = $1", b)
            assert await conn.execute("DELETE FROM trigger_cancel_log WHERE queue = $1", b) == "DELETE 0"
        finally:
            await conn.close()
    rows = {r["id"]: r["queues"] for r in await db.fetch("SELECT id, queues FROM consumer")}
    assert rows == {theirs: [b], writer: [], shared: [a, b], everything: []}
    assert await db.fetchval("SELECT count(*) FROM trigger_cancel_log") == 2


async def test_unlisted_roles_keep_their_lease_rows_and_the_whole_cancel_log(
    db: Database, dsn: str, teams: list[str],
) -> None:
    """A role not in ``team_queue`` (the shared consumer and writer roles of a single-team
    deployment) is not restricted by the policies of migration 0006: it leaves (its row goes
    at once, not at its expiry) and keeps the cancel log of every queue."""
    role = f"tfopen_{uuid.uuid4().hex[:10]}"
    await db.execute(f'CREATE ROLE "{role}" LOGIN')
    try:
        await db.execute(CONSUMER_GRANTS.format(r=f'"{role}"'))
        await db.execute("INSERT INTO trigger_cancel_log (trigger_id, queue) VALUES (1, $1)",
                         teams[1])
        conn = await asyncpg.connect(str(URL(dsn).with_user(role)))
        try:
            writer = await conn.fetchval(REGISTER, [], "writer")
            consumer = await conn.fetchval(REGISTER, teams, "consumer")
            assert await conn.execute("UPDATE consumer SET expires_at = now() + interval "
                                      "'1 hour'") == "UPDATE 2"
            assert await conn.execute("UPDATE trigger_cancel_log SET logged_at = now()") == "UPDATE 1"
            assert await conn.execute("DELETE FROM trigger_cancel_log") == "DELETE 1"
            assert await conn.execute("DELETE FROM consumer WHERE id = ANY($1::bigint[])",
                                      [writer, consumer]) == "DELETE 2"
        finally:
            await conn.close()
    finally:
        await db.execute(f'DROP OWNED BY "{role}"')
        await db.execute(f'DROP ROLE "{role}"')


async def test_team_role_cancels_its_own_task_without_a_grant_on_the_cancel_log(
    db: Database, dsn: str, teams: list[str], settings: Settings, topology: Topology,
) -> None:
    """The cancel log is written by a SECURITY DEFINER trigger: the documented SDK grants are
    enough for a team role to cancel its own task, and the sweep still learns of it."""
    async with team_role(db, dsn, teams[0]) as dsn_a:
        team_a = Settings(**{**settings.model_dump(), "database_url": dsn_a})
        async with TriggerflowClient(team_a) as c:
            mine = await c.defer(TaskKey("a", "mine", "r"), EventAfter(), queue=teams[0])
            assert await c.cancel([mine]) == 1
    assert await db.fetchval("SELECT state FROM task_instance WHERE task_id = 'mine'") == "removed"
    assert await db.fetchval(
        "SELECT count(*) FROM trigger_cancel_log WHERE trigger_id = $1", mine) == 1


async def test_kwargs_keys_per_team_with_rotation(
    db: Database, procs: Processes, teams: list[str], settings: Settings, topology: Topology,
) -> None:
    """Each team's triggers are encrypted with its own key; a consumer holding the new and
    the old key of its team runs rows written under either, and the new key encrypts."""
    from cryptography.fernet import Fernet, InvalidToken

    a_old, a_new, b = (Fernet.generate_key().decode() for _ in range(3))

    def sdk(keys: dict[str, str]) -> TriggerflowClient:
        return TriggerflowClient(Settings(**{**settings.model_dump(), "kwargs_keys": keys}))

    def token(stored: str) -> bytes:
        assert stored.startswith("fernet:") and "hunter2" not in stored
        return stored.removeprefix("fernet:").encode()

    async with sdk({teams[0]: a_old, teams[1]: b}) as c:
        first = await c.defer(TaskKey("k", "old", "r"), EventAfter(payload="old-ok",
                                                                   password="hunter2"),
                              queue=teams[0])
        theirs = await c.defer(TaskKey("k", "b", "r"), EventAfter(password="hunter2"),
                               queue=teams[1])
    stored_a = await db.fetchval("SELECT kwargs FROM trigger WHERE id = $1", first)
    stored_b = await db.fetchval("SELECT kwargs FROM trigger WHERE id = $1", theirs)
    Fernet(a_old.encode()).decrypt(token(stored_a))
    with pytest.raises(InvalidToken):  # team a's key does not open team b's row
        Fernet(a_old.encode()).decrypt(token(stored_b))
    procs.writer()
    procs.consume(teams[0], kwargs_keys=json.dumps({teams[0]: f"{a_new},{a_old}"}))
    async with sdk({teams[0]: f"{a_new},{a_old}"}) as c:
        second = await c.defer(TaskKey("k", "new", "r"), EventAfter(payload="new-ok"),
                               queue=teams[0])
        stored_new = await db.fetchval("SELECT kwargs FROM trigger WHERE id = $1", second)
        Fernet(a_new.encode()).decrypt(token(stored_new))
    await wait_until(lambda: db.fetchval(
        "SELECT count(*) = 2 FROM task_instance WHERE next_kwargs->>'event' IN "
        "('old-ok', 'new-ok')"), 15, message="both generations of rows ran")
