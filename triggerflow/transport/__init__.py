"""How messages travel between the loops: the :class:`Transport` interface and its types.

Implementations: ``triggerflow.transport.rabbitmq`` (aio-pika) and
``triggerflow.transport.memory`` (in-process, for tests). Importing this package imports no
driver.
"""

from triggerflow.transport.interface import (
    Delivery,
    DeliveryHandler,
    PublishRefused,
    QueueFull,
    QueueInfo,
    SubscribeRefused,
    Transport,
    TransportError,
    TransportUnavailable,
    Unroutable,
)

__all__ = [
    "Delivery",
    "DeliveryHandler",
    "PublishRefused",
    "QueueFull",
    "QueueInfo",
    "SubscribeRefused",
    "Transport",
    "TransportError",
    "TransportUnavailable",
    "Unroutable",
]
