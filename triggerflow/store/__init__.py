"""The durable record behind the loops: the store's role protocols and their result types.

Roles (``roles``): each loop takes only the calls it makes. Implementations:
``triggerflow.store.postgres`` (native mode, PostgreSQL), ``triggerflow.store.memory``
(in-process, for tests) and ``triggerflow.airflow.store`` (Airflow mode). Importing this
package imports no driver.
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
    StoreAccessRefused,
    StoreError,
    StoreUnavailable,
    Taker,
    TriggerRef,
    TriggerSpec,
)
from triggerflow.store.roles import (
    ClaimStore,
    Closable,
    ConsumerStore,
    DeferralStore,
    EventStore,
    LeaseStore,
    PresenceStore,
    ProbationStore,
    ReaperStore,
    SdkStore,
    ServingStore,
    Store,
    WriterStore,
)

__all__ = [
    "Applied",
    "Cancelled",
    "ClaimResult",
    "ClaimStore",
    "Closable",
    "ConsumerStore",
    "DeferralStore",
    "EventRefused",
    "EventStore",
    "EventsLocked",
    "FreedTrigger",
    "KwargsError",
    "KwargsProblem",
    "LeaseStore",
    "NewDeferral",
    "PresenceStore",
    "ProbationStore",
    "ProcessKind",
    "Reaped",
    "ReaperStore",
    "Renewal",
    "SdkStore",
    "ServingStore",
    "Store",
    "StoreAccessRefused",
    "StoreError",
    "StoreUnavailable",
    "Taker",
    "TriggerRef",
    "TriggerSpec",
    "WriterStore",
]
