"""The runs in which a trigger blocked its consumer's event loop.

A loop-blocker is quarantined after ``max_blocks`` such runs, counted by run (its attempt)
rather than against the one attempt a consumer held: in a fleet, a peer takes the trigger
over while the blocked loop cannot renew its lease, so the blocked consumer's strike lands
after the trigger has moved on. A reaper that finds a known blocker on a dead consumer
blames it alone (the partial index finds it among the dead consumer's rows at once).

Revision ID: 0013
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("trigger", sa.Column("blocked_attempts", sa.ARRAY(sa.Integer), nullable=False,
                                       server_default="{}"))
    op.execute("CREATE INDEX trigger_blocker_owner ON trigger (owner_id) "
               "WHERE cardinality(blocked_attempts) > 0")


def downgrade() -> None:
    op.execute("DROP INDEX IF EXISTS trigger_blocker_owner")
    op.drop_column("trigger", "blocked_attempts")
