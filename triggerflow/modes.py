"""Native mode and Airflow mode: everything that differs between them, behind one object.

A :class:`Mode` owns the store it connects and says what that store can do beyond the roles
(``capabilities``: the loops ask it, never the store), the loader and event encoding of its
consumers, what runs beside a writer (Airflow mode: LISTEN wake-ups, the backstop, the
triggerer heartbeat), the writer's reaper scope and where the queue gauges and ``status``
read their numbers. The composition root (``wiring``) picks one with :func:`mode_for` and
hands its parts to the same loops; nothing else asks which mode it is in.

Native mode lives here. Airflow mode lives in ``triggerflow.airflow.mode`` and is imported
only when ``settings.airflow`` asks for it, so a native process never imports Airflow's code.
"""

from __future__ import annotations

import asyncio
import contextlib
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from triggerflow.store import Capabilities

if TYPE_CHECKING:
    from triggerflow.codec import KwargsCodec
    from triggerflow.consumer.outcomes import EncodeFn
    from triggerflow.loader import Loader
    from triggerflow.reaper import Reaper
    from triggerflow.settings import Settings
    from triggerflow.store import SdkStore, ServingStore
    from triggerflow.store.gauges import GaugeSource
    from triggerflow.store.postgres import PostgresStore
    from triggerflow.store.postgres.admin import StatusStatements
    from triggerflow.transport import Transport

StoreT = TypeVar("StoreT", bound="ServingStore")


class Mode(Protocol[StoreT]):
    """What a mode decides; ``StoreT`` is the store it connects and its writer side uses.

    ``writer_queues``: the queues a writer's backstop and gauges cover; empty for every queue.
    ``capabilities``: what its store does beyond the roles; handed to the consumer and the
    writer beside the store.
    """

    name: str
    writer_queues: list[str]
    capabilities: Capabilities

    async def connect_store(self, *, max_size: int | None = None,
                            lock_timeout: float | None = None, consumer: bool = False) -> StoreT:
        """The store, connected; ``lock_timeout``: the writer's bound on row-lock waits;
        ``consumer``: for a consumer (scoped as the mode scopes consumers)."""
        ...

    async def connect_deferrals(self, *, max_size: int | None = None) -> SdkStore:
        """The store the SDK defers and cancels through; raises ``StoreError`` in a mode
        where tasks defer some other way."""
        ...

    def loader(self) -> Loader:
        """Claimed rows -> what the consumer's runner runs."""
        ...

    def encoder(self) -> EncodeFn | None:
        """How a consumer encodes what a trigger yields (None: the native wire form)."""
        ...

    def serving_consumer(self) -> AbstractAsyncContextManager[asyncio.Event | None]:
        """Entered around a consumer's run: what its triggers need beside it. Gives an event
        set once that answers (the consumer's ``warm_up``), or None: nothing to wait for."""
        ...

    def serving_writer(self, store: StoreT, transport: Transport, reaper: Reaper,
                       stop: asyncio.Event) -> AbstractAsyncContextManager[object]:
        """Entered around a writer's run: the tasks that run beside it."""
        ...

    def status_statements(self) -> StatusStatements:
        """What ``triggerflow status`` reads, in this mode's tables."""
        ...

    async def connect_gauges(self) -> GaugeSource:
        """One connection for the queue gauges' reads."""
        ...


def kwargs_codec(settings: Settings) -> KwargsCodec:
    """How native mode keeps trigger kwargs at rest (Airflow mode: Airflow's Fernet key)."""
    from triggerflow.codec import KwargsCodec

    return KwargsCodec.from_secrets(settings.kwargs_key, settings.kwargs_keys)


class NativeMode:
    """triggerflow's own tables in PostgreSQL; its triggers, its wire form, nothing beside
    the loops."""

    name = "native"

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        # A native writer serves every queue, whatever ``queues`` says (an environment
        # shared by all processes may set it).
        self.writer_queues: list[str] = []
        self.capabilities = Capabilities()

    async def connect_store(self, *, max_size: int | None = None,
                            lock_timeout: float | None = None,
                            consumer: bool = False) -> PostgresStore:
        from triggerflow.store.postgres import PostgresStore

        settings = self.settings
        return await PostgresStore.connect(
            settings.database_dsn(), max_size=max_size or settings.db_pool_size,
            pgbouncer=settings.pgbouncer, codec=kwargs_codec(settings),
            lock_timeout=lock_timeout)

    async def connect_deferrals(self, *, max_size: int | None = None) -> PostgresStore:
        return await self.connect_store(max_size=max_size)

    def loader(self) -> Loader:
        from triggerflow.loader import TriggerLoader

        return TriggerLoader(self.settings.allowed_modules)

    def encoder(self) -> EncodeFn | None:
        return None

    def serving_consumer(self) -> AbstractAsyncContextManager[asyncio.Event | None]:
        return contextlib.nullcontext(None)

    def serving_writer(self, store: PostgresStore, transport: Transport, reaper: Reaper,
                       stop: asyncio.Event) -> AbstractAsyncContextManager[object]:
        return contextlib.nullcontext()

    def status_statements(self) -> StatusStatements:
        from triggerflow.store.postgres.admin import NATIVE_STATUS

        return NATIVE_STATUS

    async def connect_gauges(self) -> GaugeSource:
        from triggerflow.store.postgres.gauges import SqlGauges

        return await SqlGauges.connect(self.settings.database_dsn(),
                                       pgbouncer=self.settings.pgbouncer)


def mode_for(settings: Settings) -> Mode[Any]:
    """The mode ``settings`` ask for; the one place that reads ``settings.airflow``."""
    if settings.airflow:
        from triggerflow.airflow.mode import AirflowMode

        return AirflowMode(settings)
    return NativeMode(settings)


if TYPE_CHECKING:

    def _is_a_mode(mode: NativeMode) -> Mode[PostgresStore]:
        return mode  # mypy checks NativeMode against the Protocol here
