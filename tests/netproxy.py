"""A TCP forwarder in the test's own event loop, standing for what sits between the processes
and a service: a cut cable (close it) or a load balancer in front of a cluster (several
targets: each new connection goes to the first that accepts, as HAProxy or a Kubernetes
Service would send it to a live node once the dead one fails its check)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field


@dataclass
class Proxy:
    server: asyncio.Server
    # (target, accepted) for every connection, in order: which node each one reached
    routed: list[tuple[tuple[str, int], bool]] = field(default_factory=list)

    def to(self, target: tuple[str, int]) -> int:
        return sum(1 for t, ok in self.routed if ok and t == target)


@contextlib.asynccontextmanager
async def tcp_proxy(port: int, *targets: tuple[str, int]) -> AsyncIterator[Proxy]:
    """Forward ``127.0.0.1:port`` to the first of ``targets`` that accepts each connection;
    leaving the block cuts every connection."""
    links: set[asyncio.StreamWriter] = set()
    proxy: Proxy

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def upstream(
        order: Sequence[tuple[str, int]],
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        for target in order:
            try:
                pair = await asyncio.open_connection(*target)
            except OSError:
                proxy.routed.append((target, False))
                continue
            proxy.routed.append((target, True))
            return pair
        return None

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up = await upstream(targets)
        if up is None:
            writer.close()
            return
        up_reader, up_writer = up
        links.update((writer, up_writer))
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    server = await asyncio.start_server(accept, "127.0.0.1", port)
    proxy = Proxy(server)
    try:
        yield proxy
    finally:
        server.close()
        for link in links:
            link.close()
        links.clear()
