"""The indices each GPU has had (``gpu_indices``): history answers "what was on GPU 2
at 14:05" by the GPU that had index 2 then, and indices move between boots. Also
``ended_at`` indexes on events and process lifetimes, so retention's batched deletes
seek to the expired rows instead of scanning each table under SQLite's write lock.

Revision ID: 2f7a5c9e4d13
Revises: 9c4d1e7b2f60
Create Date: 2026-12-08 09:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "2f7a5c9e4d13"
down_revision: str | Sequence[str] | None = "9c4d1e7b2f60"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "gpu_indices",
        sa.Column("gpu_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("since", sa.Double(), nullable=False),
        sa.Column("gpu_index", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["gpu_id"], ["gpus.id"], name=op.f("fk_gpu_indices_gpu_id_gpus"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("gpu_id", "since", name=op.f("pk_gpu_indices")),
    )
    # Earlier indices were not kept: the one each GPU has now stands for its whole past
    # (what history answered before this revision).
    op.execute(
        "INSERT INTO gpu_indices (gpu_id, since, gpu_index) SELECT id, 0, gpu_index FROM gpus"
    )
    op.create_index(op.f("ix_process_lifetimes_ended_at"), "process_lifetimes", ["ended_at"])
    op.create_index(op.f("ix_events_ended_at"), "events", ["ended_at"])


def downgrade() -> None:
    op.drop_index(op.f("ix_events_ended_at"), table_name="events")
    op.drop_index(op.f("ix_process_lifetimes_ended_at"), table_name="process_lifetimes")
    op.drop_table("gpu_indices")
