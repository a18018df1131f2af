"""The tables ``triggerflow bench airflow`` prints: every run, then the issue's targets."""

from __future__ import annotations

from typing import Any

from bench.common import ms, num

AIRFLOW_TRIGGERER = "airflow triggerer"
TRIGGERFLOW = "triggerflow"


def speedup(theirs: dict[str, Any], ours: dict[str, Any]) -> tuple[str, float | None]:
    """How many times sooner triggerflow had every task scheduled, and the factor; a lower
    bound (">") when Airflow's triggerer did not finish within the limit."""
    if ours["all_applied_s"] is None:
        return "-", None
    mine = max(ours["all_applied_s"], 1e-3)
    if theirs["all_applied_s"] is None:
        return f"> {theirs['limit_s'] / mine:.0f}x", theirs["limit_s"] / mine
    return f"{theirs['all_applied_s'] / mine:.0f}x", theirs["all_applied_s"] / mine


def table_airflow(rows: list[dict[str, Any]], native: dict[int, dict[str, Any]]) -> Any:
    from rich.table import Table

    t = Table(title="N DateTimeSensorAsync firing at one instant in Airflow 3.3.2 (no scheduler): "
              "Airflow's own triggerer vs triggerflow on identical rows, and native mode's burst")
    for col in ("served by", "N", "runs", "scheduled", "p50", "p99", "all applied",
                "held at instant", "RSS empty", "per held trigger", "statements/event",
                "vs airflow", "vs native"):
        t.add_column(col, justify="right")
    baseline: dict[int, dict[str, Any]] = {}
    for r in rows:
        lat = r["latency"]
        ratio = vs_native = ""
        if r["served_by"] == AIRFLOW_TRIGGERER:
            baseline[r["n"]] = r
        elif r["n"] in baseline:
            ratio = speedup(baseline[r["n"]], r)[0]
        if r["served_by"] == TRIGGERFLOW and r["n"] in native and r["all_applied_s"]:
            vs_native = f"{r['all_applied_s'] / native[r['n']]['all_applied']:.2f}x"
        t.add_row(r["served_by"], num(r["n"]), str(r.get("repeats", 1)),
                  f"{num(r['applied'])} in {r['limit_s']:.0f} s", ms(lat["p50"]),
                  ms(lat["p99"]), ms(r["all_applied_s"]), num(r["held_at_instant"]),
                  f"{r['rss_empty'] / 2**20:.0f} MiB",
                  "-" if r["bytes_per_held_trigger"] is None
                  else f"{r['bytes_per_held_trigger'] / 1024:.1f} KB",
                  num(r["statements_per_event"], 3), ratio, vs_native)
    for n, r in native.items():
        t.add_row("native mode", num(n), str(len(r["runs"])), num(r["applied"]), ms(r["p50"]),
                  ms(r["p99"]), ms(r["all_applied"]), "", "", "", num(r["stmts_per_event"], 4),
                  "", "1.00x")
    t.caption = ("Latency = Airflow's scheduled_dttm - the instant (native mode: updated_at - "
                 "the instant); the instant is 2.5 s + N/2,500 s after the task instances exist "
                 "(the native burst's rule), plus 1.5x the deferral time of Airflow's code. "
                 "With several runs: the median run's percentiles, the median all-applied "
                 "time. RSS = the process tree holding "
                 "the triggers (Airflow's triggerer; triggerflow's consumer). vs airflow = "
                 "Airflow's all-applied time / triggerflow's; vs native = triggerflow's (Airflow "
                 "mode) / native mode's, same N, this run. Statements from pg_stat_statements.")
    return t


