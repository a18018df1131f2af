"""How a setting's raw value (a flag, an environment variable, a keyword argument) is read:
durations, the two service URLs, and case-insensitive choices. Each refusal names what was
given and what is expected, so start-up can say which setting is wrong."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Annotated, Literal

from pydantic import BeforeValidator, SecretStr


def _seconds(value: object) -> object:
    """A number, or a string holding one, is seconds; anything else pydantic parses as a
    duration (``PT5M``, ``0:05:00``)."""
    if isinstance(value, str):
        try:
            return timedelta(seconds=float(value))
        except ValueError:
            return value
    return value


# A duration: seconds as a number (flags, env vars, keyword arguments), or a timedelta.
Duration = Annotated[timedelta, BeforeValidator(_seconds)]
ZERO = timedelta(0)


def seconds(n: float) -> timedelta:
    return timedelta(seconds=n)


def lower(value: object) -> object:
    return value.lower() if isinstance(value, str) else value


def upper(value: object) -> object:
    return value.upper() if isinstance(value, str) else value


# Airflow's own form of the same URL (sql_alchemy_conn), accepted as asyncpg's.
_POSTGRES_SCHEME = re.compile(r"^postgres(?:ql)?(?:\+[a-z0-9_]+)?://", re.I)


def check_postgres_url(value: object) -> object:
    text = value.get_secret_value() if isinstance(value, SecretStr) else value
    if not isinstance(text, str):
        return value
    if not _POSTGRES_SCHEME.match(text):
        scheme = text.split("://", 1)[0] if "://" in text else "no scheme"
        raise ValueError(f"not a PostgreSQL URL ({scheme}); give postgresql://user:pass@host/db")
    return _POSTGRES_SCHEME.sub("postgresql://", text, count=1)


def check_amqp_url(value: object) -> object:
    """Only what the AMQP client speaks: an ``http://`` URL (the management API's) or a bare
    host would otherwise be retried as an unreachable broker."""
    text = value.get_secret_value() if isinstance(value, SecretStr) else value
    if isinstance(text, str) and not re.match(r"^amqps?://", text, re.I):
        scheme = text.split("://", 1)[0] if "://" in text else "no scheme"
        raise ValueError(f"not an AMQP URL ({scheme}); give amqp://user:pass@host:5672/vhost "
                         "or amqps://")
    return value


LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
LogFormat = Literal["text", "json"]
