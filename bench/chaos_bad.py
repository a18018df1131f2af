"""Bad input for ``triggerflow bench chaos``: what a hostile or broken client sends, at the
nemesis's moments, each piece named by a token of its own so the checker can find what
became of it (``docs/security.md`` says how each is refused).

``bad_message`` publishes, with the bench's own (administrator) connection, onto the
attacking team's queue and the events exchange: malformed and oversized wake-ups and event
batches, wake-ups and events naming an unknown trigger, a wake-up naming the other team's
live triggers, an event for the other team's trigger under the attacker's routing key
(forged) and one naming the attacker's queue for it (fenced by the row's queue).
``bad_trigger`` defers, through the SDK, triggers that raise, hang, block the loop, yield
garbage, or carry kwargs their class cannot be built from (``bench.chaos_trigger.ChaosBad``).
"""

from __future__ import annotations

import json
import random
import time
from typing import TYPE_CHECKING, Any

from bench.chaos_plan import TEAMS, Fault

if TYPE_CHECKING:
    from bench.chaos_faults import EventTap, Fleet

BAD_HEADER = "x-chaos-bad"  # on each bad message: the replay fault leaves it alone
HANG_TIMEOUT = 6.0  # seconds: the deferral timeout of a hanging trigger
UNKNOWN_ID = 9_000_000_000  # no trigger has an id this high in a run
# How each bad message must end: a dead letter whose reason holds this text (and whose body
# holds the token), "ignored" (no dead letter, no task changed), or "broker" (refused by
# the broker's max_message_size before anyone reads it; a writer that gets it dead-letters
# it unparsed).
EXPECT: dict[str, str] = {
    "wakeup_malformed": "undecodable wake-up",
    "wakeup_oversized": "oversized wake-up",
    "wakeup_unknown": "ignored",  # CLAIM finds no such row
    "wakeup_foreign": "ignored",  # CLAIM takes only rows of the consumer's own queues
    "event_malformed": "undecodable event batch",
    "event_oversized": "broker",
    "event_unknown": "ignored",  # APPLY_EVENTS matches no row
    "event_forged": "forged: routing key",  # its queue is not its routing key's
    "event_fenced": "ignored",  # APPLY_EVENTS fences by the row's own queue
}
# How each bad trigger's task must end (``next_kwargs.error`` of its ``__fail__``).
FAILS: dict[str, str] = {
    "kwargs": "Trigger could not be loaded",
    "raise": "Trigger failure",
    "hang": "Trigger timeout",
    "block": "Trigger quarantined",
    "garbage": "Trigger failure",
}


def token(fault: Fault, variant: str) -> str:
    return f"bad-{fault.at:.3f}-{variant}"


