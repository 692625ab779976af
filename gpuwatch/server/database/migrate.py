"""Run the packaged Alembic migrations programmatically (no ``alembic.ini`` needed).

``gpuwatch server`` upgrades to head on start; ``gpuwatch db upgrade`` and
``gpuwatch db current`` call the same functions. On Postgres the upgrade holds a
transaction-scoped advisory lock, so replicas starting together migrate one at a time
(the second finds the schema at head and does nothing).

Developers create a revision from a checkout with::

    python -m gpuwatch.server.database.migrate revision "add foo" [DATABASE_URL]
"""

from __future__ import annotations

import sys

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, text

from gpuwatch.errors import DatabaseError
from gpuwatch.server.database.core import (
    Database,
    advisory_lock_key,
    create_database,
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


def current_revision(db: Database) -> str | None:
    """The revision the database is at; None for an empty database.

    Raises :class:`~gpuwatch.errors.DatabaseError` when it cannot be reached.
    """
    with translated_errors("cannot read the schema revision"), db.engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


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
    both SQLite and Postgres, so a failed upgrade leaves the schema as it was).

    Raises :class:`~gpuwatch.errors.DatabaseError` when the database is unreachable or
    a migration fails.
    """
    with translated_errors("cannot migrate the database"), db.begin_write() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(
                text("SELECT pg_advisory_xact_lock(:key)"), {"key": advisory_lock_key("migrate")}
            )
        command.upgrade(alembic_config(conn), revision)


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
