"""Initial schema: task_instance, trigger, consumer.

Revision ID: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql as pg

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

TS = sa.TIMESTAMP(timezone=True)


def upgrade() -> None:
    op.create_table(
        "consumer",
        sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
        sa.Column("kind", sa.Text, nullable=False),  # 'consumer' | 'writer'
        sa.Column("host", sa.Text, nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("queues", pg.ARRAY(sa.Text), nullable=False, server_default="{}"),
        sa.Column("capacity", sa.Integer, nullable=False, server_default="0"),
        sa.Column("running", sa.Integer, nullable=False, server_default="0"),
        # Suspect triggers this consumer runs on probation: if it dies now, only they are blamed.
        sa.Column("probation", pg.ARRAY(sa.BigInteger), nullable=False, server_default="{}"),
        sa.Column("version", sa.Text, nullable=False, server_default=""),
        sa.Column("started_at", TS, nullable=False, server_default=sa.func.now()),
        sa.Column("renewed_at", TS, nullable=False, server_default=sa.func.now()),
        sa.Column("expires_at", TS, nullable=False),
    )
    op.create_table(
        "trigger",
        sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
        sa.Column("classpath", sa.Text, nullable=False),
        sa.Column("kwargs", sa.Text, nullable=False),  # JSON text, or a Fernet token
        sa.Column("queue", sa.Text, nullable=False),
        sa.Column("created_at", TS, nullable=False, server_default=sa.func.now()),
        sa.Column("dispatched_at", TS, nullable=False, server_default=sa.func.now()),
        # The lease: owner names a consumer row whose expires_at is the lease expiry.
        sa.Column("owner_id", sa.BigInteger, nullable=True),
        sa.Column("claimed_at", TS, nullable=True),
        sa.Column("attempt", sa.Integer, nullable=False, server_default="0"),
        sa.Column("failures", sa.Integer, nullable=False, server_default="0"),
        sa.Column("rejected_by", pg.ARRAY(sa.BigInteger), nullable=False, server_default="{}"),
        sa.Column("quarantined_at", TS, nullable=True),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.Column("timeout_at", TS, nullable=True),
        sa.Column("traceparent", sa.Text, nullable=True),
    )
    op.create_index("trigger_owner", "trigger", ["owner_id"])
    op.create_index(
        "trigger_unclaimed",
        "trigger",
        ["queue", "dispatched_at"],
        postgresql_where=sa.text("owner_id IS NULL AND quarantined_at IS NULL"),
    )
    op.create_table(
        "task_instance",
        sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
        sa.Column("dag_id", sa.Text, nullable=False),
        sa.Column("task_id", sa.Text, nullable=False),
        sa.Column("run_id", sa.Text, nullable=False),
        sa.Column("map_index", sa.Integer, nullable=False, server_default="-1"),
        sa.Column("state", sa.Text, nullable=True),
        sa.Column("try_number", sa.Integer, nullable=False, server_default="1"),
        sa.Column("queue", sa.Text, nullable=True),
        sa.Column("next_method", sa.Text, nullable=True),
        sa.Column("next_kwargs", pg.JSONB, nullable=True),
        sa.Column("trigger_id", sa.BigInteger, nullable=True),
        sa.Column("trigger_timeout", TS, nullable=True),
        sa.Column("result", pg.JSONB, nullable=True),  # XCom of a task-end event
        sa.Column("event_fired_at", TS, nullable=True),  # consumer clock, when it fired
        sa.Column("event_applied_at", TS, nullable=True),  # database clock, when applied
        sa.Column("start_date", TS, nullable=True),
        sa.Column("end_date", TS, nullable=True),
        sa.Column("updated_at", TS, nullable=False, server_default=sa.func.now()),
        sa.UniqueConstraint("dag_id", "task_id", "run_id", "map_index", name="task_instance_key"),
    )
    op.create_index(
        "ti_trigger", "task_instance", ["trigger_id"],
        postgresql_where=sa.text("trigger_id IS NOT NULL"),
    )
    op.create_index(
        "ti_deferred_timeout", "task_instance", ["trigger_timeout"],
        postgresql_where=sa.text("state = 'deferred'"),
    )
    op.create_index(
        "ti_scheduled", "task_instance", ["updated_at"],
        postgresql_where=sa.text("state = 'scheduled'"),
    )


def downgrade() -> None:
    op.drop_table("task_instance")
    op.drop_table("trigger")
    op.drop_table("consumer")