async def bad_messages(fault: Fault, fleet: Fleet, tap: EventTap
                       ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    import aio_pika

    b = fleet.b
    assert b.broker is not None and tap.conn is not None
    topology = b.broker.topology
    own = fleet.queues[fault.team]
    other = fleet.queues[next(t for t in TEAMS if t != fault.team)]
    victims = await _victims(fleet, other, random.Random(token(fault, "victims")))
    inputs: list[dict[str, Any]] = []
    for variant in fault.variants:
        tok = token(fault, variant)
        rec: dict[str, Any] = {"variant": variant, "token": tok, "expect": EXPECT[variant],
                               "queue": own, "sent": False}
        inputs.append(rec)
        body = _body(variant, tok, own, other, victims, rec)
        if body is None:
            continue
        exchange = topology.deferrals_of(own) if variant.startswith("wakeup_") \
            else topology.events
        rec["bytes"] = len(body)
        try:
            ch = await tap.conn.channel()  # one each: the broker closes it on a refusal
            try:
                ex = await ch.get_exchange(exchange)
                await ex.publish(aio_pika.Message(body, delivery_mode=2,
                                                  headers={BAD_HEADER: tok}), own)
                rec["sent"] = True
            finally:
                if not ch.is_closed:
                    await ch.close()
        except Exception as exc:
            rec["refused"] = repr(exc)[:300]
    return _witness(fault, inputs), inputs


def _witness(fault: Fault, inputs: list[dict[str, Any]]) -> dict[str, Any]:
    """The short witness (each input is recorded apart, in the fault's ``inputs``)."""
    return {"team": fault.team, "sent": [i["variant"] for i in inputs if i["sent"]],
            "refused_at_publish": [i["variant"] for i in inputs if "refused" in i],
            "not_sent": [i["variant"] for i in inputs
                         if not i["sent"] and "refused" not in i]}


def _body(variant: str, tok: str, own: str, other: str, victims: list[tuple[int, int]],
          rec: dict[str, Any]) -> bytes | None:
    """The message of ``variant``, or None (recorded as skipped) when it has no target."""
    from triggerflow.wire import Event, encode_events, encode_wakeup

    payload = json.dumps({"d": tok})
    if variant.endswith("_malformed"):
        return tok.encode() + b" \x00\xff not JSON at all"
    if variant == "wakeup_oversized":  # over the 256 KiB a wake-up may take
        return f'{{"chaos": "{tok}", "v": 2, "ids": ['.encode() + b"1," * (150 << 10) + b"1]}"
    if variant == "event_oversized":  # over the broker's max_message_size (4 MiB)
        return f'{{"chaos": "{tok}", "junk": "'.encode() + b"x" * (4 << 20) + b'"}'
    if variant == "wakeup_unknown":
        return encode_wakeup([UNKNOWN_ID])
    if variant == "event_unknown":
        return encode_events([Event(UNKNOWN_ID, 1, own, "resume", payload, time.time())])
    if not victims:
        rec["skipped"] = "no live trigger of the other team"
        return None
    if variant == "wakeup_foreign":
        rec["victims"] = [v for v, _ in victims]
        return encode_wakeup(rec["victims"])
    # forged / fenced: the other team's live trigger at its current attempt, so only the
    # queue check stands between it and the victim's task
    tid, attempt = victims[0]
    rec["victims"] = [tid]
    queue = other if variant == "event_forged" else own
    return encode_events([Event(tid, attempt, queue, "resume", payload, time.time())])


async def _victims(fleet: Fleet, queue: str, rng: random.Random) -> list[tuple[int, int]]:
    """A few live, innocent triggers of ``queue`` (id, attempt)."""
    try:
        rows = await fleet.b.db().fetch(
            "SELECT id, attempt FROM trigger WHERE queue = $1 AND quarantined_at IS NULL "
            "AND classpath <> 'bench.chaos_trigger.ChaosBad' ORDER BY id DESC LIMIT 30", queue)
    except Exception:  # PostgreSQL restarting under another fault
        return []
    picked = rng.sample(list(rows), min(3, len(rows)))
    return [(int(r["id"]), int(r["attempt"])) for r in picked]


async def bad_triggers(fault: Fault, fleet: Fleet
                       ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    import asyncio

    from bench.chaos_trigger import ChaosBad
    from triggerflow.model import TaskKey
    from triggerflow.sdk import Deferral

    b = fleet.b
    assert b.client is not None
    queue = fleet.queues[fault.team]
    inputs: list[dict[str, Any]] = []
    for variant in fault.variants:
        tok = token(fault, variant)
        rec: dict[str, Any] = {"variant": variant, "token": tok, "expect": FAILS[variant],
                               "queue": queue, "sent": False, "trigger_id": None, "at": time.time()}
        try:
            ids = await asyncio.wait_for(b.client.defer_many([Deferral(
                TaskKey("chaos-bad", tok, "bad"), ChaosBad(variant, tok), queue,
                kwargs={"d": tok}, timeout=HANG_TIMEOUT if variant == "hang" else None)]), 30)
            rec.update(sent=True, trigger_id=ids[0])
        except Exception as exc:  # a store restart outlasting the SDK's retries
            rec["error"] = repr(exc)[:300]
        inputs.append(rec)
    return _witness(fault, inputs), inputs
