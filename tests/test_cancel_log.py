"""The native cancel log (migration 0003): a row trigger logs each task that leaves its
trigger, and each consumer's sweep takes the entries of the triggers it holds. An entry
whose trigger is already gone (deleted by ``CANCEL``, the writer or a reaper) is nobody's:
any sweep deletes it, or the log would keep it for ever."""

from __future__ import annotations

from tests.test_bad_input import insert_trigger
from triggerflow.store import ProcessKind
from triggerflow.store.postgres import Database
from triggerflow.store.postgres.store import PostgresStore


async def test_any_sweep_deletes_the_entries_of_triggers_that_are_gone(
    db: Database, dsn: str, teams: list[str],
) -> None:
    q = teams[0]
    store = await PostgresStore.connect(dsn)
    try:
        me, other = [await store.register(ProcessKind.CONSUMER, "h", 1, [q], 10, "t", 60)
                     for _ in range(2)]
        mine, others, gone = [await insert_trigger(db, "tests.triggers.EventAfter", "{}", q, n)
                              for n in range(3)]
        await db.execute("UPDATE trigger SET owner_id = $2 WHERE id = $1", mine, me)
        await db.execute("UPDATE trigger SET owner_id = $2 WHERE id = $1", others, other)
        await db.execute("UPDATE task_instance SET state = 'failed'")  # one entry each
        await db.execute("DELETE FROM trigger WHERE id = $1", gone)  # as the writer does
        assert await store.sweep_cancelled(me) == [mine]
        # The other consumer's entry waits for its sweep; the gone trigger's is deleted.
        assert [r["trigger_id"] for r in await db.fetch(
            "SELECT trigger_id FROM trigger_cancel_log")] == [others]
        assert await store.sweep_cancelled(other) == [others]
        assert await db.fetchval("SELECT count(*) FROM trigger_cancel_log") == 0
    finally:
        await store.close()
