"""How far a consumer's clock is from the database's, as of its last renewal.

A consumer times its triggers on its own wall clock; one whose clock is far off fires timers
early or fails tasks at once. Each renewal now measures the offset against the database's
clock and records it here, so ``triggerflow status`` can name a skewed consumer. NULL: not
measured yet (or a process older than this column).

Revision ID: 0008
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("consumer", sa.Column("clock_skew", sa.Float, nullable=True))


def downgrade() -> None:
    op.drop_column("consumer", "clock_skew")
