"""Run the packaged Alembic migrations programmatically (no ``alembic.ini`` needed).

``gpuwatch server`` upgrades to head on start; ``gpuwatch db upgrade`` and
``gpuwatch db current`` call the same functions. On Postgres the upgrade holds a
transaction-scoped advisory lock, so replicas starting together migrate one at a time
(the second finds the schema at head and does nothing).

A database at a revision this package does not ship (a newer gpuwatch wrote it) is
refused with that advice, never "run `gpuwatch db upgrade`"; and the upgrade always
writes (a no-op update of ``alembic_version``), so a database that can be read but not
written fails it rather than a server that then refuses every push.

Developers create a revision from a checkout with::

    python -m gpuwatch.server.database.migrate revision "add foo" [DATABASE_URL]
"""

from __future__ import annotations

import sys

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.script.revision import RevisionError
from alembic.util.exc import CommandError
from sqlalchemy import Connection, exc, text

from gpuwatch.errors import DatabaseError
from gpuwatch.server.database.core import (
    Database,
    advisory_lock_key,
    create_database,
    describe,
    is_unwritable,
    probe_write,
    translated_errors,
)

SCRIPT_LOCATION = "gpuwatch.server:migrations"
# Date-named revision files, as Netflix/dispatch names them.
FILE_TEMPLATE = "%%(year)d_%%(month).2d_%%(day).2d_%%(rev)s_%%(slug)s"


def alembic_config(connection: Connection | None = None) -> Config:
    """An Alembic config pointing at the packaged scripts, bound to ``connection``."""
    config = Config()
    config.set_main_option("script_location", SCRIPT_LOCATION)
    config.set_main_option("file_template", FILE_TEMPLATE)
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def head_revision() -> str | None:
    """The newest revision shipped in this package."""
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def is_known(revision: str) -> bool:
    """Whether ``revision`` is one this package ships."""
    try:
        return ScriptDirectory.from_config(alembic_config()).get_revision(revision) is not None
    except (CommandError, RevisionError):
        return False


class UnknownRevision(DatabaseError):
    """The database is at a revision this gpuwatch does not ship: a newer one wrote it.
    Upgrading the database cannot help; upgrading gpuwatch does."""

    def __init__(self, revision: str) -> None:
        super().__init__(
            f"the database is at revision {revision}, which this gpuwatch does not know "
            "(written by a newer version?); upgrade gpuwatch"
        )
        self.revision = revision


def _revision_of(conn: Connection) -> str | None:
    revision = MigrationContext.configure(conn).get_current_revision()
    if revision is not None and not is_known(revision):
        raise UnknownRevision(revision)
    return revision


def current_revision(db: Database) -> str | None:
    """The revision the database is at; None for an empty database.

    Raises :class:`~gpuwatch.errors.DatabaseError` when it cannot be reached, and
    :class:`UnknownRevision` when it is at a revision this package does not ship.
    """
    with (
        translated_errors(f"cannot read the schema revision of {db.location}"),
        db.engine.connect() as conn,
    ):
        return _revision_of(conn)


def require_head(db: Database) -> None:
    """Raise :class:`~gpuwatch.errors.DatabaseError` unless the schema is at head."""
    current, head = current_revision(db), head_revision()
    if current != head:
        state = "empty" if current is None else f"at revision {current}"
        raise DatabaseError(
            f"the database is {state}, this gpuwatch needs {head}; run `gpuwatch db upgrade`"
        )


def upgrade(db: Database, revision: str = "head") -> None:
    """Apply migrations up to ``revision`` in one transaction (DDL is transactional on
    both SQLite and Postgres, so a failed upgrade leaves the schema as it was), and
    write to the database in it even when nothing is pending.

    Raises :class:`~gpuwatch.errors.DatabaseError` when the database is unreachable,
    cannot be written, is at a revision this package does not ship
    (:class:`UnknownRevision`), or a migration fails.
    """
    try:
        with db.begin_write() as conn:
            if conn.dialect.name == "postgresql":
                conn.execute(
                    text("SELECT pg_advisory_xact_lock(:key)"),
                    {"key": advisory_lock_key("migrate")},
                )
            _revision_of(conn)
            command.upgrade(alembic_config(conn), revision)
            # SQLite opens a file it cannot write read-only without complaint, and at
            # head the upgrade writes nothing: this write is what finds that out.
            probe_write(conn)
    except exc.SQLAlchemyError as err:
        if is_unwritable(err):
            raise DatabaseError(
                f"the database {db.location} cannot be written: {describe(err)}"
            ) from err
        raise DatabaseError(f"cannot migrate the database {db.location}: {describe(err)}") from err
    except (CommandError, RevisionError) as err:
        raise DatabaseError(f"cannot migrate the database {db.location}: {describe(err)}") from err


def make_revision(db: Database, message: str) -> None:
    """Autogenerate a revision from the models against ``db`` (which must be at head)."""
    with db.begin_write() as conn:
        command.revision(alembic_config(conn), message=message, autogenerate=True)


if __name__ == "__main__":  # pragma: no cover - developer tool
    if len(sys.argv) < 3 or sys.argv[1] != "revision":
        sys.exit(__doc__)
    url = sys.argv[3] if len(sys.argv) > 3 else "sqlite:///gpuwatch-dev.db"
    database = create_database(url)
    upgrade(database)
    make_revision(database, sys.argv[2])
