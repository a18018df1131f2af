"""Scenario lateness: timers coming due while their consumer dies or freezes (issue 22).

Each run: one consumer (the victim) holds ``lateness`` timers due across 2 s, a peer of the
same queue holds nothing, and as the first timer comes due the victim gets

- SIGKILL: its sockets close, RabbitMQ deletes its presence queue and the peer takes it over
  at once. Measured: how long after its due time the latest timer fired (the task's
  ``event_fired_at`` minus the moment its ``DateTimeTrigger`` yielded);
- SIGSTOP: frozen with its sockets open, which the broker cannot see; only the lease
  (``lease_ttl``) frees its timers. After every task has resumed, SIGCONT: the victim wakes
  with overdue timers and stale leases. A spy queue bound to the events exchange sees every
  event it publishes; the check is that no task took its event from the frozen attempt (its
  ``event_fired_at`` is the peer's event's, never the victim's).

Shipped defaults throughout (the bench's processes get no timing overrides).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import statistics
import time
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from bench.common import BenchError, ms, num
from bench.harness import Bench, _run_id

if TYPE_CHECKING:
    from rich.table import Table

SPREAD = 2.0  # seconds over which the timers come due
SIGNALS = (signal.SIGKILL, signal.SIGSTOP)


async def _spy(b: Bench) -> tuple[Any, Any, list[Any]]:
    """A server-named queue bound to the events exchange for the bench's team queue."""
    from triggerflow.wire import decode_events

    assert b.broker is not None and b.broker.connection is not None
    ch = await b.broker.connection.channel()
    q = await ch.declare_queue("", exclusive=True, auto_delete=True)
    await q.bind(b.broker.topology.events, routing_key=b.queue)
    seen: list[Any] = []

    async def on_message(message: Any) -> None:
        with contextlib.suppress(Exception):  # anything not an event batch is not ours
            seen.extend(decode_events(message.body))
        await message.ack()

    await q.consume(on_message)
    return ch, q, seen


async def _lateness_once(b: Bench, sig: signal.Signals) -> dict[str, Any]:
    n = b.sizes.lateness
    await b.reset()
    await b.start_writer()
    victim = await b.start_consumer()
    vid = await b.consumer_id(victim)
    run = _run_id(f"late{sig.name.lower()}")
    lead = float(os.environ.get("TRIGGERFLOW_BENCH_LATENESS_LEAD", b.sizes.lateness_lead))
    start = datetime.now(UTC) + timedelta(seconds=lead)
    await b.defer(n, run, lambda i: start + timedelta(seconds=SPREAD * i / n))
    ok, _ = await b.wait_for(
        "SELECT count(*) FROM trigger WHERE owner_id = $1",
        n,
        max(1.0, start.timestamp() - time.time() - 3),
        vid,
    )
    if not ok:
        raise BenchError(
            f"the victim did not claim all {n:,} timers before they came due; "
            "raise TRIGGERFLOW_BENCH_LATENESS_LEAD on a slow machine"
        )
    peer = await b.start_consumer()
    await b.consumer_id(peer)
    tasks = {
        r["trigger_id"]: r["id"]
        for r in await b.db().fetch("SELECT id, trigger_id FROM task_instance WHERE run_id = $1", run)
    }
    ch, _, seen = await _spy(b)
    busy = await b.quiet(wait=0.0)
    wait = start.timestamp() - time.time()
    if wait <= 0:
        raise BenchError("the peer came up after the timers were due: nothing to measure")
    await asyncio.sleep(wait)
    held = await b.owned(vid)
    victim.popen.send_signal(sig)
    done, _ = await b.wait_for(
        "SELECT count(*) FROM task_instance WHERE run_id = $1 AND state = 'scheduled'",
        n,
        b.sizes.failover_timeout,
        run,
        interval=0.1,
    )
    row = await b.db().fetchrow(
        "SELECT max(extract(epoch FROM event_fired_at - (next_kwargs->>'event')::timestamptz))"
        "::float8 AS worst, count(*) FILTER (WHERE next_method = 'execute_complete') AS resumed "
        "FROM task_instance WHERE run_id = $1",
        run,
    )
    assert row is not None
    out: dict[str, Any] = {
        "signal": sig.name,
        "held": held,
        "n": n,
        "complete": done,
        "resumed": row["resumed"],
        "worst_late": float(row["worst"] or 0),
        "machine_busy_before": busy,
    }
    if sig == signal.SIGSTOP:
        out.update(await _after_thaw(b, victim, run, tasks, seen))
    await ch.close()
    await b.stop(victim, signal.SIGKILL)
    return out


