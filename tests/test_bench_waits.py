"""``triggerflow bench airflow-waits``'s numbers per group (bench/airflow_waits.py), without a
stack: the bench itself starts one and is not a test."""

from __future__ import annotations

from bench.airflow_waits import AIRFLOW, TRIGGERFLOW, group_stats, ratio, table_waits
from bench.common import ms
from bench.results import table_data


def test_lateness_is_counted_from_the_deferral_plus_the_wait() -> None:
    # (map_index, final state, deferred, resumed): one never resumed, one never deferred
    rows = [(0, "success", 100.0, 105.5), (1, "success", 101.0, 108.0),
            (2, "failed", 102.0, None), (3, "up_for_retry", None, None)]
    g = group_stats(5, rows, 2)
    assert (g["tasks"], g["succeeded"], g["deferred"], g["resumed"]) == (4, 2, 3, 2)
    assert g["lateness"] == [0.5, 2.0] and g["p50"] == 1.25 and g["max"] == 2.0
    assert g["mismatches"] == 2


def test_the_table_puts_triggerflow_over_airflow() -> None:
    theirs = group_stats(0, [(0, "success", 10.0, 12.0), (1, "failed", 10.0, 13.0)], 1)
    ours = group_stats(0, [(0, "success", 10.0, 20.0), (1, "success", 10.0, 22.0)], 0)
    nothing = group_stats(1, [(0, "failed", None, None)], 0)
    table = table_data(table_waits([{"wait": 0, "tasks": 2, AIRFLOW: theirs, TRIGGERFLOW: ours},
                                    {"wait": 1, "tasks": 1, AIRFLOW: nothing,
                                     TRIGGERFLOW: nothing}]))
    assert table["rows"][:2] == [
        ["0 s", AIRFLOW, "2", "1", "1", ms(2.5), ms(3.0), "", ""],
        ["0 s", TRIGGERFLOW, "2", "2", "0", ms(11.0), ms(12.0), "4.4x", "4.0x"]]
    assert table["rows"][3][5:] == ["-", "-", "-", "-"]
    assert ratio(1.0, 0.0) == "-" and ratio(None, 1.0) == "-"
