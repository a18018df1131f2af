"""In-memory triggerflow for tests of triggers and hosts: no RabbitMQ, no PostgreSQL.

    mem = InMemory()
    client = mem.client(settings)            # the real SDK on the in-memory store/broker
    consumer = Consumer(settings, mem.store, mem.transport())
    writer = Writer(settings, mem.store, mem.transport())

The loops are the real ones; only the store and the transport are fakes (see
``triggerflow.store.memory`` and ``triggerflow.transport.memory`` for what they mirror).
A consumer checks its clock against the store's at each renewal and runs nothing while they
differ by more than ``max_clock_skew``: with ``InMemory.with_clock(clock)``, give the
consumer the same clock (``Consumer(settings, mem.store, mem.transport(), clock=clock)``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from triggerflow.codec import KwargsCodec
from triggerflow.sdk import SyncClient, TriggerflowClient
from triggerflow.settings import Settings
from triggerflow.store import SdkStore
from triggerflow.store.memory import ManualClock, MemoryStore
from triggerflow.transport import Transport
from triggerflow.transport.memory import MemoryBroker, MemoryTransport

__all__ = ["InMemory", "ManualClock", "MemoryBroker", "MemoryStore", "MemoryTransport"]


@dataclass
class InMemory:
    """One in-memory store and broker shared by every part of a test."""

    store: MemoryStore = field(default_factory=MemoryStore)
    broker: MemoryBroker = field(default_factory=MemoryBroker)

    @classmethod
    def with_clock(cls, clock: Callable[[], float], codec: KwargsCodec | None = None) -> InMemory:
        return cls(MemoryStore(clock, codec))

    def transport(self, user: str = "guest") -> MemoryTransport:
        return MemoryTransport(self.broker, user=user)

    async def _connect(self, settings: Settings, max_connections: int) -> tuple[SdkStore, Transport]:
        return self.store, self.transport()

    def client(self, settings: Settings | None = None) -> TriggerflowClient:
        return TriggerflowClient(settings, connect=self._connect)

    def sync_client(self, settings: Settings | None = None) -> SyncClient:
        return SyncClient(settings, connect=self._connect)
