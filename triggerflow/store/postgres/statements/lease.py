"""The lease statements (:class:`~triggerflow.store.LeaseStore`,
:class:`~triggerflow.store.PresenceStore`), written once for both SQL stores.

Both keep a ``consumer`` table of the same columns: native mode in its own tables, Airflow
mode in the ``triggerflow`` schema beside Airflow's. :func:`lease_statements` writes them for
a table; only ``unregister`` differs between the stores (it frees the rows each one keeps
ownership in), so each store passes its own.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LeaseStatements:
    register: str
    renew: str
    unregister: str
    announce_presence: str
    presence_gone: str
    writer_gone: str


def lease_statements(consumer: str, unregister: str, peers: str = "") -> LeaseStatements:
    """The statements on the ``consumer`` table named here (schema-qualified or not);
    ``peers``: more conditions on a peer ``c`` of the same queue set (Airflow mode: of the
    same Airflow team, as the consumers of other teams cannot take its triggers)."""
    # Not counted as capacity until its first renewal says it is subscribed on the broker
    # (the column defaults to true only for rows of processes older than it, during an
    # upgrade).
    register = f"""
INSERT INTO {consumer} (kind, host, pid, queues, capacity, version, expires_at, subscribed)
VALUES ($1, $2, $3, $4::text[], $5, $6, now() + make_interval(secs => $7), false)
RETURNING id
"""
    # One row per renewal, whatever the number of triggers held. Also reports, for the queues
    # this process serves, whether a peer's lease has expired (so reaping starts at once) and
    # how many triggers the live peers of the same queue set hold (for rebalancing after a
    # rolling restart: consumers of different queue sets cannot take each other's triggers,
    # so they must not count as peers, or they shed to each other forever).
    # Whether a peer of my queues is dead is an EXISTS over the index of expiries (only
    # expired rows are read). The peers' counts, for rebalancing only, are read when $5 asks
    # for them (every few seconds): CASE leaves the subqueries unevaluated otherwise, so a
    # renewal does not scan the consumer table (n processes x n rows each second).
    # Only peers subscribed on the broker ($6 for my own row) count: one that cannot reach
    # the broker (a wrong password) renews its lease but receives nothing, and counted it
    # would make its peers shed triggers to it forever.
    # $7 is my clock's offset from the database's as last measured (for ``status``); db_time
    # is the database's clock now, against which the next offset is measured (skew.py).
    # $8: I am warming up (unsubscribed on purpose until my runtime answers; for ``status``).
    renew = f"""
UPDATE {consumer} SET renewed_at = now(), expires_at = now() + make_interval(secs => $2),
       running = $3, subscribed = $6, clock_skew = $7, warming = $8
WHERE id = $1 AND expires_at > now()
RETURNING
    extract(epoch FROM clock_timestamp())::float8 AS db_time,
    EXISTS (SELECT 1 FROM {consumer} c
            WHERE c.expires_at <= now()
              AND (c.queues && $4::text[] OR cardinality($4::text[]) = 0))::int AS dead_peers,
    CASE WHEN $5 THEN (SELECT count(*) FROM {consumer} c
         WHERE c.kind = 'consumer' AND c.expires_at > now()
           AND CASE WHEN c.id = $1 THEN $6 ELSE c.subscribed END
           AND c.queues @> $4::text[] AND c.queues <@ $4::text[]{peers})
    ELSE 0 END AS live_peers,
    -- my own row as this renewal writes it: subqueries of RETURNING see it as it was
    -- (0 right after a claim of thousands made me shed them all to a peer with none)
    CASE WHEN $5 THEN (
         SELECT coalesce(sum(CASE WHEN c.id = $1 THEN $3 ELSE c.running END), 0)
         FROM {consumer} c
         WHERE c.kind = 'consumer' AND c.expires_at > now()
           AND CASE WHEN c.id = $1 THEN $6 ELSE c.subscribed END
           AND c.queues @> $4::text[] AND c.queues <@ $4::text[]{peers})
    ELSE 0 END AS peers_running
"""
    # The broker presence queue of the consumer's current connection (named again after each
    # reconnect and each new registration).
    announce = f"UPDATE {consumer} SET presence = $2 WHERE id = $1 RETURNING id"
    # The broker deleted a presence queue: its connection closed (a killed process). End that
    # lease now, as its expiry would have, for the peers of its queues to reap at once. Only
    # the incarnation that named it: a consumer that reconnected or re-registered named
    # another. The lease's length is kept (renewed_at moves with expires_at), so REAP_DEAD's
    # witness test judges the loss as it judges an expiry: a crash while running a trigger
    # is blamed on it. Row security holds a team's consumer role to rows of its own queues.
    gone = f"""
UPDATE {consumer} SET expires_at = now(), renewed_at = now() - (expires_at - renewed_at)
WHERE presence = $1 AND kind = 'consumer' AND expires_at > now() AND queues && $2::text[]
RETURNING id
"""
    # The same for a writer, heard by anyone whose role may end it (its peer writers; team
    # consumer roles may not, by row security): it holds no triggers, so only ``status`` and
    # ``health`` read its row, and renewed_at stays the time it last renewed. Its peers all
    # hear it at once: clock_timestamp(), not now() (when each transaction began), so one
    # that waited on the row lock finds it ended and counts nothing.
    writer_gone = f"""
UPDATE {consumer} SET expires_at = now()
WHERE presence = $1 AND kind = 'writer' AND expires_at > clock_timestamp()
RETURNING id
"""
    return LeaseStatements(register, renew, unregister, announce, gone, writer_gone)


# Leave: a straggler still owned (a claim that committed late) is freed and dated back so
# the next reaper sweep re-sends it at once, instead of waiting on an owner that is gone.
NATIVE = lease_statements(
    "consumer",
    """
WITH stragglers AS (
    UPDATE trigger SET owner_id = NULL, dispatched_at = now() - interval '1 day'
    WHERE owner_id = $1 RETURNING id
)
DELETE FROM consumer WHERE id = $1
""",
)
