"""Free space in the pages of the tables ingest rewrites on every push (Postgres only):
``fillfactor`` from gpuwatch/server/database/core.py ``FILLFACTOR``, so that updates are
HOT (no new index entries) instead of moving each row to another page.

Only pages written from now on keep the space; rows already stored stay where they
are. ``VACUUM FULL`` on these tables (it locks them while it runs) rewrites the old
pages too, which matters little: ingest rewrites the open lifetimes, and new lifetimes
land on new pages.

Revision ID: 4b7e2a9c1d35
Revises: d8b3f1a6c259
Create Date: 2026-12-06 00:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "4b7e2a9c1d35"
down_revision: str | Sequence[str] | None = "d8b3f1a6c259"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Written out rather than imported: a migration keeps the values it was written with.
_FILLFACTOR = {
    "hosts": 50,
    "gpus": 50,
    "process_lifetimes": 70,
    "process_windows": 70,
    "gpu_windows": 70,
}


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return  # SQLite has no fillfactor: it rewrites a changed page whole anyway
    for table, fillfactor in _FILLFACTOR.items():
        op.execute(f"ALTER TABLE {table} SET (fillfactor = {fillfactor})")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table in _FILLFACTOR:
        op.execute(f"ALTER TABLE {table} RESET (fillfactor)")
