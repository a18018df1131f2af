"""What ``triggerflow status`` finds: team queues, the events and dead-letter queues, writers,
consumers, overdue and quarantined triggers, and the problems among them (exit 3)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from triggerflow.redact import Redactor
from triggerflow.settings import Settings
from triggerflow.transport import QueueInfo

if TYPE_CHECKING:
    from triggerflow.transport.management import ManagementClient

T = TypeVar("T")

SECOND_LOOK = 0.5  # seconds: longer than a subscription renewal's gap, short for a person


def most_consumers(first: dict[str, QueueInfo | None],
                   second: dict[str, QueueInfo | None]) -> dict[str, QueueInfo | None]:
    """Each queue's info with the larger consumer count of two reads."""
    merged = dict(first)
    for name, info in second.items():
        before = merged.get(name)
        if info is not None and before is not None and info.consumers > before.consumers:
            merged[name] = before._replace(consumers=info.consumers)
    return merged


async def collect_status(settings: Settings) -> dict[str, Any]:
    """Queues, processes, overdue and quarantined triggers, and the problems among them."""
    from triggerflow.modes import mode_for
    from triggerflow.transport.rabbitmq import Topology
    from triggerflow.wiring import admin_database

    redact = Redactor(settings)
    topology = Topology(settings.namespace)
    sql = mode_for(settings).status_statements()
    db = await admin_database(settings)
    try:
        process_rows: list[Any] = await db.fetch(sql.consumers)
        writer_rows: list[Any] = await db.fetch(sql.writers)
        queue_rows: list[Any] = await db.fetch(sql.queues, *sql.queue_args)
        overdue = await db.fetchval(sql.overdue)
        quarantine_rows: list[Any] = await db.fetch(sql.quarantined, *sql.quarantined_args)
        unserved_rows: list[Any] = (await db.fetch(sql.unserved, *sql.unserved_args)
                                    if sql.unserved else [])
    finally:
        await db.close()
    consumers = [dict(r) for r in process_rows]
    queues = {r["queue"]: dict(r) for r in queue_rows}
    quarantined = [dict(r) for r in quarantine_rows]
    names = set(queues) | set(settings.queues)
    for c in consumers:
        names.update(c["queues"])
    shared = [topology.events_queue, topology.dead_queue]
    listed, subscribed, management_error = await broker_view(settings, shared)
    names.update(n for n in listed if n not in shared)
    broker_info, broker_error = await amqp_queue_info(settings, sorted(names) + shared)
    report_queues = []
    problems: list[str] = []
    for name in sorted(names):
        # counted once subscribed on the broker (a refused one holds a lease, no queue)
        live = [c for c in consumers if c["alive"] and c["subscribed"]
                and c["kind"] == "consumer" and name in c["queues"]]
        row = queues.get(name, {})
        info = broker_info.get(name)
        entry = {
            "queue": name,
            "depth": info[0] if info else None,
            "broker_consumers": info[1] if info else None,
            "consumers": len(live),
            "running": row.get("owned", 0) - row.get("dead_owner", 0),
            "triggers": row.get("triggers", 0),
            "unclaimed": row.get("unclaimed", 0),
            "quarantined": row.get("quarantined", 0),
            "dead_owner": row.get("dead_owner", 0),
            **broker_columns(listed.get(name), management_error),
        }
        report_queues.append(entry)
        if not live and (entry["triggers"] or name in settings.queues or name in listed):
            problems.append(f"queue {name} has no live consumer")
        if entry["dead_owner"]:
            problems.append(f"queue {name}: {entry['dead_owner']} triggers held by dead owners")
        if info is None and not broker_error:
            problems.append(f"queue {name} does not exist on the broker")
    writers = [dict(r) for r in writer_rows]
    events = shared_queue(topology.events_queue, broker_info.get(topology.events_queue),
                          listed, management_error)
    dead = shared_queue(topology.dead_queue, broker_info.get(topology.dead_queue),
                        listed, management_error)
    grace = settings.lease_ttl.total_seconds()
    problems += await writers_checked(settings, writers, events, grace)
    if dead["depth"]:
        problems.append(f"{dead['depth']} dead-lettered message(s) in {dead['queue']}")
    bound = settings.max_clock_skew.total_seconds()
    skewed = [c for c in consumers if c["alive"] and c["kind"] == "consumer"
              and abs(c["clock_skew"] or 0.0) > bound]
    problems += [f"consumer {c['id']} on {c['host']} (pid {c['pid']}): clock "
                 f"{c['clock_skew']:+.1f}s off the database's (max_clock_skew {bound:g}s); "
                 "it runs no trigger until its clock is fixed" for c in skewed]
    # a skewed consumer unsubscribes on purpose: named above, not as unsubscribed; so does
    # one warming up beside a peer until its trigger runtime answers (listed, no problem)
    warming = [c for c in consumers if c["alive"] and c["kind"] == "consumer" and c["warming"]]
    checked = [c for c in consumers if c not in skewed and c not in warming]
    unsubscribed = not_subscribed(checked, subscribed, broker_info, grace)
    if unsubscribed:
        # A consumer renews its subscriptions every subscription_renew_interval; each renewal
        # is absent from the broker's count for a few milliseconds and from the management
        # API's consumer list until its next statistics sample: only a queue still short a
        # moment later counts, and a consumer either read lists is subscribed (CI caught
        # `status` exiting 3 on a healthy consumer, and naming one).
        await asyncio.sleep(SECOND_LOOK)
        again, _ = await amqp_queue_info(settings, sorted({u["queue"] for u in unsubscribed}))
        if subscribed is not None:
            later, _ = await ask_management(settings, lambda api, vhost: api.subscriptions(vhost))
            subscribed = subscribed_in_either(subscribed, later)
        unsubscribed = not_subscribed(checked, subscribed,
                                      most_consumers(broker_info, again), grace)
    problems += [u["problem"] for u in unsubscribed]
    unserved = [dict(r) for r in unserved_rows]
    problems += unserved_problems(unserved)
    if quarantined:
        problems.append(f"{len(quarantined)} quarantined trigger(s)")
    if overdue:
        problems.append(f"{overdue} deferred task(s) past their timeout")
    problems += _access_problems(broker_error, management_error, redact)
    for q in quarantined:
        q["last_error"] = redact(q["last_error"]) if q["last_error"] else q["last_error"]
    return {"queues": report_queues, "events": events, "dead_letters": dead,
            "writers": writers, "consumers": consumers, "not_subscribed": unsubscribed,
            "warming": [c["id"] for c in warming], "unserved": unserved,
            "overdue_tasks": overdue, "quarantined": quarantined, "problems": problems}


