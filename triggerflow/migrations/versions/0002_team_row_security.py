"""Row-level security by queue: a database role listed in ``team_queue`` sees and writes only
the ``trigger`` and ``task_instance`` rows of its queues.

Opt-in per role, so existing deployments keep working: a role with no ``team_queue`` row is
not restricted (the shared consumer, writer and operator roles), and the tables' owner
bypasses row security as PostgreSQL always lets it. A team's SDK role, once listed, can
neither insert a trigger row for another team's queue nor read, cancel or overwrite its
tasks.

Revision ID: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

# Restricted only if listed; then only the listed queues. The first EXISTS does not depend on
# the row, so PostgreSQL runs it once per statement (an InitPlan), not once per row.
ALLOWED = """
NOT EXISTS (SELECT 1 FROM team_queue tq WHERE tq.role = current_user)
OR EXISTS (SELECT 1 FROM team_queue tq WHERE tq.role = current_user AND tq.queue = {table}.queue)
"""

TABLES = ("trigger", "task_instance")


def upgrade() -> None:
    op.create_table(
        "team_queue",
        sa.Column("role", sa.Text, primary_key=True),
        sa.Column("queue", sa.Text, primary_key=True),
    )
    # The policies read it as the querying role.
    op.execute("GRANT SELECT ON team_queue TO PUBLIC")
    for table in TABLES:
        allowed = ALLOWED.format(table=table)
        op.execute(f"ALTER TABLE {table} ENABLE ROW LEVEL SECURITY")
        op.execute(f"CREATE POLICY team_rows ON {table} USING ({allowed}) WITH CHECK ({allowed})")


def downgrade() -> None:
    for table in TABLES:
        op.execute(f"DROP POLICY team_rows ON {table}")
        op.execute(f"ALTER TABLE {table} DISABLE ROW LEVEL SECURITY")
    op.drop_table("team_queue")
