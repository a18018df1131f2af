"""Broker-side attacks of one team on another (issue 19: 7, 8, 12b, 12c, 12d), each made on
the suite's real RabbitMQ node by a team user holding exactly the permissions that
``brokers/rabbitmq/definitions.json`` gives ``team-ml`` (or ``team-data-eng``), in a scratch
vhost whose topology the administrator declared with ``RabbitTransport.declare``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import aio_pika
import aiormq
import httpx
import pytest
from yarl import URL

from tests.conftest import ROOT, Processes, SuiteServices, wait_until
from triggerflow.transport import Delivery, PublishRefused, QueueFull
from triggerflow.transport.rabbitmq import RabbitTransport, Topology
from triggerflow.wire import (
    MAX_ID_MESSAGE_BYTES,
    MAX_MESSAGE_BYTES,
    Event,
    WireError,
    decode_events,
    decode_wakeup,
    encode_wakeup,
)

DEFINITIONS = json.loads((ROOT / "brokers" / "rabbitmq" / "definitions.json").read_text())
ML, DE = "team-ml", "team-data-eng"  # the shipped queues the permissions are written for


@dataclass
class Broker:
    """A scratch vhost with the shipped topology and two team users (shipped permissions)."""

    vhost: str
    admin: RabbitTransport
    urls: dict[str, str]  # shipped user name -> AMQP URL of its stand-in on this node
    management: str

    def team(self, user: str) -> RabbitTransport:
        return RabbitTransport(self.urls[user], self.admin.topology, name=f"test-{user}")

    async def ready(self, queue: str) -> int:
        info = await self.admin.queue_info(queue)
        assert info is not None
        return info.ready


def _grant(node: Any, vhost: str, shipped: str, user: str) -> None:
    (perms,) = [p for p in DEFINITIONS["permissions"] if p["user"] == shipped]
    node.ctl("set_permissions", "-p", vhost, user, perms["configure"], perms["write"], perms["read"])
    for topic in DEFINITIONS["topic_permissions"]:
        if topic["user"] == shipped:
            node.ctl("set_topic_permissions", "-p", vhost, user, topic["exchange"],
                     topic["write"], topic["read"])


@contextlib.contextmanager
def scratch_users(services: SuiteServices, vhost: str) -> Iterator[dict[str, str]]:
    node = services.rabbit()
    base = URL(services.amqp).with_path("/" + vhost)
    tag = uuid.uuid4().hex[:8]
    users = {shipped: f"tfbi-{shipped}-{tag}" for shipped in ("team-ml", "team-data-eng")}
    node.ctl("add_vhost", vhost)
    try:
        node.ctl("set_permissions", "-p", vhost, base.user or "guest", ".*", ".*", ".*")
        for shipped, user in users.items():
            node.ctl("add_user", user, user)
            _grant(node, vhost, shipped, user)
        yield {shipped: str(base.with_user(user).with_password(user))
               for shipped, user in users.items()}
    finally:
        node.ctl("delete_vhost", vhost)
        for user in users.values():
            with contextlib.suppress(Exception):
                node.ctl("delete_user", user)


@contextlib.asynccontextmanager
async def shipped_broker(services: SuiteServices, topology: Topology | None = None
                         ) -> AsyncIterator[Broker]:
    vhost = f"tfbi-{uuid.uuid4().hex[:8]}"
    with scratch_users(services, vhost) as urls:
        admin = RabbitTransport(str(URL(services.amqp).with_path("/" + vhost)),
                                topology or Topology(), management_url=services.management)
        await admin.connect()
        try:
            await admin.declare([ML, DE])
            yield Broker(vhost, admin, urls, services.management)
        finally:
            await admin.close()


@pytest.fixture
async def broker(services: SuiteServices) -> AsyncIterator[Broker]:
    async with shipped_broker(services) as b:
        yield b


@contextlib.asynccontextmanager
async def raw_channel(url: str) -> AsyncIterator[aio_pika.abc.AbstractChannel]:
    conn = await aio_pika.connect(url)
    try:
        yield await conn.channel(publisher_confirms=True)
    finally:
        await conn.close()


# -- attack 7: CC/BCC headers --------------------------------------------------------------

async def test_cc_and_bcc_headers_cannot_route_a_wakeup_into_another_teams_queue(
    broker: Broker,
) -> None:
    """RabbitMQ checks no CC/BCC against topic permissions; with per-queue exchanges they can
    only name queues bound to the attacker's own exchange, and that is its own queue."""
    topo = broker.admin.topology
    async with raw_channel(broker.urls[ML]) as ch:
        own = await ch.get_exchange(topo.deferrals_of(ML), ensure=False)
        await own.publish(aio_pika.Message(encode_wakeup([1]), headers={
            "CC": [DE], "BCC": [DE, topo.deferrals_of(DE)]}), routing_key=ML, mandatory=True)
    assert await wait_until(lambda: broker.ready(ML), 5) == 1
    assert await broker.ready(DE) == 0, "a CC header routed team-ml's wake-up into team-data-eng"
    for exchange in (topo.deferrals_of(DE), topo.deferrals):
        async with raw_channel(broker.urls[ML]) as ch:
            other = await ch.get_exchange(exchange, ensure=False)
            with pytest.raises(aiormq.exceptions.ChannelAccessRefused):
                await other.publish(aio_pika.Message(encode_wakeup([2])), routing_key=DE)
    assert await broker.ready(DE) == 0


