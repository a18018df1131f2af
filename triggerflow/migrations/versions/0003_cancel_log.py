"""A change log of tasks that left 'deferred' outside the writer: the cancel sweep's input.

The cancel sweep used to anti-join everything a consumer holds against every deferred task,
every few seconds (about 70 ms of database time at 100,000 held). Now a row trigger writes
the trigger id of a task that stopped waiting on it (cancelled, cleared or marked by hand,
re-deferred on another trigger, deleted), and the sweep reads only those entries. The
writer's own moves (which set ``event_applied_at``) are not logged: they are the hot path,
and the writer deletes the trigger row itself.

Also an index of consumer expiries, so a renewal's dead-peer check reads only expired rows.

Revision ID: 0003
"""

from __future__ import annotations

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("""
        CREATE TABLE trigger_cancel_log (
            trigger_id bigint NOT NULL,
            logged_at timestamptz NOT NULL DEFAULT now()
        )""")
    op.execute("CREATE INDEX trigger_cancel_log_trigger ON trigger_cancel_log (trigger_id)")
    # A renewal asks "is a peer dead?": this index reads only the expired rows.
    op.execute("CREATE INDEX consumer_expires ON consumer (expires_at)")
    op.execute("""
        CREATE FUNCTION log_trigger_cancel() RETURNS trigger LANGUAGE plpgsql
        -- The log is bookkeeping, not a grant: a restricted SDK or team role that cancels
        -- its own task must not need a privilege on it (and search_path cannot be hijacked).
        SECURITY DEFINER SET search_path FROM CURRENT AS $$
        BEGIN
            INSERT INTO trigger_cancel_log (trigger_id) VALUES (OLD.trigger_id);
            RETURN NULL;
        END $$""")
    # WHEN is checked without calling the function: the writer's moves cost nothing extra.
    op.execute("""
        CREATE TRIGGER task_left_deferred AFTER UPDATE ON task_instance FOR EACH ROW
        WHEN (OLD.state = 'deferred' AND OLD.trigger_id IS NOT NULL
              AND (NEW.state IS DISTINCT FROM 'deferred'
                   OR NEW.trigger_id IS DISTINCT FROM OLD.trigger_id)
              AND NEW.event_applied_at IS NOT DISTINCT FROM OLD.event_applied_at)
        EXECUTE FUNCTION log_trigger_cancel()""")
    op.execute("""
        CREATE TRIGGER deferred_task_deleted AFTER DELETE ON task_instance FOR EACH ROW
        WHEN (OLD.state = 'deferred' AND OLD.trigger_id IS NOT NULL)
        EXECUTE FUNCTION log_trigger_cancel()""")


def downgrade() -> None:
    op.execute("DROP TRIGGER IF EXISTS deferred_task_deleted ON task_instance")
    op.execute("DROP TRIGGER IF EXISTS task_left_deferred ON task_instance")
    op.execute("DROP FUNCTION IF EXISTS log_trigger_cancel()")
    op.execute("DROP TABLE IF EXISTS trigger_cancel_log")
    op.execute("DROP INDEX IF EXISTS consumer_expires")
