"""The statements the native store runs, one module per role (named as in ``store.roles``).

Set-based (``unnest`` of arrays, one round trip per batch) and on database time only
(``now()``), so leases never depend on a process's clock. ``lease`` is written once for both
SQL stores (Airflow mode's differs only in its schema); admin and host-side statements live
in ``postgres.admin``.
"""