# -- attack 8 and the size half of 7: floods ------------------------------------------------

async def test_oversized_messages_are_refused_at_the_broker_and_other_teams_go_on(
    broker: Broker,
) -> None:
    """A 10 MB event batch (or wake-up) under team-ml's own key is refused by the broker's
    max_message_size; team-data-eng's event right after is queued."""
    topo = broker.admin.topology
    junk = b"[" + b"1," * (5 << 20) + b"1]"  # 10 MB of junk ids
    for exchange, key in ((topo.events, ML), (topo.deferrals_of(ML), ML)):
        async with raw_channel(broker.urls[ML]) as ch:
            ex = await ch.get_exchange(exchange, ensure=False)
            with pytest.raises(aiormq.exceptions.ChannelPreconditionFailed, match="max size"):
                await ex.publish(aio_pika.Message(junk), routing_key=key)
    de = broker.team(DE)
    await de.connect()
    try:
        await de.publish(topo.events, DE, b'{"v": 2, "events": []}', user_id=de.user)
    finally:
        await de.close()
    assert await wait_until(lambda: broker.ready(topo.events_queue), 5) == 1
    assert await broker.ready(ML) == 0


async def test_a_batch_of_large_events_is_split_under_the_bound(broker: Broker) -> None:
    """100 events of 64 KiB payload (13 MB once escaped) leave a consumer as several
    messages the broker accepts, every event in one of them."""
    topo = broker.admin.topology
    payload = json.dumps("\"" * (64 << 10))
    events = [Event(i, 0, ML, "resume", payload, 0.0) for i in range(100)]
    ml = broker.team(ML)
    await ml.connect()
    try:
        with pytest.raises(PublishRefused, match="over the"):  # refused before it is sent...
            await ml.publish(topo.events, ML, b" " * (MAX_MESSAGE_BYTES + 1), user_id=ml.user)
        await ml.publish_events(ML, events)  # ...so the channel is still open
    finally:
        await ml.close()
    got: list[int] = []
    async with raw_channel(broker.admin.url) as ch:
        q = await ch.declare_queue(topo.events_queue, passive=True)
        while (message := await q.get(no_ack=True, fail=False)) is not None:
            assert len(message.body) <= MAX_MESSAGE_BYTES
            got += [ev.trigger_id for ev in decode_events(message.body)]
    assert sorted(got) == list(range(100))


