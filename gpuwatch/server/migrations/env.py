"""Alembic environment: online only, on the connection the migration runner passes in.

SQLite gets ``render_as_batch`` because it has almost no ``ALTER TABLE``: batch mode
rebuilds a table (create, copy, drop, rename) for the operations SQLite lacks.
"""

from __future__ import annotations

from alembic import context

from gpuwatch.server.models import metadata


def _run() -> None:
    connection = context.config.attributes.get("connection")
    if connection is None:
        raise RuntimeError("run migrations through gpuwatch.server.database.migrate")
    context.configure(
        connection=connection,
        target_metadata=metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


_run()
