"""One typed settings object. Every field is a CLI flag and a ``TRIGGERFLOW_*`` env var.

The variables are read here (not by pydantic-settings, whose import alone cost more than the
whole CLI's start-up budget), and only for the fields asked for: a command validates the
settings it uses, so one bad unrelated variable cannot stop it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from triggerflow.setting_values import (
    ZERO,
    Duration,
    LogFormat,
    LogLevel,
    check_amqp_url,
    check_postgres_url,
    lower,
    seconds,
    upper,
)
from triggerflow.store.interface import MAX_BLOCKS
from triggerflow.variables import UnknownSetting, refusal, unknown_variables

# Airflow mode's hold after a deferral (docs/airflow-race.md): its ceiling, the smallest
# delay measured safe on the real stack; and the time a deferring worker may take to exit,
# from which the scheduler's own writes are read as the witness that releases it sooner.
AIRFLOW_RESUME_DELAY = 20.0
AIRFLOW_EXIT_GRACE = 10.0


# Flags not spelled from their field's name.
_FLAGS = {"queues": "--queue", "airflow_team": "--team"}


class Settings(BaseModel):
    """Configuration for every triggerflow process (SDK, consumer, writer, admin commands).

    ``Settings(**values)`` fills every field not given from its variable (the SDK, tests);
    ``Settings.without_environment(values)`` reads no variable (the CLI: click reads the
    variables of the options a command declares).
    """

    # built on first validation: `--help` only reads the fields
    model_config = ConfigDict(extra="ignore", defer_build=True)

    @model_validator(mode="before")
    @classmethod
    def _variables_under_values(cls, data: Any, info: ValidationInfo) -> Any:
        """Refuses a keyword or, when it reads them, a ``TRIGGERFLOW_*`` variable that names no
        setting (``UnknownSetting``, a ConfigurationError), instead of ignoring a typo."""
        if not isinstance(data, dict):
            return data
        line = refusal(data, cls.model_fields)
        if line:
            raise UnknownSetting(line)
        if (info.context or {}).get("environment") is False:
            return data
        cls.check_environment()
        return {**cls.environment(), **data}

    @classmethod
    def check_environment(cls, environ: Mapping[str, str] = os.environ) -> None:
        """Raise UnknownSetting naming each ``TRIGGERFLOW_*`` variable that is no setting, no
        CLI option and not read elsewhere (``triggerflow.variables``), with the closest name."""
        line = unknown_variables(environ, [cls.env_name(name) for name in cls.model_fields])
        if line:
            raise UnknownSetting(line)

    @classmethod
    def without_environment(cls, values: Mapping[str, Any]) -> Settings:
        """``values`` validated; every field not in them keeps its default."""
        return cls.model_validate(values, context={"environment": False})

    @classmethod
    def environment(cls, fields: Iterable[str] | None = None,
                    environ: Mapping[str, str] = os.environ) -> dict[str, str]:
        """The set ``TRIGGERFLOW_*`` variables of ``fields`` (default: all), by field."""
        names = cls.model_fields if fields is None else fields
        return {name: environ[cls.env_name(name)] for name in names
                if cls.env_name(name) in environ}

    # -- connections --------------------------------------------------------------------
    amqp_url: Annotated[SecretStr, BeforeValidator(check_amqp_url)] = Field(
        SecretStr("amqp://guest:guest@127.0.0.1:5672/"),
        description="RabbitMQ URL. The heartbeat below is added unless the URL sets one.",
    )
    management_url: SecretStr | None = Field(
        None,
        description=(
            "RabbitMQ management HTTP API URL, credentials included (`status` lists the broker's "
            "team queues with it). Default: the AMQP URL's user, password and host on port 15672."
        ),
    )
    database_url: Annotated[SecretStr, BeforeValidator(check_postgres_url)] = Field(
        SecretStr("postgresql://127.0.0.1:5432/triggerflow"),
        description=(
            "PostgreSQL URL. Airflow's `postgresql+psycopg2://` form is accepted as "
            "`postgresql://`."),
    )
    heartbeat: int = Field(10, ge=1, description="AMQP heartbeat in seconds (the client's is 60).")
    db_pool_size: int = Field(4, ge=1, description="Max PostgreSQL connections per process.")
    pgbouncer: bool = Field(
        False, description="Behind PgBouncer in transaction mode: no prepared-statement cache."
    )
    namespace: str = Field("triggerflow", description="Prefix of every exchange and shared queue.")

    # -- Airflow mode (docs/airflow-reference.md) -----------------------------------------
    airflow: bool = Field(
        False,
        description=(
            "Serve an Airflow 3.3 metadata database (DATABASE_URL) in place of `airflow "
            "triggerer`: Airflow's trigger rows, classes and event semantics."
        ),
    )
    default_queue: str | None = Field(
        None,
        description=(
            "Airflow mode: the queue of trigger rows that have none (asset watchers, "
            "deadline callbacks, tasks deferred before `queues_enabled`). Unset: such rows are "
            "left to Airflow's own triggerer."
        ),
    )
    airflow_team: str | None = Field(
        None,
        min_length=1,
        description=(
            "Airflow mode, with Airflow's [core] multi_team on: the Airflow team whose trigger "
            "rows this consumer serves (as `airflow triggerer --team-name`). Unset: rows of no "
            "team (every row while multi_team is off)."
        ),
    )
    airflow_resume_delay: Duration = Field(
        seconds(AIRFLOW_RESUME_DELAY),
        ge=ZERO,
        description=(
            "Airflow mode: a consumer sends no event that puts a task back to 'scheduled' "
            "sooner than this after the task deferred, so Airflow's scheduler has seen the "
            "deferring worker exit first (docs/airflow-race.md). The ceiling: such an event "
            "goes sooner once the scheduler's own writes show it has handled that exit. 0: off."
        ),
    )
    airflow_exit_grace: Duration = Field(
        seconds(AIRFLOW_EXIT_GRACE),
        ge=ZERO,
        description=(
            "Airflow mode: how long a worker may take to exit after its task deferred (more "
            "than Airflow's [workers] min_heartbeat_interval); the scheduler loops that prove "
            "the exit handled are counted from then (docs/airflow-race.md)."
        ),
    )

    # -- consumer -----------------------------------------------------------------------
    queues: list[str] = Field(
        default_factory=list,
        description=(
            "Team queues to consume / scope. `writer --airflow`: the queues triggerflow serves "
            "(rows of others are left to Airflow's own triggerer); unset: every queue."
        ),
    )
    capacity: int = Field(200_000, ge=1, description="Max triggers one consumer runs at once.")
    allowed_modules: list[str] = Field(
        default_factory=lambda: ["triggerflow.triggers"],
        description="Module prefixes trigger classes may come from (checked before import).",
    )
    lease_ttl: Duration = Field(
        seconds(3.0), gt=ZERO,
        description="Seconds a consumer's lease lives unrenewed (a writer's: at least 10; a "
                    "killed one is seen through its presence queue at once).",
    )
    renew_interval: Duration = Field(
        seconds(1.0), gt=ZERO, description="Seconds between lease renewals (a writer's: at least 1).")
    claim_batch: int = Field(2000, ge=1, description="Max trigger ids claimed per statement.")
    prefetch: int = Field(64, ge=1, description="Unacked wake-up messages per consumer.")
    reclaim_rate: int = Field(
        20_000, ge=1, description="Max triggers a reaper re-sends per second (reclaim storms)."
    )
    reap_batch: int = Field(
        20_000, ge=1, description="Max triggers of dead consumers one reaper statement frees.")
    probation_seconds: Duration = Field(
        seconds(1.0), gt=ZERO, description="How long a suspect group must run before it is cleared."
    )
    max_failures: int = Field(
        30, ge=2, description="Ungraceful losses (its consumer died while running it) after "
        "which a trigger is quarantined."
    )
    blocked_threshold: Duration = Field(
        seconds(0.2), gt=ZERO, description="Seconds the loop may stay busy before the culprit is named."
    )
    block_limit: Duration = Field(
        seconds(1.0), gt=ZERO,
        description="Seconds a trigger may block the event loop before it is stopped and "
        "charged a strike (counted towards max_blocks).",
    )
    max_blocks: int = Field(
        MAX_BLOCKS, ge=1, description="Runs in which a trigger blocked its consumer's event "
        "loop past block_limit (or, past the lease, got its consumer taken over) after which "
        "it is quarantined.",
    )
    subscription_check_interval: Duration = Field(
        seconds(3.0), gt=ZERO, description="Seconds between checks that the broker still delivers to us."
    )
    subscription_renew_interval: Duration = Field(
        seconds(30.0), ge=ZERO,
        description="Seconds between a consumer's re-subscriptions, which heal a subscription "
        "the broker keeps but no longer delivers to (RabbitMQ 3.10, a queue deleted and "
        "declared again at once); each drops it from the broker's lists for a moment.",
    )

    # -- events -------------------------------------------------------------------------
    event_batch: int = Field(500, ge=1, description="Max events per published message.")
    event_linger: Duration = Field(
        seconds(0.004), ge=ZERO, description="Seconds a fired event waits for others to share its message."
    )
    max_event_bytes: int = Field(65_536, ge=256, description="Largest event payload accepted.")
    max_kwargs_bytes: int = Field(65_536, ge=256, description="Largest trigger kwargs accepted.")

    # -- writer -------------------------------------------------------------------------
    writer_batch: int = Field(5000, ge=1, description="Max events applied per transaction.")
    writer_prefetch: int = Field(400, ge=1, description="Unacked event messages per writer.")
    writer_concurrency: int = Field(
        2, ge=1, description="Batches one writer applies at once, each on its own connection.")
    writer_lock_timeout: Duration = Field(
        seconds(0.5), gt=ZERO,
        description="Seconds a batch waits for rows another transaction holds before it "
                    "applies the free ones and retries the rest later.")
    max_event_message_bytes: int = Field(
        4 * 1024 * 1024, ge=262_144,
        description="Largest event message a writer parses; larger ones are dead-lettered unread.")
    team_users: dict[str, str] = Field(
        default_factory=dict,
        description=(
            'Queue -> AMQP user that alone may publish its events, e.g. {"team-ml": "team-ml"}.'
        ),
    )

    # -- reaper -------------------------------------------------------------------------
    reaper_interval: Duration = Field(seconds(10.0), gt=ZERO, description="Seconds between reaper sweeps.")
    cancel_sweep_interval: Duration = Field(
        seconds(5.0), gt=ZERO, description="Seconds between sweeps for held triggers whose task moved on."
    )
    reconcile_after: Duration = Field(
        seconds(60.0), gt=ZERO,
        description="Seconds after a trigger fired before a row still held for it is taken "
        "as a lost event and re-sent.",
    )
    unclaimed_grace: Duration = Field(
        seconds(15.0), gt=ZERO, description="Seconds an unclaimed trigger waits before it is re-sent."
    )
    max_deferral: Duration = Field(
        seconds(7 * 86400.0), gt=ZERO, description="Longest any task may stay deferred (seconds)."
    )
    max_clock_skew: Duration = Field(
        seconds(2.0), gt=ZERO,
        description="Seconds a consumer's clock may differ from the database's (measured at "
        "each lease renewal); past it the consumer runs no trigger until its clock is back.",
    )

    # -- security -----------------------------------------------------------------------
    kwargs_key: SecretStr | None = Field(
        None, description=(
            "Fernet key(s), comma-separated, newest first: encrypt trigger kwargs at rest when "
            "set. The newest encrypts, all decrypt (rotation)."),
    )
    kwargs_keys: dict[str, SecretStr] = Field(
        default_factory=dict,
        description=(
            'Queue -> its own Fernet key(s), comma-separated, newest first, e.g. '
            '{"team-ml": "<new>,<old>"}; used instead of kwargs_key for that queue.'),
    )

    # -- telemetry ----------------------------------------------------------------------
    metrics_port: int = Field(0, ge=0, description="Prometheus endpoint port (0: off).")
    otlp_endpoint: str | None = Field(None, description="OTLP/HTTP endpoint for traces+metrics.")
    trace_file: str | None = Field(None, description="Append finished spans as JSON lines here.")
    log_level: Annotated[LogLevel, BeforeValidator(upper)] = Field(
        "INFO", description="Log level: DEBUG, INFO, WARNING, ERROR or CRITICAL (any case).")
    log_format: Annotated[LogFormat, BeforeValidator(lower)] = Field(
        "text", description="Log lines as `text` or `json` (any case).")

    @field_validator("queues", "allowed_modules", mode="before")
    @classmethod
    def _split_commas(cls, value: object) -> object:
        if isinstance(value, str):
            if value.lstrip().startswith("["):
                return json.loads(value)
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("team_users", "kwargs_keys", mode="before")
    @classmethod
    def _json_object(cls, value: object) -> object:
        return json.loads(value) if isinstance(value, str) else value

    @field_validator("kwargs_key", "kwargs_keys")
    @classmethod
    def _fernet_keys(cls, value: Any) -> Any:
        """A bad key is refused at start, naming its variable, not at the first kwargs."""
        if value:
            from triggerflow.codec import KwargsCodec

            keys = value.values() if isinstance(value, dict) else [value]
            for key in keys:
                KwargsCodec(key.get_secret_value())  # raises ValueError for a malformed key
        return value

    @staticmethod
    def env_name(field: str) -> str:
        """The environment variable of a field (the one naming rule; see ``model_config``)."""
        return f"TRIGGERFLOW_{field.upper()}"

    @staticmethod
    def flag_name(field: str) -> str:
        """The CLI flag of a field: ``--field-name`` (``--queue``, repeatable, for queues;
        ``--team`` for airflow_team)."""
        return _FLAGS.get(field) or "--" + field.replace("_", "-")

    def amqp_dsn(self) -> str:
        """The AMQP URL with ``heartbeat`` added as a query parameter unless it has one."""
        from yarl import URL

        url = URL(self.amqp_url.get_secret_value())
        if "heartbeat" in url.query:
            return str(url)
        return str(url.update_query(heartbeat=self.heartbeat))

    def management_dsn(self) -> str:
        if self.management_url is not None:
            return self.management_url.get_secret_value()
        from triggerflow.transport.management import default_management_url

        return default_management_url(self.amqp_url.get_secret_value())

    def database_dsn(self) -> str:
        return self.database_url.get_secret_value()

    def as_env(self, **overrides: Any) -> dict[str, str]:
        """``TRIGGERFLOW_*`` variables that give a child process exactly these settings."""
        values = self.model_dump()
        values.update(overrides)
        env: dict[str, str] = {}
        for key, value in values.items():
            if value is None:
                continue
            if isinstance(value, SecretStr):
                value = value.get_secret_value()
            if isinstance(value, timedelta):
                value = value.total_seconds()
            if isinstance(value, dict):  # kwargs_keys holds secrets too
                value = {k: v.get_secret_value() if isinstance(v, SecretStr) else v
                         for k, v in value.items()}
            if isinstance(value, list | dict):
                value = json.dumps(value)
            env[self.env_name(key)] = str(value)
        return env

