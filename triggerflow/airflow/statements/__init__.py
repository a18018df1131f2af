"""Every statement ``AirflowStore`` runs, one module per role (named as in ``store.roles``).

Airflow's rows (``trigger``, ``task_instance``) are read, and written only as Airflow's own
code writes them (see ``airflow.events``); leases and bookkeeping live in the ``triggerflow``
schema, whose lease statements are native mode's (``store.postgres.statements.lease``). A
trigger row of Airflow's has bookkeeping once triggerflow has seen it (published, claimed);
before that it is simply absent. ``$default`` parameters name the queue that rows without a
``queue`` belong to, or NULL when such rows are left to Airflow's own triggerer.
"""
