"""Scenario promote: the database primary is SIGKILLed mid-burst and its synchronous standby
promoted; how long until events apply again, and whether every task was applied once.

The two PostgreSQL clusters are the scenario's own (``testbed/replication.py``, which
``tests/test_promotion.py`` runs with short leases and checks); the processes get a URL
listing both with ``target_session_attrs=read-write`` and otherwise shipped defaults. The
standby is promoted ``PROMOTE_AFTER`` seconds after the kill, standing for an HA manager's
detection time (Patroni's loop, RDS's): that part is the manager's, not triggerflow's, so it
is printed apart from what follows it.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.common import median_of, ms, num

if TYPE_CHECKING:
    from rich.table import Table

    from bench.harness import Bench

PROMOTE_AFTER = 1.0


async def _promote_once(b: Bench) -> dict[str, Any]:
    from testbed.replication import promote_mid_burst

    logdir = Path(tempfile.mkdtemp(prefix="promote-", dir=b.out))
    run = await promote_mid_burst(
        b.settings.amqp_dsn(),
        logdir,
        burst=b.sizes.promote,
        spread=b.sizes.promote_spread,
        failover_delay=PROMOTE_AFTER,
        timeout=b.sizes.failover_timeout,
    )
    promoted = run.promoted_at - run.killed_at
    return {
        "tasks": run.tasks,
        "applied_before_kill": run.applied_before_kill,
        "promoted_after_s": promoted,
        "resumed_after_kill_s": run.first_apply_after,
        "resumed_after_promotion_s": run.first_apply_after - promoted,
        "worst_late_s": run.worst_late,
        "applied": len(run.applies),
        "applied_twice": run.applied_twice,
        "stale_events": run.stale_events,
        "complete": run.complete,
        "alive": run.alive,
    }


async def scenario_promote(b: Bench) -> dict[str, Any]:
    runs = []
    for i in range(b.sizes.promote_repeats):
        r = await b.measured("promote", lambda: _promote_once(b))
        runs.append(r)
        b.log(
            f"promote run {i + 1}: applying again {r['resumed_after_kill_s']:.2f}s after the "
            f"kill ({r['resumed_after_promotion_s']:.2f}s after the promotion); "
            f"{r['applied']:,}/{r['tasks']:,} applied, {r['applied_twice']} twice"
        )
    return {
        "runs": runs,
        "resumed_after_kill_s": median_of(runs, "resumed_after_kill_s"),
        "resumed_after_promotion_s": median_of(runs, "resumed_after_promotion_s"),
        "all_once": all(r["complete"] and r["applied_twice"] == 0 for r in runs),
    }


def table_promote(res: dict[str, Any], n: int) -> Table:
    from rich.table import Table

    runs = res["runs"]
    t = Table(
        title=f"Database primary SIGKILLed mid-burst ({n:,} timers over the burst), "
        f"standby promoted {PROMOTE_AFTER:.0f} s later"
    )
    for col in ("", "median", "max"):
        t.add_column(col, justify="right")
    for key, label in (
        ("promoted_after_s", "kill → standby promoted (the HA manager's)"),
        ("resumed_after_promotion_s", "promoted → first event applied"),
        ("resumed_after_kill_s", "kill → first event applied"),
        ("worst_late_s", "latest task: applied - due"),
    ):
        values = [r[key] for r in runs]
        t.add_row(label, ms(statistics.median(values)), ms(max(values)))
    t.add_row(
        "tasks applied / applied twice",
        f"{num(min(r['applied'] for r in runs))} / {max(r['applied_twice'] for r in runs)}",
        f"of {num(runs[0]['tasks'])}",
    )
    t.caption = (
        f"{len(runs)} runs. Synchronous streaming replication; processes on "
        "postgresql://…h1,h2/db?target_session_attrs=read-write with shipped defaults. "
        "First applied = the first apply_log row written on the promoted standby. "
        + (
            "Every task applied exactly once in every run."
            if res["all_once"]
            else "[red]Some run lost or doubled a task."
        )
    )
    return t
