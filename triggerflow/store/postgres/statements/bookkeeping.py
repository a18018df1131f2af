"""Where a mode keeps who owns each trigger row (``Bookkeeping``), and native mode's: in its
``trigger`` rows themselves. The statements over it are ``ownership``'s templates."""

from __future__ import annotations

from dataclasses import dataclass, replace

from triggerflow.model import FAIL_METHOD, FailureReason


@dataclass(frozen=True)
class Template:
    """An ownership statement for :meth:`Bookkeeping.render`; ``default``, ``team``: the
    parameter numbers Airflow mode's statement takes the default queue and the Airflow team
    in (after every shared parameter; native mode's statement has neither)."""

    sql: str
    default: int | None = None
    team: int | None = None

    def mutated(self, sql: str) -> Template:
        return replace(self, sql=sql)


@dataclass(frozen=True)
class Bookkeeping:
    """Where a mode records who owns each trigger row (what both modes record: ``ownership``).

    ``state``: the table (aliased ``s``); ``key``: its trigger id column; ``ids``: the array
    type of trigger ids; ``sent``: the column a (re-)send stamps; ``consumer``: the lease
    table; ``t``: the alias of the trigger row's columns; ``trigger``, ``match``: the trigger
    row's table (aliased ``t``) and how it matches ``s``, when it is another table;
    ``queue``: a row's queue (``$D``: the default queue); ``in_team``: a condition on the row
    (``$T``: the consumer's Airflow team); ``serves``: one on a consumer ``c`` that may run
    the row; ``named``: what names the trigger in a reason; ``fail_quarantined``,
    ``fail_unloadable``: the UPDATE, up to its FROM, that fails the task of a trigger ``f``
    (``id``, ``why``, ``last_error``) just quarantined or that nobody can load;
    ``claimed``: a claim's columns of CTE ``claimed`` (``RETURNING s.*``), with its FROM;
    ``registered``: the lease table's column of when a process registered; ``runnable``: a
    condition on the row, that it has work to run; ``reaps``: one on a dead consumer ``d``,
    that this consumer may reap it; ``reaped``: REAP_DEAD's columns of CTE ``freed``, with
    its FROM."""

    state: str
    key: str
    ids: str
    sent: str
    consumer: str
    t: str
    trigger: str
    match: str
    queue: str
    in_team: str
    serves: str
    named: str
    fail_quarantined: str
    fail_unloadable: str
    claimed: str
    registered: str
    runnable: str
    reaps: str
    reaped: str

    def render(self, template: Template) -> str:
        """``template`` written out for this bookkeeping, its ``$D`` and ``$T`` numbered."""
        fields = {name: getattr(self, name) for name in self.__dataclass_fields__}
        apart = bool(self.trigger)  # the trigger row is not the bookkeeping's own row
        fields.update(
            joined=f" JOIN {self.trigger} ON {self.match}" if apart else "",
            trigger_from=f", {self.trigger}" if apart else "",  # a FROM list's tail
            from_trigger=f"FROM {self.trigger}" if apart else "",  # an UPDATE's FROM
            using_trigger=f"USING {self.trigger}" if apart else "",  # a DELETE's USING
            is_trigger=f"{self.match} AND " if apart else "",
            # trigger rows, with their bookkeeping if any (``s`` NULL where none)
            rows=f"{self.trigger} LEFT JOIN {self.state} s ON {self.match}" if apart
            else f"{self.state} s")
        sql = template.sql.format(**fields)
        if template.default is not None:
            sql = sql.replace("$D", f"${template.default}")
        if template.team is not None:
            sql = sql.replace("$T", str(template.team))
        assert "$D" not in sql and "$T" not in sql, f"unnumbered parameter in {template.sql}"
        return sql

    def render_all(self, templates: tuple[Template, ...]) -> tuple[str, ...]:
        return tuple(self.render(template) for template in templates)


def _fail(error: str, *, keep_deferral: bool, detach: bool) -> str:
    """Native mode's failure of a task (the failure reason ``error``, ``f.why`` its message);
    ``keep_deferral``: with what it deferred to; ``detach``: the trigger row is gone."""
    deferral = (",\n            'deferred_next_method', ti.next_method, "
                "'deferred_next_kwargs', ti.next_kwargs") if keep_deferral else ""
    return f"""UPDATE task_instance ti SET state = 'scheduled', next_method = '{FAIL_METHOD}',
        next_kwargs = jsonb_build_object('error', '{error}', 'message', f.why{deferral}),
        {"trigger_id = NULL, " if detach else ""}trigger_timeout = NULL, updated_at = clock_timestamp()"""


NATIVE = Bookkeeping(
    state="trigger", key="id", ids="bigint[]", sent="dispatched_at", consumer="consumer",
    t="s", trigger="", match="", queue="s.queue", in_team="true", serves="true", named="''",
    # a quarantined row stays, with its task, for status and `trigger release`
    fail_quarantined=_fail(FailureReason.TRIGGER_QUARANTINED, keep_deferral=True, detach=False),
    fail_unloadable=_fail(FailureReason.TRIGGER_UNLOADABLE, keep_deferral=False, detach=True),
    claimed="""c.id, c.attempt, c.classpath, c.kwargs, c.queue, c.failures, c.traceparent,
    extract(epoch FROM c.timeout_at)::float8 AS timeout_at,
    CASE WHEN ti.task_id IS NOT NULL  -- NULL once the task left (a cancel the owner has yet to sweep)
        THEN format('%s.%s@%s', ti.dag_id, ti.task_id, ti.run_id) END AS task,
    'claimed' AS outcome
FROM claimed c LEFT JOIN task_instance ti ON ti.trigger_id = c.id""",
    registered="started_at", runnable="true", reaps="true",
    # the columns of a claim for what the reaper took (kwargs only for those)
    reaped="""c.id, c.attempt, c.classpath, CASE WHEN c.take THEN c.kwargs END AS kwargs, c.queue,
       c.failures, c.traceparent, extract(epoch FROM c.timeout_at)::float8 AS timeout_at,
       format('%s.%s@%s', ti.dag_id, ti.task_id, ti.run_id) AS task,
       c.take AS taken, c.quarantined, (SELECT count(*) FROM gone) AS dead
FROM freed c LEFT JOIN task_instance ti ON c.take AND ti.trigger_id = c.id""")