def test_a_consumer_refuses_an_oversized_wakeup_before_decoding_it() -> None:
    """Bytes that are not even JSON: an oversized body is refused for its size, so none of it
    was decoded (a 41 MB wake-up cost a consumer 770 MiB when it was)."""
    with pytest.raises(WireError, match=r"^oversized wake-up"):
        decode_wakeup(b"[" * (MAX_ID_MESSAGE_BYTES + 1))
    with pytest.raises(WireError, match=r"^undecodable wake-up"):
        decode_wakeup(b"[" * MAX_ID_MESSAGE_BYTES)


POLICY_WAIT = 60.0


async def policy_applied(broker: Broker, queue: str, key: str = "max-length") -> bool:
    base = URL(broker.management)
    url = f"http://{base.host}:{base.port}/api/queues/{broker.vhost}/{queue}"
    async with httpx.AsyncClient(auth=(base.user or "", base.password or "")) as http:
        body = (await http.get(url)).json()
    return bool((body.get("effective_policy_definition") or {}).get(key))


async def test_a_flood_fills_only_the_flooding_teams_queue(services: SuiteServices) -> None:
    """Team queues are length-limited (reject-publish, set as a policy by ``declare``): a
    flood of team-ml's own wake-ups ends in QueueFull for team-ml alone. A quorum queue
    takes one message past its limit before it refuses (RabbitMQ 3.10.8)."""
    async with shipped_broker(services, Topology(max_messages=3)) as broker:
        # The management API shows a queue's effective policy from its statistics, which a
        # loaded broker (CI: the whole suite on two cores) refreshes seconds late.
        await wait_until(lambda: policy_applied(broker, ML), POLICY_WAIT, message="limits policy")
        await wait_until(lambda: policy_applied(broker, broker.admin.topology.dead_queue,
                                                "max-length-bytes"), POLICY_WAIT,
                         message="dead policy")
        ml, de = broker.team(ML), broker.team(DE)
        await ml.connect()
        await de.connect()
        try:
            with pytest.raises(QueueFull):
                for i in range(10):
                    await ml.publish_wakeups({ML: [i]})
            await de.publish_wakeups({DE: [5, 6]}, chunk=1)
        finally:
            await ml.close()
            await de.close()
        assert await broker.ready(ML) <= 4
        assert await broker.ready(DE) == 2


# -- attack 12c: a dead letter "from" another team ----------------------------------------

async def dead_letters(broker: Broker, n: int) -> list[aio_pika.abc.AbstractIncomingMessage]:
    got: list[aio_pika.abc.AbstractIncomingMessage] = []
    async with raw_channel(broker.admin.url) as ch:
        q = await ch.declare_queue(broker.admin.topology.dead_queue, passive=True)
        for _ in range(50):
            message = await q.get(no_ack=True, fail=False)
            if message is not None:
                got.append(message)
            if len(got) == n:
                break
            await asyncio.sleep(0.1)
    return got


async def test_a_team_cannot_file_a_dead_letter_in_another_teams_name(broker: Broker) -> None:
    topo = broker.admin.topology
    ml = broker.team(ML)
    await ml.connect()
    try:
        with pytest.raises(PublishRefused, match="ACCESS_REFUSED"):
            await ml.dead_letter(b"{}", "forged: looks like data-eng's", source=DE)
        await ml.connect()
        await ml.dead_letter(b"{}", "really mine", source=ML)
        # From a writer on a broker allowing more: cut to the bound, not lost.
        await ml.dead_letter(b"x" * (MAX_MESSAGE_BYTES + 10), "too big", source=ML)
    finally:
        await ml.close()
    async with raw_channel(broker.urls[ML]) as ch:
        dead = await ch.get_exchange(topo.dead, ensure=False)
        with pytest.raises(aiormq.exceptions.ChannelPreconditionFailed, match="user_id"):
            await dead.publish(aio_pika.Message(b"{}", user_id=URL(broker.urls[DE]).user),
                               routing_key=ML)
    letter, big = await dead_letters(broker, 2)
    assert (letter.routing_key, letter.user_id) == (ML, URL(broker.urls[ML]).user)
    assert letter.headers["x-triggerflow-reason"] == "really mine"
    assert len(big.body) == MAX_MESSAGE_BYTES
    assert big.headers["x-triggerflow-truncated"] == MAX_MESSAGE_BYTES + 10


