"""The summary against the targets, the burst plot, and the tables of each scenario."""


from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.common import TARGETS, Sizes, ms, num
from bench.dbload import scenario_dbload, tables_dbload
from bench.defer import scenario_defer, table_defer
from bench.failover import scenario_failover, table_failover
from bench.fire import scenario_fire, table_fire
from bench.harness import Bench
from bench.lateness import lateness_ok, scenario_lateness, table_lateness
from bench.million import million_checks, scenario_million, table_million
from bench.nodeloss import scenario_nodeloss, table_nodeloss
from bench.periodic import scenario_periodic, tables_periodic
from bench.promote import scenario_promote, table_promote
from bench.reference import scenario_reference, table_reference
from bench.scenarios import (
    scenario_burst,
    scenario_capacity,
    scenario_held,
    scenario_steady,
    table_burst,
    table_capacity,
    table_steady,
)
from bench.wide import scenario_wide, table_wide
from bench.zone import scenario_zone, table_zone

if TYPE_CHECKING:
    from rich.table import Table

def _verdict(ok: bool | None) -> str:
    if ok is None:
        return "-"
    return "[green]met" if ok else "[bold red]missed"


Row = tuple[str, str, str, str, bool | None]


def _row(key: str, what: str, value: str, ok: bool | None) -> Row:
    target, airflow = TARGETS[key]
    return (what, value, target, airflow, ok)


def _summary_capacity(cap: dict[str, Any]) -> list[Row]:
    timers = [r for r in cap["rows"] if r["kind"] == "timer"]
    big = max(timers, key=lambda r: r["n"])
    worst = min(timers, key=lambda r: r["claim_rate"])
    rows = [
        _row("capacity_n", "waiting timers held by one consumer", num(big["n"]),
             big["n"] >= 100_000),
        _row("kb_timer", f"memory per waiting timer (N={big['n']:,})",
             f"{big['bytes_per_trigger'] / 1024:.2f} KB", big["bytes_per_trigger"] <= 1024),
    ]
    rows += [_row("kb_coroutine", f"memory per coroutine trigger (N={r['n']:,})",
                  f"{r['bytes_per_trigger'] / 1024:.2f} KB", r["bytes_per_trigger"] <= 3072)
             for r in cap["rows"] if r["kind"] == "coroutine"]
    rows += [
        _row("cpu_waiting", f"CPU while {big['n']:,} wait", f"{big['cpu_pct']:.2f} %",
             big["cpu_pct"] <= 2.0),
        _row("claim_rate", f"claim+start rate (slowest, N={worst['n']:,})",
             f"{worst['claim_rate']:,.0f} /s", worst["claim_rate"] >= 10_000),
    ]
    return rows


def _summary_latency(results: dict[str, Any]) -> list[Row]:
    rows = []
    for n, r in results.get("burst", {}).get("sizes", {}).items():
        key = "burst_1k" if int(n) <= 1_000 else "burst_10k"
        limit = 0.1 if key == "burst_1k" else 0.5
        rows.append(_row(key, f"burst of {int(n):,}: p50 / p99 / all applied",
                         f"{ms(r['p50'])} / {ms(r['p99'])} / {ms(r['all_applied'])}",
                         r["all_applied"] <= limit))
    held = results.get("held", {})
    for stats, res in (("no statistics", held), ("fresh statistics", held.get("fresh", {}))):
        for n, r in res.get("sizes", {}).items():
            key, limit = ("held_1k", 1.5) if int(n) <= 1_000 else ("held_10k", 1.3)
            rows.append(_row(key, f"burst of {int(n):,} while {held['held']:,} wait, {stats}: "
                             "all applied / reference", f"{ms(r['all_applied'])} / "
                             f"{ms(r['reference_all_applied'])} = {r['ratio']:.2f}x",
                             r["ratio"] <= limit))
    wide: dict[str, Any] = results.get("wide") or {}
    for n, r in wide.get("sizes", {}).items():
        rows.append(_row("wide_100k", f"burst of {int(n):,} over {wide['consumers']} consumers "
                         f"and {wide['writers']} writers: all applied / reference",
                         f"{ms(r['all_applied'])} / {ms(r['reference_all_applied'])} = "
                         f"{r['ratio']:.2f}x", r["ratio"] <= 1.5))
    steady = results.get("steady")
    if steady:
        rows.append(_row("steady", f"steady {steady['rate']:,}/s: p50 / p99",
                         f"{ms(steady['p50'])} / {ms(steady['p99'])}",
                         steady["p50"] <= 0.010 and steady["p99"] <= 0.050))
    return rows


def _summary_db(results: dict[str, Any]) -> list[Row]:
    rows = []
    db = results.get("dbload")
    if db:
        per = db["idle"]["per_s"]
        rows += [_row("stmts_idle", f"statements/s of the {role} while "
                      f"{db['idle']['waiting']:,} wait", f"{per[role]:.2f}", per[role] <= 2.0)
                 for role in ("consumer", "writer") if per.get(role)]
        rows.append(_row("stmts_burst", f"statements per event, burst of "
                         f"{db['burst']['applied']:,}", f"{db['burst']['stmts_per_event']:.4f}",
                         db["burst"]["stmts_per_event"] <= 0.02))
    steady = db["steady"] if db else results.get("steady")
    if steady:
        rows.append(_row("stmts_steady", f"statements per event, steady {steady['rate']:,}/s",
                         f"{steady['stmts_per_event']:.3f}", steady["stmts_per_event"] <= 0.5))
    return rows


def _summary_periodic(results: dict[str, Any]) -> list[Row]:
    p = results.get("periodic")
    if not p:
        return []
    held = [r["db_ms_per_s"] for r in p["held"]]
    idle = [r["stmts_per_s_per_process"] for r in p["idle"]]
    return [
        _row("periodic_flat", "periodic DB time/s at " + ", ".join(
            num(r["held"]) for r in p["held"]) + " held",
            " / ".join(f"{x:.3f} ms" for x in held), max(held) <= 2 * min(held)),
        _row("idle_procs", "statements/s per idle consumer at " + ", ".join(
            str(r["processes"]) for r in p["idle"]) + " processes",
            " / ".join(f"{x:.2f}" for x in idle),
            max(idle) <= 1.5 and max(idle) <= 1.2 * min(idle)),
    ]


def _summary_ops(results: dict[str, Any]) -> list[Row]:
    rows = []
    d = results.get("defer")
    if d:
        rows.append(_row("defer_p50", "single defer(): p50 / p99",
                         f"{ms(d['single']['lat_p50'])} / {ms(d['single']['lat_p99'])}",
                         d["single"]["lat_p50"] <= 0.005))
        rows.append(_row("defer_batched", "batched deferrals/s, one process",
                         num(d["batched"]["per_s"]), d["batched"]["per_s"] >= 5_000))
    f = results.get("failover")
    if f:
        rows.append(_row("failover_kill", "failover after SIGKILL (median)",
                         ms(f["SIGKILL"]["seconds"]), f["SIGKILL"]["seconds"] <= 5))
        rows.append(_row("failover_term", "handover after SIGTERM (median)",
                         ms(f["SIGTERM"]["seconds"]), f["SIGTERM"]["seconds"] <= 1))
    late = results.get("lateness")
    if late:
        k, s = late["SIGKILL"], late["SIGSTOP"]
        rows.append(_row("lateness_kill", "SIGKILL as timers come due: latest fired after its "
                         "moment (median / max)", f"{ms(k['median'])} / {ms(k['max'])}",
                         k["median"] <= 0.5 and k["max"] <= 1.0 and lateness_ok(late)))
        rows.append(_row("lateness_stop", "SIGSTOP as timers come due: latest fired after "
                         "(median); frozen-attempt events applied after SIGCONT",
                         f"{ms(s['median'])}; {sum(r['stale_applied'] for r in s['runs'])}",
                         lateness_ok(late)))
    return rows


