"""Settings <-> CLI options <-> environment, derived once from the Settings model.

``settings_options`` turns fields into click options (flag and env var named by
``Settings.flag_name``/``Settings.env_name``, type from the annotation); ``build_settings``
turns what click parsed back into one validated ``Settings``.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import typing
from collections.abc import Callable, Coroutine
from datetime import timedelta
from typing import Any, TypeVar

import click
from pydantic import ValidationError

from triggerflow.settings import Settings

F = TypeVar("F", bound=Callable[..., Any])

CONNECTION = ("amqp_url", "database_url", "namespace", "heartbeat", "db_pool_size", "pgbouncer",
              "log_level", "log_format")
TELEMETRY = ("metrics_port", "otlp_endpoint", "trace_file")
CONSUMER = ("queues", "capacity", "allowed_modules", "lease_ttl", "renew_interval",
            "claim_batch", "prefetch", "reclaim_rate", "probation_seconds",
            "max_failures", "blocked_threshold", "subscription_check_interval", "event_batch",
            "event_linger", "max_event_bytes", "max_event_message_bytes", "reaper_interval",
            "cancel_sweep_interval", "unclaimed_grace", "max_deferral", "kwargs_key", "kwargs_keys",
            "airflow", "default_queue")
WRITER = ("writer_batch", "writer_prefetch", "writer_concurrency", "writer_lock_timeout",
          "max_event_message_bytes", "team_users", "lease_ttl",
          "renew_interval", "reaper_interval", "unclaimed_grace", "max_deferral", "reclaim_rate",
          "subscription_check_interval", "airflow", "default_queue", "queues")
SDK = ("allowed_modules", "max_kwargs_bytes", "max_deferral", "kwargs_key", "kwargs_keys")

# Durations are given in seconds on the command line, as in the environment.
_CLICK_TYPES: dict[Any, Any] = {int: int, float: float, timedelta: float}


def _option(name: str) -> Callable[[F], F]:
    info = Settings.model_fields[name]
    flag, env = Settings.flag_name(name), Settings.env_name(name)
    kwargs: dict[str, Any] = {"help": info.description, "envvar": env, "show_envvar": True,
                              "default": None}
    if typing.get_origin(info.annotation) is list:
        # pydantic-settings reads the env var itself ("a,b" or JSON); click would split it
        # on whitespace.
        kwargs.update(multiple=True, default=(), envvar=None, show_envvar=False,
                      help=f"{info.description} Repeatable.  [env var: {env}]")
    elif info.annotation is bool:
        flag = f"{flag}/--no-{flag[2:]}"
    elif info.annotation in _CLICK_TYPES:
        kwargs["type"] = _CLICK_TYPES[info.annotation]
    return click.option(flag, name, **kwargs)


def settings_options(*names: str) -> Callable[[F], F]:
    """One option per Settings field, ``--field-name`` with env ``TRIGGERFLOW_FIELD_NAME``."""

    def decorate(fn: F) -> F:
        for name in reversed(names):
            fn = _option(name)(fn)
        return fn

    return decorate


def build_settings(values: dict[str, Any]) -> Settings:
    """The Settings that the parsed options (and the environment) give; a usage error if invalid."""
    given: dict[str, Any] = {}
    for key, value in values.items():
        if key not in Settings.model_fields or value is None or value == ():
            continue
        if isinstance(value, tuple):  # repeatable flags; an env var may hold "a,b" or JSON
            if len(value) == 1 and str(value[0]).lstrip().startswith("["):
                value = json.loads(value[0])
            else:
                value = [part for item in value
                         for part in str(item).replace(" ", ",").split(",") if part]
        elif key in ("team_users", "kwargs_keys") and isinstance(value, str):
            value = json.loads(value)
        given[key] = value
    try:
        return Settings(**given)
    except ValidationError as exc:
        raise click.UsageError(str(exc)) from None


def run_async(main: Coroutine[Any, Any, int | None]) -> int:
    from triggerflow.loop import run

    return run(main) or 0  # uvloop, with the long waits of coroutine triggers on one heap


def stop_on_signals() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


def fail(message: str) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(1)

