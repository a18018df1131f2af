"""MemoryStore: every role of the store (:class:`~triggerflow.store.Store`) in one process,
for tests and trials, one module per role.

Mirrors the native PostgreSQL store's semantics with plain dicts: fencing by attempt (an
event applies only to the current attempt on the event's own queue, while its task is still
deferred on that trigger), leases that expire by ``clock`` (pass a :class:`ManualClock` to
move time by hand), probation in halving groups, quarantine of triggers blamed alone or too
often, refusal of an event whose payload is not JSON (as ``jsonb`` refuses it). All calls
complete at once and never raise ``StoreUnavailable``; wrap it to inject failures.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from triggerflow.store.memory.claims import MemoryClaims
from triggerflow.store.memory.deferral import MemoryDeferrals
from triggerflow.store.memory.leases import MemoryLeases
from triggerflow.store.memory.reaper import MemoryReaper
from triggerflow.store.memory.state import ManualClock
from triggerflow.store.memory.writer import MemoryEvents

__all__ = ["ManualClock", "MemoryStore"]


class MemoryStore(MemoryLeases, MemoryClaims, MemoryEvents, MemoryReaper, MemoryDeferrals):
    """The store as dicts. ``clock`` gives epoch seconds (leases, timeouts, dispatch times)."""


if TYPE_CHECKING:
    from triggerflow.store import Store

    def _is_a_store(store: MemoryStore) -> Store:
        return store  # mypy checks MemoryStore against every role here
