"""Airflow mode: triggerflow serves an existing Airflow 3 metadata database.

Airflow's tables stay Airflow's. triggerflow keeps its leases and bookkeeping in a schema of
its own (``triggerflow``) inside Airflow's database and installs one thing on Airflow's
tables: a trigger that NOTIFYs when Airflow inserts ``trigger`` rows.

Modules: ``schema`` (DDL and the Airflow versions it knows), ``setup`` (install/remove),
``kwargs`` (decode with Airflow's own code), ``events`` (apply events with Airflow's
semantics), ``heartbeat`` (the triggerer job row), ``timers`` (Airflow's timer triggers on
triggerflow's heap). Only ``kwargs`` and ``timers`` import Airflow.
"""
