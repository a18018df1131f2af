"""What the per-queue gauges read from the durable record, whichever mode keeps it.

Native mode reads triggerflow's tables, Airflow mode triggerflow's schema beside Airflow's
rows; ``queue_gauges`` knows only :class:`GaugeSource`, which each mode connects
(``Mode.connect_gauges``). Imports no driver.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class QueueLeases:
    """One team queue as the leases see it."""

    consumers: int  # live consumers subscribed on the broker (what KEDA divides by)
    expected: int  # live consumers well below capacity, registered long enough to subscribe
    overdue: int  # deferred tasks well past their timeout: nothing times them out


@dataclass(frozen=True)
class LeaseGauges:
    writers: int  # live writers
    queues: dict[str, QueueLeases] = field(default_factory=dict)


def lease_gauges(rows: Iterable[Mapping[str, Any]]) -> LeaseGauges:
    """Rows of a mode's gauge statement (queue, writers, consumers, expected, overdue; one row
    with a NULL queue when no queue was asked) as :class:`LeaseGauges`."""
    writers = 0
    queues: dict[str, QueueLeases] = {}
    for row in rows:
        writers = int(row["writers"])
        if row["queue"] is not None:
            queues[row["queue"]] = QueueLeases(int(row["consumers"]), int(row["expected"]),
                                               int(row["overdue"]))
    return LeaseGauges(writers, queues)


class GaugeSource(Protocol):
    """One connection's worth of gauge reads; the poller reconnects after any failure."""

    async def leases(self, queues: Sequence[str], settle: float) -> LeaseGauges:
        """Writers, and per queue of ``queues`` its consumers by lease; a consumer registered
        less than ``settle`` seconds ago is not yet expected to be subscribed."""
        ...

    async def team_queues(self) -> set[str]:
        """Queues with triggers waiting, and those live consumers declare."""
        ...

    async def close(self) -> None: ...