async def _after_thaw(
    b: Bench, victim: Any, run: str, tasks: dict[int, int], seen: list[Any]
) -> dict[str, Any]:
    """SIGCONT the frozen victim, give it time to publish what it still holds, and check
    that every task took the event of the attempt the peer ran, never the victim's."""
    victim.popen.send_signal(signal.SIGCONT)
    await asyncio.sleep(b.sizes.lateness_thaw)
    latest: dict[int, int] = {}  # per trigger, the attempt of the last claim seen firing
    for e in seen:
        latest[e.trigger_id] = max(e.attempt, latest.get(e.trigger_id, 0))
    stale = [e for e in seen if e.attempt < latest[e.trigger_id]]
    applied = {
        r["id"]: r["fired"]
        for r in await b.db().fetch(
            "SELECT id, extract(epoch FROM event_fired_at)::float8 AS fired FROM task_instance "
            "WHERE run_id = $1",
            run,
        )
    }
    stale_applied = sum(
        1 for e in stale if abs(applied.get(tasks.get(e.trigger_id, -1), -1.0) - e.fired_at) < 1e-6
    )
    return {"stale_published": len(stale), "stale_applied": stale_applied}


async def scenario_lateness(b: Bench) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for sig in SIGNALS:
        reps = b.sizes.lateness_repeats if sig == signal.SIGKILL else b.sizes.lateness_stop_repeats
        runs = []
        for i in range(reps):
            r = await b.measured(f"lateness {sig.name}", functools.partial(_lateness_once, b, sig))
            runs.append(r)
            extra = (
                (
                    f", {r['stale_published']} events of the frozen attempt published after "
                    f"SIGCONT, {r['stale_applied']} applied"
                )
                if sig == signal.SIGSTOP
                else ""
            )
            b.log(
                f"lateness: {sig.name} run {i + 1}/{reps}: victim held {r['held']:,}; latest "
                f"timer fired {r['worst_late']:.2f}s after its moment{extra}"
                + ("" if r["complete"] else " [red]INCOMPLETE")
            )
        late = [r["worst_late"] for r in runs]
        out[sig.name] = {"runs": runs, "median": statistics.median(late), "max": max(late), "min": min(late)}
    return out


def lateness_ok(res: dict[str, Any]) -> bool:
    """Every task resumed by its own timer, and nothing of a frozen attempt applied."""
    runs = [r for sig in SIGNALS for r in res[sig.name]["runs"]]
    return all(r["complete"] and r["resumed"] == r["n"] for r in runs) and not any(
        r.get("stale_applied") for r in runs
    )


def table_lateness(res: dict[str, Any], n: int) -> Table:
    from rich.table import Table

    t = Table(
        title=f"Timers coming due while their consumer dies: {n:,} due across "
        f"{SPREAD:.0f} s, the victim signalled as the first comes due"
    )
    for col in (
        "signal",
        "runs",
        "victim held (median)",
        "latest fired after its moment: min / median / max",
        "frozen attempt: published / applied",
        "all resumed",
    ):
        t.add_column(col, justify="right")
    for name in (sig.name for sig in SIGNALS):
        r = res[name]
        runs = r["runs"]
        stale = (
            (f"{sum(x['stale_published'] for x in runs):,} / {sum(x['stale_applied'] for x in runs):,}")
            if name == "SIGSTOP"
            else "-"
        )
        t.add_row(
            name,
            str(len(runs)),
            num(statistics.median(x["held"] for x in runs)),
            f"{ms(r['min'])} / {ms(r['median'])} / {ms(r['max'])}",
            stale,
            "yes" if all(x["complete"] and x["resumed"] == x["n"] for x in runs) else "[red]NO",
        )
    t.caption = (
        "Shipped defaults (lease_ttl 3 s). Lateness = task_instance.event_fired_at "
        "minus the timer's moment, the latest task of the run. SIGKILL: taken over "
        "when RabbitMQ deletes the victim's presence queue. SIGSTOP: sockets stay "
        "open, so only the lease frees the timers; after SIGCONT a spy queue on the "
        "events exchange counts what the victim published for attempts already "
        "taken over, and 'applied' counts tasks whose event was one of those (must "
        "be 0)."
    )
    return t
