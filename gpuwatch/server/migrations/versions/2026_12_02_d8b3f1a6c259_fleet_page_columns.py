"""What the fleet page reads, kept by ingest and filled here from what is stored: each
GPU's open events as a flag mask on its gpus row (``open_flags``, bit ``i``: an open
event of kind ``GPU_FLAG_KINDS[i]`` on the GPU's host and index), and each host's GPUs
as the page draws them (``hosts.tiles``, JSON: gpuwatch/server/hosts/tiles.py), so the
page reads one row per host instead of one per GPU and every open event.

Revision ID: d8b3f1a6c259
Revises: a9d4e6b2c718
Create Date: 2026-12-02 00:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import groupby
from operator import itemgetter

import sqlalchemy as sa
from alembic import op

from gpuwatch.server.hosts.tiles import tiles_text

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


# What hosts/tiles.py reads of a GPU, named as it reads them.
_TILE_GPUS = """
SELECT host_id, gpu_index, memory_total_bytes, memory_used_bytes, lost, holder_user,
       holder_bytes, holder_processes, holder_users, open_flags
FROM gpus ORDER BY host_id
"""


def upgrade() -> None:
    # A constant default: SQLite adds the column in place, Postgres without a rewrite.
    op.add_column("gpus", sa.Column("open_flags", sa.Integer(), server_default="0", nullable=False))
    op.execute(sa.text(_BACKFILL))
    op.add_column("hosts", sa.Column("tiles", sa.Text(), nullable=True))
    # With the code ingest uses: the text is the page's format, not SQL's. One row a GPU
    # in memory: a fleet of thousands of GPUs is a few MB.
    bind = op.get_bind()
    gpus = bind.execute(sa.text(_TILE_GPUS)).all()
    tiles = [
        {"tiles": tiles_text(rows), "host_id": host_id}  # type: ignore[arg-type]
        for host_id, rows in groupby(gpus, itemgetter(0))
    ]
    if tiles:
        bind.execute(sa.text("UPDATE hosts SET tiles = :tiles WHERE id = :host_id"), tiles)


def downgrade() -> None:
    op.drop_column("hosts", "tiles")
    op.drop_column("gpus", "open_flags")