# -- attack 12d: binding to another team's control routing ---------------------------------

async def test_a_team_cannot_bind_to_another_teams_control_and_never_gets_its_cancels(
    broker: Broker,
) -> None:
    topo = broker.admin.topology
    for exchange in (topo.control_of(DE), topo.deferrals_of(DE), topo.events, topo.dead):
        async with raw_channel(broker.urls[ML]) as ch:
            spy = await ch.declare_queue("", exclusive=True)
            with pytest.raises(aiormq.exceptions.ChannelAccessRefused):
                await spy.bind(exchange, "#")
    de_consumer, victim_id = broker.team(DE), 7
    got: dict[str, list[bytes]] = {"de": [], "spy": []}

    def keep(into: list[bytes]) -> Any:
        async def on(delivery: Delivery) -> None:
            into.append(delivery.body)
            await delivery.ack()
        return on

    ml = broker.team(ML)
    await de_consumer.connect()
    await ml.connect()
    try:
        await de_consumer.subscribe_control(victim_id, keep(got["de"]), prefetch=10, queues=[DE])
        # team-ml's own control exchange, with the victim's consumer id as key: allowed,
        # and useless, since the victim's cancels travel on team-data-eng's exchange.
        await ml.subscribe_control(victim_id, keep(got["spy"]), prefetch=10, queues=[ML])
        await broker.admin.publish_control(victim_id, "cancel", [42], queue=DE)
        await wait_until(lambda: asyncio.sleep(0, got["de"]), 5, message="the real cancel")
        await asyncio.sleep(0.5)
    finally:
        await ml.close()
        await de_consumer.close()
    assert got["spy"] == [], "team-ml received team-data-eng's cancel"


# -- presence: no team can announce another team's consumer gone -------------------------

async def test_a_team_cannot_fake_another_teams_consumer_leaving(broker: Broker) -> None:
    """A peer takes a consumer's triggers over when the broker announces its presence queue
    deleted (consumer/presence.py). Another team can neither delete that queue, nor take its
    name first, nor publish an announcement of its own (docs/security.md)."""
    victim = broker.team(DE)
    await victim.connect()
    try:
        name = await victim.watch_presence(lambda _: None)  # team-data-eng may read presence
        assert name and name.startswith("amq.gen-")
        topo = broker.admin.topology
        async with raw_channel(broker.urls[ML]) as ch:  # the name matches its configure rule
            with pytest.raises(aiormq.exceptions.ChannelLockedResource):
                await ch.queue_delete(name)
        async with raw_channel(broker.urls[ML]) as ch:
            with pytest.raises((aiormq.exceptions.ChannelLockedResource,
                                aiormq.exceptions.ChannelAccessRefused)):
                await ch.declare_queue(name, exclusive=True)
        async with raw_channel(broker.urls[ML]) as ch:
            presence = await ch.get_exchange(topo.presence, ensure=False)
            with pytest.raises(aiormq.exceptions.ChannelAccessRefused):
                await presence.publish(aio_pika.Message(b"", headers={
                    "name": name, "vhost": broker.vhost}), "queue.deleted")
        assert victim.is_open  # and its presence queue still stands for it
    finally:
        await victim.close()


# -- attack 12b: a multi-queue consumer with a per-team user ------------------------------

def wait_exit(proc: subprocess.Popen[bytes], timeout: float) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"consumer still running after {timeout}s") from None


