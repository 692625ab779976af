"""``gpuwatch token``: per-host agent tokens (create, list, revoke).

The database keeps only each token's SHA-256; ``create`` shows the token once, as its
last line of output, so scripts can take it with ``| tail -n1``. It is written before
it is committed: when it cannot be written (standard output closed, a full disk, the
reader gone), nothing is kept and the command fails, since an active token whose only
copy was lost is a credential nobody holds.
"""

from __future__ import annotations

import sys
import time
import unicodedata
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from gpuwatch.cli.db import open_database
from gpuwatch.cli.server import CONFIG_HELP, DATABASE_URL_HELP
from gpuwatch.errors import GpuwatchError, NotFound

if TYPE_CHECKING:
    from gpuwatch.server.database import Database

token = typer.Typer(name="token", help="Per-host agent tokens.", no_args_is_help=True)

_URL = typer.Option(None, "--database-url", metavar="URL", help=DATABASE_URL_HELP)
_CONFIG = typer.Option(None, "--config", help=CONFIG_HELP)


@contextmanager
def _migrated(database_url: str | None, config: Path | None) -> Iterator[Database]:
    """The configured database, refused unless migrated to head; disposed afterwards."""
    from gpuwatch.server.database.migrate import require_head

    database = open_database(database_url, config)
    try:
        require_head(database)
        yield database
    finally:
        database.dispose()


def _hostname(value: str) -> str:
    # Control and format characters (a right-to-left override, a zero-width space) would
    # let a name read as another host's in the dashboard and in alerts.
    if (
        not value
        or len(value) > 256
        or any(c.isspace() or unicodedata.category(c) in _INVISIBLE for c in value)
    ):
        raise typer.BadParameter(
            "a host name: 1-256 characters, no spaces, control or format characters"
        )
    return value


_INVISIBLE = frozenset({"Cc", "Cf", "Cs", "Co", "Cn"})


def _new_hostname(value: str) -> str:
    # Browsers (and most HTTP clients) drop "." and ".." path segments, "%2e" spellings
    # included, so /hosts/.. would open the fleet page instead. Only a new host is
    # refused: ``revoke`` still takes a name a database already holds.
    if _hostname(value) in (".", ".."):
        raise typer.BadParameter(f"{value!r} cannot be a host name (a URL path resolves it away)")
    return value


@token.command("create")
def create(
    host: str = typer.Argument(..., callback=_new_hostname, help="Host name the agent reports."),
    database_url: str | None = _URL,
    config: Path | None = _CONFIG,
) -> None:
    """Create a token for HOST (adding the host); prints the token as the last line."""
    from gpuwatch.server.auth import service
    from gpuwatch.server.database import translated_errors

    with (
        _migrated(database_url, config) as database,
        translated_errors("cannot create the token"),
        database.writer() as session,
    ):
        secret = service.create_token(session=session, hostname=host, now=time.time())
        try:
            typer.echo(
                f"token for {host} (shown once; set it as GPUWATCH_AGENT_TOKEN on that host):"
            )
            typer.echo(secret)
            sys.stdout.flush()
        except OSError as err:  # BrokenPipeError included
            session.rollback()
            raise GpuwatchError(
                f"cannot write the token to standard output ({err.strerror or err}):"
                f" no token was created for {host}"
            ) from None
        session.commit()


@token.command("list")
def list_(database_url: str | None = _URL, config: Path | None = _CONFIG) -> None:
    """List tokens: host, created, revoked (never the tokens themselves)."""
    from rich.console import Console
    from rich.table import Table

    from gpuwatch.server.auth import service
    from gpuwatch.server.database import translated_errors

    with (
        _migrated(database_url, config) as database,
        translated_errors("cannot list tokens"),
        database.reader() as session,
    ):
        tokens = service.list_tokens(session=session)
    table = Table("ID", "HOST", "CREATED", "REVOKED", box=None)
    for info in tokens:
        table.add_row(
            str(info.id),
            info.hostname,
            _when(info.created_at),
            "-" if info.revoked_at is None else _when(info.revoked_at),
        )
    Console(soft_wrap=True).print(table)


@token.command("revoke")
def revoke(
    host: str = typer.Argument(..., callback=_hostname, help="Host whose tokens to revoke."),
    retire: bool = typer.Option(
        False,
        "--retire",
        help=(
            "Also retire the host (decommissioned): end its open events and process "
            "lifetimes, stop judging it silent, leave it out of the fleet views. Its "
            "history stays; a new token brings it back."
        ),
    ),
    database_url: str | None = _URL,
    config: Path | None = _CONFIG,
) -> None:
    """Revoke every active token of HOST; its agent is refused (403) from now on."""
    from gpuwatch.server.auth import service
    from gpuwatch.server.database import translated_errors
    from gpuwatch.server.hosts.retire import retire_host

    with (
        _migrated(database_url, config) as database,
        translated_errors("cannot revoke tokens"),
        database.writer() as session,
    ):
        now = time.time()
        retired = None
        if retire:
            retired = retire_host(session=session, dialect=database.dialect, hostname=host, now=now)
            if retired is None:
                raise NotFound(f"no host named {host}")
            revoked = retired.tokens
        else:
            revoked = service.revoke_tokens(session=session, hostname=host, now=now)
        session.commit()
    if retired is not None:
        typer.echo(
            f"revoked {revoked} token(s) of {host} and retired it: ended "
            f"{retired.lifetimes} process lifetime(s) and {retired.events} open event(s); "
            "its history stays"
        )
        return
    if revoked == 0:
        # An expected outcome a script may test for, not an unexpected failure (exit 1).
        raise NotFound(f"host {host} has no active token")
    typer.echo(f"revoked {revoked} token(s) of {host}")


def _when(epoch: float) -> str:
    return datetime.fromtimestamp(epoch).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")


def register(app: typer.Typer) -> None:
    app.add_typer(token)
