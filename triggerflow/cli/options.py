"""Settings <-> CLI options <-> environment, derived once from the Settings model.

``settings_options`` turns fields into click options (flag and env var named by
``Settings.flag_name``/``Settings.env_name``); ``build_settings`` turns what click parsed
back into one ``Settings``, validating only the fields the command declares. Click reads the
variables but converts nothing: pydantic does, so a bad value is reported in one line naming
the flag or variable it came from.
"""

from __future__ import annotations

import logging
import typing
from collections.abc import Callable, Coroutine, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import click
from click.core import ParameterSource

from triggerflow.cli import failures
from triggerflow.logs import quiet_client_libraries
from triggerflow.settings import Settings

if TYPE_CHECKING:
    import asyncio

F = TypeVar("F", bound=Callable[..., Any])

CONNECTION = ("amqp_url", "database_url", "namespace", "heartbeat", "db_pool_size", "pgbouncer",
              "log_level", "log_format")
TELEMETRY = ("metrics_port", "otlp_endpoint", "trace_file")
CONSUMER = ("queues", "capacity", "allowed_modules", "lease_ttl", "renew_interval",
            "claim_batch", "prefetch", "reclaim_rate", "reap_batch", "probation_seconds",
            "max_failures", "blocked_threshold", "block_limit", "max_blocks",
            "subscription_check_interval",
            "subscription_renew_interval", "event_batch", "event_linger", "max_event_bytes",
            "max_event_message_bytes",
            "reaper_interval", "cancel_sweep_interval", "reconcile_after", "unclaimed_grace",
            "max_deferral", "max_clock_skew", "kwargs_key", "kwargs_keys", "airflow",
            "default_queue", "airflow_team",
            "airflow_resume_delay", "airflow_exit_grace")
# The writer runs a reaper too (max_failures, max_blocks), and its store carries the kwargs codec.
WRITER = ("writer_batch", "writer_prefetch", "writer_concurrency", "writer_lock_timeout",
          "max_event_message_bytes", "team_users", "lease_ttl", "renew_interval",
          "reaper_interval", "reap_batch", "unclaimed_grace", "max_deferral", "reclaim_rate",
          "max_failures", "max_blocks", "subscription_check_interval", "airflow", "default_queue",
          "queues",
          "kwargs_key", "kwargs_keys")
SDK = ("allowed_modules", "max_kwargs_bytes", "max_deferral", "kwargs_key", "kwargs_keys")

# Shown in --help; the value itself is converted by pydantic. Durations are seconds.
_METAVARS: dict[Any, str] = {int: "INTEGER", float: "FLOAT", timedelta: "SECONDS"}


class WholeVariable(click.ParamType):  # type: ignore[type-arg]
    """A repeatable option whose variable is one value (``a,b`` or a JSON list), not split on
    whitespace as click would."""

    name = "text"

    def split_envvar_value(self, rv: str) -> Sequence[str]:
        return [rv] if rv else []


def _option(name: str) -> Callable[[F], F]:
    info = Settings.model_fields[name]
    flag, env = Settings.flag_name(name), Settings.env_name(name)
    kwargs: dict[str, Any] = {"help": info.description, "envvar": env, "show_envvar": True,
                              "default": None}
    if typing.get_origin(info.annotation) is list:
        kwargs.update(multiple=True, default=(), type=WholeVariable(),
                      help=f"{info.description} Repeatable.")
    elif info.annotation is bool:
        flag = f"{flag}/--no-{flag[2:]}"
    else:
        kwargs["metavar"] = _METAVARS.get(info.annotation, "TEXT")
    return click.option(flag, name, **kwargs)


def settings_options(*names: str) -> Callable[[F], F]:
    """One option per Settings field, ``--field-name`` with env ``TRIGGERFLOW_FIELD_NAME``."""

    def decorate(fn: F) -> F:
        for name in reversed(names):
            fn = _option(name)(fn)
        return fn

    return decorate


def _from_environment(ctx: click.Context, name: str) -> bool:
    return ctx.get_parameter_source(name) is ParameterSource.ENVIRONMENT


def build_settings(values: dict[str, Any], every_variable: bool = False) -> Settings:
    """The Settings of the fields this command declares (its options, flag or variable),
    checked: an invalid value ends the command with one line naming its flag or variable
    (exit 2). The variables of other fields are read too (a setting used but not declared
    still follows its variable), but one that is invalid is left at its default, so an
    unrelated variable cannot break the command. ``every_variable``: check every variable
    (commands that pass them on to processes they start)."""
    ctx = click.get_current_context()
    given: dict[str, Any] = {}
    for key, value in values.items():
        if key not in Settings.model_fields or value is None or value == ():
            continue
        if isinstance(value, tuple):  # repeated flags; a variable is one "a,b" or JSON value
            value = list(value) if len(value) > 1 else value[0]
        given[key] = value
    try:
        settings = Settings(**given) if every_variable else Settings.without_environment(given)
    except ValueError as exc:  # pydantic's ValidationError
        raise failures.ConfigError(failures.config_problem(
            exc, lambda field: Settings.env_name(field) if field not in given
            or _from_environment(ctx, field) else Settings.flag_name(field))) from None
    if not every_variable:
        settings = _with_valid_other_variables(settings, given, set(values))
    failures.current.settings = settings
    quiet_client_libraries(logging.getLevelName(settings.log_level))
    return settings


def _with_valid_other_variables(settings: Settings, given: dict[str, Any],
                                declared: set[str]) -> Settings:
    others = {k: v for k, v in Settings.environment().items() if k not in declared}
    while others:
        try:
            return Settings.without_environment({**others, **given})
        except ValueError as exc:  # drop the invalid ones: this command does not take them
            bad = {str(e["loc"][0]) for e in getattr(exc, "errors", list)() if e["loc"]}
            others = {k: v for k, v in others.items() if k not in bad} if bad else {}
    return settings


def run_async(main: Coroutine[Any, Any, int | None]) -> int:
    from triggerflow.loop import run

    return run(main) or 0  # uvloop, with the long waits of coroutine triggers on one heap


def stop_on_signals() -> asyncio.Event:
    import asyncio
    import signal

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop

