"""``gpuwatch db``: the server database's schema revision, and upgrading it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from gpuwatch.cli.server import CONFIG_HELP, DATABASE_URL_HELP
from gpuwatch.errors import DatabaseError

if TYPE_CHECKING:
    from gpuwatch.server.database import Database

db = typer.Typer(name="db", help="Server database schema (migrations).", no_args_is_help=True)


def open_database(
    database_url: str | None, config: Path | None, *, create: bool = False
) -> Database:
    """The configured server database (``--database-url`` over env over config file).

    Only ``create`` (``db upgrade``) makes a SQLite file that is not there; every other
    command is refused with "no database at PATH" (exit 7), so a mistyped path does not
    leave an empty database behind.
    """
    from gpuwatch.cli.agent import use_config_file
    from gpuwatch.server.database import database_for
    from gpuwatch.settings import ServerSettings, load

    use_config_file(config)
    return database_for(load(ServerSettings, database_url=database_url), create=create)


@db.command("upgrade")
def upgrade(
    database_url: str | None = typer.Option(
        None, "--database-url", metavar="URL", help=DATABASE_URL_HELP
    ),
    config: Path | None = typer.Option(None, "--config", help=CONFIG_HELP),
) -> None:
    """Apply every pending migration (what `gpuwatch server` does on start)."""
    from gpuwatch.server.database.migrate import current_revision, upgrade

    database = open_database(database_url, config, create=True)
    try:
        upgrade(database)
        typer.echo(f"database at revision {current_revision(database)} (head)")
    finally:
        database.dispose()


@db.command("current")
def current(
    database_url: str | None = typer.Option(
        None, "--database-url", metavar="URL", help=DATABASE_URL_HELP
    ),
    config: Path | None = typer.Option(None, "--config", help=CONFIG_HELP),
) -> None:
    """Print the database's schema revision and whether it is this version's head."""
    from gpuwatch.server.database.core import NoDatabase
    from gpuwatch.server.database.migrate import current_revision, head_revision

    head = head_revision()
    try:
        database = open_database(database_url, config)
    except NoDatabase as err:
        # Not migrated either (exit 7), but never created here: a mistyped path stays so.
        typer.echo(
            f"none (empty database: no database at {err.path}; head is {head}; "
            "run `gpuwatch db upgrade` to create it)"
        )
        raise typer.Exit(DatabaseError.exit_code) from None
    try:
        revision = current_revision(database)
    finally:
        database.dispose()
    if revision is None:
        typer.echo(f"none (empty database; head is {head}; run `gpuwatch db upgrade`)")
    elif revision == head:
        typer.echo(f"{revision} (head)")
    else:
        typer.echo(f"{revision} (head is {head}; run `gpuwatch db upgrade`)")
    if revision != head:
        # Not migrated (exit 7), so `gpuwatch db current || gpuwatch db upgrade` works.
        raise typer.Exit(DatabaseError.exit_code)


def register(app: typer.Typer) -> None:
    app.add_typer(db)
