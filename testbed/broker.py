"""Broker housekeeping shared by the tests and the benchmarks: delete what a run declared."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib

import aio_pika

from triggerflow.transport.rabbitmq import Topology


def delete_queues(amqp_url: str, queues: list[str]) -> None:
    """Team queues keep their own names, so an earlier module's ``default`` outlives it on
    the suite's broker: declared again under another namespace it is refused (its
    dead-letter exchange differs), and the wake-ups it holds name another stack's triggers.
    Each serving starts with its team queues deleted."""
    async def delete() -> None:
        conn = await aio_pika.connect(amqp_url)
        try:
            for queue in queues:
                channel = await conn.channel()
                with contextlib.suppress(Exception):  # absent: nothing to delete
                    await channel.queue_delete(queue)
                if not channel.is_closed:
                    await channel.close()
        finally:
            await conn.close()

    # A thread of its own: some callers run inside an event loop (async fixtures).
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, delete()).result(timeout=60)


async def delete_topology(amqp_dsn: str, topo: Topology, queues: list[str]) -> None:
    """Delete everything a test's namespace declared: its team queues, shared queues and
    exchanges. A failed delete closes its channel, so each gets a channel of its own."""
    conn = await aio_pika.connect(amqp_dsn)
    try:
        deletions = [("queue_delete", q) for q in (*queues, topo.events_queue, topo.dead_queue)]
        deletions += [("exchange_delete", x) for x in topo.exchanges()]
        deletions += [("exchange_delete", x) for q in queues for x in topo.team_exchanges(q)]
        for method, name in deletions:
            ch = await conn.channel()
            with contextlib.suppress(Exception):
                await getattr(ch, method)(name)
            if not ch.is_closed:
                await ch.close()
    finally:
        await conn.close()
