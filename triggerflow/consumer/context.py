"""What a consumer's parts share: built once by the consumer, handed to each part it builds.

Each part keeps a narrow constructor of its own (what it reads, so a test can hand it fakes)
and an ``of(context, ...)`` that takes the shared pieces from here; only what is the part's
alone, or built after it, is passed beside the context.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from triggerflow.lease import Lease
from triggerflow.lifecycle import Background
from triggerflow.runner import TriggerRunner
from triggerflow.settings import Settings
from triggerflow.store import ConsumerStore, TriggerRef

# Wakes the queues' consumers for triggers we hand back (freed rows, by queue).
Republish = Callable[[Sequence[TriggerRef]], Awaitable[None]]


@dataclass(frozen=True)
class ConsumerContext:
    """The consumer's settings, store, lease, runner, background and wake-up sender."""

    settings: Settings
    store: ConsumerStore
    lease: Lease
    runner: TriggerRunner
    background: Background  # what must not hold up the caller (hand-overs, sheds, starts)
    republish: Republish

    @property
    def queues(self) -> list[str]:
        return list(self.settings.queues)
