"""Plain types shared by every part: task identity, event kinds, the class allow-list.

Imports no I/O library, so the SDK, the consumer, the writer and tests all agree on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class TaskState(StrEnum):
    DEFERRED = "deferred"
    SCHEDULED = "scheduled"
    RUNNING = "running"
    SUCCESS = "success"
    FAILED = "failed"
    SKIPPED = "skipped"
    REMOVED = "removed"


class EventKind(StrEnum):
    """What a fired trigger asks the writer to do to its task instance."""

    RESUME = "resume"  # -> scheduled, next_kwargs["event"] = payload
    SUCCESS = "success"  # task-end: final state, payload is the XCom value
    FAILED = "failed"
    SKIPPED = "skipped"
    FAIL = "fail"  # trigger error/timeout -> scheduled with next_method "__fail__"


FAIL_METHOD = "__fail__"


class FailureReason(StrEnum):
    """``next_kwargs["error"]`` values, as Airflow's ``TriggerFailureReason``."""

    TRIGGER_FAILURE = "Trigger failure"
    TRIGGER_TIMEOUT = "Trigger timeout"
    TRIGGER_UNLOADABLE = "Trigger could not be loaded"
    TRIGGER_DISALLOWED = "Trigger class not allowed"
    TRIGGER_QUARANTINED = "Trigger quarantined"
    DEFERRAL_TIMEOUT = "Deferral timed out with no trigger running"


@dataclass(frozen=True, slots=True)
class TaskKey:
    """Identity of a task instance, as Airflow's (dag_id, task_id, run_id, map_index)."""

    dag_id: str
    task_id: str
    run_id: str
    map_index: int = -1

    def __str__(self) -> str:
        suffix = f"[{self.map_index}]" if self.map_index >= 0 else ""
        return f"{self.dag_id}.{self.task_id}{suffix}@{self.run_id}"


def is_allowed(classpath: str, allowed_modules: list[str]) -> bool:
    """True when ``classpath`` lies inside one of ``allowed_modules`` at a dot boundary.

    Checked on the string before anything is imported, so ``os.system`` or
    ``triggerflow.triggersevil.X`` never reach ``import_module``.
    """
    module, _, name = classpath.rpartition(".")
    if not module or not name.isidentifier():
        return False
    return any(module == m or module.startswith(m + ".") for m in allowed_modules)
