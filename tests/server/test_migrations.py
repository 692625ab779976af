"""Migrations: empty -> head on both databases, with no drift from the models."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from gpuwatch.server.database import create_database
from gpuwatch.server.database.migrate import current_revision, head_revision, upgrade
from gpuwatch.server.models import metadata


def test_empty_to_head_matches_the_models(database_url: str) -> None:
    database = create_database(database_url)
    assert current_revision(database) is None

    upgrade(database)

    assert current_revision(database) == head_revision()
    with database.engine.connect() as conn:
        context = MigrationContext.configure(
            conn, opts={"compare_type": True, "render_as_batch": conn.dialect.name == "sqlite"}
        )
        assert compare_metadata(context, metadata) == []
        assert set(inspect(conn).get_table_names()) == set(metadata.tables) | {"alembic_version"}
    database.dispose()


def test_upgrade_is_idempotent(database_url: str) -> None:
    database = create_database(database_url)
    upgrade(database)
    upgrade(database)  # a second replica starting, or `gpuwatch db upgrade` after start

    assert current_revision(database) == head_revision()
    database.dispose()
