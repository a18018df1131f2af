"""Broker names and limits, derived from one namespace in one place.

Mirrored in ``brokers/rabbitmq/definitions.json`` (``tests/test_compose.py`` keeps the two in
step: RabbitMQ refuses a re-declare with other arguments). Imports no driver.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# The event exchange plugin (rabbitmq_event_exchange) publishes the broker's own events here,
# in the virtual host of its ``event_exchange.vhost`` setting ("/" by default).
EVENT_EXCHANGE = "amq.rabbitmq.event"
QUEUE_DELETED = "queue.deleted"


@dataclass(frozen=True)
class Topology:
    """Every exchange and shared-queue name, derived from one namespace.

    Each team queue has exchanges of its own, ``<ns>.deferrals.<queue>`` (wake-ups) and
    ``<ns>.control.<queue>`` (cancels for its consumers), and only its queue is bound to
    them. RabbitMQ checks neither ``CC`` nor ``BCC`` headers against topic permissions, but
    a message can only reach queues bound to the exchange it was published to: a team user
    allowed to write only its own exchanges cannot route into another team's queue with any
    header, nor bind a queue of its own to another team's control exchange (binding needs
    read on the exchange). Events and dead letters share one exchange each (one queue is
    bound to each, the writer's and the operators'), pinned to the team's key by topic
    permissions. ``max_messages``/``max_bytes`` bound every team queue (policy
    :meth:`limits_policy`, reject-publish), so a flood fills only the flooding team's queue.
    """

    namespace: str = "triggerflow"
    max_messages: int = 1_000_000
    max_bytes: int = 1 << 30
    dead_max_bytes: int = 1 << 30

    def deferrals_of(self, queue: str) -> str:
        return f"{self.namespace}.deferrals.{queue}"

    def control_of(self, queue: str) -> str:
        return f"{self.namespace}.control.{queue}"

    @property
    def deferrals(self) -> str:
        """Prefix of the per-queue deferral exchanges; the shared exchange of that name
        (before per-queue exchanges) is no longer declared nor published to."""
        return f"{self.namespace}.deferrals"

    @property
    def control(self) -> str:
        """Prefix of the per-queue control exchanges (the shared one is no longer used)."""
        return f"{self.namespace}.control"

    @property
    def events(self) -> str:
        return f"{self.namespace}.events"

    @property
    def events_queue(self) -> str:
        return f"{self.namespace}.events"

    @property
    def dead(self) -> str:
        return f"{self.namespace}.dead"

    @property
    def dead_queue(self) -> str:
        return f"{self.namespace}.dead"

    @property
    def presence(self) -> str:
        """Where the broker announces deleted queues: bound from :data:`EVENT_EXCHANGE` for
        :data:`QUEUE_DELETED` only, so a team user reading it learns which queues went, not
        the rest of the broker's events (logins, users, connections)."""
        return f"{self.namespace}.presence"

    def exchanges(self) -> dict[str, str]:
        """The shared exchanges (see :meth:`team_exchanges` for each queue's own)."""
        return {self.events: "topic", self.dead: "topic", self.presence: "fanout"}

    def team_exchanges(self, queue: str) -> dict[str, str]:
        return {self.deferrals_of(queue): "direct", self.control_of(queue): "direct"}

    def queue_arguments(self, delivery_limit: int = 5) -> dict[str, Any]:
        """Arguments of team queues and the events queue (quorum, DLX, explicit limit)."""
        return {
            "x-queue-type": "quorum",
            "x-dead-letter-exchange": self.dead,
            "x-delivery-limit": delivery_limit,
        }

    def limits_policy(self, queue: str) -> tuple[str, dict[str, Any]]:
        """The policy (name, body) bounding one team queue. A policy, not queue arguments:
        RabbitMQ refuses to re-declare an existing queue with new arguments, but applies a
        policy to queues that already exist."""
        return f"{self.namespace}.limits.{queue}", {
            "pattern": f"^{re.escape(queue)}$", "apply-to": "queues", "priority": 1,
            "definition": {"max-length": self.max_messages, "max-length-bytes": self.max_bytes,
                           "overflow": "reject-publish"},
        }

    def dead_policy(self) -> tuple[str, dict[str, Any]]:
        """Dead letters are bounded by size, oldest dropped first: one team's flood of dead
        letters must not fill the broker's disk (its alarm blocks every publisher)."""
        return f"{self.namespace}.limits.{self.dead_queue}", {
            "pattern": f"^{re.escape(self.dead_queue)}$", "apply-to": "queues", "priority": 1,
            "definition": {"max-length-bytes": self.dead_max_bytes, "overflow": "drop-head"},
        }
