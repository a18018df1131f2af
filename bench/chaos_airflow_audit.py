"""The record of ``triggerflow bench chaos --mode airflow``: row triggers of the run's own on
Airflow's ``task_instance`` and ``xcom`` (``chaos_audit``), and the mapping of what they
recorded into native mode's history format, so ``chaos_check.check`` judges both alike.

What differs in Airflow's rows, and how the mapping makes it native mode's:

- no ``event_applied_at``: an apply is a change made by triggerflow's sessions (their
  ``triggerflow.origin``), stamped with ``scheduled_dttm`` (a resume or a ``__fail__``,
  state ``scheduled``) or ``end_date`` (a task-end event); ``old_applied`` is the same of the
  old row, so triggerflow letting go of a finished task's trigger (``trigger_id`` cleared,
  dates kept) is no apply, and a second event applied to a resumed task is;
- the timer's event is Airflow's serde of a datetime: it becomes its ISO form;
- a task-end event's result is its XComs: the ``xcom`` rows written in the same
  transaction as the task's change;
- a re-deferral clears the task (state none) and defers its next try in one transaction:
  the changes one transaction made to one task are merged into one (the first's old side,
  the last's new side), as native mode's re-deferral is one change of its row.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

AUDIT = """
CREATE TABLE chaos_audit (
    seq bigserial PRIMARY KEY, at float8 NOT NULL, op text NOT NULL, tx bigint NOT NULL,
    origin text, task text, queue text, old_state text, new_state text, old_d text,
    new_d text, old_trigger bigint, new_trigger bigint, next_method text, event jsonb,
    try_number int, applied float8, old_applied float8, xkey text, xvalue jsonb);
CREATE FUNCTION chaos_applied(state text, scheduled timestamptz, ended timestamptz)
RETURNS float8 LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN state = 'scheduled' THEN extract(epoch FROM scheduled)
                WHEN state IN ('success', 'failed', 'skipped') THEN extract(epoch FROM ended)
           END $$;
CREATE FUNCTION chaos_audit_ti() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
SET search_path = public AS $$
DECLARE
    origin text := current_setting('triggerflow.origin', true);
    upd boolean := TG_OP = 'UPDATE';
BEGIN
    INSERT INTO chaos_audit (at, op, tx, origin, task, queue, old_state, new_state, old_d,
                             new_d, old_trigger, new_trigger, next_method, event, try_number,
                             applied, old_applied)
    VALUES (extract(epoch FROM clock_timestamp()), left(TG_OP, 1), txid_current(), origin,
            NEW.task_id || ':' || NEW.map_index, NEW.queue,
            CASE WHEN upd THEN OLD.state END, NEW.state,
            CASE WHEN upd THEN OLD.next_kwargs->>'d' END, NEW.next_kwargs->>'d',
            CASE WHEN upd THEN OLD.trigger_id END, NEW.trigger_id, NEW.next_method,
            (NEW.next_kwargs->'event')::jsonb, NEW.try_number,
            CASE WHEN origin = 'triggerflow'
                 THEN chaos_applied(NEW.state, NEW.scheduled_dttm, NEW.end_date) END,
            CASE WHEN upd THEN chaos_applied(OLD.state, OLD.scheduled_dttm, OLD.end_date) END);
    RETURN NULL;
END $$;
CREATE TRIGGER chaos_audit AFTER INSERT OR UPDATE ON task_instance
    FOR EACH ROW EXECUTE FUNCTION chaos_audit_ti();
CREATE FUNCTION chaos_audit_xcom() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
SET search_path = public AS $$
BEGIN
    INSERT INTO chaos_audit (at, op, tx, origin, task, xkey, xvalue)
    VALUES (extract(epoch FROM clock_timestamp()), 'X', txid_current(),
            current_setting('triggerflow.origin', true), NEW.task_id || ':' || NEW.map_index,
            NEW.key, to_jsonb(NEW.value));
    RETURN NULL;
END $$;
CREATE TRIGGER chaos_audit_xcom AFTER INSERT OR UPDATE ON xcom
    FOR EACH ROW EXECUTE FUNCTION chaos_audit_xcom();
"""

# A trigger row left, with triggerflow's bookkeeping of it (who holds it, since when, when
# its wake-up was last published): what the report needs to tell why.
FINAL_TRIGGERS = """
SELECT t.id, t.queue, t.classpath, s.owner_id, s.attempt, s.claimed_at::text,
       s.published_at::text, s.failures, s.quarantined_at IS NOT NULL AS quarantined,
       s.last_error
FROM trigger t LEFT JOIN triggerflow.trigger_state s ON s.trigger_id = t.id ORDER BY t.id
"""
FINAL_DEFERRED = ("SELECT task_id || ':' || map_index AS task_id, queue, "
                  "next_kwargs->>'d' AS d, trigger_id FROM task_instance "
                  "WHERE state = 'deferred'")
ENDED = ("success", "failed", "skipped")


def _loads(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def event_of(value: Any) -> Any:
    """An applied event as native mode records it: Airflow's serde of a datetime (the
    timer's moment) as its ISO form; anything else as it is."""
    value = _loads(value)
    if isinstance(value, dict) and "datetime" in str(value.get("__classname__", "")).lower():
        data = value.get("__data__")
        if isinstance(data, dict) and "timestamp" in data:
            return datetime.fromtimestamp(float(data["timestamp"]), UTC).isoformat()
    return value


def native_audit(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The recorded changes (in ``seq`` order) in native mode's audit format: one change per
    task and transaction, events decoded, a task-end's XComs as its ``result``."""
    xcoms: dict[tuple[int, str], dict[str, Any]] = {}
    for r in rows:
        if r["op"] == "X":
            xcoms.setdefault((r["tx"], r["task"]), {})[r["xkey"]] = _loads(r["xvalue"])
    out: list[dict[str, Any]] = []
    merged: dict[tuple[int, str], dict[str, Any]] = {}
    for r in rows:
        if r["op"] == "X":
            continue
        key = (r["tx"], r["task"])
        new = {"new_state": r["new_state"], "new_d": r["new_d"],
               "new_trigger": r["new_trigger"], "next_method": r["next_method"],
               "event": event_of(r["event"]), "applied": r["applied"],
               "try_number": r["try_number"], "queue": r["queue"],
               "result": xcoms.get(key) if r["new_state"] in ENDED else None}
        if key in merged:  # the same task changed again in the same transaction
            merged[key].update(new, merged=merged[key].get("merged", 1) + 1)
            continue
        row = {"seq": r["seq"], "at": r["at"], "op": r["op"], "task": r["task"],
               "origin": r["origin"], "old_state": r["old_state"], "old_d": r["old_d"],
               "old_trigger": r["old_trigger"], "old_applied": r["old_applied"],
               "error": None, **new}
        merged[key] = row
        out.append(row)
    return out
