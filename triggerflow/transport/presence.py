"""Presence on RabbitMQ: hear from the broker, within milliseconds, that a peer's connection
closed, instead of waiting for its lease to run out.

Each consumer declares an exclusive, server-named queue on its own connection and never
consumes it. RabbitMQ deletes an exclusive queue the moment its connection closes (a killed
process's kernel closes the socket at once), and the event exchange plugin
(``rabbitmq_event_exchange``) announces it: ``queue.deleted`` with headers ``name`` and
``vhost``. ``declare`` relays those announcements, and only those, to ``<ns>.presence``;
each consumer binds a private queue to that exchange.

Nobody can announce a live consumer's queue gone but its own connection: the broker chooses
the name ("amq.gen-…", which no client may declare), an exclusive queue can be deleted only
through the connection that declared it, the event exchange is internal (nobody publishes to
it) and team users may read the presence exchange but not write to it. A frozen process
(SIGSTOP) keeps its socket, so the broker sees nothing until its heartbeat gives up: the
lease stays the rule for what the broker cannot see.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import aiormq
from aio_pika.abc import AbstractConnection, AbstractIncomingMessage

from triggerflow.transport.topology import EVENT_EXCHANGE, QUEUE_DELETED, Topology

log = logging.getLogger(__name__)

# What the broker refuses when the plugin is off, the topology is older than presence, or the
# user may not read the presence exchange: presence is then off, the lease still fails over.
_MISSING = (aiormq.exceptions.ChannelNotFoundEntity, aiormq.exceptions.ChannelAccessRefused)


def _text(value: object) -> str | None:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return value if isinstance(value, str) else None


async def relay_deleted_queues(connection: AbstractConnection, topology: Topology) -> bool:
    """Bind ``topology.presence`` to the event exchange's ``queue.deleted``; False (and a
    warning) when the broker has no event exchange in this virtual host."""
    ch = await connection.channel(publisher_confirms=False)
    try:
        presence = await ch.get_exchange(topology.presence, ensure=False)
        await presence.bind(EVENT_EXCHANGE, QUEUE_DELETED)
        return True
    except _MISSING as exc:
        log.warning(
            "presence off, failover waits for the lease: no %s here (enable the "
            "rabbitmq_event_exchange plugin, event_exchange.vhost = this vhost): %s",
            EVENT_EXCHANGE,
            exc,
        )
        return False
    finally:
        if not ch.is_closed:
            await ch.close()


async def watch_presence(
    connection: AbstractConnection, topology: Topology, vhost: str, on_gone: Callable[[str], None]
) -> str | None:
    """Declare this connection's presence queue and call ``on_gone(name)`` for every
    presence queue of ``vhost`` the broker deletes. Returns our queue's name; None (and a
    warning) when nobody could hear it go: no presence exchange, or not readable to us."""
    ch = await connection.channel(publisher_confirms=False)
    try:
        heard = await ch.declare_queue("", exclusive=True, auto_delete=True)
        await heard.bind(topology.presence, "")
    except _MISSING as exc:
        log.warning(
            "presence off, failover waits for the lease: cannot bind to %s (run "
            "`triggerflow topology apply`; team users need read on it): %s",
            topology.presence,
            exc,
        )
        if not ch.is_closed:
            await ch.close()
        return None
    own = await ch.declare_queue("", exclusive=True, auto_delete=False)

    async def on_deleted(message: AbstractIncomingMessage) -> None:
        headers = message.headers or {}
        name = _text(headers.get("name"))
        if name and name != own.name and _text(headers.get("vhost")) == vhost:
            on_gone(name)

    await heard.consume(on_deleted, no_ack=True)
    return own.name
