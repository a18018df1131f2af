"""Native mode's store on PostgreSQL: pool, schema, statements and the Store adapter."""

from triggerflow.store.postgres.pool import Database, create_pool
from triggerflow.store.postgres.schema import (
    current_revision,
    database_name,
    downgrade_schema,
    ensure_database,
    revisions,
    upgrade_schema,
    with_database,
)
from triggerflow.store.postgres.store import PostgresStore

__all__ = [
    "Database",
    "PostgresStore",
    "create_pool",
    "current_revision",
    "database_name",
    "downgrade_schema",
    "ensure_database",
    "revisions",
    "upgrade_schema",
    "with_database",
]
