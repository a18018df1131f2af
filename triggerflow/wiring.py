"""The composition root: the one place that picks and builds the real store and transport.

Everything else takes a :class:`~triggerflow.store.Store` and a
:class:`~triggerflow.transport.Transport`. A new mode (Airflow's tables) adds a branch to
:func:`connect_store`, not a fork of the loops.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from tenacity import wait_exponential_jitter

from triggerflow.codec import KwargsCodec
from triggerflow.health import get_health
from triggerflow.lifecycle import report_refused
from triggerflow.refusals import Refusals
from triggerflow.settings import Settings
from triggerflow.store import Store, StoreAccessRefused, StoreError
from triggerflow.transport import Transport

if TYPE_CHECKING:
    from triggerflow.store.postgres import Database
    from triggerflow.transport.rabbitmq import RabbitTransport

log = logging.getLogger(__name__)


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

    # Only a URL given explicitly: ``declare`` must not fail on a guessed one (no plugin, or
    # another port); without one it warns that the queue limits are not set.
    management = settings.management_url
    return RabbitTransport(settings.amqp_dsn(), Topology(settings.namespace), name=name,
                           management_url=management.get_secret_value() if management else None)


CONSUMER_CONNECTION = "triggerflow-consumer:"
# Tries to reach the database at start (about 15 s with the backoff): long enough for one
# started beside it, short enough that a wrong host or port is one line, not a hang.
STARTUP_ATTEMPTS = 6


def consumer_connection_name(queues: list[str]) -> str:
    """What a consumer's AMQP connection calls itself: ``status`` matches the broker's
    subscribers to consumer rows (host, pid) by it."""
    import os
    import socket

    return f"{CONSUMER_CONNECTION}{','.join(queues)}@{socket.gethostname()}:{os.getpid()}"


async def _connect_store_retrying(settings: Settings, stop: asyncio.Event,
                                  lock_timeout: float | None = None) -> Store | None:
    """The store once it answers (None: stopped first). Retries, a bounded number of times,
    while it is unreachable (then its last StoreUnavailable: the CLI's one line names the
    setting) or refuses our credentials (then StoreAccessRefused); readiness names the
    database meanwhile. Once started, a process rides out outages of any length."""
    refusals = Refusals("the database", StoreAccessRefused, log,
                        unavailable_attempts=STARTUP_ATTEMPTS)
    get_health().check("database", lambda: f"connecting ({refusals.last_error or 'starting'})")

    async def connect() -> Store:
        async for attempt in refusals.retrying(
                StoreError, wait_exponential_jitter(multiplier=0.5, max=5, jitter=0.5)):
            with attempt:
                return await connect_store(settings, lock_timeout=lock_timeout)
        raise AssertionError("unreachable: the retrying re-raises its last error")

    connecting = asyncio.ensure_future(connect())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait([connecting, stopping], return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not connecting.done():
        connecting.cancel()
        return None
    return connecting.result()


async def _serve(settings: Settings, stop: asyncio.Event,
                 serve: Callable[[Store], Awaitable[int]], *,
                 lock_timeout: float | None = None) -> int:
    """``serve`` on the store once connected; 1 with one line when the store refused us."""
    try:
        store = await _connect_store_retrying(settings, stop, lock_timeout)
    except StoreAccessRefused as exc:
        report_refused(exc)
        return 1
    if store is None:
        return 0
    try:
        return await serve(store)
    finally:
        await store.close()


async def serve_consumer(settings: Settings, stop: asyncio.Event) -> int:
    """Run a consumer on the real store and transport until ``stop``; its exit code."""
    return await _serve(settings, stop, lambda store: _consume(settings, store, stop))


async def _consume(settings: Settings, store: Store, stop: asyncio.Event) -> int:
    from triggerflow.consumer import Consumer

    transport = make_transport(settings, name=consumer_connection_name(settings.queues))
    if settings.airflow:
        from triggerflow.airflow import serve

        return await serve.serve_consumer(settings, store, transport, stop)
    return await Consumer(settings, store, transport).run(stop)


async def serve_writer(settings: Settings, stop: asyncio.Event) -> int:
    """Run a writer on the real store and transport until ``stop``; its exit code."""
    return await _serve(settings, stop, lambda store: _write(settings, store, stop),
                        lock_timeout=settings.writer_lock_timeout.total_seconds())


async def _write(settings: Settings, store: Store, stop: asyncio.Event) -> int:
    from triggerflow.writer import Writer

    transport = make_transport(settings, name="triggerflow-writer")
    if settings.airflow:
        from triggerflow.airflow import serve

        return await serve.serve_writer(settings, store, transport, stop)
    return await Writer(settings, store, transport).run(stop)


async def admin_database(settings: Settings) -> Database:
    """One connection to the native tables for the operator commands and gauges."""
    from triggerflow.store.postgres import Database

    return await Database.connect(settings.database_dsn(), max_size=1,
                                  pgbouncer=settings.pgbouncer)