async def test_a_multi_queue_consumer_whose_user_may_not_read_a_queue_refuses_with_one_line(
    broker: Broker, procs: Processes, services: SuiteServices,
) -> None:
    """``--queue team-ml --queue team-data-eng`` as team-ml's user: one error line naming the
    user and the queue, exit 1 (it was 33,203 retry warnings in 4 s). Once the user may
    read both (and bind to both control exchanges), the same command serves both."""
    args = {"amqp_url": broker.urls[ML], "namespace": "triggerflow",
            "management_url": broker.management}
    proc = procs.consume(ML, DE, **args)
    assert await asyncio.to_thread(wait_exit, proc, 60) == 1
    log = procs.log(proc)
    user = URL(broker.urls[ML]).user
    refusals = [line for line in log.splitlines() if "may not read" in line]
    # The queue and its control exchange are subscribed at once: whichever is refused first
    # is named (the line names the user and team-data-eng's queue or control exchange).
    named = (f"may not read queue '{DE}'", f"may not read control exchange 'triggerflow.control.{DE}'")
    assert refusals and f"broker user '{user}' may not read" in refusals[0] \
        and any(n in refusals[0] for n in named), log[-3000:]
    assert "retrying in" not in log, log[-3000:]
    (perms,) = [p for p in DEFINITIONS["permissions"] if p["user"] == ML]
    both = perms["read"].replace(f"^({ML}|", f"^({ML}|{DE}|triggerflow\\.control\\.{DE}|")
    assert both != perms["read"]
    services.rabbit().ctl("set_permissions", "-p", broker.vhost, user or "",
                          perms["configure"], perms["write"], both)
    procs.consume(ML, DE, **args)

    async def consumers() -> bool:
        infos = [await broker.admin.queue_info(q) for q in (ML, DE)]
        return all(i is not None and i.consumers == 1 for i in infos)
    await wait_until(consumers, 30, message="one consumer on each queue")


# -- migration from the shared exchanges -----------------------------------------------------

async def test_topology_apply_over_the_shared_exchanges_keeps_old_publishers_delivering(
    broker: Broker,
) -> None:
    """A broker set up by an older version has the shared topic exchange bound to each team
    queue; declaring again (twice: idempotent) adds the per-queue route and keeps the old."""
    topo = broker.admin.topology
    async with raw_channel(broker.admin.url) as ch:
        legacy = await ch.declare_exchange(topo.deferrals, aio_pika.ExchangeType.TOPIC,
                                           durable=True)
        queue = await ch.declare_queue(ML, passive=True)
        await queue.bind(legacy, ML)
    await broker.admin.declare([ML, DE])
    await broker.admin.declare([ML, DE])
    await broker.admin.publish(topo.deferrals, ML, encode_wakeup([1]))  # an old SDK
    await broker.admin.publish_wakeups({ML: [2]})  # a new one

    async def both() -> bool:
        return await broker.ready(ML) == 2
    await wait_until(both, 5, message="both wake-ups in team-ml's queue")


async def queue_type(broker: Broker, queue: str) -> str:
    base = URL(broker.management)
    url = f"http://{base.host}:{base.port}/api/queues/{broker.vhost}/{queue}"
    async with httpx.AsyncClient(auth=(base.user or "", base.password or "")) as http:
        return str((await http.get(url)).json()["type"])


async def test_topology_apply_makes_an_older_classic_dead_letter_queue_quorum_losing_nothing(
    broker: Broker, caplog: pytest.LogCaptureFixture,
) -> None:
    """The dead-letter queue is a quorum queue (a classic one lives on one node and drops what
    is filed while that node is down). A classic one left by an older version is replaced
    only when empty: one that holds dead letters is kept, with a warning, until they are read."""
    topo = broker.admin.topology
    assert await queue_type(broker, topo.dead_queue) == "quorum"
    async with raw_channel(broker.admin.url) as ch:
        await ch.queue_delete(topo.dead_queue)
        old = await ch.declare_queue(topo.dead_queue, durable=True)  # as older versions did
        await old.bind(topo.dead, "#")
    await broker.admin.dead_letter(b"kept", "an older dead letter", source=ML)
    await broker.admin.declare([ML, DE])
    assert await queue_type(broker, topo.dead_queue) == "classic"
    assert "classic queue holding 1 dead letters" in caplog.text
    [kept] = await dead_letters(broker, 1)
    assert kept.body == b"kept"
    await broker.admin.declare([ML, DE])
    assert await queue_type(broker, topo.dead_queue) == "quorum"
    await broker.admin.dead_letter(b"new", "a dead letter after the upgrade", source=ML)
    [new] = await dead_letters(broker, 1)
    assert new.body == b"new"
