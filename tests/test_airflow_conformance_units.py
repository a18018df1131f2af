"""The oracle comparison of the real-stack modules (tests/airflow_conformance.py) tells two
runs apart by every column it claims to compare, and only by those."""

from __future__ import annotations

from dataclasses import replace

from tests.airflow_conformance import TaskEnd, differences, mask

RUN = "manual__2026-12-04T23:40:01.123456+00:00"
OTHER_RUN = "manual__2026-12-04T23:47:55.000001+00:00"
KEY = ("tf_dag", "sensor", -1)


def test_run_ids_and_instants_are_masked_everywhere_in_a_value() -> None:
    value = {"run": RUN, "at": "2026-12-04 23:40:03.5+00:00", f"key {RUN}": [RUN, 3, None]}
    assert mask(value, [RUN]) == {"run": "<run>", "at": "<time>", "key <run>": ["<run>", 3, None]}
    # Airflow's serde form of a datetime (an HITL answer's responded_at)
    serde = {"__classname__": "datetime.datetime", "__version__": 2,
             "__data__": {"timestamp": 1796427326.057356, "tz": "UTC"}}
    assert mask({"responded_at": serde, "n": 1.5}, [RUN]) == {"responded_at": "<time>", "n": 1.5}
    # the same XCom of two runs of one DAG compares equal once masked
    assert mask({"run": RUN}, [RUN]) == mask({"run": OTHER_RUN}, [OTHER_RUN])


def test_every_compared_column_tells_the_runs_apart() -> None:
    oracle = TaskEnd("success", 1, {"return_value": {"rows": 3}}, ((1, "failed"),), False)
    assert differences({KEY: oracle}, {KEY: oracle}) == []
    for column, value in (("state", "failed"), ("try_number", 2), ("xcoms", {}),
                          ("history", ()), ("on_trigger", True)):
        found = differences({KEY: oracle}, {KEY: replace(oracle, **{column: value})})
        assert len(found) == 1 and f" {column}: " in found[0], found


def test_a_task_instance_only_one_side_has_is_a_difference() -> None:
    end = TaskEnd("success", 1, {}, (), False)
    mapped = ("tf_dag", "sensor", 3)
    assert differences({KEY: end}, {KEY: end, mapped: end}) == [
        f"{mapped}: only under triggerflow ({end})"]
    assert differences({KEY: end, mapped: end}, {KEY: end}) == [
        f"{mapped}: only under Airflow's triggerer ({end})"]


def test_a_try_one_side_skipped_is_left_out_and_every_recorded_try_compared() -> None:
    # Airflow's triggerer: try 1 failed to start (no history row), tries 2 and 3 timed out
    oracle = TaskEnd("failed", 3, {}, ((2, "failed"),), False)
    ours = TaskEnd("failed", 3, {}, ((1, "failed"), (2, "failed")), False)
    assert differences({KEY: oracle}, {KEY: ours}) == []
    assert differences({KEY: ours}, {KEY: oracle}) == []
    # a try both recorded, in another state
    found = differences({KEY: oracle}, {KEY: replace(ours, history=((1, "failed"), (2, "success")))})
    assert len(found) == 1 and " history: " in found[0], found
    # a try past the other side's try number is no skip
    found = differences({KEY: replace(oracle, try_number=2, history=((1, "failed"),))},
                        {KEY: replace(ours, try_number=2, history=((1, "failed"), (2, "failed")))})
    assert len(found) == 1 and " history: " in found[0], found
