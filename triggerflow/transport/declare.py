"""Declaring the broker topology: exchanges, team queues, the events queue, dead letters,
the presence relay and (through the management API) the queues' length-limit policies.

Idempotent, and also the migration from the shared deferral and control exchanges of older
versions: each queue gets its own exchanges; the old ones keep their bindings so that
clients not yet upgraded still deliver (docs/security.md, "Migrating").
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import aio_pika
import aiormq
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractExchange

from triggerflow.transport.management import ManagementClient, vhost_of
from triggerflow.transport.presence import relay_deleted_queues
from triggerflow.transport.topology import Topology

log = logging.getLogger(__name__)


async def declare(
    channel: AbstractChannel,
    connection: AbstractConnection,
    topology: Topology,
    team_queues: Sequence[str],
    *,
    delivery_limit: int,
    management_url: str | None,
    url: str,
) -> dict[str, AbstractExchange]:
    """Declare everything ``team_queues`` need; returns the exchanges by name. Policies are
    set only with a ``management_url`` (AMQP cannot set them; a warning says so)."""
    t = topology
    exchanges = dict(t.exchanges())
    for team in team_queues:
        exchanges.update(t.team_exchanges(team))
    declared = {
        name: await channel.declare_exchange(name, aio_pika.ExchangeType(kind), durable=True)
        for name, kind in exchanges.items()
    }
    await declare_dead_queue(connection, t)
    args = t.queue_arguments(delivery_limit)
    events_q = await channel.declare_queue(t.events_queue, durable=True, arguments=args)
    await events_q.bind(t.events, "#")
    for team in team_queues:
        q = await channel.declare_queue(team, durable=True, arguments=args)
        await q.bind(t.deferrals_of(team), team)
    await relay_deleted_queues(connection, t)
    if management_url is None:
        log.warning(
            "queue length limits not set (they need the management API: set "
            "TRIGGERFLOW_MANAGEMENT_URL, or load the policies of "
            "brokers/rabbitmq/definitions.json)"
        )
        return declared
    vhost = vhost_of(url)
    async with ManagementClient(management_url) as api:
        for name, body in [t.dead_policy(), *map(t.limits_policy, team_queues)]:
            await api.set_policy(vhost, name, body)
    return declared


async def declare_dead_queue(connection: AbstractConnection, topology: Topology) -> None:
    """The dead-letter queue, a quorum queue like the queues it serves: a classic queue lives
    on one node, and a dead letter filed while that node is down is dropped.

    Older versions declared it classic, and RabbitMQ refuses to change a queue's type. An
    empty classic one is replaced; one holding dead letters is kept (with a warning naming
    the steps) so that no dead letter is lost to the upgrade. Throwaway channels: a refused
    declaration closes its channel."""
    t = topology
    quorum: dict[str, Any] = {"x-queue-type": "quorum"}
    try:
        async with connection.channel(publisher_confirms=False) as ch:
            q = await ch.declare_queue(t.dead_queue, durable=True, arguments=quorum)
            await q.bind(t.dead, "#")
            return
    except aiormq.exceptions.ChannelPreconditionFailed:
        pass  # it exists with another type: a classic queue of an older version
    async with connection.channel(publisher_confirms=False) as ch:
        old = await ch.declare_queue(t.dead_queue, passive=True)
        held = int(old.declaration_result.message_count or 0)
        if held:
            log.warning(
                "dead-letter queue %s is a classic queue holding %d dead letters: kept as it "
                "is (a dead letter filed while its node is down is lost); read or move them, "
                "delete the queue, and run `triggerflow topology apply` to make it a quorum "
                "queue (docs/upgrade-backup.md)", t.dead_queue, held)
            return
        await old.delete(if_unused=False, if_empty=True)
        q = await ch.declare_queue(t.dead_queue, durable=True, arguments=quorum)
        await q.bind(t.dead, "#")
        log.info("dead-letter queue %s is now a quorum queue (was classic and empty)",
                 t.dead_queue)