def table_targets(rows: list[dict[str, Any]], native: dict[int, dict[str, Any]],
                  waiting_n: int) -> Any:
    """Issue 9's targets for ``triggerflow bench airflow``, met or missed in this run."""
    from rich.table import Table

    ours = {r["n"]: r for r in rows if r["served_by"] == TRIGGERFLOW}
    theirs = {r["n"]: r for r in rows if r["served_by"] == AIRFLOW_TRIGGERER}
    t = Table(title="Issue 9's targets for Airflow mode, this run")
    for col in ("measure", "triggerflow", "target", "met"):
        t.add_column(col, justify="right")

    def verdict(ok: bool | None) -> str:
        return "-" if ok is None else ("met" if ok else "MISSED")

    n = max(ours) if ours else 0
    if n in ours and n in native:
        mine, base = ours[n]["all_applied_s"], native[n]["all_applied"]
        ratio = mine / base if mine and base else None
        for target in (2.0, 1.3):  # issue 9's, then issue 18's
            t.add_row(f"{n:,} at one instant, all scheduled, vs native mode's {n:,} burst",
                      f"{ms(mine)} vs {ms(base)} = {num(ratio, 2)}x", f"≤ {target:g}x",
                      verdict(None if ratio is None else ratio <= target))
        ours_us, native_us = ours[n].get("writer_us_per_event"), native[n].get("writer_us_per_event")
        if ours_us and native_us:
            t.add_row(f"writer's database time per event in the {n:,} burst, vs native mode's",
                      f"{ours_us:.1f} µs vs {native_us:.1f} µs = {ours_us / native_us:.1f}x", "", "")
    floor = (ours.get(waiting_n, {}).get("waiting") or {}).get("floor")
    if floor and floor["rows"] and n in native and native[n]["all_applied"]:
        wall = floor["wall_s"]
        t.add_row(f"Airflow's bare row change of {floor['rows']:,} deferred tasks alone "
                  f"({floor['lanes']} connections, rolled back), vs native mode's whole burst",
                  f"{ms(wall)} = {wall / native[n]['all_applied']:.2f}x "
                  f"({floor['us_per_row']:.1f} µs/row)", "", "")
    for size in sorted(ours):
        if size in theirs:
            text, factor = speedup(theirs[size], ours[size])
            t.add_row(f"{size:,} at one instant vs Airflow's own triggerer", text, "≥ 100x",
                      verdict(None if factor is None else factor >= 100))
    waited = ours.get(waiting_n, {}).get("waiting")
    if waited:
        per = waited["bytes_per_waiting_trigger"]
        t.add_row(f"RSS per waiting Airflow DateTimeTrigger ({waited['n']:,} held)",
                  f"{per:.0f} B", "≤ 1 KB", verdict(per <= 1024))
        for name, rate in waited["statements_per_s"].items():
            t.add_row(f"statements/s, {name} process, while {waited['n']:,} wait",
                      f"{rate:.2f}", "≤ 2 /s", verdict(rate <= 2))
    t.caption = ("RSS per waiting trigger = growth of the consumer's RSS from before the rows "
                 "to all held (settled), / N. Statements: pg_stat_statements calls of each "
                 "process's own database role over the window, after ANALYZE, nothing firing. "
                 "Database time: pg_stat_statements total_exec_time of the writer's role from "
                 "before the instant to all applied, / events. The bare row change: what every "
                 "server of Airflow's rows writes per event (state, trigger_id, next_kwargs, "
                 "scheduled_dttm, updated_at) as one UPDATE per connection of the waiting rows "
                 "(bench/airflow_floor.py).")
    return t


def table_runtime(rows: list[dict[str, Any]], requests: int) -> Any:
    """The trigger runtime's request latency as trigger code sees it (``airflow_runtime``)."""
    from rich.table import Table

    from bench.airflow_runtime import TRIGGERS

    t = Table(title="The trigger runtime's requests, timed by the trigger (tf_runtime_latency: "
              f"{TRIGGERS} LatencyTriggers at once, {requests} of each request each), "
              "on one Airflow stack")
    for col in ("served by", "request", "n", "p50", "p99", "max"):
        t.add_column(col, justify="left" if col in ("served by", "request") else "right")
    for r in rows:
        cells = [f"{r[k]:.2f} ms" for k in ("p50", "p99", "max")] if r["n"] else ["-"] * 3
        t.add_row(r["served_by"], r["request"], f"{r['n']:,}", *cells)
    return t
