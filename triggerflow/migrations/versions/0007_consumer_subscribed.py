"""Whether a consumer is subscribed on the broker, as of its last renewal.

A consumer that cannot reach the broker (a wrong password, a refused vhost) still renews its
lease, but receives nothing. Counted as a live peer it made its healthy peers shed triggers
to it every few seconds and diluted the consumers-per-queue gauge that scaling reads; the
renewal now records ``subscribed`` and only subscribed consumers are counted as capacity.
The lease and its fencing are unchanged: they still go by ``expires_at`` alone.

The default is true, for the rows of processes older than this column (during a rolling
upgrade they are counted as before); every registration from now on writes false.

Revision ID: 0007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("consumer", sa.Column("subscribed", sa.Boolean, nullable=False,
                                        server_default=sa.true()))


def downgrade() -> None:
    op.drop_column("consumer", "subscribed")
