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
from triggerflow.transport import AccessRefused, Transport, TransportUnavailable

if TYPE_CHECKING:
    from triggerflow.store.postgres import Database
    from triggerflow.transport.rabbitmq import RabbitTransport

log = logging.getLogger(__name__)

StoreT = TypeVar("StoreT", bound=ServingStore)
T = TypeVar("T")


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
# Tries to reach the database, then the broker, at start (about 15 s each with the backoff):
# long enough for one started beside it, short enough that a wrong host or port is one line,
# not a hang.
STARTUP_ATTEMPTS = 6


def consumer_connection_name(queues: list[str]) -> str:
    """What a consumer's AMQP connection calls itself: ``status`` matches the broker's
    subscribers to consumer rows (host, pid) by it."""
    import os
    import socket

    return f"{CONSUMER_CONNECTION}{','.join(queues)}@{socket.gethostname()}:{os.getpid()}"


# The back-off between start-up attempts: STARTUP_ATTEMPTS of it last about 15 s.
_STARTUP_WAIT = wait_exponential_jitter(multiplier=0.5, max=5, jitter=0.5)


async def _at_start(service: str, refused: type[Exception],
                    retry_on: tuple[type[Exception], ...],
                    connect: Callable[[], Awaitable[T]], stop: asyncio.Event) -> T | None:
    """``connect()`` once ``service`` answers (None: stopped first). Retries a bounded number
    of times while it is unreachable (then its last error: the CLI's one line names the
    setting) or refuses our credentials (then ``refused``); readiness names it meanwhile.
    Once started, a process rides out outages of any length."""
    refusals = Refusals(service, refused, log, unavailable_attempts=STARTUP_ATTEMPTS)
    check = service.removeprefix("the ")
    get_health().check(check, lambda: f"connecting ({refusals.last_error or 'starting'})")

    async def attempts() -> T:
        async for attempt in refusals.retrying(retry_on, _STARTUP_WAIT):
            with attempt:
                return await connect()
        raise AssertionError("unreachable: the retrying re-raises its last error")

    connected = await before_stop(attempts(), stop)
    return None if connected is None else connected.result()


async def _connect_store_retrying(mode: Mode[StoreT], stop: asyncio.Event,
                                  lock_timeout: float | None = None,
                                  consumer: bool = False) -> StoreT | None:
    """The store once it answers (None: stopped first), or its last error (``_at_start``)."""
    return await _at_start("the database", StoreAccessRefused, (StoreError,),
                           lambda: mode.connect_store(lock_timeout=lock_timeout,
                                                      consumer=consumer), stop)


async def _reach_broker(settings: Settings, name: str, stop: asyncio.Event) -> bool:
    """True once the broker answered (the connection is closed again: the loops open their
    own), False when stopped first; its last error when it was never reached (``_at_start``),
    so a wrong host or port ends the process in one line as the database's does, where the
    loops would retry it for ever as they retry a broker lost later. A refusal of our
    credentials goes on to the loops, which retry it a bounded number of times too, with
    the process registered but not ready and not counted as a consumer."""

    async def probe() -> bool:
        transport = make_transport(settings, name=name)
        try:
            await transport.connect()
        except AccessRefused:
            pass  # answered: the subscriptions meet it again and end the process
        finally:
            await transport.close()
        return True

    return bool(await _at_start("the broker", AccessRefused, (TransportUnavailable,), probe,
                                stop))


async def _serve(mode: Mode[StoreT], stop: asyncio.Event,
                 serve: Callable[[StoreT], Awaitable[int]], *,
                 reach_broker: Callable[[], Awaitable[bool]],
                 lock_timeout: float | None = None, consumer: bool = False) -> int:
    """``serve`` on the store once it and then the broker answer; 1 with one line when the
    store refused our credentials."""
    try:
        store = await _connect_store_retrying(mode, stop, lock_timeout, consumer)
    except StoreAccessRefused as exc:
        report_refused(exc)
        return 1
    if store is None:
        return 0
    try:
        if not await reach_broker():
            return 0
        return await serve(store)
    finally:
        await store.close()


async def serve_consumer(settings: Settings, stop: asyncio.Event) -> int:
    """Run a consumer on the real store and transport until ``stop``; its exit code."""
    mode = mode_for(settings)
    name = consumer_connection_name(settings.queues)
    return await _serve(mode, stop, lambda store: _consume(settings, mode, store, stop),
                        reach_broker=lambda: _reach_broker(settings, name, stop), consumer=True)


async def _consume(settings: Settings, mode: Mode[StoreT], store: StoreT,
                   stop: asyncio.Event) -> int:
    from triggerflow.consumer import Consumer

    transport = make_transport(settings, name=consumer_connection_name(settings.queues))
    async with mode.serving_consumer() as ready:
        consumer = Consumer(settings, store, transport, loader=mode.loader(),
                            encode=mode.encoder(), warm_up=ready,
                            capabilities=mode.capabilities)
        return await consumer.run(stop)


async def serve_writer(settings: Settings, stop: asyncio.Event) -> int:
    """Run a writer on the real store and transport until ``stop``; its exit code."""
    mode = mode_for(settings)
    return await _serve(mode, stop, lambda store: _write(settings, mode, store, stop),
                        reach_broker=lambda: _reach_broker(settings, "triggerflow-writer", stop),
                        lock_timeout=settings.writer_lock_timeout.total_seconds())


async def _write(settings: Settings, mode: Mode[StoreT], store: StoreT,
                 stop: asyncio.Event) -> int:
    from triggerflow.writer import Writer

    transport = make_transport(settings, name="triggerflow-writer")
    writer = Writer(settings, store, transport, reaper_queues=mode.writer_queues,
                    capabilities=mode.capabilities)
    async with mode.serving_writer(store, transport, writer.reaper, stop):
        return await writer.run(stop)


async def admin_database(settings: Settings) -> Database:
    """One connection to the native tables for the operator commands and gauges."""
    from triggerflow.store.postgres import Database

    return await Database.connect(settings.database_dsn(), max_size=1,
                                  pgbouncer=settings.pgbouncer)
