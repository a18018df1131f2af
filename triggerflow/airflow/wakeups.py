"""The LISTEN side of the NOTIFY trigger ``setup`` installs on Airflow's ``trigger`` table.

``listen`` keeps one connection LISTENing and hands each notification — a queue (None for
rows without one) and up to 500 trigger ids — to ``deliver``, which publishes the wake-ups
(the writer, in Airflow mode). A notification sent while no listener was connected is lost
by design of LISTEN/NOTIFY: the store's backstop (``resend_unclaimed``) finds those rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable

import asyncpg

from triggerflow.airflow.schema import NOTIFY_CHANNEL

log = logging.getLogger(__name__)

Deliver = Callable[[str | None, list[int]], Awaitable[None]]


def parse(payload: str) -> tuple[str | None, list[int]]:
    message = json.loads(payload)
    return message["queue"], [int(i) for i in message["ids"]]


async def listen(dsn: str, deliver: Deliver, stop: asyncio.Event, *,
                 retry_interval: float = 1.0, keepalive: float = 30.0,
                 on_connected: Callable[[], None] | None = None) -> None:
    """LISTEN until ``stop`` is set, reconnecting after a lost connection."""

    async def handle(payload: str) -> None:
        await deliver(*parse(payload))

    await listen_channel(dsn, NOTIFY_CHANNEL, handle, stop, retry_interval=retry_interval,
                         keepalive=keepalive, on_connected=on_connected)


async def listen_channel(dsn: str, channel: str, handle: Callable[[str], Awaitable[None]],
                         stop: asyncio.Event, *, retry_interval: float = 1.0,
                         keepalive: float = 30.0,
                         on_connected: Callable[[], None] | None = None) -> None:
    """LISTEN on ``channel``, each payload to ``handle``, until ``stop``; reconnects.
    ``on_connected`` runs after each (re)connection: what was sent meanwhile is lost."""
    pending: asyncio.Queue[str] = asyncio.Queue()
    while not stop.is_set():
        conn: asyncpg.Connection | None = None
        try:
            conn = await asyncpg.connect(dsn, server_settings={
                "application_name": "triggerflow-airflow-listen"})
            lost = asyncio.Event()
            conn.add_termination_listener(lambda _conn, lost=lost: lost.set())
            await conn.add_listener(channel, lambda *args: pending.put_nowait(args[3]))
            if on_connected is not None:
                on_connected()
            await _drain(conn, pending, handle, stop, lost, keepalive)
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            log.warning("LISTEN %s lost: %r; reconnecting", channel, exc)
        finally:
            if conn is not None:
                with contextlib.suppress(Exception):
                    await conn.close()
        if not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), retry_interval)


async def _drain(conn: asyncpg.Connection, pending: asyncio.Queue[str],
                 handle: Callable[[str], Awaitable[None]],
                 stop: asyncio.Event, lost: asyncio.Event, keepalive: float) -> None:
    while not (stop.is_set() or lost.is_set()):
        getter = asyncio.ensure_future(pending.get())
        waiters = {getter, asyncio.ensure_future(stop.wait()), asyncio.ensure_future(lost.wait())}
        done, rest = await asyncio.wait(waiters, timeout=keepalive,
                                        return_when=asyncio.FIRST_COMPLETED)
        for waiter in rest:
            waiter.cancel()
        if not done:
            # An idle LISTEN connection sends nothing: a half-open socket is only found out
            # by using it.
            await conn.execute("SELECT 1")
        elif getter in done:
            await handle(getter.result())
