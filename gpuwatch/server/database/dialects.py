"""The few statements whose SQL differs between SQLite and Postgres."""

from __future__ import annotations

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
