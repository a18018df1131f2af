"""Airflow 3.3's teams (``[core] multi_team``): which trigger rows a consumer may touch.

Airflow 3.3.2's triggerer filters its rows by team in ``Trigger.ids_for_triggerer`` and
``Trigger.get_sorted_triggers``: with ``[core] multi_team`` on, ``airflow triggerer
--team-name T`` takes only rows whose ``trigger.team_name`` is T, and a triggerer without
``--team-name`` only rows with no team; with it off, no filter at all (rows written while it
was on are still served). ``consume --airflow --team T`` (``airflow_team``) applies the same
filter, in SQL, to everything it touches: claims, probation, take-overs and re-sends.

The statements carry markers written out once per store (``render``; the status's and the
heartbeat's at import, for the installed Airflow), because Airflow 3.2's ``trigger`` table
has no ``team_name`` column and a consumer without the filter must not pay for it:

* ``in_team(column, n)``: ``column`` (a trigger row's ``t.team_name``, a consumer row's
  ``d.team``) is the team in parameter ``$n`` (NULL: no team). Unfiltered it reads
  ``$n::text IS NULL`` (the store passes NULL then): always true, yet the parameter keeps its
  type.
* ``consumer_serves(consumer, row)``: consumer row ``consumer`` (``triggerflow.consumer``,
  which records the filter each consumer applies: ``team``, ``team_scoped``) may take trigger
  row ``row``. For the status, the gauges and the heartbeat, which run without Airflow's
  configuration.
* ``team_of(row)``: the row's team, ``''`` for none (Airflow's team names match
  ``[a-zA-Z0-9_-]{3,50}``), for hashed lookups.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass

import asyncpg

from triggerflow.errors import SettingRefused

_IN_TEAM = re.compile(r"@IN_TEAM\(([\w.]+),(\d+)\)@")
_SERVES = re.compile(r"@CONSUMER_SERVES\((\w+),(\w+)\)@")
_TEAM_OF = re.compile(r"@TEAM_OF\((\w+)\)@")


@dataclass(frozen=True)
class TeamScope:
    """The rows a consumer may touch under ``[core] multi_team``: those of ``team`` (None:
    those of no team), as ``airflow triggerer [--team-name team]`` takes them."""

    team: str | None


class TeamRefused(SettingRefused):
    """``--team`` cannot work on this deployment (what ``airflow triggerer --team-name``
    refuses too)."""


def in_team(column: str, param: int | str) -> str:
    """(``param`` "$T": the team parameter of an ownership template, numbered as it is
    rendered.)"""
    return f"@IN_TEAM({column},{param})@"


def consumer_serves(consumer: str, row: str) -> str:
    return f"@CONSUMER_SERVES({consumer},{row})@"


def team_of(row: str) -> str:
    return f"@TEAM_OF({row})@"


def render(sql: str, *, scoped: bool, has_teams: bool) -> str:
    """``sql`` with its markers written out: ``scoped``, the consumer filters by team;
    ``has_teams``, Airflow's ``trigger`` table has ``team_name`` (3.3)."""
    sql = _IN_TEAM.sub(lambda m: (f"{m[1]} IS NOT DISTINCT FROM ${m[2]}::text" if scoped
                                  else f"${m[2]}::text IS NULL"), sql)
    sql = _TEAM_OF.sub(lambda m: f"coalesce({m[1]}.team_name, '')" if has_teams else "''", sql)
    return _SERVES.sub(lambda m: (f"(NOT {m[1]}.team_scoped OR {m[1]}.team IS NOT DISTINCT FROM "
                                  f"{m[2]}.team_name)" if has_teams else "true"), sql)


def has_teams(release: str) -> bool:
    """Whether Airflow ``release``'s trigger rows carry a team (3.3 added ``team_name``)."""
    return release != "3.2"


def installed_has_teams() -> bool:
    """Whether the Airflow installed here has teams on trigger rows (without it: as 3.3)."""
    from importlib.metadata import PackageNotFoundError

    from triggerflow.airflow.schema import installed_release

    try:
        return has_teams(installed_release())
    except PackageNotFoundError:
        return True


def multi_team() -> bool:
    """Airflow's ``[core] multi_team``, read as Airflow reads it (``airflow.cfg`` or
    ``AIRFLOW__CORE__MULTI_TEAM``)."""
    from airflow.configuration import conf

    return conf.getboolean("core", "multi_team", fallback=False)


async def scope_for(conn: asyncpg.Connection, team: str | None,
                    release: str) -> TeamScope | None:
    """The filter a consumer of ``team`` (None: of no team) applies, as Airflow's triggerer
    does: None (no filter) when ``[core] multi_team`` is off or the release has no teams.
    ``team`` is refused as ``airflow triggerer --team-name`` refuses it (``TeamRefused``)."""
    on = has_teams(release) and await asyncio.to_thread(multi_team)  # imports Airflow
    if team is not None:
        await _check_team(conn, team, release, on)
    return TeamScope(team) if on else None


async def _check_team(conn: asyncpg.Connection, team: str, release: str, on: bool) -> None:
    """Airflow's ``triggerer`` command refuses ``--team-name`` with multi_team off, then a
    team not in its ``team`` table; 3.2 has no team on trigger rows."""
    if not has_teams(release):
        raise TeamRefused(f"--team {team}: Airflow {release} has no teams on trigger rows "
                          "(trigger.team_name is Airflow 3.3's)")
    if not on:
        raise TeamRefused(f"--team {team}: Airflow's [core] multi_team is off "
                          "(AIRFLOW__CORE__MULTI_TEAM); `airflow triggerer --team-name` refuses "
                          "it the same way")
    if await conn.fetchval("SELECT name FROM team WHERE name = $1", team) is None:
        raise TeamRefused(f"--team {team}: no such team in Airflow's team table "
                          "(`airflow teams list`)")
