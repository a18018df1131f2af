"""A task instance can wait only on a trigger of its own queue.

Trigger ids come from one sequence shared by every team. Row security lets a team's SDK role
write task rows only in its own queues, but it could still point one of them at another
team's trigger id: the writer then applied the other team's event to that row too (the
attacker read the victim's result), and a past timeout on it made the reaper delete the
victim's trigger. Every statement that joins the two tables trusted ``trigger_id``; now the
database refuses such a row, so none of them has to check the queue again.

Inserts are checked once per statement over the transition table (a 10,000-task ``defer``
pays one set-based query, not 10,000 function calls). Updates are checked per row, and only
when ``trigger_id`` or ``queue`` changes to a trigger: the writer's hot path clears
``trigger_id`` and never calls the function (``WHEN`` is evaluated without it).

Revision ID: 0005
"""

from __future__ import annotations

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

# SECURITY DEFINER: the check must see the trigger whatever the caller's row security
# shows it, and no caller needs a grant for it; search_path is pinned against hijacking.
_CHECK = """
    IF EXISTS (SELECT 1 FROM {rows}
               WHERE n.trigger_id IS NOT NULL AND NOT EXISTS (
                   SELECT 1 FROM trigger t WHERE t.id = n.trigger_id AND t.queue = n.queue)) THEN
        RAISE EXCEPTION 'a task instance may wait only on a trigger of its own queue'
            USING ERRCODE = 'foreign_key_violation';
    END IF;
"""


def upgrade() -> None:
    op.execute(f"""
        CREATE FUNCTION check_inserted_task_trigger_queue() RETURNS trigger LANGUAGE plpgsql
        SECURITY DEFINER SET search_path FROM CURRENT AS $$
        BEGIN {_CHECK.format(rows="inserted n")} RETURN NULL; END $$""")
    op.execute(f"""
        CREATE FUNCTION check_updated_task_trigger_queue() RETURNS trigger LANGUAGE plpgsql
        SECURITY DEFINER SET search_path FROM CURRENT AS $$
        BEGIN {_CHECK.format(rows="(SELECT NEW.trigger_id, NEW.queue) AS n(trigger_id, queue)")}
        RETURN NULL; END $$""")
    op.execute("""
        CREATE TRIGGER task_trigger_same_queue_on_insert AFTER INSERT ON task_instance
        REFERENCING NEW TABLE AS inserted FOR EACH STATEMENT
        EXECUTE FUNCTION check_inserted_task_trigger_queue()""")
    op.execute("""
        CREATE TRIGGER task_trigger_same_queue_on_update AFTER UPDATE OF trigger_id, queue
        ON task_instance FOR EACH ROW
        WHEN (NEW.trigger_id IS NOT NULL AND (NEW.trigger_id IS DISTINCT FROM OLD.trigger_id
                                              OR NEW.queue IS DISTINCT FROM OLD.queue))
        EXECUTE FUNCTION check_updated_task_trigger_queue()""")


def downgrade() -> None:
    op.execute("DROP TRIGGER IF EXISTS task_trigger_same_queue_on_update ON task_instance")
    op.execute("DROP TRIGGER IF EXISTS task_trigger_same_queue_on_insert ON task_instance")
    op.execute("DROP FUNCTION IF EXISTS check_updated_task_trigger_queue()")
    op.execute("DROP FUNCTION IF EXISTS check_inserted_task_trigger_queue()")
