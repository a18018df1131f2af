"""Run in a fresh interpreter by tests/test_airflow_orm_race.py: the race that stopped a
``consume --airflow`` for good in CI, forced in the order it happened.

The main thread (the consumer's loop) imports a trigger class whose module imports an Airflow
model (``ExternalTaskTrigger`` -> ``airflow.models.serialized_dag`` -> ``dagcode``); another
thread (``task_context.workload``) uses the ORM for the first time, which configures the
mappers under SQLAlchemy's lock and, in Airflow's ``before_configured`` hook, imports every
model. ``python -m tests.airflow_orm_race lazy|prepared`` prints ``finished`` or, when the two
threads wait for each other, ``deadlocked`` (exit 3).
"""

from __future__ import annotations

import importlib
import importlib.abc
import os
import sys
import threading
import time
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

DEADLOCK_AFTER = 10.0  # seconds; the race itself is over in about one
PAUSED_MODULE = "airflow.models.dagcode"


class PauseInModel(importlib.abc.MetaPathFinder):
    """Holds the main thread inside ``PAUSED_MODULE``'s import (its parent modules' import
    locks held) until the other thread has begun configuring the mappers."""

    def __init__(self, paused: threading.Event) -> None:
        self.paused = paused

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname == PAUSED_MODULE and threading.current_thread() is threading.main_thread():
            self.paused.set()
            time.sleep(1.0)
        return None


def main(prepared: bool) -> int:
    import airflow  # noqa: F401  configures Airflow's ORM and its before_configured hook
    from airflow.models.trigger import Trigger
    from sqlalchemy.orm import class_mapper

    if prepared:
        from triggerflow.airflow.task_context import prepare_orm

        prepare_orm()
    paused = threading.Event()
    sys.meta_path.insert(0, PauseInModel(paused))

    def first_orm_use() -> None:
        paused.wait()
        class_mapper(Trigger)

    def watchdog() -> None:
        time.sleep(DEADLOCK_AFTER)
        print("deadlocked", flush=True)
        os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()
    worker = threading.Thread(target=first_orm_use)
    worker.start()
    importlib.import_module("airflow.providers.standard.triggers.external_task")
    paused.set()  # no pause: the model was imported already
    worker.join()
    print("finished", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] == ["prepared"]))
