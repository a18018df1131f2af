"""The durable record behind the loops: the :class:`Store` interface and its result types.

Implementations: ``triggerflow.store.postgres`` (native mode, PostgreSQL) and
``triggerflow.store.memory`` (in-process, for tests). Importing this package imports no driver.
"""

from triggerflow.store.interface import (
    Applied,
    Cancelled,
    ClaimResult,
    EventRefused,
    EventsLocked,
    FreedTrigger,
    KwargsError,
    KwargsProblem,
    NewDeferral,
    ProcessKind,
    Reaped,
    Renewal,
    Store,
    StoreAccessRefused,
    StoreError,
    StoreUnavailable,
    Taker,
    TriggerRef,
    TriggerSpec,
)

__all__ = [
    "Applied",
    "Cancelled",
    "ClaimResult",
    "EventRefused",
    "EventsLocked",
    "FreedTrigger",
    "KwargsError",
    "KwargsProblem",
    "NewDeferral",
    "ProcessKind",
    "Reaped",
    "Renewal",
    "Store",
    "StoreAccessRefused",
    "StoreError",
    "StoreUnavailable",
    "Taker",
    "TriggerRef",
    "TriggerSpec",
]
