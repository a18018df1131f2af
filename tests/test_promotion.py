"""The database primary dies mid-burst and its standby is promoted: every process reconnects
to the new primary through its multi-host URL and goes on; each task is applied exactly once.

The primary and its synchronous standby are clusters of this test's own
(testbed/replication.py); the broker is the session's. How long the gap lasts is printed by
``triggerflow bench promote``, not asserted here.
"""

from __future__ import annotations

from pathlib import Path

from testbed.replication import promote_mid_burst
from tests.conftest import FAST


async def test_promoted_standby_takes_over_mid_burst_and_each_task_is_applied_once(
    amqp_server: str,
    tmp_path: Path,
) -> None:
    run = await promote_mid_burst(amqp_server, tmp_path, burst=2_000, settings=FAST)
    where = f"writer log:\n{run.logs['writer'][-3000:]}\nconsumer log:\n{run.logs['consumer'][-3000:]}"
    # the kill landed inside the burst: some applied on the old primary, most still to come
    assert 0 < run.applied_before_kill < 2_000, (run.applied_before_kill, where)
    assert run.complete, (len(run.applies), where)
    assert len(run.applies) == run.tasks  # the burst and the 100 deferred after the promotion
    assert run.applied_twice == 0, run.applies.most_common(5)
    # events went on after the promotion (on the new primary, counted from the kill)
    assert run.first_apply_after > 0
    # every trigger fired and was seen on the events exchange
    assert len(run.events) == run.tasks
    assert run.alive, where
    # the processes met the loss of the primary (and did not just miss it)
    assert "retrying" in run.logs["writer"] or "unavailable" in run.logs["writer"].lower(), where


def test_a_url_listing_several_hosts_is_edited_and_redacted_whole() -> None:
    """``with_database`` (``db upgrade``, ``setup``) keeps every host and the query, the
    redactor still hides the password, and failures name all the hosts."""
    from triggerflow.cli.failures import _where
    from triggerflow.redact import Redactor
    from triggerflow.settings import Settings
    from triggerflow.store.postgres.schema import database_name, with_database
    from triggerflow.store.postgres.urls import parse

    url = "postgresql://tf:s3cret%21@db-a:5432,db-b:5433/tf?target_session_attrs=read-write"
    assert with_database(url, "postgres") == (
        "postgresql://tf:s3cret%21@db-a:5432,db-b:5433/postgres?target_session_attrs=read-write"
    )
    assert database_name(url) == "tf"
    assert parse(url).query["host"] == ("db-a:5432", "db-b:5433")  # SQLAlchemy's multi-host form
    assert with_database("postgresql://u@h:1/a?x=1", "b") == "postgresql://u@h:1/b?x=1"
    redact = Redactor(Settings(database_url=url))
    assert redact(f"lost {url}; password s3cret!") == (
        "lost postgresql://tf:***@db-a:5432,db-b:5433/tf?target_session_attrs=read-write; password ***"
    )
    assert _where(url) == "db-a:5432,db-b:5433"
