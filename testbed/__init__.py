"""Private services for the test suite and the benchmarks: PostgreSQL clusters and RabbitMQ
nodes started for a run (``services``), streaming replication and promotion
(``replication``), a three-node RabbitMQ cluster losing a node (``clusterloss``), a TCP
proxy that cuts connections (``netproxy``), a real Airflow stack (``airflow_stack``), a spy
on the events exchange (``spy``) and broker housekeeping (``broker``).

``tests/`` and ``bench/`` both import it; it imports neither (an import contract in
pyproject.toml).
"""
