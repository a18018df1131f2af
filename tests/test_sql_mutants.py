"""The SQL mutant generator of ``make mutate`` (``tools/sql_mutants.py``): every condition
dropped in turn, and nothing that is not a condition (DDL's ``OR REPLACE``, the ``FROM`` of
``IS DISTINCT FROM``), so a mutant PostgreSQL rejects is rare and a survivor means a missing
case."""

from __future__ import annotations

from tools.sql_mutants import mutants

TRIGGER_DDL = """
CREATE OR REPLACE TRIGGER t AFTER UPDATE ON task_instance FOR EACH ROW
WHEN (OLD.state = 'deferred' AND (NEW.state IS DISTINCT FROM 'deferred' OR NEW.x <> OLD.x)
      AND current_setting('o', true) IS DISTINCT FROM 'me')
EXECUTE FUNCTION f();
"""


def test_each_condition_of_a_trigger_when_is_dropped_and_nothing_else() -> None:
    assert [m.description for m in mutants(TRIGGER_DDL)] == [
        "L3: drop `AND (NEW.state IS DISTINCT FROM 'deferred' OR NEW.x <> OLD.x)`",
        "L3: drop `OLD.state = 'deferred' AND`",
        "L3: drop `OR NEW.x <> OLD.x`",
        "L3: drop `NEW.state IS DISTINCT FROM 'deferred' OR`",
        "L4: drop `AND current_setting('o', true) IS DISTINCT FROM 'me'`",
    ]


def test_order_comparisons_move_by_one() -> None:
    sql = "SELECT 1 FROM c WHERE c.expires_at > now() AND c.n <= $1"
    assert [m.text for m in mutants(sql) if "->" in m.description] == [
        "SELECT 1 FROM c WHERE c.expires_at >= now() AND c.n <= $1",
        "SELECT 1 FROM c WHERE c.expires_at > now() AND c.n < $1",
    ]


def test_every_policy_of_the_migrations_is_a_target_and_each_clause_is_made_true() -> None:
    from tools.mutate_policies import policies, policy_mutants

    found = policies()
    assert set(found) == {
        ("trigger", "team_rows"), ("task_instance", "team_rows"), ("consumer", "team_sees"),
        ("consumer", "team_registers"), ("consumer", "team_renews"), ("consumer", "team_leaves"),
        ("trigger_cancel_log", "team_entries"), ("trigger", "trigger_id_drawn_by_this_session")}
    renews = policy_mutants(found["consumer", "team_renews"])
    described = [m.description for m in renews]
    assert described[:2] == ["`USING (…)` -> `USING (true)`",
                             "`WITH CHECK (…)` -> `WITH CHECK (true)`"]
    assert renews[1].text.endswith("WITH CHECK (true)")
    # The re-pointing the WITH CHECK exists to refuse, named by its clause:
    assert any(d.startswith("WITH CHECK: drop `AND queues <@ ARRAY(") for d in described)
