"""The composition root: the one place that picks and builds the real store and transport.

Everything else takes a :class:`~triggerflow.store.Store` and a
:class:`~triggerflow.transport.Transport`. A new mode (Airflow's tables) adds a branch to
:func:`connect_store`, not a fork of the loops.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from triggerflow.codec import KwargsCodec
from triggerflow.settings import Settings
from triggerflow.store import Store
from triggerflow.transport import Transport

if TYPE_CHECKING:
    from triggerflow.store.postgres import Database
    from triggerflow.transport.rabbitmq import RabbitTransport


def kwargs_codec(settings: Settings) -> KwargsCodec:
    return KwargsCodec.from_secrets(settings.kwargs_key, settings.kwargs_keys)


async def connect_store(settings: Settings, *, max_size: int | None = None,
                        lock_timeout: float | None = None) -> Store:
    """The store ``settings`` ask for, connected (native mode: PostgreSQL; ``airflow``:
    Airflow's metadata database). ``lock_timeout``: the writer's bound on row-lock waits."""
    if settings.airflow:
        from triggerflow.airflow import serve

        return await serve.connect_store(settings, max_size=max_size, lock_timeout=lock_timeout)
    from triggerflow.store.postgres import PostgresStore

    return await PostgresStore.connect(
        settings.database_dsn(), max_size=max_size or settings.db_pool_size,
        pgbouncer=settings.pgbouncer, codec=kwargs_codec(settings), lock_timeout=lock_timeout)


def make_transport(settings: Settings, *, name: str) -> Transport:
    """The transport ``settings`` ask for (RabbitMQ), not yet connected."""
    return rabbit_transport(settings, name=name)


def rabbit_transport(settings: Settings, *, name: str) -> RabbitTransport:
    from triggerflow.transport.rabbitmq import RabbitTransport, Topology

    return RabbitTransport(settings.amqp_dsn(), Topology(settings.namespace), name=name)


async def serve_consumer(settings: Settings, stop: asyncio.Event) -> int:
    """Run a consumer on the real store and transport until ``stop``; its exit code."""
    from triggerflow.consumer import Consumer

    store = await connect_store(settings)
    transport = make_transport(
        settings, name=f"triggerflow-consumer:{','.join(settings.queues)}")
    try:
        if settings.airflow:
            from triggerflow.airflow import serve

            return await serve.serve_consumer(settings, store, transport, stop)
        return await Consumer(settings, store, transport).run(stop)
    finally:
        await store.close()


async def serve_writer(settings: Settings, stop: asyncio.Event) -> int:
    """Run a writer on the real store and transport until ``stop``; its exit code."""
    from triggerflow.writer import Writer

    store = await connect_store(settings,
                                lock_timeout=settings.writer_lock_timeout.total_seconds())
    transport = make_transport(settings, name="triggerflow-writer")
    try:
        if settings.airflow:
            from triggerflow.airflow import serve

            return await serve.serve_writer(settings, store, transport, stop)
        return await Writer(settings, store, transport).run(stop)
    finally:
        await store.close()


async def admin_database(settings: Settings) -> Database:
    """One connection to the native tables for the operator commands and gauges."""
    from triggerflow.store.postgres import Database

    return await Database.connect(settings.database_dsn(), max_size=1,
                                  pgbouncer=settings.pgbouncer)
