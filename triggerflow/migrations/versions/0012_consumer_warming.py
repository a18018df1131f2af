"""Whether a consumer is warming up, as of its last renewal.

A consumer that joins a fleet in Airflow mode takes nothing until its trigger runtime
answers (the peer serving its queues runs everything meanwhile) and stays unsubscribed on
purpose. ``triggerflow status`` read that as a consumer the broker refused once it had been
registered longer than ``lease_ttl``; the renewal now records ``warming``, so status names
it as warming up instead, and the queue gauges do not count it as a consumer that should
be subscribed. False for the rows of processes older than this column.

Revision ID: 0012
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("consumer", sa.Column("warming", sa.Boolean, nullable=False,
                                        server_default=sa.false()))


def downgrade() -> None:
    op.drop_column("consumer", "warming")
