"""The composition root: the one place that picks and builds the real store and transport.

Everything else takes the store's roles it uses (:mod:`triggerflow.store.roles`) and a
:class:`~triggerflow.transport.Transport`. The mode (``triggerflow.modes``: native or
Airflow) is picked once per process and supplies the store and what differs around the
same loops; a new mode is a new :class:`~triggerflow.modes.Mode`, not a fork of the loops.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from tenacity import wait_exponential_jitter

from triggerflow.health import get_health
from triggerflow.lifecycle import before_stop, report_refused
from triggerflow.modes import Mode, mode_for
from triggerflow.refusals import Refusals
from triggerflow.settings import Settings
from triggerflow.store import SdkStore, ServingStore, StoreAccessRefused, StoreError
from triggerflow.transport import Transport

if TYPE_CHECKING:
    from triggerflow.store.postgres import Database
    from triggerflow.transport.rabbitmq import RabbitTransport

log = logging.getLogger(__name__)

StoreT = TypeVar("StoreT", bound=ServingStore)


async def connect_deferral_store(settings: Settings, *, max_size: int | None = None) -> SdkStore:
    """The store the SDK defers through, connected (native mode: PostgreSQL); ``StoreError``
    in Airflow mode, where tasks defer through Airflow."""
    return await mode_for(settings).connect_deferrals(max_size=max_size)


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


async def _connect_store_retrying(mode: Mode[StoreT], stop: asyncio.Event,
                                  lock_timeout: float | None = None) -> StoreT | None:
    """The store once it answers (None: stopped first). Retries, a bounded number of times,
    while it is unreachable (then its last StoreUnavailable: the CLI's one line names the
    setting) or refuses our credentials (then StoreAccessRefused); readiness names the
    database meanwhile. Once started, a process rides out outages of any length."""
    refusals = Refusals("the database", StoreAccessRefused, log,
                        unavailable_attempts=STARTUP_ATTEMPTS)
    get_health().check("database", lambda: f"connecting ({refusals.last_error or 'starting'})")

    async def connect() -> StoreT:
        async for attempt in refusals.retrying(
                StoreError, wait_exponential_jitter(multiplier=0.5, max=5, jitter=0.5)):
            with attempt:
                return await mode.connect_store(lock_timeout=lock_timeout)
        raise AssertionError("unreachable: the retrying re-raises its last error")

    connected = await before_stop(connect(), stop)
    return None if connected is None else connected.result()


async def _serve(mode: Mode[StoreT], stop: asyncio.Event,
                 serve: Callable[[StoreT], Awaitable[int]], *,
                 lock_timeout: float | None = None) -> int:
    """``serve`` on the store once connected; 1 with one line when the store refused us."""
    try:
        store = await _connect_store_retrying(mode, stop, lock_timeout)
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
    mode = mode_for(settings)
    return await _serve(mode, stop, lambda store: _consume(settings, mode, store, stop))


async def _consume(settings: Settings, mode: Mode[StoreT], store: StoreT,
                   stop: asyncio.Event) -> int:
    from triggerflow.consumer import Consumer

    transport = make_transport(settings, name=consumer_connection_name(settings.queues))
    async with mode.serving_consumer() as ready:
        consumer = Consumer(settings, store, transport, loader=mode.loader(),
                            encode=mode.encoder(), warm_up=ready)
        return await consumer.run(stop)


async def serve_writer(settings: Settings, stop: asyncio.Event) -> int:
    """Run a writer on the real store and transport until ``stop``; its exit code."""
    mode = mode_for(settings)
    return await _serve(mode, stop, lambda store: _write(settings, mode, store, stop),
                        lock_timeout=settings.writer_lock_timeout.total_seconds())


async def _write(settings: Settings, mode: Mode[StoreT], store: StoreT,
                 stop: asyncio.Event) -> int:
    from triggerflow.writer import Writer

    transport = make_transport(settings, name="triggerflow-writer")
    writer = Writer(settings, store, transport, reaper_queues=mode.writer_queues)
    async with mode.serving_writer(store, transport, writer.reaper, stop):
        return await writer.run(stop)


async def admin_database(settings: Settings) -> Database:
    """One connection to the native tables for the operator commands and gauges."""
    from triggerflow.store.postgres import Database

    return await Database.connect(settings.database_dsn(), max_size=1,
                                  pgbouncer=settings.pgbouncer)