async def ask_management(
    settings: Settings, question: Callable[[ManagementClient, str], Awaitable[T]],
) -> tuple[T | None, str | None]:
    """``question(api, vhost)`` answered by the management API, or why it could not be."""
    from triggerflow.transport.management import (
        ManagementClient,
        ManagementUnavailable,
        vhost_of,
    )

    try:
        async with ManagementClient(settings.management_dsn()) as api:
            return await question(api, vhost_of(settings.amqp_dsn())), None
    except ManagementUnavailable as exc:
        return None, str(exc)


async def broker_view(
    settings: Settings, shared: list[str],
) -> tuple[dict[str, Any], set[tuple[str, str]] | None, str | None]:
    """From the management API: every team queue (bound to the deferrals exchange) and the
    shared queues by name, the (queue, connection name) subscriptions, or why it could not."""
    from triggerflow.transport.rabbitmq import Topology

    async def ask(api: ManagementClient,
                  vhost: str) -> tuple[dict[str, Any], set[tuple[str, str]]]:
        found: dict[str, Any] = dict(await api.team_queues(
            vhost, Topology(settings.namespace).deferrals))
        found.update(await api.queues(vhost, set(shared)))
        return found, await api.subscriptions(vhost)

    answer, error = await ask_management(settings, ask)
    if answer is None:
        return {}, None, error
    return answer[0], answer[1], None


