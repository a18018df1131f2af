"""aio-pika's side of the RabbitMQ adapter: its errors become the transport's own, and a
received message becomes a :class:`~triggerflow.transport.Delivery`.

``transport.rabbitmq`` makes its calls into aio-pika and aiormq under these mappings (a
publish also maps the refusals only a publish meets), so no driver error leaves the adapter.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import aio_pika
import aiormq
from aio_pika.abc import AbstractIncomingMessage

from triggerflow.transport.interface import AccessRefused, SubscribeRefused, TransportUnavailable

# Errors after which the connection (or channel) is gone and must be rebuilt.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    aio_pika.exceptions.AMQPConnectionError,
    aio_pika.exceptions.ChannelInvalidStateError,
    aiormq.exceptions.ChannelInvalidStateError,
    aiormq.exceptions.ConnectionClosed,
    ConnectionError,
    OSError,
)


# The broker refused who we are: a wrong password or unknown user (RabbitMQ closes the
# connection during the handshake) or a virtual host this user may not open.
ACCESS_ERRORS: tuple[type[BaseException], ...] = (
    aiormq.exceptions.ProbableAuthenticationError,
    aiormq.exceptions.AuthenticationError,
    aiormq.exceptions.ConnectionNotAllowed,
)


@contextlib.asynccontextmanager
async def connection_errors() -> AsyncIterator[None]:
    try:
        yield
    except ACCESS_ERRORS as exc:
        raise AccessRefused(f"{type(exc).__name__}: {exc}") from exc
    except CONNECTION_ERRORS as exc:
        raise TransportUnavailable(repr(exc)) from exc


class AmqpDelivery:
    """A received AMQP message as a :class:`~triggerflow.transport.Delivery`."""

    __slots__ = ("_message",)

    def __init__(self, message: AbstractIncomingMessage) -> None:
        self._message = message

    @property
    def body(self) -> bytes:
        return self._message.body

    @property
    def routing_key(self) -> str:
        return self._message.routing_key or ""

    @property
    def user_id(self) -> str | None:
        return self._message.user_id

    async def ack(self, *, multiple: bool = False) -> None:
        async with connection_errors():
            await self._message.ack(multiple=multiple)

    async def reject(self, *, requeue: bool = False) -> None:
        async with connection_errors():
            await self._message.reject(requeue=requeue)


@contextlib.asynccontextmanager
async def read_refusals(user: str, what: str) -> AsyncIterator[None]:
    """ACCESS_REFUSED on a subscription is permanent: say which user and queue."""
    try:
        yield
    except aiormq.exceptions.ChannelAccessRefused as exc:
        raise SubscribeRefused(f"broker user {user!r} may not read {what}: {exc}") from exc
