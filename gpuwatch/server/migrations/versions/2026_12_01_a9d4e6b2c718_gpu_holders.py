"""Each GPU's holders on its gpus row (the owner of the largest open lifetime and its
bytes, how many open lifetimes and distinct users), kept by ingest, so the fleet page
reads them with the GPU instead of aggregating every open lifetime per request; filled
here from the open lifetimes already stored.

Revision ID: a9d4e6b2c718
Revises: f3c8a2d6b154
Create Date: 2026-12-01 22:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "a9d4e6b2c718"
down_revision: str | Sequence[str] | None = "f3c8a2d6b154"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# One statement for both databases. The open lifetimes of a GPU are found through the
# (host_id, ended_at) index; the largest is the one ingest names (state.py): most
# bytes, unknown bytes last, then the oldest lifetime.
_OPEN = (
    "FROM process_lifetimes l"
    " WHERE l.host_id = gpus.host_id AND l.ended_at IS NULL AND l.gpu_id = gpus.id"
)
_BACKFILL = f"""
UPDATE gpus SET
    holder_processes = (SELECT count(*) {_OPEN}),
    holder_users = (SELECT count(DISTINCT l."user") {_OPEN}),
    holder_bytes = (SELECT max(l.current_bytes) {_OPEN}),
    holder_user = (SELECT l."user" {_OPEN}
                   ORDER BY l.current_bytes IS NULL, l.current_bytes DESC, l.id LIMIT 1)
WHERE EXISTS (SELECT 1 {_OPEN})
"""


def upgrade() -> None:
    op.add_column("gpus", sa.Column("holder_user", sa.String(length=256), nullable=True))
    op.add_column("gpus", sa.Column("holder_bytes", sa.BigInteger(), nullable=True))
    # Constant defaults: SQLite adds the columns in place, Postgres without a rewrite.
    for name in ("holder_processes", "holder_users"):
        op.add_column("gpus", sa.Column(name, sa.Integer(), server_default="0", nullable=False))
    op.execute(sa.text(_BACKFILL))


def downgrade() -> None:
    for name in ("holder_users", "holder_processes", "holder_bytes", "holder_user"):
        op.drop_column("gpus", name)
