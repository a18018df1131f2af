"""A team role may insert a trigger only under an id its own session drew from the sequence.

Trigger ids are one namespace over every team. A team's SDK role inserted a ``trigger`` row
of its own queue with an explicit id ahead of the shared sequence, so the ``defer`` (of any
team) that later drew that id failed on ``trigger_pkey``. ``DEFER`` draws its ids itself
(``nextval`` in a CTE) and inserts them explicitly, so explicit ids cannot be refused; a
listed role's new id must instead be no greater than what its session last drew. An id
ahead of the sequence can then never be planted: drawing it would have moved the sequence
past it. A session that drew none is refused too (``currval`` is not yet defined).

What remains: an id another session drew but has not inserted yet lies below this session's
``currval``. ``DEFER`` draws and inserts in one statement, so that window lasts one statement
and the attacker must guess the id drawn in it. The ids of deleted triggers may be inserted
again, into the inserting team's own queue only.

No role may change a trigger's id either (a team's consumer role holds UPDATE on the table):
the same squatting by ``UPDATE ... SET id``.

Revision ID: 0011
"""

from __future__ import annotations

from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

# CASE, not OR: currval must not run for unlisted roles (the shared roles, which may insert
# under ids they did not draw), and OR does not fix the order of evaluation.
DRAWN = """
CASE WHEN EXISTS (SELECT 1 FROM team_queue tq WHERE tq.role = current_user)
     THEN id <= currval(pg_get_serial_sequence('trigger', 'id'))
     ELSE true END
"""


def upgrade() -> None:
    # Restrictive: holds on top of the queue policy of migration 0002, for inserts only.
    op.execute(
        f"CREATE POLICY trigger_id_drawn_by_this_session ON trigger AS RESTRICTIVE "
        f"FOR INSERT WITH CHECK ({DRAWN})"
    )
    op.execute("""
        CREATE FUNCTION refuse_trigger_id_change() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            RAISE EXCEPTION 'a trigger''s id never changes'
                USING ERRCODE = 'insufficient_privilege';
        END $$""")
    op.execute("""
        CREATE TRIGGER trigger_id_fixed BEFORE UPDATE OF id ON trigger FOR EACH ROW
        WHEN (NEW.id IS DISTINCT FROM OLD.id) EXECUTE FUNCTION refuse_trigger_id_change()""")


def downgrade() -> None:
    op.execute("DROP TRIGGER IF EXISTS trigger_id_fixed ON trigger")
    op.execute("DROP FUNCTION IF EXISTS refuse_trigger_id_change()")
    op.execute("DROP POLICY IF EXISTS trigger_id_drawn_by_this_session ON trigger")
