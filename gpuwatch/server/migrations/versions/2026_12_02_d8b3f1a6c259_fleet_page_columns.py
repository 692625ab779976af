"""Each GPU's open events as a flag mask on its gpus row (``open_flags``, bit ``i``: an
open event of kind ``GPU_FLAG_KINDS[i]`` on the GPU's host and index), kept by ingest,
so the fleet page reads its flags with the GPU instead of reading every open event per
request; filled here from the open events already stored.

Revision ID: d8b3f1a6c259
Revises: a9d4e6b2c718
Create Date: 2026-12-02 00:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "d8b3f1a6c259"
down_revision: str | Sequence[str] | None = "a9d4e6b2c718"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Written out rather than imported: a migration keeps the meaning the bits had when it
# was written (gpuwatch/server/hosts/models.py GPU_FLAG_KINDS, in this order).
_KINDS = ("orphaned", "idle", "filling_up", "runaway", "gpu_lost")
# One statement for both databases. Each kind is one bit, so the sum of the distinct
# bits of a GPU's open events is their OR.
_BIT = " ".join(f"WHEN '{kind}' THEN {1 << bit}" for bit, kind in enumerate(_KINDS))
_OPEN = (
    "FROM events e WHERE e.host_id = gpus.host_id AND e.ended_at IS NULL"
    " AND e.gpu_index = gpus.gpu_index"
)
_BACKFILL = f"""
UPDATE gpus SET open_flags = (SELECT coalesce(sum(DISTINCT CASE e.kind {_BIT} ELSE 0 END), 0)
                              {_OPEN})
WHERE EXISTS (SELECT 1 {_OPEN})
"""


def upgrade() -> None:
    # A constant default: SQLite adds the column in place, Postgres without a rewrite.
    op.add_column("gpus", sa.Column("open_flags", sa.Integer(), server_default="0", nullable=False))
    op.execute(sa.text(_BACKFILL))


def downgrade() -> None:
    op.drop_column("gpus", "open_flags")
