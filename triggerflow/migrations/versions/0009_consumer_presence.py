"""The broker presence queue of each consumer's current connection.

RabbitMQ deletes a consumer's exclusive presence queue the moment its connection closes (a
killed process's kernel closes the socket at once); a peer that hears of it ends that
consumer's lease at once instead of waiting for it to expire. The column names the queue of
the current connection only, so a deletion heard late about an older connection (the
consumer reconnected since) matches nothing. Null: presence unknown, the lease alone decides.

Revision ID: 0009
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("consumer", sa.Column("presence", sa.Text, nullable=True))


def downgrade() -> None:
    op.drop_column("consumer", "presence")
