"""A task instance's key is unique per queue, not across every team.

Task rows were unique on Airflow's key (dag_id, task_id, run_id, map_index) alone, over every
queue. Row security keeps a team's SDK role to its own queues' rows, so a team could create
a row under a key another team would use later: that team's ``defer`` of the key then met a
row it may not see, and PostgreSQL refused the upsert ("new row violates row-level security
policy"). With the queue in the key, each queue has its own namespace of keys: a row in one
queue never collides with a deferral into another, so no team can squat on another's keys.

Deferring a key into another queue than its earlier deferral therefore records another task
instance (the earlier row keeps its state) instead of moving the row between queues.

Existing rows were unique on the four columns, so they are unique on the five: the upgrade
cannot fail on data. The downgrade fails if a key has since been used in two queues.

Revision ID: 0010
"""

from __future__ import annotations

from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

KEY = ("dag_id", "task_id", "run_id", "map_index")


def upgrade() -> None:
    # Build the new index first, so the table is never without a unique key.
    op.create_unique_constraint("task_instance_queue_key", "task_instance", [*KEY, "queue"])
    op.drop_constraint("task_instance_key", "task_instance", type_="unique")


def downgrade() -> None:
    op.create_unique_constraint("task_instance_key", "task_instance", list(KEY))
    op.drop_constraint("task_instance_queue_key", "task_instance", type_="unique")