def subscribed_in_either(first: set[tuple[str, str]],
                         second: set[tuple[str, str]] | None) -> set[tuple[str, str]]:
    """The subscriptions of two management API looks (the second may have failed): a renewal
    takes a subscription off the list until the broker's next statistics sample, so a
    consumer either look lists is subscribed."""
    return first | (second or set())


async def amqp_queue_info(settings: Settings,
                          names: list[str]) -> tuple[dict[str, QueueInfo | None], str | None]:
    """Exact depth and consumer count of each queue by passive declare, or why not."""
    from triggerflow.wiring import rabbit_transport

    info: dict[str, QueueInfo | None] = {}
    try:
        broker = rabbit_transport(settings, name="triggerflow-status")
        await broker.connect()
        try:
            for name in names:
                info[name] = await broker.queue_info(name)
        finally:
            await broker.close()
    except Exception as exc:
        return info, Redactor(settings)(str(exc) or type(exc).__name__)
    return info, None


def shared_queue(name: str, info: QueueInfo | None, listed: dict[str, Any],
                 management_error: str | None) -> dict[str, Any]:
    return {"queue": name, "depth": info[0] if info else None,
            "broker_consumers": info[1] if info else None,
            **broker_columns(listed.get(name), management_error)}


async def writers_checked(settings: Settings, writers: list[dict[str, Any]],
                          events: dict[str, Any], grace: float) -> list[str]:
    """:func:`writer_problems`, with a second look at the broker's count of the events
    queue's consumers when it was 0 (a writer reconnecting is off it for a moment)."""
    if events_unserved(writers, events, grace):
        await asyncio.sleep(SECOND_LOOK)
        again, _ = await amqp_queue_info(settings, [events["queue"]])
        if (info := again.get(events["queue"])) is not None:
            events["broker_consumers"] = info[1]
    return writer_problems(writers, events, grace)


def events_unserved(writers: list[dict[str, Any]], events: dict[str, Any],
                    grace: float) -> list[dict[str, Any]]:
    """The live writers, registered over ``grace`` seconds ago, when the broker's exact count
    says none consumes the events queue (all killed: their leases outlive them where nobody
    who heard their presence queues go may end them, as under per-team consumer roles)."""
    if events["broker_consumers"] != 0:
        return []
    live = [w for w in writers if w["alive"]]
    return live if any(w["started_ago"] > grace for w in live) else []


def unserved_problems(rows: list[dict[str, Any]]) -> list[str]:
    """One line per queue, Airflow team and reason of the rows nothing serves, naming the
    first few."""
    grouped: dict[tuple[str, str | None, str], list[dict[str, Any]]] = {}
    for r in rows:
        grouped.setdefault((r["queue"], r.get("team"), r["reason"]), []).append(r)
    lines = []
    for (queue, team, reason), named in grouped.items():
        total = named[0]["total"]
        which = ", ".join(f"trigger {r['id']} ({r['kind']}, {r['classpath']})" for r in named)
        more = f" and {total - len(named)} more" if total > len(named) else ""
        where = queue if team is None else f"{queue} (Airflow team {team})"
        lines.append(f"queue {where}: {total} trigger row(s) nothing serves, "
                     f"{named[0]['why'] or reason}: {which}{more}")
    return lines


