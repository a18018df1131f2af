"""What Airflow's triggerer gives a task's trigger besides its kwargs: ``task_instance``, and
for ``start_from_trigger`` tasks the template context its templated kwargs are rendered with.

Airflow 3.3's triggerer builds a ``RunTrigger`` workload per new trigger row in its
supervisor (``TriggerRunnerSupervisor._create_workload``, with the database): the task
instance as a ``TaskInstanceDTO``, its ``trigger_timeout``, and, when the task has
``start_from_trigger``, the serialized DAG and the DAG run. Its runner then
(``TriggerRunner.create_triggers``/``run_trigger``) sets ``trigger.task_instance`` to the DTO,
or to a ``RuntimeTaskInstance`` built from the serialized task (``create_runtime_ti``), and
calls ``trigger.render_template_fields(context)`` with that instance's template context
before ``run()``. A row the scheduler creates for a ``start_from_trigger`` task carries the
operator's fields unrendered (``DateTimeSensorAsync(target_time="{{ ... }}")``), so without
this a trigger would wait for a Jinja string.

``workload`` calls Airflow's own ``_create_workload`` (blocking, Airflow's ORM session on
``[database] sql_alchemy_conn``: the consumer runs it in a thread); ``attach`` is Airflow's
runner side, on the trigger's own coroutine (rendering may call ``SUPERVISOR_COMMS``, e.g.
``ti.xcom_pull`` in a template, through the greenback portal as in Airflow).

Importing this module imports Airflow (``triggerflow[airflow]``).
"""

from __future__ import annotations

import uuid
from types import SimpleNamespace
from typing import Any

from airflow.executors.workloads.trigger import RunTrigger
from airflow.jobs.triggerer_job_runner import TriggerRunner, TriggerRunnerSupervisor
from airflow.models import import_all_models
from airflow.models.dagbag import DBDagBag
from airflow.models.trigger import Trigger
from airflow.utils.helpers import log_filename_template_renderer
from airflow.utils.session import create_session


def prepare_orm() -> None:
    """Import every Airflow model and configure the ORM mappers now, before any trigger runs.

    Airflow configures its mappers lazily, on first use, and its ``before_configured`` hook
    imports every model module while holding SQLAlchemy's configure lock. Left lazy, the first
    ``workload`` (a thread) takes that lock and waits for a model module that the loop's
    thread is importing for a trigger class (``ExternalTaskTrigger`` imports
    ``airflow.models.serialized_dag``), whose class body waits for the same lock: both stop for
    good (seen in CI: the consumer's loop blocked from its first claim on).
    """
    from sqlalchemy.orm import configure_mappers

    import_all_models()  # type: ignore[no-untyped-call]
    configure_mappers()


def workload(trigger_id: int) -> RunTrigger | None:
    """Airflow's ``RunTrigger`` for a task's trigger row (None: no task instance defers on it
    any more, or its DAG version is unknown, as Airflow's triggerer skips it)."""
    # _create_workload reads only these of its supervisor: the job (None: no Airflow job),
    # the id naming the trigger's log file, and the cache of per-trigger log factories.
    supervisor = SimpleNamespace(job=None, id=uuid.uuid4(), logger_cache={})
    with create_session() as session:
        row = Trigger.bulk_fetch([trigger_id], session=session).get(trigger_id)
        if row is None or row.task_instance is None:
            return None
        if not hasattr(TriggerRunnerSupervisor, "_create_workload"):
            return _workload_3_2(row)
        made: RunTrigger | None = TriggerRunnerSupervisor._create_workload(
            supervisor,  # type: ignore[arg-type]
            trigger=row,
            dag_bag=DBDagBag(),
            render_log_fname=log_filename_template_renderer(),
            session=session,
        )
        return made


def _workload_3_2(row: Any) -> RunTrigger | None:
    """Airflow 3.2 builds the ``RunTrigger`` inline in ``update_triggers``: the same here (no
    ``dag_data``, as 3.2 has no ``start_from_trigger``)."""
    from airflow.executors.workloads.task import TaskInstanceDTO

    ti = row.task_instance
    if not ti.dag_version_id:  # skipped, as 3.2's triggerer skips it
        return None
    return RunTrigger(classpath=row.classpath, id=row.id, encrypted_kwargs=row.encrypted_kwargs,
                      ti=TaskInstanceDTO.model_validate(ti, from_attributes=True),
                      timeout_after=ti.trigger_timeout)


def attach(trigger: Any, work: RunTrigger) -> Any:
    """Set ``task_instance`` and ``timeout_after`` on the trigger as Airflow's runner does;
    returns the template context to render with (``start_from_trigger`` tasks), else None."""
    context: Any = None
    if work.ti is not None:
        dag_data = getattr(work, "dag_data", None)  # Airflow 3.2's RunTrigger has none
        if dag_data:
            runtime_ti = TriggerRunner.create_runtime_ti(work.ti, dag_data, work.dag_run_data or {})
            context = runtime_ti.get_template_context()
            trigger.task_instance = runtime_ti
        else:
            trigger.task_instance = work.ti
    trigger.timeout_after = work.timeout_after
    return context


def watched_assets(trigger_id: int) -> dict[str, str] | None:
    """The assets a watcher row watches (name to URI), as Airflow's supervisor puts them in the
    row's ``RunTrigger`` (``watched_assets``); None for a row that watches none (a callback's)."""
    with create_session() as session:
        row = session.get(Trigger, trigger_id)
        if row is None or not row.assets:
            return None
        return {asset.name: asset.uri for asset in row.assets}


def render(trigger: Any, context: Any) -> None:
    """``run_trigger``'s first step: templated fields rendered in place before ``run()``."""
    if context is not None:
        trigger.render_template_fields(context=context)
