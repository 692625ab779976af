"""The few statements whose SQL differs between SQLite and Postgres."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Table
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.sql.dml import Insert


def insert_ignoring_conflicts(table: Table, dialect: str) -> Insert:
    """``INSERT ... ON CONFLICT DO NOTHING`` for ``table`` on ``dialect``.

    With ``.returning(...)`` it yields only the rows actually inserted, which is how
    ingest tells new snapshots from retried ones in one round trip.
    """
    if dialect == "postgresql":
        return postgresql.insert(table).on_conflict_do_nothing()
    if dialect == "sqlite":
        return sqlite.insert(table).on_conflict_do_nothing()
    raise NotImplementedError(f"gpuwatch supports SQLite and Postgres, not {dialect}")


def upsert(table: Table, dialect: str, *, key: Sequence[str], columns: Sequence[str]) -> Insert:
    """``INSERT ... ON CONFLICT (key) DO UPDATE SET`` ``columns`` from the new row."""
    if dialect == "postgresql":
        pg = postgresql.insert(table)
        return pg.on_conflict_do_update(
            index_elements=list(key), set_={name: pg.excluded[name] for name in columns}
        )
    if dialect == "sqlite":
        lite = sqlite.insert(table)
        return lite.on_conflict_do_update(
            index_elements=list(key), set_={name: lite.excluded[name] for name in columns}
        )
    raise NotImplementedError(f"gpuwatch supports SQLite and Postgres, not {dialect}")
