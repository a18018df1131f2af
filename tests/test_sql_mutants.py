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