def writer_problems(writers: list[dict[str, Any]], events: dict[str, Any],
                    grace: float) -> list[str]:
    """No live writer: nothing applies events, every fired trigger's task stays deferred."""
    if unserved := events_unserved(writers, events, grace):
        held = ", ".join(f"writer {w['id']} on {w['host']} (pid {w['pid']})" for w in unserved)
        return [f"no writer consumes {events['queue']} on the broker, though {held} "
                "hold(s) a lease: killed, or cut off from the broker"]
    if any(w["alive"] for w in writers):
        return []
    waiting = f"{events['depth']} event message(s) waiting in {events['queue']}" \
        if events["depth"] is not None else f"events in {events['queue']} are not applied"
    if not writers:
        return [f"no live writer (none has registered): {waiting}"]
    last = writers[0]
    return [f"no live writer: {waiting}; the last, writer {last['id']} on {last['host']} "
            f"(pid {last['pid']}), renewed {last['renewed_ago']:.0f}s ago"]


def not_subscribed(consumers: list[dict[str, Any]], subscribed: set[tuple[str, str]] | None,
                   broker_info: dict[str, QueueInfo | None], grace: float) -> list[dict[str, Any]]:
    """Live consumers well below capacity, registered more than ``grace`` seconds ago, that
    the broker does not deliver one of their queues to (a consumer pauses its subscriptions
    only at capacity). A queue counts when the broker's exact consumer count (AMQP) is short
    of those consumers; the management API then names which, by the connection name each
    consumer gives the broker (``…@host:pid``); its lists lag by a statistics interval, so
    they only name, never decide."""
    from triggerflow.wiring import CONSUMER_CONNECTION

    expected = [c for c in consumers if c["alive"] and c["kind"] == "consumer"
                and c["running"] < 0.9 * c["capacity"] and c["started_ago"] > grace]
    by = {(queue, name.rpartition("@")[2]) for queue, name in subscribed or ()
          if name.startswith(CONSUMER_CONNECTION)}
    found: list[dict[str, Any]] = []
    for queue in sorted({q for c in expected for q in c["queues"]}):
        mine = [c for c in expected if queue in c["queues"]]
        info = broker_info.get(queue)
        if info is None or info[1] >= len(mine):
            continue
        missing = [c for c in mine if (queue, f"{c['host']}:{c['pid']}") not in by]
        if subscribed is None or not missing:
            found.append({"queue": queue, "consumer_id": None, "host": None, "pid": None,
                          "problem": (f"queue {queue}: {len(mine)} consumer(s) hold a lease "
                                      f"below capacity but {info[1]} are subscribed on the "
                                      "broker")})
            continue
        found += [{"queue": queue, "consumer_id": c["id"], "host": c["host"], "pid": c["pid"],
                   "problem": (f"consumer {c['id']} on {c['host']} (pid {c['pid']}) holds a "
                               f"lease on {queue} but is not subscribed on the broker")}
                  for c in missing]
    return found


def _access_problems(broker_error: str | None, management_error: str | None,
                     redact: Redactor) -> list[str]:
    problems = []
    if broker_error:
        problems.append(f"broker unreachable: {broker_error}")
    if management_error:
        problems.append(f"broker queue list unavailable: {redact(management_error)}")
    return problems


def broker_columns(queue: Any, error: str | None) -> dict[str, Any]:
    """The broker's own numbers for one queue (a management API ``BrokerQueue``); None when
    they could not be read."""
    return {
        "in_broker": None if error else queue is not None,
        "broker_ready": queue.ready if queue else None,
        "broker_unacked": queue.unacked if queue else None,
        "broker_listed_consumers": queue.consumers if queue else None,
    }


async def trigger_ids(settings: Settings, statement: str,
                      queues: list[str]) -> list[dict[str, Any]]:
    """[{id, queue}] of the triggers ``statement`` (the mode's ``StatusStatements.trigger_ids``
    of a state) lists on ``queues`` (all queues when empty)."""
    from triggerflow.wiring import admin_database

    db = await admin_database(settings)
    try:
        rows: list[Any] = await db.fetch(statement, queues or None)
    finally:
        await db.close()
    return [dict(r) for r in rows]
