"""How a command ends when it fails: one line on stderr naming what to fix, never a traceback
(unless the log level is DEBUG).

Exit 2 for configuration (a flag or variable), 1 for everything else. The root group calls
:func:`report` for whatever a command raises, so every command and every failure a service
gives up on (a refused password, an unreachable database) reads the same.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import click

from triggerflow.errors import ConfigurationError

if TYPE_CHECKING:
    from triggerflow.settings import Settings

DATABASE_VAR = "TRIGGERFLOW_DATABASE_URL (--database-url)"
BROKER_VAR = "TRIGGERFLOW_AMQP_URL (--amqp-url)"
_DATABASE_MODULES = ("asyncpg", "sqlalchemy", "alembic", "psycopg2")
_BROKER_MODULES = ("aiormq", "aio_pika", "pamqp")


class ConfigError(click.ClickException, ConfigurationError):
    """A flag or variable with an invalid value."""

    exit_code = 2

    def show(self, file: Any = None) -> None:
        click.echo(f"error: {self.message}", err=True)


@dataclass
class Current:
    """What the running command built, for the handler that reports its failure."""

    settings: Settings | None = None


current = Current()

_SECRET_FIELDS = ("amqp_url", "database_url", "management_url", "kwargs_key", "kwargs_keys")


def config_problem(exc: Any, source: Callable[[str], str]) -> str:
    """One line for a pydantic ValidationError; ``source(field)`` names where the value came
    from (its flag or variable). Values of secret fields are never repeated."""
    parts = []
    for error in exc.errors():
        field = str(error["loc"][0]) if error["loc"] else "settings"
        text = f"{source(field)}: {error['msg'].removeprefix('Value error, ')}"
        if field not in _SECRET_FIELDS and isinstance(error.get("input"), str | int | float):
            text += f" (got {error['input']!r})"
        parts.append(text)
    return "; ".join(parts)


def debugging() -> bool:
    settings = current.settings
    level = settings.log_level if settings else os.environ.get("TRIGGERFLOW_LOG_LEVEL", "")
    return level.upper() == "DEBUG"


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    item: BaseException | None = exc
    while item is not None and id(item) not in seen:
        seen.add(id(item))
        yield item
        item = item.__cause__ or item.__context__


def _origin(exc: BaseException) -> str | None:
    """'database' or 'broker': whose client code the failure was raised in."""
    for item in _chain(exc):
        modules = [str(frame.f_globals.get("__name__", ""))
                   for frame, _ in traceback.walk_tb(item.__traceback__)]
        modules.append(type(item).__module__)
        for module in reversed(modules):  # the innermost frame decides
            root = module.split(".")[0]
            if root in _DATABASE_MODULES:
                return "database"
            if root in _BROKER_MODULES:
                return "broker"
    return None


def _where(url: str) -> str:
    from yarl import URL

    try:
        parsed = URL(url)
    except ValueError:
        # a host list (a primary and its standbys: h1:5432,h2:5432) is no URL yarl reads
        hosts = url.partition("://")[2].partition("/")[0].rpartition("@")[2]
        return hosts if "," in hosts else "?"
    return f"{parsed.host}:{parsed.port}" if parsed.host else "?"


def _database_line(exc: BaseException, settings: Settings | None) -> str:
    at = f" at {_where(settings.database_dsn())}" if settings else ""
    states = {str(getattr(item, "sqlstate", "") or "") for item in _chain(exc)}
    if any(state.startswith("28") for state in states):
        return f"the database{at} refused the login: {exc}; check {DATABASE_VAR}"
    if "3D000" in states:
        return f"{exc} (database server{at}); run `triggerflow db upgrade` or check {DATABASE_VAR}"
    if any(isinstance(item, OSError) for item in _chain(exc)):
        return f"cannot reach the database{at}: {exc}; check {DATABASE_VAR}"
    return f"database error{at}: {type(exc).__name__}: {exc}"


def _broker_line(exc: BaseException, settings: Settings | None) -> str:
    at = f" at {_where(settings.amqp_url.get_secret_value())}" if settings else ""
    text = " ".join(f"{type(item).__name__}: {item}" for item in _chain(exc))
    if "ACCESS_REFUSED" in text or "Authentication" in text:
        return f"the broker{at} refused the login (ACCESS_REFUSED); check {BROKER_VAR}"
    if any(isinstance(item, OSError) for item in _chain(exc)) or "Connect call failed" in text:
        return f"cannot reach the broker{at}: {exc}; check {BROKER_VAR}"
    return f"broker error{at}: {type(exc).__name__}: {exc}"


def describe(exc: BaseException, settings: Settings | None = None) -> str:
    """One line saying what failed and which setting to check, secrets removed."""
    origin = _origin(exc)
    if origin == "database":
        line = _database_line(exc, settings)
    elif origin == "broker":
        line = _broker_line(exc, settings)
    elif type(exc).__module__.startswith("triggerflow.") and str(exc):
        line = str(exc)  # our own errors are written for the operator
    else:
        line = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    from triggerflow.redact import Redactor
    from triggerflow.settings import Settings

    # Without settings the redactor still masks the password of any URL in the text.
    return Redactor(settings or Settings.without_environment({}))(" ".join(line.split()))


def report(exc: BaseException) -> int:
    """Print ``exc`` as one line (the traceback too at DEBUG) and give the exit code."""
    if debugging():
        traceback.print_exception(exc)
    click.echo(f"error: {describe(exc, current.settings)}", err=True)
    return 1
