"""A process's presence on the broker: its row names its connection's presence queue, and it
hears every other one go.

A killed process's kernel closes its sockets at once, and RabbitMQ deletes the presence
queue of that connection within milliseconds (``transport.presence``). Whoever hears it ends
the lease of the row that named it, instead of waiting for the lease to run out. Here: a
writer's. A writer fences nothing, so its lease is long (``Writer``) and only ``status``,
``health`` and the gauges read its row; ended on the broker's word, a killed writer shows
dead at once. Its peer writers hear it, and so do consumers whose database role may update a
writer's row (row security keeps a team's consumer role to its own rows: there ``status``
reads the events queue's consumer count from the broker instead). A consumer's peers also
take its triggers over (``consumer.presence``).

What the broker cannot see -- a frozen process, whose socket stays open; a partition or a
vanished host, until the broker's heartbeat gives up -- is left to the lease.
"""

from __future__ import annotations

import logging

from triggerflow.lease import Lease
from triggerflow.lifecycle import Background
from triggerflow.store import PresenceStore, StoreError
from triggerflow.telemetry import get_metrics
from triggerflow.transport import Transport, TransportUnavailable

log = logging.getLogger(__name__)


class Presence:
    """Our presence queue named on our row, and writers heard going ended."""

    def __init__(self, store: PresenceStore, transport: Transport, lease: Lease) -> None:
        self.store = store
        self.transport = transport
        self.lease = lease
        self.name: str | None = None  # our connection's presence queue; None: presence off
        self._named_on = 0  # the row id that names it
        self._checks = Background()

    async def connected(self) -> None:
        """On each new broker connection: a new presence queue, named on our row."""
        try:
            self.name = await self.transport.watch_presence(self._heard)
        except TransportUnavailable:
            raise  # the connection went: the next one tries again
        except Exception:  # never worth our subscriptions: the lease still decides
            log.exception("presence off on this connection; a death waits for the lease")
            self.name = None
        self._named_on = 0
        await self.announce()

    async def announce(self) -> None:
        """Name our presence queue on our current row, if not done yet (after a connect or a
        new registration); a failure is retried on the next call (each renewal)."""
        me = self.lease.me
        if self.name is None or self._named_on == me or not me:
            return
        try:
            if await self.store.announce_presence(me, self.name):
                self._named_on = me
        except StoreError as exc:
            log.warning("naming our presence queue failed (%r); retrying at the next renewal", exc)

    def _heard(self, name: str) -> None:
        self._checks.spawn(self._gone(name))

    async def _gone(self, name: str) -> None:
        await self.end_writer(name)

    async def end_writer(self, name: str) -> None:
        """End the lease of the writer whose connection's presence queue ``name`` was."""
        try:
            ids = await self.store.writer_gone(name)
        except StoreError as exc:
            log.warning("presence queue %s deleted, but ending a writer's lease on it failed "
                        "(%r); its lease will expire", name, exc)
            return
        if ids:
            get_metrics().presence_lost.add(len(ids), {"kind": "writer"})
            log.warning("writer %s closed its broker connection (presence queue %s deleted): "
                        "its lease ended now", ",".join(map(str, ids)), name)
