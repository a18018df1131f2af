"""``triggerflow airflow …``: install and remove Airflow mode in an Airflow metadata database."""

from __future__ import annotations

import asyncio

import click

from triggerflow.airflow import setup as airflow_setup


def _postgres_url(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """Airflow's ``postgresql+psycopg2://`` form (its sql_alchemy_conn) is taken as is."""
    from pydantic import ValidationError

    from triggerflow.settings import Settings

    try:
        return Settings.without_environment({"database_url": value}).database_dsn()
    except ValidationError as exc:
        # pydantic prefixes a validator's message with "Value error, "; the line is ours.
        raise click.BadParameter(exc.errors()[0]["msg"].removeprefix("Value error, ")) from None


DATABASE_URL = click.option(
    "--database-url", required=True, envvar="TRIGGERFLOW_DATABASE_URL", show_envvar=True,
    callback=_postgres_url,
    help="Airflow's metadata database (PostgreSQL), e.g. postgresql://airflow@db/airflow "
         "(or Airflow's postgresql+psycopg2:// form).")


@click.group("airflow")
def airflow_group() -> None:
    """Airflow mode: serve an Airflow 3 metadata database in place of `airflow triggerer`."""


@airflow_group.command("setup")
@DATABASE_URL
def setup_command(database_url: str) -> None:
    """Create triggerflow's schema and the NOTIFY trigger in Airflow's database (idempotent)."""
    try:
        release = asyncio.run(airflow_setup.setup(database_url))
    except airflow_setup.UnknownAirflowSchema as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"triggerflow Airflow mode installed (Airflow {release} schema)")


@airflow_group.command("teardown")
@DATABASE_URL
def teardown_command(database_url: str) -> None:
    """Remove triggerflow's schema and the NOTIFY trigger; Airflow's tables are left as they are."""
    asyncio.run(airflow_setup.teardown(database_url))
    click.echo("triggerflow Airflow mode removed")
