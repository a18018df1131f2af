"""Airflow mode: triggerflow serves an existing Airflow 3 metadata database.

Airflow's tables stay Airflow's. triggerflow keeps its leases and bookkeeping in a schema of
its own (``triggerflow``) inside Airflow's database and installs one thing on Airflow's
tables: a trigger that NOTIFYs when Airflow inserts ``trigger`` rows.

Without Airflow imported: ``schema``/``setup``/``cli`` (install, remove, version check),
``statements``/``store`` (``AirflowStore``), ``events`` (set-based apply with Airflow's
semantics), ``heartbeat`` (the triggerer job row), ``wakeups`` (LISTEN). With Airflow
(``triggerflow[airflow]``): ``kwargs`` (decode and build triggers with Airflow's code),
``codec`` (event bodies with Airflow's serialisers), ``timers`` (Airflow's timer triggers on
the heap), ``orm`` (the events Airflow's own function applies). See docs/airflow.md.
"""
