"""Row security on the lease table and the cancel log, for per-team consumer roles.

A team's consumer runs that team's trigger code with the consumer's database credentials,
so a consumer role is as hostile as the team. Listed in ``team_queue`` (as migration 0002
does for SDK roles), a consumer role now:

- registers, renews and deletes only consumer rows of its own queues: it cannot plant an
  idle "peer" of another team's queue for that team's consumers to shed triggers to, nor
  end or stretch another team's lease;
- still *sees* every process that shares one of its queues, and the writers (no queues), so
  a claim never mistakes a live owner it cannot see for a dead one, and the reaper's
  "witnessed" check counts the writers;
- reads and deletes only cancel-log entries of its own queues: an entry names only a
  trigger id, and a trigger hidden by row security looked "gone" to the sweep, which then
  deleted other teams' entries. The log now carries the queue the task was in.

Unlisted roles (the shared roles of a single-team deployment, the writer, operators) are not
restricted, as before.

Revision ID: 0006
"""

from __future__ import annotations

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

UNLISTED = "NOT EXISTS (SELECT 1 FROM team_queue tq WHERE tq.role = current_user)"
MINE = "ARRAY(SELECT tq.queue FROM team_queue tq WHERE tq.role = current_user)"
OWN_CONSUMER = f"kind = 'consumer' AND cardinality(queues) > 0 AND queues <@ {MINE}"
SEES = f"cardinality(queues) = 0 OR queues && {MINE}"
OWN_ENTRY = "EXISTS (SELECT 1 FROM team_queue tq WHERE tq.role = current_user " \
            "AND tq.queue = trigger_cancel_log.queue)"


def upgrade() -> None:
    op.execute("ALTER TABLE consumer ENABLE ROW LEVEL SECURITY")
    op.execute(f"CREATE POLICY team_sees ON consumer FOR SELECT USING ({UNLISTED} OR {SEES})")
    op.execute(f"CREATE POLICY team_registers ON consumer FOR INSERT "
               f"WITH CHECK ({UNLISTED} OR {OWN_CONSUMER})")
    op.execute(f"CREATE POLICY team_renews ON consumer FOR UPDATE "
               f"USING ({UNLISTED} OR {OWN_CONSUMER}) WITH CHECK ({UNLISTED} OR {OWN_CONSUMER})")
    op.execute(f"CREATE POLICY team_leaves ON consumer FOR DELETE "
               f"USING ({UNLISTED} OR {OWN_CONSUMER})")

    op.execute("ALTER TABLE trigger_cancel_log ADD COLUMN queue text")
    op.execute("""
        CREATE OR REPLACE FUNCTION log_trigger_cancel() RETURNS trigger LANGUAGE plpgsql
        SECURITY DEFINER SET search_path FROM CURRENT AS $$
        BEGIN
            INSERT INTO trigger_cancel_log (trigger_id, queue) VALUES (OLD.trigger_id, OLD.queue);
            RETURN NULL;
        END $$""")
    op.execute("ALTER TABLE trigger_cancel_log ENABLE ROW LEVEL SECURITY")
    op.execute(f"CREATE POLICY team_entries ON trigger_cancel_log "
               f"USING ({UNLISTED} OR {OWN_ENTRY}) WITH CHECK ({UNLISTED} OR {OWN_ENTRY})")


def downgrade() -> None:
    op.execute("DROP POLICY IF EXISTS team_entries ON trigger_cancel_log")
    op.execute("ALTER TABLE trigger_cancel_log DISABLE ROW LEVEL SECURITY")
    op.execute("""
        CREATE OR REPLACE FUNCTION log_trigger_cancel() RETURNS trigger LANGUAGE plpgsql
        SECURITY DEFINER SET search_path FROM CURRENT AS $$
        BEGIN
            INSERT INTO trigger_cancel_log (trigger_id) VALUES (OLD.trigger_id);
            RETURN NULL;
        END $$""")
    op.execute("ALTER TABLE trigger_cancel_log DROP COLUMN queue")
    for policy in ("team_sees", "team_registers", "team_renews", "team_leaves"):
        op.execute(f"DROP POLICY IF EXISTS {policy} ON consumer")
    op.execute("ALTER TABLE consumer DISABLE ROW LEVEL SECURITY")
