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


async def connect_store(settings: Settings, *, max_size: int | None = None) -> Store:
    """The store ``settings`` ask for, connected (native mode: PostgreSQL; ``airflow``:
    Airflow's metadata database)."""
    if settings.airflow:
        from triggerflow.airflow import serve

        return await serve.connect_store(settings, max_size=max_size)
    from triggerflow.store.postgres import PostgresStore

    return await PostgresStore.connect(
        settings.database_dsn(), max_size=max_size or settings.db_pool_size,
        pgbouncer=settings.pgbouncer, codec=kwargs_codec(settings))


def make_transport(settings: Settings, *, name: str) -> Transport:
    """The transport ``settings`` ask for (RabbitMQ), not yet connected."""
    return rabbit_transport(settings, name=name)


def rabbit_transport(settings: Settings, *, name: str) -> RabbitTransport:
    from triggerflow.transport.rabbitmq import RabbitTransport, Topology

    # Only a URL given explicitly: ``declare`` must not fail on a guessed one (no plugin, or
    # another port); without one it warns that the queue limits are not set.
    management = settings.management_url
    return RabbitTransport(settings.amqp_dsn(), Topology(settings.namespace), name=name,
                           management_url=management.get_secret_value() if management else None)


CONSUMER_CONNECTION = "triggerflow-consumer:"


def consumer_connection_name(queues: list[str]) -> str:
    """What a consumer's AMQP connection calls itself: ``status`` matches the broker's
    subscribers to consumer rows (host, pid) by it."""
    import os
    import socket

    return f"{CONSUMER_CONNECTION}{','.join(queues)}@{socket.gethostname()}:{os.getpid()}"


async def serve_consumer(settings: Settings, stop: asyncio.Event) -> int:
    """Run a consumer on the real store and transport until ``stop``; its exit code."""
    from triggerflow.consumer import Consumer

    store = await connect_store(settings)
    transport = make_transport(settings, name=consumer_connection_name(settings.queues))
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

    store = await connect_store(settings)
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
