"""SQL for Airflow trigger rows with no deferred task (asset watchers, callback triggers).

What keeps such a row alive in Airflow is what keeps Airflow's ``Trigger.clean_unused`` from
deleting it: an ``asset_watcher`` or a ``callback`` naming it. The store's statements claim,
re-send and keep (not sweep) a row that has a deferred task *or* one of these
(``LIVE``); the writer sends their events to Airflow's ``Trigger.submit_event``
(``orm.apply_watcher_events``). See ``watchers`` for how Airflow runs them.

No Airflow import: the writer needs only PostgreSQL.
"""

from __future__ import annotations

from triggerflow.airflow.schema import SCHEMA

# The row ``t`` is an asset watcher's or a callback's.
NON_TASK = """(EXISTS (SELECT 1 FROM asset_watcher aw WHERE aw.trigger_id = t.id)
     OR EXISTS (SELECT 1 FROM callback cb WHERE cb.trigger_id = t.id))"""

# The row ``t`` has work: a task deferred on it (coalesce(): found by ti_trigger_id, never by
# the ti_state index, see events.APPLY), or it is a non-task row.
LIVE = f"""(EXISTS (SELECT 1 FROM task_instance ti
             WHERE ti.trigger_id = t.id AND coalesce(ti.state, '') = 'deferred')
     OR {NON_TASK})"""

# Of a batch's trigger ids, those of non-task rows: APPLY moves no task for their events.
NON_TASK_IDS = f"""
SELECT t.id FROM "trigger" t WHERE t.id = ANY($1::int[]) AND {NON_TASK}
"""

# The non-task rows this consumer runs ($2 ids, $3 attempts) whose bookkeeping no longer
# says it holds them at that attempt: the writer deleted the row with it (the DAG dropped
# the watcher, the callback ended) or another consumer took it. The consumer stops them.
GONE_WATCHERS = f"""
SELECT w.id FROM unnest($2::int[], $3::int[]) AS w(id, attempt)
WHERE NOT EXISTS (SELECT 1 FROM {SCHEMA}.trigger_state s
                  WHERE s.trigger_id = w.id AND s.owner_id = $1 AND s.attempt = w.attempt)
"""
