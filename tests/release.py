"""Helpers for the release tests: the previous release's code, run beside this one, and an
audit of what happened to each task instance.

The previous release is the commit before the one that added the newest migration (the code
that ran on the previous migration head), read from this checkout's git history with
``git archive``. Its processes run with that tree first on the path and as their working
directory (``python -m`` puts the working directory ahead of everything), and this
checkout after it for ``tests.triggers``.
"""

from __future__ import annotations

import io
import subprocess
import tarfile
from pathlib import Path

import pytest

from tests.conftest import ROOT
from triggerflow.store.postgres import Database
from triggerflow.store.postgres.schema import MIGRATIONS

# Every write to a task instance once it left 'deferred', and the write that made it leave:
# an event applied twice, or a stale one applied after the task moved on, shows as a second
# row for the task.
AUDIT = """
CREATE TABLE ti_audit (ti_id bigint, old_state text, new_state text, next_method text);
CREATE FUNCTION ti_audit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO ti_audit VALUES (NEW.id, OLD.state, NEW.state, NEW.next_method);
    RETURN NEW;
END $$;
CREATE TRIGGER ti_audit AFTER UPDATE ON task_instance FOR EACH ROW
    WHEN (OLD.state IS DISTINCT FROM 'deferred' AND OLD.state IS NOT NULL
          OR OLD.state = 'deferred' AND NEW.state IS DISTINCT FROM 'deferred')
    EXECUTE FUNCTION ti_audit();
"""


def previous_release(into: Path) -> Path:
    """Extract the previous release's ``triggerflow`` package under ``into``; skip the test
    when this checkout has no history to read it from (a tarball, a shallow clone)."""
    newest = sorted((MIGRATIONS / "versions").glob("0*.py"))[-1]
    added = subprocess.run(
        ["git", "log", "-1", "--format=%H", "--diff-filter=A", "--", str(newest)],
        cwd=ROOT, capture_output=True, text=True)
    # Not committed yet: the committed tree is still the previous release's.
    commit = f"{added.stdout.strip()}^" if added.stdout.strip() else "HEAD"
    archive = subprocess.run(["git", "archive", commit, "triggerflow"], cwd=ROOT,
                             capture_output=True)
    if added.returncode or archive.returncode:
        pytest.skip(f"no git history to read the previous release from: {archive.stderr!r}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")
    return into


async def audit(db: Database) -> None:
    await db.execute(AUDIT)


async def audited(db: Database) -> dict[int, list[tuple[str, str, str | None]]]:
    """Per task instance, every audited write (old state, new state, next_method)."""
    rows = await db.fetch("SELECT ti.id, a.old_state, a.new_state, a.next_method "
                          "FROM task_instance ti LEFT JOIN ti_audit a ON a.ti_id = ti.id")
    found: dict[int, list[tuple[str, str, str | None]]] = {}
    for r in rows:
        writes = found.setdefault(r["id"], [])
        if r["old_state"] is not None:
            writes.append((r["old_state"], r["new_state"], r["next_method"]))
    return found
