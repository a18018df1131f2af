"""The writer's statement in Airflow mode beside ``airflow.events.APPLY``
(:class:`~triggerflow.store.EventStore`)."""

from triggerflow.airflow.statements.bookkeeping import AIRFLOW
from triggerflow.store.postgres.statements import ownership

HELD_ELSEWHERE = AIRFLOW.render(ownership.HELD_ELSEWHERE)
