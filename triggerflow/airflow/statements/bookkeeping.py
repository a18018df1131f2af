"""Where Airflow mode records who owns each of Airflow's trigger rows: the
``triggerflow.trigger_state`` row beside it, absent until triggerflow has sent or claimed the
row (the ownership statements are written once, in ``store.postgres.statements.ownership``)."""

from triggerflow.airflow.nontask import LIVE
from triggerflow.airflow.schema import SCHEMA
from triggerflow.airflow.teams import consumer_serves, in_team
from triggerflow.model import FAIL_METHOD, FailureReason
from triggerflow.store.postgres.statements.bookkeeping import Bookkeeping


def _fail(traceback: str) -> str:
    """Fail a task the way Airflow fails a trigger (``Trigger.submit_failure``: '__fail__',
    'Trigger failure'), triggerflow's reason as the traceback's text."""
    return f"""UPDATE task_instance ti SET state = 'scheduled', next_method = '{FAIL_METHOD}',
        next_kwargs = jsonb_build_object(
            'error', '{FailureReason.TRIGGER_FAILURE}', 'traceback', jsonb_build_array({traceback})),
        trigger_id = NULL, scheduled_dttm = now(), updated_at = now()"""


# What a consumer needs to run a claimed trigger (of CTE ``c``): Airflow's classpath and
# encrypted kwargs, the team queue, the task for log lines (NULL: an asset watcher's or a
# callback's row, watchers.py), and how long ago the task deferred (the API server writes
# created_date with the deferral: the scheduler race's clock, witness.py). Timeouts stay the
# scheduler's (as in Airflow).
SPEC = """
    t.id, c.attempt, t.classpath, t.kwargs, coalesce(t.queue, $D) AS queue,
    CASE WHEN ti.id IS NOT NULL THEN format('%s.%s@%s', ti.dag_id, ti.task_id, ti.run_id)
    END AS task,
    extract(epoch FROM clock_timestamp() - t.created_date)::float8 AS deferred_for"""

AIRFLOW = Bookkeeping(
    state=f"{SCHEMA}.trigger_state", key="trigger_id", ids="int[]", sent="published_at",
    consumer=f"{SCHEMA}.consumer", t="t", trigger='"trigger" t', match="t.id = s.trigger_id",
    # rows with no queue (asset watchers, callbacks) are the default queue's, if any
    queue="coalesce(t.queue, $D)", in_team=in_team("t.team_name", "$T"),
    serves=consumer_serves("c", "t"), named="format('trigger %s (%s): ', t.id, t.classpath)",
    fail_quarantined=_fail("format('triggerflow quarantined this trigger: %s', f.last_error)"),
    fail_unloadable=_fail("'triggerflow could not load this trigger: ' || f.why"),
    claimed=f"""{SPEC}, 'claimed' AS outcome
FROM claimed c JOIN "trigger" t ON t.id = c.trigger_id
LEFT JOIN task_instance ti ON ti.trigger_id = t.id AND coalesce(ti.state, '') = 'deferred'""",
    # a consumer of an Airflow team reaps only consumers of its team, takes only its rows
    registered="registered_at", runnable=f"{LIVE} AND {in_team('t.team_name', '$T')}",
    reaps=in_team("d.team", "$T"),
    reaped=f"""{SPEC.replace("c.attempt", "f.attempt")}, f.failures,
       f.quarantined, f.take AS taken, (SELECT count(*) FROM gone) AS dead
FROM freed f JOIN "trigger" t ON t.id = f.trigger_id
LEFT JOIN task_instance ti ON ti.trigger_id = t.id AND coalesce(ti.state, '') = 'deferred'""")
