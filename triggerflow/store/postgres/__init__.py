"""Native mode's store on PostgreSQL: pool, schema, statements and the Store adapter."""

from triggerflow.store.postgres.pool import Database, create_pool
from triggerflow.store.postgres.schema import database_name, ensure_database, upgrade_schema, with_database
from triggerflow.store.postgres.store import PostgresStore

__all__ = [
    "Database",
    "PostgresStore",
    "create_pool",
    "database_name",
    "ensure_database",
    "upgrade_schema",
    "with_database",
]