def _summary_million(results: dict[str, Any]) -> list[Row]:
    m = results.get("million")
    if not m:
        return []
    return [_row(key, what, value, ok if m["n"] >= 1_000_000 else None)
            for key, what, value, _, ok in million_checks(m)]


def summary_rows(results: dict[str, Any]) -> list[Row]:
    rows = _summary_capacity(results["capacity"]) if "capacity" in results else []
    return (rows + _summary_latency(results) + _summary_db(results) + _summary_periodic(results)
            + _summary_ops(results) + _summary_million(results))


def table_summary(results: dict[str, Any]) -> Table:
    from rich.table import Table

    quick = bool(results.get("quick"))
    t = Table(title="Summary: triggerflow vs targets (issue 4) and Airflow 3.3.2's triggerer "
              "(DESIGN.md)")
    for col in ("metric", "triggerflow", "target", "Airflow triggerer", ""):
        t.add_column(col)
    for what, value, target, airflow, ok in summary_rows(results):
        t.add_row(what, value, target, airflow, "-" if quick else _verdict(ok))
    if quick:
        t.caption = "--quick: sizes far too small to judge the targets; run without it."
    return t


def plot_bursts(burst: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    sizes = list(burst["sizes"].items())
    fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4), squeeze=False)
    for ax, (n, r) in zip(axes[0], sizes, strict=True):
        for i, run in enumerate(r["runs"]):
            lat = sorted(x * 1000 for x in run["latencies"])
            ys = [(k + 1) / len(lat) for k in range(len(lat))]
            ax.plot(lat, ys, label=f"run {i + 1}: all in {run['all_applied'] * 1000:.0f} ms")
        limit = 100 if int(n) <= 1000 else 500
        ax.axvline(limit, color="red", linestyle="--", label=f"target: all ≤ {limit} ms")
        ax.set_title(f"{int(n):,} DateTimeTriggers at one instant")
        ax.set_xlabel("fire instant → task_instance updated (ms, DB clock)")
        ax.set_ylabel("fraction of tasks applied")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------- entry point

RUNNERS: dict[str, Callable[[Bench], Awaitable[dict[str, Any]]]] = {
    "reference": scenario_reference, "held": scenario_held, "fire": scenario_fire,
    "wide": scenario_wide,
    "periodic": scenario_periodic,
    "capacity": scenario_capacity, "burst": scenario_burst, "steady": scenario_steady,
    "dbload": scenario_dbload, "defer": scenario_defer, "failover": scenario_failover,
    "lateness": scenario_lateness,
    "million": scenario_million, "promote": scenario_promote,
    "zone": scenario_zone, "nodeloss": scenario_nodeloss,
}


# the scenarios whose table needs only their results
SIMPLE_TABLES: dict[str, Callable[[dict[str, Any]], Table]] = {
    "capacity": table_capacity, "reference": table_reference, "steady": table_steady,
    "million": table_million, "zone": table_zone, "nodeloss": table_nodeloss,
    "fire": table_fire,
}


def _tables(name: str, res: dict[str, Any], sizes: Sizes) -> list[Table]:
    if name in SIMPLE_TABLES:
        return [SIMPLE_TABLES[name](res)]
    if name == "burst":
        return [table_burst(res, sizes.repeats)]
    if name == "held":
        return [table_burst(res, sizes.repeats, res["held"], "no statistics since the deferrals"),
                table_burst(res["fresh"], sizes.repeats, res["held"], "ANALYZE before each instant")]
    if name == "wide":
        return [table_wide(res, sizes.repeats)]
    if name == "periodic":
        return tables_periodic(res)
    if name == "dbload":
        return tables_dbload(res)
    if name == "defer":
        return [table_defer(res, sizes.defer_batch)]
    if name == "lateness":
        return [table_lateness(res, sizes.lateness)]
    if name == "promote":
        return [table_promote(res, sizes.promote)]
    return [table_failover(res, sizes.failover)]
