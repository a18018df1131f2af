"""Scenario wide: one big burst shared by several consumers and several writers.

``consumers`` consumers on the one team queue split the claims of N timers due at one instant
and ``writers`` writers share the events queue; the all-applied time is printed as a multiple
of the bare reference at the same N, run right before each burst (issue 11: 100,000 over 2 + 2
within 1.5x).
"""


from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bench.harness import Bench
from bench.scenarios import _bursts, table_burst

if TYPE_CHECKING:
    from rich.table import Table

# Deferring 100,000 through the SDK took 20 s on a busy day and over 70 s with the load
# average at 25 (the instant then passed mid-deferral): the instant is set far enough ahead
# that all are deferred and claimed before it.
DEFER_RATE = 1000.0


async def scenario_wide(b: Bench) -> dict[str, Any]:
    await b.reset()
    for _ in range(b.sizes.wide_writers):
        await b.start_writer()
    for _ in range(b.sizes.wide_consumers):
        await b.start_consumer()
    assert b.broker is not None
    seen = {"team": await b.subscribed(b.queue, b.sizes.wide_consumers),
            "events": await b.subscribed(b.broker.topology.events_queue, b.sizes.wide_writers)}
    # keep_held: DELETE the applied tasks between runs; a TRUNCATE (an exclusive lock) can
    # deadlock with a statement a consumer still has in flight after 100,000 events
    sizes = await _bursts(b, (b.sizes.wide,), "wide", keep_held=True, defer_rate=DEFER_RATE)
    return {"consumers": b.sizes.wide_consumers, "writers": b.sizes.wide_writers,
            "broker_consumers": seen, "sizes": sizes}


def table_wide(res: dict[str, Any], repeats: int) -> Table:
    t = table_burst(res, repeats)
    t.title = (f"Wide burst: N DateTimeTriggers at one instant over {res['consumers']} "
               f"consumers and {res['writers']} writers (median of {repeats} runs)")
    t.caption = str(t.caption).replace(
        "one consumer + one writer",
        f"{res['consumers']} consumers on one queue + {res['writers']} writers on the events queue")
    return t
